//! Tests of [`super`]: exports and copies over a socket pair; two fabrics agreeing on shared
//! memory; and the case it is for, in two processes: a non-dumpable writer and a receiver
//! without `CAP_SYS_PTRACE`, so `process_vm_readv` is refused and every byte goes through shared
//! memory, none through the socket. Also a same-run comparison of the three same-host paths
//! (ignored: a measurement, run by hand).

use std::io::{BufRead, BufReader, Write};
use std::time::{Duration, Instant};

use super::*;
use crate::fabric::shared_memory::tests::{NON_DUMPABLE, drop_cap_sys_ptrace, set_dumpable};
use crate::fabric::{
    Access, FabricBackend, FabricConfig, Memory, RegionDescriptor, TcpFabric, WriteOp,
};

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 11) as u8
}

fn shared_source(len: usize) -> Arc<RegisteredMemory> {
    let m = RegisteredMemory::new(Memory::alloc_shared("test", len).unwrap());
    // SAFETY: fresh memory of `len` bytes that nothing else references yet.
    let b = unsafe { std::slice::from_raw_parts_mut(m.as_ptr(), len) };
    for (i, v) in b.iter_mut().enumerate() {
        *v = pattern(i);
    }
    m
}

#[test]
fn exports_map_once_and_copies_gather_in_order() {
    let (a, b) = UnixStream::pair().unwrap();
    let mut exporter = SharedExporter {
        sock: a,
        sent: Vec::new(),
    };
    let mut reader = SharedWriter {
        sock: b,
        maps: Vec::new(),
    };
    let src = shared_source(1 << 20);
    assert!(exporter.export(&src).unwrap());
    assert!(exporter.export(&src).unwrap(), "already with the receiver");
    let plain = RegisteredMemory::new(Memory::alloc(4096).unwrap());
    assert!(
        !exporter.export(&plain).unwrap(),
        "anonymous memory is not shared"
    );
    let base = src.as_ptr() as u64;
    let mut dst = vec![0u8; 30_000];
    let d = dst.as_mut_ptr();
    // SAFETY: two disjoint ranges of `dst`, which nothing else borrows during the call.
    let n = unsafe {
        reader.pull_run(
            &[(d, 10_000), (d.add(10_000), 20_000)],
            &[(base + 500_000, 15_000), (base + 7, 15_000)],
        )
    }
    .unwrap();
    assert_eq!(n, 30_000);
    assert_eq!(reader.mapped(), 1, "one export, mapped once");
    assert!((0..15_000).all(|i| dst[i] == pattern(500_000 + i)));
    assert!((0..15_000).all(|i| dst[15_000 + i] == pattern(7 + i)));
    // An address the writer never shared is an error, not a read of anything.
    // SAFETY: as above.
    let err = unsafe { reader.pull_run(&[(d, 8)], &[(0x1000, 8)]) }.unwrap_err();
    assert!(err.to_string().contains("did not share"), "{err}");
    // A source freed and allocated again is exported again; the new mapping replaces any old
    // one over the same addresses.
    drop(src);
    let again = shared_source(1 << 20);
    assert!(exporter.export(&again).unwrap());
    assert_eq!(exporter.sent.len(), 1, "the freed source was pruned");
    let at = again.as_ptr() as u64;
    // SAFETY: as above.
    unsafe { reader.pull_run(&[(d, 100)], &[(at + 3, 100)]) }.unwrap();
    assert!((0..100).all(|i| dst[i] == pattern(3 + i)));
}

#[test]
fn auto_shares_sources_where_it_is_free_or_ptrace_is_likely_refused() {
    assert!(shmem_policy_huge(
        "always within_size [advise] never deny force"
    ));
    assert!(!shmem_policy_huge(
        "always within_size advise [never] deny force"
    ));
    assert!(!shmem_policy_huge(
        "always within_size advise never [deny] force"
    ));
    assert!(sources_shared(SameHostPath::Shared));
    assert!(!sources_shared(SameHostPath::Ptrace));
    let _one = NON_DUMPABLE.lock();
    set_dumpable(false);
    let refused = sources_shared(SameHostPath::Auto);
    set_dumpable(true);
    assert!(refused, "a non-dumpable process shares its sources");
}

fn config(path: SameHostPath) -> FabricConfig {
    FabricConfig {
        same_host_path: path,
        ..FabricConfig::loopback("shared-pulls", 2)
    }
}

