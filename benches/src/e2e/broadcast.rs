//! The broadcast baseline executed for real through the same fabric: gather to training rank 0,
//! broadcast to every inference rank, each rank reloads its part (verl / OpenRLHF with NCCL).
//!
//! Per bucket of whole tensors (in model order, up to `bucket_bytes`):
//! 1. **gather**: every trainer one-sided-writes its shards of the bucket's tensors into rank 0's
//!    bucket buffer (rank 0 copies its own locally), so rank 0 holds the full bf16 tensors;
//! 2. **broadcast**: rank 0 writes the whole bucket into every inference rank's receive buffer
//!    (a star from rank 0; on loopback every hop shares the same host anyway, so a ring would
//!    carry the same bytes);
//! 3. **reload**: every inference rank copies its share of each tensor out of the buffer and
//!    quantises it to fp8 (the worker's own kernel) when the engine holds it in fp8, while the
//!    next bucket is gathered (two buffers per rank).
//!
//! Training shards held in f32 (FSDP2 under mixed precision, `dtype=f32`) are gathered and
//! broadcast in f32 and converted where an engine's loader converts them, in the reload: cast
//! to bf16, or quantised from f32. (Casting to bf16 on rank 0 first, to broadcast half the
//! bytes, measured slower here, one run each: 2.07 s against 1.54 s a sync for `bench e2e
//! --dtype bf16 --train fsdp=4,dtype=f32`, since rank 0's cast sits between the gather and the
//! broadcast; the faster one is the baseline.)
//!
//! What is simplified, always in the baseline's favour: a rank's share is taken as contiguous
//! rows (`rank bytes / engine bytes` of each tensor), so the strided column slices a real engine
//! cuts for row-parallel tensors are not paid; and the quantised output goes to a scratch buffer.
//! Only dim-0 sharded training layouts (FSDP, HSDP) are supported: their shards are contiguous
//! rows of the full tensors. Like the engines it stands for, which reload into weights allocated
//! once, it allocates every buffer once: rank 0's own shards are copied straight into its bucket
//! buffer, and each rank's reload reuses its input and fp8 output buffers from bucket to bucket
//! and sync to sync (fresh buffers per bucket cost 170 k page faults, 0.8 CPU-s, a sync).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use weightsync_common::DType;
use weightsync_common::fabric::{Access, FabricBackend, FabricConfig, Region, TcpFabric, WriteOp};
use weightsync_schedules::RoutingTable;
use weightsync_schedules::table::Transform;
use weightsync_worker::{Fp8Shape, Threads, cast, quantise_fp8};

use super::E2eError;
use super::loopback::{TOKEN, weights};

/// Buffers per inference rank (and at rank 0).
const SLOTS: usize = 2;

/// One full tensor of the model as the baseline moves it.
#[derive(Debug, Clone)]
struct FullTensor {
    /// Rows, columns (1-D tensors: one row).
    rows: u64,
    cols: u64,
    /// Element size in the training dtype.
    elem: u64,
    /// Quantised to fp8 on the inference side.
    quantised: bool,
    /// Cast to bf16 on the inference side (f32 training shards of a bf16 engine tensor).
    cast_to_bf16: bool,
    /// (trainer, arena offset, bytes, byte offset in the full tensor) of each distinct shard.
    parts: Vec<(u32, u64, u64, u64)>,
}

impl FullTensor {
    fn bytes(&self) -> u64 {
        self.rows * self.cols * self.elem
    }
}

/// The baseline's moving parts, set up once.
#[derive(Debug)]
pub struct BroadcastBaseline {
    trainers: Vec<(TcpFabric, Region)>,
    /// Rank 0's bucket buffers.
    root_slots: Vec<Region>,
    /// Per inference rank.
    rollouts: Vec<Rollout>,
    buckets: Vec<Vec<(FullTensor, u64)>>,
    bucket_bytes: u64,
}

/// One inference rank of the baseline.
#[derive(Debug)]
struct Rollout {
    /// Kept alive for its receive buffers.
    _fabric: TcpFabric,
    /// Receive buffers, one per slot.
    slots: Vec<Region>,
    /// Its share of an engine.
    share: f64,
    /// Per slot, its reload's buffers.
    scratch: Vec<Arc<Mutex<ReloadScratch>>>,
}

fn fab_err(what: &str) -> impl Fn(weightsync_common::fabric::FabricError) -> E2eError + '_ {
    move |e| E2eError::Setup(format!("broadcast baseline, {what}: {e}"))
}

