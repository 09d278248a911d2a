//! The fabric bench's best rate, measured inside the calling process: the yardstick of a
//! `ratio_vs_fabric` where a whole `bench fabric` run (a peer process, every block size and lane
//! count, latencies, several NICs) would take longer than what it is compared with (the demo's
//! syncs).
//!
//! Same method as the bench's throughput rows: a writer fabric and a receiving fabric on
//! loopback, the bench's [`REGION_BYTES`] regions, blocks of the bench's two large sizes
//! (1 MiB and 64 MiB) written into cycling offsets with the bench's window, best of `reps`
//! rounds, from a source holding bytes (as the bench's does). Only the receiving side lives in
//! this process instead of a peer's, which on loopback changes nothing the wire sees.

use weightsync_common::fabric::{Access, FabricBackend, FabricConfig, TcpFabric, limit};

use super::{REGION_BYTES, fabric_throughput, gbps, plan};

/// Block sizes measured (the bench's large ones: per-write costs vanish at these).
const BLOCKS: [usize; 2] = [1 << 20, 64 << 20];

/// Best GB/s (10^9 bytes per second) one writer with `lanes` lanes per peer moves to one peer,
/// over `reps` rounds of every block size.
pub async fn best_rate_gbps(lanes: usize, reps: usize) -> anyhow::Result<f64> {
    anyhow::ensure!(
        lanes > 0,
        "the fabric rate needs at least one lane, not {lanes}"
    );
    let token = format!("fabric-rate-{:016x}", rand::random::<u64>());
    let config = FabricConfig::loopback(&token, lanes);
    let receiver = TcpFabric::start(&config).await?;
    let region = receiver.alloc(REGION_BYTES, Access::RECEIVE)?;
    let writer = TcpFabric::start(&config).await?;
    writer.connect(&region.descriptor().endpoint).await?;
    let src = writer.alloc(REGION_BYTES, Access::SOURCE)?;
    limit::fill_source(&src)?;
    let mut best: f64 = 0.0;
    for _ in 0..reps.max(1) {
        for block in BLOCKS {
            let (total, _) = plan(block, false);
            let took = fabric_throughput(&writer, &src, region.descriptor(), block, total).await?;
            best = best.max(gbps(total / block as u64 * block as u64, took));
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_writer_and_its_peer_in_one_process_move_bytes_at_a_rate() {
        let g = best_rate_gbps(1, 1).await.unwrap();
        assert!(g > 0.0 && g.is_finite(), "{g}");
    }

    #[tokio::test]
    async fn no_lanes_is_refused_by_name() {
        let e = best_rate_gbps(0, 1).await.unwrap_err().to_string();
        assert!(e.contains("at least one lane"), "{e}");
    }
}
