//! Plans the anchor case (Kimi-K2, `pp=2,ep=8,fsdp=16` -> `tp=8,ep=32,dp=4` fp8) once and
//! prints how long each step took and the summary, for `/usr/bin/time -v` (peak memory) and a
//! quick look without the whole `weightsync` binary
//! (`TABLE_OUT=path` also writes the table's bincode there). Arguments override the case:
//! `cargo run --release -p weightsync-schedules --example plan_anchor -- MODEL TRAIN INFER DTYPE`.

use std::time::Instant;

use weightsync_schedules::*;

/// (user, system) CPU seconds this process has used so far, from /proc (Linux); wall time is
/// meaningless on a shared, loaded machine. For planning, system time is nearly all page faults
/// of fresh memory.
fn cpu_times() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |x| x.1);
    let f: Vec<f64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // Fields 14 and 15 (utime, stime) are at 11 and 12 after the command name; 100 ticks/s.
    let tick = |i: usize| f.get(i).unwrap_or(&0.0) / 100.0;
    (tick(11), tick(12))
}

fn cpu_s() -> f64 {
    let (u, s) = cpu_times();
    u + s
}

/// Peak resident memory so far, MB (VmHWM from /proc; 0 where there is none).
fn peak_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1e3)
}

fn sys_s() -> f64 {
    cpu_times().1
}

fn main() -> Result<(), PlanError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: &str| args.get(i).cloned().unwrap_or_else(|| d.to_string());
    let (model, train, infer, dtype) = (
        arg(0, "kimi-k2"),
        arg(1, "pp=2,ep=8,fsdp=16"),
        arg(2, "tp=8,ep=32,dp=4"),
        arg(3, "fp8"),
    );
    let c0 = cpu_s();
    let t0 = Instant::now();
    let tspec: TrainSpec = train.parse()?;
    let m = Model::preset(&model, tspec.experts)?;
    let t = TrainingLayout::build(&m, &tspec)?;
    let mut ispec: InferSpec = infer.parse()?;
    ispec.dtype = dtype.parse()?;
    let i = InferenceLayout::build(&m, &ispec)?;
    let m1 = peak_mb();
    let t1 = Instant::now();
    let c1 = cpu_s();
    let s1 = sys_s();
    let cost = CostModel::default();
    let table = plan(&m, &t, &i, &cost)?;
    let m2 = peak_mb();
    let t2 = Instant::now();
    let c2 = cpu_s();
    let s2 = sys_s();
    let s = Summary::of(&table, &cost);
    let t3 = Instant::now();
    if std::env::var_os("BY_SENDER").is_some() {
        senders(&table);
    }
    if std::env::var_os("STORED").is_some() {
        use weightsync_schedules::compact::{BASE_FIELDS, SHARD_FIELDS, TASK_FIELDS};
        let sum = |f: &dyn Fn(&weightsync_schedules::table::CompactTrainer) -> usize| -> usize {
            table.trainers.iter().map(f).sum()
        };
        println!(
            "stored: {} patterns ({} writes, {} copies), {} task records for {} tasks, {} base \
             records, {} shard records for {} shards, {} rollout layouts; inputs: {} pieces, {} \
             shards",
            sum(&|t| t.routes.patterns.len()),
            sum(&|t| t.routes.writes.len()),
            sum(&|t| t.routes.copies.len()),
            sum(&|t| t.routes.tasks.stored(TASK_FIELDS)),
            sum(&|t| t.routes.tasks.len() as usize),
            sum(&|t| t.routes.bases.stored(BASE_FIELDS)),
            sum(&|t| t.routes.shards.stored(SHARD_FIELDS)),
            sum(&|t| t.routes.shards.len() as usize),
            table.rollout_layouts.len(),
            i.pieces.len(),
            t.shards.len()
        );
    }
    if std::env::var_os("BY_KIND").is_some() {
        writes_by_kind(&table);
    }
    let bytes = if std::env::var_os("NO_BINCODE").is_some() {
        0
    } else {
        let b = table.to_bincode();
        // The table itself, to compare planners byte for byte.
        if let Some(path) = std::env::var_os("TABLE_OUT") {
            std::fs::write(path, &b).expect("writing TABLE_OUT");
        }
        b.len()
    };
    let largest_slice = if std::env::var_os("SLICES").is_some() {
        (0..table.trainers.len() as u32)
            .map(|r| table.slice(r).map_or(0, |s| s.to_bincode().len()))
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    println!(
        "peak memory: after inputs {m1:.0} MB, after planning {m2:.0} MB; largest slice {:.2} MB",
        largest_slice as f64 / 1e6
    );
    println!(
        "cpu: inputs {:.2} s, plan {:.2} s (system {:.2} s: page faults); wall: inputs {:.3} s, plan {:.3} s, summary {:.3} s, bincode {:.1} MB",
        c1 - c0,
        c2 - c1,
        s2 - s1,
        (t1 - t0).as_secs_f64(),
        (t2 - t1).as_secs_f64(),
        (t3 - t2).as_secs_f64(),
        bytes as f64 / 1e6
    );
    println!(
        "{}",
        serde_json::to_string_pretty(&s).expect("summary serialises")
    );
    Ok(())
}

/// Writes landing on inference rank 0, by tensor kind (debugging aid).
#[allow(dead_code)]
fn writes_by_kind(table: &RoutingTable) {
    use std::collections::BTreeMap;
    let r0 = table.rollout(0).expect("rank 0");
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for r in 0..table.trainers.len() as u32 {
        let t = table.trainer_plan(r).expect("slice expands");
        for w in t.all_writes() {
            if w.dst == weightsync_schedules::table::WriteTarget::Rollout(0) {
                let i = r0.tensors.partition_point(|x| x.offset <= w.dst_offset) - 1;
                let name = &r0.tensors[i].name;
                let kind = name.split('.').skip(3).collect::<Vec<_>>().join(".");
                *by.entry(kind).or_default() += 1;
            }
        }
    }
    for (k, v) in by {
        println!("{v:>8} {k}");
    }
}

/// Bytes each trainer sends, by kind of parameter, for the busiest and the idlest (debugging aid).
#[allow(dead_code)]
fn senders(table: &RoutingTable) {
    use std::collections::BTreeMap;
    let plans: Vec<_> = (0..table.trainers.len() as u32)
        .map(|r| table.trainer_plan(r).expect("slice expands"))
        .collect();
    let mut tx: Vec<(u64, u32)> = plans
        .iter()
        .map(|t| (t.all_writes().map(|w| w.len as u64).sum(), t.rank))
        .collect();
    tx.sort_unstable();
    for &(b, r) in tx.iter().rev().take(3).chain(tx.iter().take(2)) {
        let t = &plans[r as usize];
        let mut by: BTreeMap<String, u64> = BTreeMap::new();
        for task in &t.tasks {
            let name = &t.params[task.param as usize].name;
            let kind: String = name
                .split('.')
                .filter(|x| x.parse::<u32>().is_err())
                .collect::<Vec<_>>()
                .join(".");
            *by.entry(kind).or_default() += t.task_writes(task).map(|w| w.len as u64).sum::<u64>();
        }
        println!("trainer {r}: {:.2} GB", b as f64 / 1e9);
        for (k, v) in by.iter().filter(|x| *x.1 > 200_000_000) {
            println!("   {:>8.2} GB {k}", *v as f64 / 1e9);
        }
    }
}