/// The model's full tensors, with the shards that make them, from the table.
fn full_tensors(table: &RoutingTable) -> Result<Vec<FullTensor>, E2eError> {
    let mut by_id: BTreeMap<u32, FullTensor> = BTreeMap::new();
    let plans = table
        .trainer_plans()
        .map_err(|e| E2eError::Setup(format!("broadcast baseline, expanding the slices: {e}")))?;
    for plan in &plans {
        for s in &plan.shards {
            let p = &plan.params[s.param as usize];
            let dims = p.shape.dims();
            let cols: u64 = dims.iter().skip(1).map(|&d| d as u64).product();
            let rows = dims.first().map_or(1, |&d| d as u64);
            let (rows, cols) = if dims.len() <= 1 {
                (1, rows)
            } else {
                (rows, cols)
            };
            let elem = s.dtype.size() as u64;
            let t = by_id.entry(p.id).or_insert_with(|| FullTensor {
                rows,
                cols,
                elem,
                quantised: false,
                cast_to_bf16: false,
                parts: Vec::new(),
            });
            let g = &s.global;
            let trailing_whole =
                (1..g.ndim as usize).all(|d| g.start[d] == 0 && g.len[d] == p.shape.dims[d]);
            if !trailing_whole {
                return Err(E2eError::Setup(format!(
                    "broadcast baseline: shard {} of {} is not a dim-0 slice (only FSDP/HSDP layouts)",
                    g, p.name
                )));
            }
            let row_bytes = if dims.len() <= 1 { elem } else { cols * elem };
            let at = g.start[0] as u64 * row_bytes;
            if !t.parts.iter().any(|&(_, _, _, o)| o == at) {
                t.parts.push((plan.rank, s.offset, s.bytes(), at));
            }
        }
        for task in &plan.tasks {
            let id = plan.params[task.param as usize].id;
            let Some(t) = by_id.get_mut(&id) else {
                continue;
            };
            match task.transform {
                Transform::Fp8Block { .. } => t.quantised = true,
                Transform::Cast {
                    from: DType::F32,
                    to: DType::BF16,
                } => t.cast_to_bf16 = true,
                _ => {}
            }
        }
    }
    Ok(by_id.into_values().collect())
}

impl BroadcastBaseline {
    /// Starts the fabrics, registers every trainer's source (random weights) and the buffers.
    pub async fn start(
        table: &RoutingTable,
        bucket_bytes: u64,
        lanes_per_peer: usize,
    ) -> Result<Self, E2eError> {
        let cfg = FabricConfig::loopback(TOKEN, lanes_per_peer);
        let tensors = full_tensors(table)?;
        let bucket_bytes =
            bucket_bytes.max(tensors.iter().map(FullTensor::bytes).max().unwrap_or(1));
        let mut buckets: Vec<Vec<(FullTensor, u64)>> = vec![Vec::new()];
        let mut fill = 0;
        for t in tensors {
            if fill + t.bytes() > bucket_bytes && fill > 0 {
                buckets.push(Vec::new());
                fill = 0;
            }
            let at = fill;
            fill += t.bytes();
            buckets
                .last_mut()
                .expect("at least one bucket")
                .push((t, at));
        }
        let mut trainers = Vec::new();
        for plan in &table.trainers {
            let f = TcpFabric::start(&cfg).await.map_err(fab_err("fabric"))?;
            let len = plan.source_arena_bytes.max(1);
            let src = f
                .alloc(len as usize, Access::SOURCE)
                .map_err(fab_err("source"))?;
            src.write_at(0, &weights(len, plan.rank as u64 + 101))
                .map_err(fab_err("filling the source"))?;
            trainers.push((f, src));
        }
        let root = &trainers
            .first()
            .ok_or_else(|| E2eError::Setup("the table has no training ranks".into()))?
            .0;
        let root_slots = (0..SLOTS)
            .map(|_| root.alloc(bucket_bytes as usize, Access::RECEIVE | Access::SOURCE))
            .collect::<Result<Vec<_>, _>>()
            .map_err(fab_err("rank 0 buffers"))?;
        let mut engine_total: BTreeMap<u32, u64> = BTreeMap::new();
        let held = |rank: u32| -> u64 {
            table
                .rollout_layout(rank)
                .map_or(0, |l| l.tensors.iter().map(|t| t.len).sum())
        };
        for r in &table.rollouts {
            *engine_total.entry(r.engine).or_default() += held(r.rank);
        }
        let mut rollouts = Vec::new();
        for r in &table.rollouts {
            let f = TcpFabric::start(&cfg).await.map_err(fab_err("fabric"))?;
            let slots = (0..SLOTS)
                .map(|_| f.alloc(bucket_bytes as usize, Access::RECEIVE))
                .collect::<Result<Vec<_>, _>>()
                .map_err(fab_err("receive buffers"))?;
            let mine = held(r.rank);
            let share = mine as f64 / engine_total[&r.engine].max(1) as f64;
            rollouts.push(Rollout {
                _fabric: f,
                slots,
                share: share.min(1.0),
                scratch: (0..SLOTS).map(|_| Arc::default()).collect(),
            });
        }
        Ok(BroadcastBaseline {
            trainers,
            root_slots,
            rollouts,
            buckets,
            bucket_bytes,
        })
    }

