//! The fabric limit: the same bytes between the same pairs as a sync, written by the same fabric
//! with the same lanes, and nothing else (no routing table, no staging, no preparation, no
//! immediates, no barrier): large blocks from one registered buffer per trainer into one
//! registered region per rollout, every pair at once, a few writes in flight per pair.
//!
//! Why: a sync's landing rate alone mixes two losses, the fabric's own and the pipeline's.
//! Measured beside a sync in the same run, `ratio_vs_fabric` (sync landing rate over this)
//! isolates the second: what the pipeline between the routing table and the wire costs. It
//! lives here, beside the fabric, because more than the benches measure against it: the GPU
//! check (`weightsync-worker`'s `gpu::check`) puts it beside a sync from device memory.

use std::collections::BTreeMap;
use std::time::Instant;

use super::{
    Access, FabricBackend, FabricConfig, Region, RegionDescriptor, Result, TcpFabric, WriteOp,
};

/// Bytes per write: large enough that per-write costs vanish on every backend.
const BLOCK: u64 = 4 << 20;
/// Writes in flight per pair.
const WINDOW: usize = 4;
/// Most bytes of each source buffer and destination region (blocks cycle through it; the fabric
/// bench's regions are the same size), larger than the caches. A sync reads its weights from
/// memory and lands them in memory; a limit cycling through a few cache-hot blocks would be one
/// no sync can reach. An endpoint moving less gets what it moves (rounded up to whole blocks).
pub const REGION_BYTES: u64 = 128 << 20;

/// Bytes of the buffer of an endpoint moving `bytes` in all.
fn region_bytes(bytes: u64) -> u64 {
    bytes
        .div_ceil(BLOCK)
        .clamp(WINDOW as u64, REGION_BYTES / BLOCK)
        * BLOCK
}

/// One fabric per trainer and per rollout, connected, with their buffers registered.
#[derive(Debug)]
pub struct FabricLimit {
    trainers: BTreeMap<u32, (TcpFabric, Region)>,
    rollouts: BTreeMap<u32, (TcpFabric, Region, RegionDescriptor)>,
    pairs: Vec<(u32, u32, u64)>,
}

impl FabricLimit {
    /// Starts the fabrics for `pairs` (trainer, rollout, bytes), each configured as `config`
    /// (the sync's own: same lanes, same local addresses).
    pub async fn start(pairs: &[(u32, u32, u64)], config: &FabricConfig) -> Result<FabricLimit> {
        let start = || TcpFabric::start(config);
        let mut sent: BTreeMap<u32, u64> = BTreeMap::new();
        let mut received: BTreeMap<u32, u64> = BTreeMap::new();
        for &(t, r, bytes) in pairs {
            *sent.entry(t).or_default() += bytes;
            *received.entry(r).or_default() += bytes;
        }
        let mut trainers = BTreeMap::new();
        let mut rollouts = BTreeMap::new();
        for &(t, r, _) in pairs {
            if let std::collections::btree_map::Entry::Vacant(slot) = trainers.entry(t) {
                let f = start().await?;
                let src = f.alloc(region_bytes(sent[&t]) as usize, Access::SOURCE)?;
                fill_source(&src)?;
                slot.insert((f, src));
            }
            if let std::collections::btree_map::Entry::Vacant(slot) = rollouts.entry(r) {
                let f = start().await?;
                let dst = f.alloc(region_bytes(received[&r]) as usize, Access::RECEIVE)?;
                let d = dst.descriptor().clone();
                slot.insert((f, dst, d));
            }
        }
        // Each trainer's fabric told its peers, as a sync's trainer tells its own
        // (`TrainerWorker::set_destinations`), so that both open the same lanes.
        for (t, (f, _)) in &trainers {
            f.expect_peers(pairs.iter().filter(|p| p.0 == *t).count());
        }
        Ok(FabricLimit {
            trainers,
            rollouts,
            pairs: pairs.to_vec(),
        })
    }