#[tokio::test]
async fn lanes_agreed_on_shared_memory_move_no_byte_through_the_socket() {
    if super::super::same_host::boot_id().is_none() {
        return; // no boot id here: pulls are never offered
    }
    let a = TcpFabric::start(&config(SameHostPath::Shared))
        .await
        .unwrap();
    let b = TcpFabric::start(&config(SameHostPath::Shared))
        .await
        .unwrap();
    let len: u64 = 3 << 20;
    let src = a.alloc(len as usize, Access::SOURCE).unwrap();
    assert!(
        src.memory().shared().is_some(),
        "TCP sources are shared memory"
    );
    let data: Vec<u8> = (0..len as usize).map(pattern).collect();
    src.write_at(0, &data).unwrap();
    let dst = b.alloc(len as usize, Access::RECEIVE).unwrap();
    // A small frame too: on a shared lane it is pulled as well.
    a.write_batch(vec![
        WriteOp::new(&src, 0, dst.descriptor(), 0, 100).with_imm(1),
        WriteOp::new(&src, 100, dst.descriptor(), 100, len - 100).with_imm(2),
    ])
    .await
    .unwrap();
    b.imm_counter().expect(1, 1).await.unwrap();
    b.imm_counter().expect(2, 1).await.unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    let stats = b.stats();
    assert_eq!(stats.bytes_received, len);
    assert_eq!(
        stats.bytes_shared, len,
        "every byte from shared memory: {stats:?}"
    );
    assert_eq!(stats.bytes_pulled, len);
    // Only headers crossed the socket, and the writer names the path.
    assert!(a.stats().bytes_sent < 4096, "{:?}", a.stats());
    let paths = a.transfer_paths().unwrap();
    assert_eq!(paths.shared_memory_bytes, len, "{paths:?}");
    assert_eq!(paths.name(), "shared_memory");
    // A source in anonymous memory (a caller's tensor) travels as payloads on the same lanes.
    let plain = a
        .register(Memory::alloc(1 << 20).unwrap(), Access::SOURCE)
        .unwrap();
    plain.write_at(0, &data[..1 << 20]).unwrap();
    a.write(WriteOp::new(&plain, 0, dst.descriptor(), 0, 1 << 20).with_imm(3))
        .await
        .unwrap();
    b.imm_counter().expect(3, 1).await.unwrap();
    assert_eq!(
        b.stats().bytes_shared,
        len,
        "anonymous memory is not shared"
    );
    let more = a.transfer_paths().unwrap().since(&paths);
    assert_eq!((more.payload_bytes, more.name()), (1 << 20, "payloads"));
    src.deregister();
}

const CHILD_ENV: &str = "WEIGHTSYNC_SHARED_PULLS_CHILD";
const CHILD_LEN: u64 = 24 << 20;

/// The receiver, in its own process without `CAP_SYS_PTRACE` (run by
/// [`a_non_dumpable_writer_is_read_through_shared_memory`]; a no-op without [`CHILD_ENV`]):
/// prints its region, waits for the write, checks every byte and prints its counters.
#[test]
#[ignore = "a child process of a_non_dumpable_writer_is_read_through_shared_memory"]
fn shared_pulls_receiver_child() {
    if std::env::var(CHILD_ENV).is_err() {
        return;
    }
    drop_cap_sys_ptrace();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let b = TcpFabric::start(&config(SameHostPath::Auto)).await.unwrap();
        let dst = b.alloc(CHILD_LEN as usize, Access::RECEIVE).unwrap();
        println!(
            "REGION {}",
            serde_json::to_string(dst.descriptor()).unwrap()
        );
        std::io::stdout().flush().unwrap();
        tokio::time::timeout(Duration::from_secs(60), b.imm_counter().expect(7, 1))
            .await
            .expect("the write landed in time")
            .unwrap();
        let got = dst.to_vec().unwrap();
        let equal = got.iter().enumerate().all(|(i, &v)| v == pattern(i));
        let s = b.stats();
        println!(
            "RESULT equal={equal} received={} pulled={} shared={}",
            s.bytes_received, s.bytes_pulled, s.bytes_shared
        );
        std::io::stdout().flush().unwrap();
    });
}

#[test]
fn a_non_dumpable_writer_is_read_through_shared_memory() {
    if super::super::same_host::boot_id().is_none() {
        return; // no boot id here: pulls are never offered
    }
    let _one = NON_DUMPABLE.lock();
    tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(non_dumpable_writer());
}