    /// Bytes one sync moves over the fabric (gather plus broadcast).
    pub fn fabric_bytes(&self) -> u64 {
        let mut b = 0;
        for bucket in &self.buckets {
            for (t, _) in bucket {
                b += t
                    .parts
                    .iter()
                    .filter(|p| p.0 != 0)
                    .map(|p| p.2)
                    .sum::<u64>();
                b += t.bytes() * self.rollouts.len() as u64;
            }
        }
        b
    }

    /// Bucket size used.
    pub fn bucket_bytes(&self) -> u64 {
        self.bucket_bytes
    }

    /// One sync: every bucket gathered, broadcast and reloaded; seconds.
    pub async fn sync(&self) -> Result<f64, E2eError> {
        let t0 = Instant::now();
        let mut reloads: Vec<Vec<tokio::task::JoinHandle<Result<(), E2eError>>>> =
            (0..SLOTS).map(|_| Vec::new()).collect();
        for (k, bucket) in self.buckets.iter().enumerate() {
            let slot = k % SLOTS;
            // The slot is free once the ranks reloaded what was in it.
            for h in reloads[slot].drain(..) {
                h.await
                    .map_err(|e| E2eError::Sync(format!("reload panicked: {e}")))??;
            }
            // 1. Gather onto rank 0.
            let root_buf = &self.root_slots[slot];
            let root_desc = root_buf.descriptor().clone();
            let mut per_trainer: BTreeMap<u32, Vec<WriteOp>> = BTreeMap::new();
            for (t, at) in bucket {
                for &(rank, src_off, len, dst_off) in &t.parts {
                    if rank == 0 {
                        root_buf
                            .copy_from(at + dst_off, &self.trainers[0].1, src_off, len as usize)
                            .map_err(fab_err("local gather"))?;
                    } else {
                        let src = &self.trainers[rank as usize].1;
                        per_trainer.entry(rank).or_default().push(WriteOp::new(
                            src,
                            src_off,
                            &root_desc,
                            at + dst_off,
                            len,
                        ));
                    }
                }
            }
            let gathers: Vec<_> = per_trainer
                .into_iter()
                .map(|(rank, ops)| self.trainers[rank as usize].0.write_batch(ops))
                .collect();
            all_landed("gather", gathers).await?;
            // 2. Broadcast from rank 0 to every inference rank.
            let used: u64 = bucket.iter().map(|(t, _)| t.bytes()).sum();
            let root = &self.trainers[0].0;
            let sends: Vec<_> = self
                .rollouts
                .iter()
                .map(|r| {
                    root.write_batch(vec![WriteOp::new(
                        root_buf,
                        0,
                        r.slots[slot].descriptor(),
                        0,
                        used,
                    )])
                })
                .collect();
            all_landed("broadcast", sends).await?;
            // 3. Every rank reloads its share, in the background.
            for r in &self.rollouts {
                let buf = r.slots[slot].clone();
                let share = r.share;
                let tensors: Vec<(FullTensor, u64)> = bucket.clone();
                let scratch = r.scratch[slot].clone();
                reloads[slot].push(tokio::task::spawn_blocking(move || {
                    // One reload per rank and slot at a time (the slot waits for it): the
                    // lock is never contended.
                    let mut scratch = scratch.lock();
                    reload(&buf, &tensors, share, &mut scratch)
                }));
            }
        }
        for hs in reloads {
            for h in hs {
                h.await
                    .map_err(|e| E2eError::Sync(format!("reload panicked: {e}")))??;
            }
        }
        Ok(t0.elapsed().as_secs_f64())
    }
}