    /// Moves every pair's bytes once, all pairs at once; returns the seconds it took.
    pub async fn sync(&self) -> Result<f64> {
        let t0 = Instant::now();
        let mut pairs = Vec::with_capacity(self.pairs.len());
        for (k, &(t, r, bytes)) in self.pairs.iter().enumerate() {
            let (fabric, src) = &self.trainers[&t];
            let dst = &self.rollouts[&r].2;
            let slots = src.len().min(dst.len) / BLOCK;
            // Pairs start at different blocks, so that no two read or write the same memory
            // at once (one would find it in cache).
            let first = k as u64 * slots / self.pairs.len() as u64;
            pairs.push(pair(
                fabric.clone(),
                src.clone(),
                dst.clone(),
                bytes,
                first,
                slots,
            ));
        }
        futures::future::try_join_all(pairs).await?;
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// Writes weight-like bytes over all of `src`, a source a yardstick reads from. Untouched, a
/// fresh buffer reads as the kernel's zero page: every block would be copied out of one physical
/// page (one huge page with THP), always in cache, a rate no sync reading real weights can
/// reach. (Until 2026-12-07 this limit and the demo's fabric rate read exactly that; see the
/// performance log, docs/performance-log.md, "Huge pages".)
pub fn fill_source(src: &Region) -> Result<()> {
    let pattern: Vec<u8> = (0..BLOCK as u32)
        .map(|i| i.wrapping_mul(2_654_435_761).to_le_bytes()[3])
        .collect();
    let mut at = 0u64;
    while at < src.len() {
        let n = (src.len() - at).min(BLOCK);
        src.write_at(at, &pattern[..n as usize])?;
        at += n;
    }
    Ok(())
}

/// One pair's bytes in [`BLOCK`]s, [`WINDOW`] in flight, cycling through the first `slots`
/// blocks of the regions from block `first`.
async fn pair(
    fabric: TcpFabric,
    src: Region,
    dst: RegionDescriptor,
    bytes: u64,
    first: u64,
    slots: u64,
) -> Result<()> {
    type Pending = std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;
    let mut in_flight: std::collections::VecDeque<Pending> =
        std::collections::VecDeque::with_capacity(WINDOW);
    let mut sent = 0u64;
    let mut i = 0u64;
    while sent < bytes {
        let len = BLOCK.min(bytes - sent);
        let off = ((first + i) % slots) * BLOCK;
        if in_flight.len() == WINDOW {
            let f = in_flight.pop_front().expect("window is full");
            f.await?;
        }
        in_flight.push_back(Box::pin(
            fabric.write(WriteOp::new(&src, off, &dst, off, len)),
        ));
        sent += len;
        i += 1;
    }
    for f in in_flight {
        f.await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_gets_what_it_moves_in_whole_blocks_within_the_bench_region() {
        assert_eq!(region_bytes(1), WINDOW as u64 * BLOCK);
        assert_eq!(region_bytes(10 * BLOCK + 1), 11 * BLOCK);
        assert_eq!(region_bytes(10 * REGION_BYTES), REGION_BYTES);
        assert_eq!(REGION_BYTES % BLOCK, 0);
    }

    /// A source the limit reads holds bytes in every block, the tail included: left zero, it
    /// would be read from the kernel's zero page (see [`fill_source`]).
    #[tokio::test]
    async fn the_limits_sources_hold_bytes_in_every_block() {
        let pairs = [(0, 0, BLOCK + 12_345)];
        let limit = FabricLimit::start(&pairs, &FabricConfig::loopback("limit-test", 1))
            .await
            .unwrap();
        let src = &limit.trainers[&0].1;
        assert_eq!(src.len(), region_bytes(BLOCK + 12_345));
        let mut block = vec![0u8; BLOCK as usize];
        for at in (0..src.len()).step_by(BLOCK as usize) {
            src.read_at(at, &mut block).unwrap();
            let zero = block.iter().filter(|&&b| b == 0).count();
            assert!(zero < block.len() / 64, "block at {at}: {zero} zero bytes");
        }
        limit.sync().await.unwrap();
    }
}
