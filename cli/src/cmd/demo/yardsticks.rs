//! What the demo's syncs are compared with, measured in the same run on the same machine: one
//! plain TCP stream on loopback, and the fabric limit (`weightsync_common::fabric::limit`: the
//! same bytes between the same trainer/rollout pairs as a sync, written by the same fabric with
//! the same lanes, and nothing else).
//!
//! Why both: one TCP stream is what a newcomer knows a machine can do; the fabric limit is what
//! weightsync's own transport can do for exactly this job, so a sync's ratio to it is what the
//! rest of weightsync (planning, staging, quantisation, control) costs.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use weightsync_common::fabric::FabricConfig;
use weightsync_common::fabric::limit::FabricLimit;
use weightsync_common::protocol::WorldSpec;
use weightsync_schedules::table::WriteTarget;

use super::spinner;

/// The run's yardsticks, GB/s.
#[derive(Debug, Clone, Copy)]
pub(super) struct Yardsticks {
    /// One plain TCP stream on loopback.
    pub tcp_gbps: f64,
    /// The fabric limit for this job's pairs and lanes.
    pub fabric_gbps: f64,
}

/// One plain TCP stream over loopback moving `bytes`: GB/s.
pub(super) fn plain_tcp_gbps(bytes: usize) -> std::io::Result<f64> {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let reader = std::thread::spawn(move || -> std::io::Result<Duration> {
        let (mut s, _) = listener.accept()?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0usize;
        let mut start = None;
        while got < bytes {
            let n = s.read(&mut buf)?;
            if n == 0 {
                break;
            }
            start.get_or_insert_with(Instant::now);
            got += n;
        }
        Ok(start.map_or(Duration::ZERO, |s| s.elapsed()))
    });
    let mut s = std::net::TcpStream::connect(addr)?;
    let chunk = vec![7u8; 1 << 20];
    let mut sent = 0;
    while sent < bytes {
        let n = chunk.len().min(bytes - sent);
        s.write_all(&chunk[..n])?;
        sent += n;
    }
    drop(s);
    let took = reader
        .join()
        .map_err(|_| std::io::Error::other("reader thread panicked"))??;
    Ok(bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9)
}

/// The median of three plain TCP streams of 256 MiB on loopback, GB/s.
pub(super) async fn measure_tcp() -> anyhow::Result<f64> {
    let pb = spinner("measuring one plain TCP stream on loopback (a yardstick)".into());
    let mut runs: Vec<f64> = Vec::new();
    for _ in 0..3 {
        runs.push(tokio::task::spawn_blocking(|| plain_tcp_gbps(256 << 20)).await??);
    }
    runs.sort_by(f64::total_cmp);
    pb.finish_and_clear();
    eprintln!("  one plain TCP stream: {:.2} GB/s", runs[1]);
    Ok(runs[1])
}

/// Bytes each trainer writes to each rollout per sync, from the job's routing table (planned
/// here as the controller plans it).
fn pair_bytes(world: &WorldSpec) -> anyhow::Result<Vec<(u32, u32, u64)>> {
    let config = world.read_model_config()?;
    let job = weightsync_schedules::job::plan_job(world, config.as_deref())?;
    let mut out = Vec::new();
    for t in job.table.trainer_plans()? {
        let mut per = BTreeMap::<u32, u64>::new();
        for w in t.all_writes() {
            if let WriteTarget::Rollout(r) = w.dst {
                *per.entry(r).or_default() += w.len as u64;
            }
        }
        out.extend(per.into_iter().map(|(r, b)| (t.rank, r, b)));
    }
    Ok(out)
}

/// The fabric limit for `world`'s pairs with `lanes` lanes: the best of three runs after a
/// warm-up, GB/s.
pub(super) async fn measure_fabric_limit(world: &WorldSpec, lanes: usize) -> anyhow::Result<f64> {
    let pb = spinner(format!(
        "measuring the fabric limit: this job's bytes between its pairs, {lanes} lanes, nothing else"
    ));
    let w = world.clone();
    let pairs = tokio::task::spawn_blocking(move || pair_bytes(&w)).await??;
    let bytes: u64 = pairs.iter().map(|p| p.2).sum();
    let token = format!("demo-fabric-limit-{:016x}", rand::random::<u64>());
    let limit = FabricLimit::start(&pairs, &FabricConfig::loopback(&token, lanes)).await?;
    limit.sync().await?;
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        best = best.min(limit.sync().await?);
    }
    drop(limit);
    pb.finish_and_clear();
    let gbps = bytes as f64 / best / 1e9;
    eprintln!(
        "  fabric limit: {gbps:.2} GB/s ({:.1} MB in {best:.3} s, {} pairs, {lanes} lanes)",
        bytes as f64 / 1e6,
        pairs.len()
    );
    Ok(gbps)
}