async fn non_dumpable_writer() {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "fabric::tcp::shared_pulls::tests::shared_pulls_receiver_child",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let region: RegionDescriptor = loop {
        let line = lines.next().expect("the child printed its region").unwrap();
        // libtest may print "test <name> ... " before the test's own output on the same line.
        if let Some((_, json)) = line.split_once("REGION ") {
            break serde_json::from_str(json).unwrap();
        }
    };
    // This process is the writer, non-dumpable while it writes (restored below).
    set_dumpable(false);
    let a = TcpFabric::start(&config(SameHostPath::Auto)).await.unwrap();
    let src = a.alloc(CHILD_LEN as usize, Access::SOURCE).unwrap();
    let data: Vec<u8> = (0..CHILD_LEN as usize).map(pattern).collect();
    src.write_at(0, &data).unwrap();
    let before = a.transfer_paths().unwrap();
    let wrote = a
        .write(WriteOp::new(&src, 0, &region, 0, CHILD_LEN).with_imm(7))
        .await;
    let paths = a.transfer_paths().unwrap().since(&before);
    let result = lines.find_map(|l| {
        l.ok()
            .and_then(|l| l.split_once("RESULT ").map(|(_, r)| r.to_string()))
    });
    let status = child.wait().unwrap();
    set_dumpable(true);
    wrote.unwrap();
    assert!(status.success(), "receiver child failed");
    let result = result.expect("the child printed its result");
    assert!(result.contains("equal=true"), "{result}");
    assert!(
        result.contains(&format!("shared={CHILD_LEN}")),
        "every byte through shared memory: {result}"
    );
    assert!(
        result.contains(&format!("received={CHILD_LEN}")),
        "{result}"
    );
    // No payload byte crossed the socket: only frame headers; the writer names the path.
    let sent = a.stats().bytes_sent;
    assert!(sent < 4096, "{sent} bytes went through the socket");
    assert_eq!(paths.shared_memory_bytes, CHILD_LEN, "{paths:?}");
    assert_eq!(paths.payload_bytes, 0, "{paths:?}");
    assert_eq!(paths.name(), "shared_memory");
}

/// Same-run throughput of the three same-host paths (payloads over loopback TCP,
/// `process_vm_readv` pulls, shared-memory pulls), 256 MiB in 4 MiB writes, best of 5 each,
/// alternated. Run by hand: `cargo test -p weightsync-common --lib --release
/// same_host_paths_compared -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement, run by hand"]
async fn same_host_paths_compared() {
    let len: u64 = 256 << 20;
    let piece: u64 = 4 << 20;
    let mut fabrics = Vec::new();
    for (name, same_host, path) in [
        ("tcp_payloads", false, SameHostPath::Auto),
        ("process_vm_readv", true, SameHostPath::Ptrace),
        ("shared_memory", true, SameHostPath::Shared),
    ] {
        let c = FabricConfig {
            same_host,
            ..config(path)
        };
        let a = TcpFabric::start(&c).await.unwrap();
        let b = TcpFabric::start(&c).await.unwrap();
        let src = a.alloc(len as usize, Access::SOURCE).unwrap();
        src.write_at(0, &vec![0x5a; len as usize]).unwrap();
        let dst = b.alloc(len as usize, Access::RECEIVE).unwrap();
        dst.write_at(0, &vec![0; len as usize]).unwrap();
        fabrics.push((name, a, b, src, dst, Vec::new()));
    }
    for _round in 0..5 {
        for (_, a, _, src, dst, times) in fabrics.iter_mut() {
            let ops: Vec<WriteOp> = (0..len / piece)
                .map(|i| WriteOp::new(src, i * piece, dst.descriptor(), i * piece, piece))
                .collect();
            let t = Instant::now();
            a.write_batch(ops).await.unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let best = |t: &Vec<f64>| t.iter().copied().fold(f64::MAX, f64::min);
    let base = best(&fabrics[0].5);
    for (name, _, b, _, _, times) in &fabrics {
        let s = best(times);
        println!(
            "same-host path {name}: {:.2} GB/s, {:.2}x tcp_payloads (shared bytes {})",
            len as f64 / s / 1e9,
            base / s,
            b.stats().bytes_shared
        );
    }
}
