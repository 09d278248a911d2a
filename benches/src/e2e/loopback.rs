//! A whole weightsync deployment inside one process on loopback: one TCP fabric (its own
//! listener, lanes and threads, as a separate process would have) per trainer and per rollout,
//! the real `TrainerWorker`s and `RolloutWorker`s, and a driver that does what the controller
//! does per sync: arm every rollout, start every trainer, wait until every rollout landed.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rayon::prelude::*;
use weightsync_common::fabric::{FabricConfig, TcpFabric};
use weightsync_common::protocol::{DeltaFigures, DeltaRecord};
use weightsync_schedules::RoutingTable;
use weightsync_worker::RolloutWorker;
use weightsync_worker::{
    DeltaSync, Destinations, PipelineMode, SourceView, SyncId, TrainerConfig, TrainerWorker,
};

use super::E2eError;
use super::registered_source::RegisteredSource;
use super::split::TrainerSplit;

/// How the workers run.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    /// Staging watermark per trainer, bytes.
    pub watermark_bytes: u64,
    /// Lanes per peer of every fabric.
    pub lanes_per_peer: usize,
    /// Local addresses (NICs) per fabric: 127.0.0.1, 127.0.0.2, ... (every one is loopback on
    /// Linux). Lane `i` to a peer leaves from address `i mod addresses`, so a sync stripes over
    /// all of them when `lanes_per_peer >= addresses`.
    pub addresses: usize,
    /// Checksums on (trainers hash what they write; costs host CPU).
    pub verify: bool,
    /// Prepare on every rayon thread.
    pub prepare_all_threads: bool,
    /// Pipelined or serialised stages.
    pub mode: PipelineMode,
    /// Trainers' weights registered with their fabric as write sources (as the Python package
    /// registers a training job's tensors), so same-dtype copies of contiguous boxes are
    /// written straight from them; `false`: a plain arena, everything staged (the sidecar's
    /// path). See `registered_source`.
    pub registered_sources: bool,
    /// Same-host pulls off even with one address: every byte crosses a socket, as between
    /// hosts.
    pub sockets_only: bool,
    /// Delta syncs: trainers keep bases (sources are plain arenas the bench can change between
    /// syncs), rollouts register an inbox of this fraction of their bytes; `None`: full syncs.
    pub delta_inbox: Option<f64>,
}

impl Default for WorkerOptions {
    fn default() -> Self {
        WorkerOptions {
            watermark_bytes: 256 << 20,
            lanes_per_peer: 2,
            addresses: 1,
            verify: false,
            prepare_all_threads: true,
            mode: PipelineMode::Pipelined,
            registered_sources: true,
            sockets_only: false,
            delta_inbox: None,
        }
    }
}

/// Job token shared by every fabric of a bench run.
pub(crate) const TOKEN: &str = "weightsync-bench-e2e";

/// Most local addresses per fabric the bench lays out (127.0.0.1 ..= 127.0.0.8).
pub const MAX_ADDRESSES: usize = 8;

impl WorkerOptions {
    /// Checks the options that a fabric would otherwise refuse later, or silently not use.
    pub fn check(&self) -> Result<(), E2eError> {
        if self.addresses == 0 || self.addresses > MAX_ADDRESSES {
            return Err(E2eError::Options(format!(
                "addresses {}: expected 1 to {MAX_ADDRESSES}",
                self.addresses
            )));
        }
        if self.lanes_per_peer < self.addresses {
            return Err(E2eError::Options(format!(
                "addresses {} with {} lane(s) per peer: lane i leaves from address i mod {}, so \
                 every address needs a lane (give at least {} lanes)",
                self.addresses, self.lanes_per_peer, self.addresses, self.addresses
            )));
        }
        Ok(())
    }

    /// The fabric configuration of every worker (and of the fabric limit beside it). With
    /// several addresses same-host pulls are off: that run measures the bytes each address
    /// carries, and pulled bytes cross none.
    pub(crate) fn fabric_config(&self) -> FabricConfig {
        FabricConfig {
            extra_listen: (2..=self.addresses)
                .map(|k| format!("127.0.0.{k}:0"))
                .collect(),
            same_host: self.addresses == 1 && !self.sockets_only,
            ..FabricConfig::loopback(TOKEN, self.lanes_per_peer)
        }
    }
}