/// Runs every write batch at once (spawned, so they are all in flight) and waits for all.
async fn all_landed<F>(what: &str, fs: Vec<F>) -> Result<(), E2eError>
where
    F: std::future::Future<Output = weightsync_common::fabric::Result<()>> + Send + 'static,
{
    let mut jobs = tokio::task::JoinSet::new();
    for f in fs {
        jobs.spawn(f);
    }
    while let Some(j) = jobs.join_next().await {
        j.map_err(|e| E2eError::Sync(format!("{what} panicked: {e}")))?
            .map_err(|e| E2eError::Sync(format!("{what}: {e}")))?;
    }
    Ok(())
}

/// What a rank's reload copies into and quantises into, kept from bucket to bucket and sync
/// to sync: an engine reloads into weights it allocated once, so the baseline allocating (and
/// the kernel zero-filling) fresh buffers for every bucket would charge it a cost it does not
/// have.
#[derive(Debug, Default)]
struct ReloadScratch {
    input: Vec<u8>,
    values: Vec<u8>,
    scales: Vec<u8>,
}

/// `v`'s first `len` bytes, grown (once) when it is shorter.
fn at_least(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

/// One rank's reload of one bucket: copy its rows of every tensor out, cast or quantise them
/// where the engine holds them so (from f32 or bf16).
fn reload(
    buf: &Region,
    tensors: &[(FullTensor, u64)],
    share: f64,
    scratch: &mut ReloadScratch,
) -> Result<(), E2eError> {
    for (t, at) in tensors {
        let rows = ((t.rows as f64 * share).ceil() as u64).clamp(1, t.rows);
        let len = (rows * t.cols * t.elem) as usize;
        let input = at_least(&mut scratch.input, len);
        buf.read_at(*at, input)
            .map_err(|e| E2eError::Sync(format!("reload read: {e}")))?;
        let from = if t.elem == 4 { DType::F32 } else { DType::BF16 };
        if t.cast_to_bf16 {
            let out = at_least(&mut scratch.values, len / 2);
            cast(&scratch.input[..len], from, out, DType::BF16, Threads::One)
                .map_err(|e| E2eError::Sync(format!("reload cast: {e}")))?;
        }
        if t.quantised {
            let shape = Fp8Shape {
                rows: rows as usize,
                cols: t.cols as usize,
            };
            let values = at_least(&mut scratch.values, shape.rows * shape.cols);
            let scales = at_least(
                &mut scratch.scales,
                shape.row_blocks() * shape.col_blocks() * 4,
            );
            quantise_fp8(
                &scratch.input[..len],
                from,
                shape,
                values,
                scales,
                Threads::One,
            )
            .map_err(|e| E2eError::Sync(format!("reload quantise: {e}")))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_worker::f32_to_bf16;

    fn f32_tensor(rows: u64, cols: u64) -> FullTensor {
        FullTensor {
            rows,
            cols,
            elem: 4,
            quantised: false,
            cast_to_bf16: false,
            parts: Vec::new(),
        }
    }

    #[tokio::test]
    async fn a_reload_converts_f32_as_the_engine_holds_it() {
        // f32 shards (dtype=f32) reach the engines in f32: the reload casts a bf16 tensor's
        // rows, and quantises an fp8 one's from f32, not from its bytes read as bf16.
        let fabric = TcpFabric::start(&FabricConfig::loopback(TOKEN, 1))
            .await
            .unwrap();
        let (rows, cols) = (256u64, 128u64);
        let values: Vec<f32> = (0..rows * cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let bytes: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let buf = fabric.alloc(bytes.len(), Access::RECEIVE).unwrap();
        buf.write_at(0, &bytes).unwrap();
        let half_rows = (rows / 2 * cols) as usize;

        let mut cast = f32_tensor(rows, cols);
        cast.cast_to_bf16 = true;
        let mut scratch = ReloadScratch::default();
        reload(&buf, &[(cast, 0)], 0.5, &mut scratch).unwrap();
        let want: Vec<u8> = values[..half_rows]
            .iter()
            .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
            .collect();
        assert!(scratch.values[..want.len()] == want[..]);

        let mut fp8 = f32_tensor(rows, cols);
        fp8.quantised = true;
        let mut scratch = ReloadScratch::default();
        reload(&buf, &[(fp8, 0)], 0.5, &mut scratch).unwrap();
        let shape = Fp8Shape {
            rows: (rows / 2) as usize,
            cols: cols as usize,
        };
        let mut q = vec![0u8; shape.rows * shape.cols];
        let mut s = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
        let input = &bytes[..half_rows * 4];
        quantise_fp8(input, DType::F32, shape, &mut q, &mut s, Threads::One).unwrap();
        assert!(scratch.values[..q.len()] == q[..] && scratch.scales[..s.len()] == s[..]);
    }
}
