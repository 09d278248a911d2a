fn main() {
    let mib = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(64);
    let r = weightsync_benches::prepare::run(&weightsync_benches::prepare::Config { input_mib: mib, reps: 5 }).unwrap();
    print!("{}", r.human());
}