/// Bytes one local address (NIC) carried, summed over every fabric of a cluster.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct AddressTraffic {
    /// The address's IP (every fabric of the bench uses the same IPs, each its own port).
    pub ip: String,
    /// Bytes sent from it (frame headers included).
    pub bytes_sent: u64,
    /// Payload bytes received on it.
    pub bytes_received: u64,
}

/// Bytes of plausible bf16 weights (values in about [-2, 2]), deterministic in `seed`.
pub(crate) fn weights(len: u64, seed: u64) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    out.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut x =
                seed ^ (c as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
            for pair in chunk.chunks_mut(2) {
                // xorshift64*
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let r = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
                let v = ((r >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0;
                let b = (v.to_bits() >> 16) as u16;
                let bytes = b.to_le_bytes();
                pair.copy_from_slice(&bytes[..pair.len()]);
            }
        });
    out
}

/// Trainers and rollouts of one table, wired together.
#[derive(Debug)]
pub struct LoopbackCluster {
    /// Every worker's fabric (clones), for the per-address byte counts.
    fabrics: Vec<TcpFabric>,
    trainers: Vec<Arc<TrainerWorker<TcpFabric>>>,
    rollouts: Vec<Arc<RolloutWorker<TcpFabric>>>,
    landed_bytes: u64,
    epoch: u64,
    /// With deltas: each trainer's weights, which [`LoopbackCluster::change`] edits.
    delta_sources: Vec<Arc<RegisteredSource>>,
    /// With deltas: the version every engine holds after the last successful sync.
    held: Option<u64>,
    /// Whether [`sync`](Self::sync) has every engine verify the trainers' checksums before
    /// the sync counts (when the trainers send them), timed with it.
    pub verify_engines: bool,
}

/// One measured sync.
#[derive(Debug, Clone)]
pub struct SyncTime {
    /// From starting the trainers to the last rollout landed, seconds.
    pub seconds: f64,
    /// Bytes that landed in rollouts.
    pub landed_bytes: u64,
    /// Where each trainer's wall went, by rank.
    pub trainers: Vec<TrainerSplit>,
    /// What the deltas came to, summed over trainers (encode time summed too) and, in
    /// `rollout_apply_ns`, the slowest rollout's apply.
    pub delta: DeltaFigures,
    /// The slowest rollout's apply, nanoseconds.
    pub rollout_apply_ns: u64,
    /// The slowest rollout's verification (after landing and applying; 0: not verifying),
    /// nanoseconds.
    pub rollout_verify_ns: u64,
    /// From starting the trainers until every trainer finished and every rollout landed (before
    /// any apply or verification), seconds.
    pub landed_s: f64,
}

/// Bytes every sync lands in rollouts: what the trainers' writes to rollouts carry, counted on
/// the compact table (the summary's count, equal to the explicit writes' by the planner's tests).
pub(crate) fn landed_bytes(table: &RoutingTable) -> u64 {
    weightsync_schedules::Summary::of(table, &weightsync_schedules::CostModel::default())
        .bytes_to_move
}

/// Starts one worker's fabric and keeps a clone in `all`.
async fn start_fabric(
    config: &FabricConfig,
    all: &mut Vec<TcpFabric>,
) -> Result<TcpFabric, E2eError> {
    let f = TcpFabric::start(config)
        .await
        .map_err(|e| E2eError::Setup(format!("starting a loopback fabric: {e}")))?;
    all.push(f.clone());
    Ok(f)
}

impl LoopbackCluster {
    /// Starts a fabric per worker, builds every worker from its slice of `table` with random
    /// weights, and exchanges descriptors.
    pub async fn start(table: &RoutingTable, opts: &WorkerOptions) -> Result<Self, E2eError> {
        opts.check()?;
        let config = opts.fabric_config();
        let mut fabrics = Vec::new();
        let mut rollouts = Vec::new();
        let mut dsts = Destinations::default();
        for r in table.rollout_plans() {
            let rank = r.rank;
            let total: u64 = r.mr_bytes.iter().sum();
            let mut w = RolloutWorker::new(
                start_fabric(&config, &mut fabrics).await?,
                format!("rollout-{rank}"),
                r,
            )
            .map_err(|e| E2eError::Setup(format!("rollout {rank}: {e}")))?;
            if let Some(fraction) = opts.delta_inbox {
                w.enable_delta_inbox(weightsync_worker::delta::inbox_bytes(total, fraction))
                    .map_err(|e| E2eError::Setup(format!("rollout {rank}'s inbox: {e}")))?;
                if let Some(d) = w.inbox_descriptor() {
                    dsts.inboxes.insert(rank, d);
                }
            }
            dsts.rollouts.insert(rank, w.descriptors());
            rollouts.push(Arc::new(w));
        }
        let mut trainers = Vec::new();
        let mut delta_sources = Vec::new();
        for rank in 0..table.trainers.len() as u32 {
            // What a trainer is sent: its compact slice, which it expands itself.
            let plan = table
                .trainer_plan(rank)
                .map_err(|e| E2eError::Setup(format!("trainer {rank}'s slice: {e}")))?;
            let bytes = weights(plan.source_arena_bytes, plan.rank as u64 + 1);
            let fabric = start_fabric(&config, &mut fabrics).await?;
            let source: Arc<dyn SourceView> = if opts.delta_inbox.is_some() {
                // Registered as in the full cluster, so that a task gone dense is written
                // straight from it as a full sync writes it.
                let shared = Arc::new(if opts.registered_sources {
                    RegisteredSource::register(&fabric, &plan, bytes)?
                } else {
                    RegisteredSource::unregistered(bytes)
                });
                delta_sources.push(shared.clone());
                shared
            } else if opts.registered_sources {
                Arc::new(RegisteredSource::register(&fabric, &plan, bytes)?)
            } else {
                Arc::new(bytes)
            };
            let mut cfg =
                TrainerConfig::new(format!("trainer-{}", plan.rank), opts.watermark_bytes);
            cfg.verify = opts.verify;
            cfg.prepare_all_threads = opts.prepare_all_threads;
            cfg.mode = opts.mode;
            cfg.delta.keep_bases = opts.delta_inbox.is_some();
            // Same-dtype copies too (the bench's weights are bf16 on both sides): staged while
            // compared, written from the registered source again once they go dense.
            cfg.delta.keep_direct = true;
            let w = TrainerWorker::new(fabric, source, plan, cfg)
                .map_err(|e| E2eError::Setup(format!("trainer {rank}: {e}")))?;
            if let Some(d) = w.gather_descriptor() {
                dsts.trainers.insert(rank, d);
            }
            trainers.push(w);
        }
        let trainers = trainers
            .into_iter()
            .map(|mut w| {
                w.set_destinations(&dsts)
                    .map_err(|e| E2eError::Setup(format!("destinations: {e}")))?;
                Ok(Arc::new(w))
            })
            .collect::<Result<Vec<_>, E2eError>>()?;
        Ok(LoopbackCluster {
            fabrics,
            trainers,
            rollouts,
            landed_bytes: landed_bytes(table),
            epoch: 0,
            delta_sources,
            held: None,
            verify_engines: false,
        })
    }

    /// Changes `fraction` of each trainer's bf16 weights (their lowest mantissa bit, at
    /// positions drawn from `seed`), as an optimizer step at a small learning rate does; only a
    /// cluster started with deltas has weights to change.
    pub fn change(&self, fraction: f64, seed: u64) -> Result<(), E2eError> {
        let threshold = (fraction.clamp(0.0, 1.0) * (1u64 << 32) as f64) as u64;
        for (i, src) in self.delta_sources.iter().enumerate() {
            src.modify(|bytes| {
                bytes
                    .par_chunks_mut(1 << 16)
                    .enumerate()
                    .for_each(|(c, chunk)| {
                        let mut x = (seed ^ (i as u64) << 48 ^ c as u64)
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                            | 1;
                        for pair in chunk.chunks_exact_mut(2) {
                            x ^= x >> 12;
                            x ^= x << 25;
                            x ^= x >> 27;
                            if (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) < threshold {
                                pair[0] ^= 1;
                            }
                        }
                    });
            })?;
        }
        Ok(())
    }

    /// Bytes each local address carried so far, summed over every worker's fabric, in the
    /// order of the fabrics' addresses (127.0.0.1 first).
    pub fn address_traffic(&self) -> Vec<AddressTraffic> {
        let mut out: Vec<AddressTraffic> = Vec::new();
        for f in &self.fabrics {
            for (i, a) in f.address_stats().into_iter().enumerate() {
                if out.len() <= i {
                    let ip = a
                        .address
                        .rsplit_once(':')
                        .map_or(a.address.as_str(), |p| p.0);
                    out.push(AddressTraffic {
                        ip: ip.to_string(),
                        ..Default::default()
                    });
                }
                out[i].bytes_sent += a.bytes_sent;
                out[i].bytes_received += a.bytes_received;
            }
        }
        out
    }

    /// Runs one sync end to end (arm, write, land) and times it.
    pub async fn sync(&mut self) -> Result<SyncTime, E2eError> {
        self.epoch += 1;
        let sync = SyncId {
            version: self.epoch,
            epoch: self.epoch,
        };
        for r in &self.rollouts {
            r.arm(sync)
                .map_err(|e| E2eError::Sync(format!("arming: {e}")))?;
        }
        // Deltas on top of what every engine holds (a full sync first, and after a failure).
        let delta = self
            .held
            .filter(|_| !self.delta_sources.is_empty())
            .map(|base| DeltaSync {
                base_version: base,
                rollouts: (0..self.rollouts.len() as u32).collect(),
            });
        self.held = None;
        let t0 = Instant::now();
        let mut jobs = tokio::task::JoinSet::new();
        for (rank, t) in self.trainers.iter().enumerate() {
            let t = t.clone();
            let delta = delta.clone();
            jobs.spawn(async move {
                let r = match &delta {
                    Some(d) => {
                        t.run_delta_sync_until(sync, d, std::future::pending())
                            .await?
                    }
                    None => t.run_sync(sync).await?,
                };
                Ok(Some((
                    TrainerSplit::of(rank as u32, &r),
                    r.deltas,
                    r.delta,
                    r.checksums,
                )))
            });
        }
        for r in &self.rollouts {
            let r = r.clone();
            jobs.spawn(async move { r.await_landed(Duration::from_secs(300)).await.map(|_| None) });
        }
        let mut trainers = Vec::with_capacity(self.trainers.len());
        let mut records: Vec<DeltaRecord> = Vec::new();
        let mut figures = DeltaFigures::default();
        let mut checksums = Vec::new();
        while let Some(j) = jobs.join_next().await {
            let done = j
                .map_err(|e| E2eError::Sync(format!("a worker task panicked: {e}")))?
                .map_err(|e: weightsync_worker::WorkerError| E2eError::Sync(e.to_string()))?;
            if let Some((split, deltas, f, sums)) = done {
                trainers.push(split);
                records.extend(deltas);
                figures.add(&f);
                checksums.extend(sums);
            }
        }
        let landed_s = t0.elapsed().as_secs_f64();
        // A version counts as landed once every engine applied its deltas.
        let records = Arc::new(records);
        let applies: Vec<u64> = self
            .rollouts
            .par_iter()
            .map(|r| r.apply_deltas(&records).map(|f| f.codec_ns))
            .collect::<Result<_, _>>()
            .map_err(|e| E2eError::Sync(format!("applying deltas: {e}")))?;
        // Verifying engines, a version counts once every engine verified it (full and delta
        // syncs alike: what a deployment waits for before it serves the weights).
        let verifies: Vec<u64> = if checksums.is_empty() || !self.verify_engines {
            Vec::new()
        } else {
            self.rollouts
                .par_iter()
                .map(|r| {
                    let t = Instant::now();
                    r.verify(&checksums).map(|_| t.elapsed().as_nanos() as u64)
                })
                .collect::<Result<_, _>>()
                .map_err(|e| E2eError::Sync(format!("verifying: {e}")))?
        };
        let seconds = t0.elapsed().as_secs_f64();
        if !self.delta_sources.is_empty() {
            self.held = Some(sync.version);
        }
        trainers.sort_by_key(|t| t.trainer);
        Ok(SyncTime {
            seconds,
            landed_bytes: self.landed_bytes,
            trainers,
            delta: figures,
            rollout_apply_ns: applies.into_iter().max().unwrap_or(0),
            rollout_verify_ns: verifies.into_iter().max().unwrap_or(0),
            landed_s,
        })
    }
}
