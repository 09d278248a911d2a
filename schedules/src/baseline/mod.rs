//! The broadcast baselines, planned from the same inputs and simulated on the same cluster model
//! as weightsync, so the ratio between them is a like-for-like comparison.
//!
//! Why model them rather than quote published figures: published numbers come from different
//! clusters, NICs and models. Planning the methods RL frameworks use today on *this* cluster
//! model, from the same routing table's model and layouts, isolates what the method costs.
//!
//! Both baselines use NCCL the way it is normally configured: collectives run as one ring per
//! NIC of a node (`nics_per_node` rings), each ring carrying a share of the bytes and crossing
//! every node once, with hops inside a node on NVLink (not modelled as a limit). A node therefore
//! receives every byte of a broadcast once, spread over all of its NICs; that is the best a
//! broadcast can do and the reason it cannot compete with routing: every inference node takes
//! in the *whole* model instead of its shard.
//!
//! - [`Baseline::GatherBroadcast`] (verl, OpenRLHF with NCCL): per mesh group (layer), the
//!   full tensors are gathered to training rank 0 (in the training dtype), then rank 0
//!   broadcasts them to every inference GPU; one tensor at a time, each NCCL call costing
//!   `nccl_call_s`; every engine rank then cuts and quantises its part while the next layer
//!   moves.
//! - [`Baseline::BucketedBroadcast`] (checkpoint-engine): the model in its checkpoint format
//!   (fp8 and scales when the destination is fp8) is cut into buckets of `bucket_bytes`; the
//!   owner of each bucket (training ranks in turn) gathers its tensors, quantises them and
//!   broadcasts the bucket into every engine's IPC buffer; engines copy what they need out of
//!   it (reload). Two buckets in flight (double buffering).
//!
//! # Layout
//! - this file: [`Baseline`], [`BaselineOptions`], [`simulate_baseline`] and the model facts both
//!   need ([`ModelBytes`]);
//! - `gather_broadcast`, `bucketed_broadcast`: the two plans.

mod bucketed_broadcast;
mod gather_broadcast;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::simulate::engine::{self, Hop, SimPlan};
use crate::simulate::{ClusterModel, SimError, SimReport, report};
use crate::table::{FP8_BLOCK, RoutingTable, Transform};

/// Which baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Baseline {
    /// Gather to training rank 0, then NCCL broadcast to every engine (verl, OpenRLHF).
    GatherBroadcast,
    /// Bucketed broadcast of the checkpoint format, engines reload (checkpoint-engine).
    BucketedBroadcast,
}

impl Baseline {
    /// Both baselines.
    pub const ALL: [Baseline; 2] = [Baseline::GatherBroadcast, Baseline::BucketedBroadcast];

    /// Short name.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::GatherBroadcast => "gather_broadcast",
            Baseline::BucketedBroadcast => "bucketed_broadcast",
        }
    }

    /// Who does it this way.
    pub fn as_in(self) -> &'static str {
        match self {
            Baseline::GatherBroadcast => "verl / OpenRLHF (NCCL)",
            Baseline::BucketedBroadcast => "checkpoint-engine",
        }
    }
}

/// Knobs of the baselines.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BaselineOptions {
    /// Bucket size of the bucketed broadcast, bytes.
    pub bucket_bytes: u64,
    /// Fixed cost of one NCCL collective call (launch and ring set-up), seconds.
    pub nccl_call_s: f64,
    /// NCCL chunk size (one work request per chunk per hop), bytes.
    pub nccl_chunk_bytes: u64,
}

impl Default for BaselineOptions {
    fn default() -> Self {
        BaselineOptions {
            bucket_bytes: 2 << 30,
            nccl_call_s: 20e-6,
            nccl_chunk_bytes: 4 << 20,
        }
    }
}

/// One logical parameter as the baselines see it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ParamBytes {
    /// Mesh group (layer) it belongs to.
    pub group: u16,
    /// Bytes of the full tensor in the training dtype.
    pub full: u64,
    /// Bytes in the checkpoint format (fp8 values and f32 scales when quantised).
    pub checkpoint: u64,
    /// Per node holding it, the bytes that node contributes to a gather (replicas counted once).
    pub per_node: BTreeMap<u32, f64>,
}

/// What the baselines need to know about the model, read off the routing table.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelBytes {
    pub(crate) params: Vec<ParamBytes>,
    /// Bytes of the whole model in the training dtype.
    pub full_bytes: u64,
    /// Bytes of the whole model in the checkpoint (destination) format.
    pub checkpoint_bytes: u64,
    /// The largest share of one engine's bytes a single inference rank holds.
    pub max_rank_share: f64,
    /// Nodes of the inference GPUs, in order.
    pub(crate) rollout_nodes: Vec<u32>,
}

/// Per parameter id: its shape, dtype size, whether it is quantised, its mesh group and the
/// shard bytes each node holds.
struct Acc {
    numel: u64,
    dims: Vec<u32>,
    size: u64,
    quantised: bool,
    group: u16,
    held: BTreeMap<u32, u64>,
}

/// What every trainer's slice holds, per parameter id (see [`Acc`]).
fn held_params(table: &RoutingTable, cluster: &ClusterModel) -> BTreeMap<u32, Acc> {
    let nt = table.trainers.len() as u32;
    let mut acc: BTreeMap<u32, Acc> = BTreeMap::new();
    for plan in &table.trainers {
        let node = cluster.node_of(plan.rank, nt);
        let ids: Vec<u64> = plan.params.iter::<1>().map(|[id]| id).collect();
        let param = |local: u64| {
            let id = *ids.get(local as usize)?;
            table.params.get(id as usize)
        };
        for s in plan.routes.local_shards().unwrap_or_default() {
            let Some(p) = param(s.param as u64) else {
                continue;
            };
            let a = acc.entry(p.id).or_insert_with(|| Acc {
                numel: p.shape.numel(),
                dims: p.shape.dims().to_vec(),
                size: s.dtype.size() as u64,
                quantised: false,
                group: 0,
                held: BTreeMap::new(),
            });
            *a.held.entry(node).or_default() += s.bytes();
        }
        let mut tasks = plan.routes.tasks.iter::<{ crate::compact::TASK_FIELDS }>();
        for [g, num, ..] in plan.groups.iter::<{ crate::table::GROUP_FIELDS }>() {
            for [pattern, local, _] in tasks.by_ref().take(num as usize) {
                let Some(id) = param(local).map(|p| p.id) else {
                    continue;
                };
                let fp8 = plan
                    .routes
                    .patterns
                    .get(pattern as usize)
                    .is_some_and(|p| matches!(p.transform, Transform::Fp8Block { .. }));
                if let Some(a) = acc.get_mut(&id) {
                    a.group = g as u16;
                    a.quantised |= fp8;
                }
            }
        }
    }
    acc
}

/// Reads the model's tensors, their holders and formats off a routing table.
pub fn model_bytes(table: &RoutingTable, cluster: &ClusterModel) -> ModelBytes {
    let nt = table.trainers.len() as u32;
    let acc = held_params(table, cluster);
    let mut params = Vec::with_capacity(acc.len());
    let (mut full_bytes, mut checkpoint_bytes) = (0u64, 0u64);
    for a in acc.into_values() {
        let full = a.numel * a.size;
        let checkpoint = if a.quantised && a.dims.len() >= 2 {
            let n = a.dims.len();
            let lead: u64 = a.dims[..n - 2].iter().map(|&d| d as u64).product();
            let b = FP8_BLOCK as u64;
            let scales =
                lead * (a.dims[n - 2] as u64).div_ceil(b) * (a.dims[n - 1] as u64).div_ceil(b);
            a.numel + scales * 4
        } else {
            full
        };
        let held: u64 = a.held.values().sum();
        let scale = if held > 0 {
            full as f64 / held as f64
        } else {
            0.0
        };
        full_bytes += full;
        checkpoint_bytes += checkpoint;
        params.push(ParamBytes {
            group: a.group,
            full,
            checkpoint,
            per_node: a
                .held
                .into_iter()
                .map(|(n, b)| (n, b as f64 * scale))
                .collect(),
        });
    }
    // Largest share of one engine's bytes on one rank.
    let mut engine_total: BTreeMap<u32, u64> = BTreeMap::new();
    let held = |r: &crate::table::RolloutEntry| -> u64 {
        table
            .rollout_layouts
            .get(r.layout as usize)
            .map_or(0, |l| l.tensors.iter().map(|t| t.len).sum())
    };
    for r in &table.rollouts {
        *engine_total.entry(r.engine).or_default() += held(r);
    }
    let max_rank_share = table
        .rollouts
        .iter()
        .map(|r| held(r) as f64 / engine_total[&r.engine].max(1) as f64)
        .fold(0.0, f64::max);
    let mut rollout_nodes: Vec<u32> = (0..table.rollouts.len() as u32)
        .map(|r| cluster.node_of(nt + r, nt))
        .collect();
    rollout_nodes.dedup();
    ModelBytes {
        params,
        full_bytes,
        checkpoint_bytes,
        max_rank_share,
        rollout_nodes,
    }
}

/// NIC `i` of node `node`.
pub(crate) fn node_nic(cluster: &ClusterModel, node: u32, i: u32) -> u32 {
    node * cluster.nics_per_node + i
}

/// Hops of an NCCL broadcast of `bytes` from `root` through `nodes`: one ring per NIC of a
/// node, each carrying `bytes / rings`, visiting every node once.
pub(crate) fn ring_hops(
    cluster: &ClusterModel,
    opts: &BaselineOptions,
    root: u32,
    nodes: &[u32],
    bytes: f64,
) -> Vec<Hop> {
    let rings = cluster.nics_per_node;
    let share = bytes / rings as f64;
    let wrs = (share / opts.nccl_chunk_bytes as f64).ceil().max(1.0);
    let mut hops = Vec::with_capacity(nodes.len() * rings as usize);
    for i in 0..rings {
        let mut prev = root;
        for &n in nodes {
            if n == prev {
                continue;
            }
            hops.push(Hop {
                local: false,
                from: one_nic(node_nic(cluster, prev, i)),
                to: one_nic(node_nic(cluster, n, i)),
                to_node: n,
                bytes: share,
                wrs,
            });
            prev = n;
        }
    }
    hops
}

/// Hops of gathering `per_node` bytes onto node `root`, spread over the NICs of each node.
pub(crate) fn gather_hops(
    cluster: &ClusterModel,
    opts: &BaselineOptions,
    root: u32,
    per_node: &BTreeMap<u32, f64>,
) -> Vec<Hop> {
    let rings = cluster.nics_per_node;
    let mut hops = Vec::new();
    for (&n, &b) in per_node {
        if n == root || b <= 0.0 {
            continue;
        }
        let share = b / rings as f64;
        let wrs = (share / opts.nccl_chunk_bytes as f64).ceil().max(1.0);
        for i in 0..rings {
            hops.push(Hop {
                local: false,
                from: one_nic(node_nic(cluster, n, i)),
                to: one_nic(node_nic(cluster, root, i)),
                to_node: root,
                bytes: share,
                wrs,
            });
        }
    }
    hops
}

/// A hop's NIC range for one NIC (NCCL rings: one ring per NIC).
fn one_nic(nic: u32) -> std::ops::Range<u32> {
    nic..nic + 1
}

/// Plans and simulates a baseline on the same cluster model as weightsync.
pub fn simulate_baseline(
    table: &RoutingTable,
    cluster: &ClusterModel,
    which: Baseline,
    opts: &BaselineOptions,
) -> Result<SimReport, SimError> {
    cluster.validate()?;
    if table.trainers.is_empty() {
        return Err(SimError::Empty("training ranks"));
    }
    if table.rollouts.is_empty() {
        return Err(SimError::Empty("inference ranks"));
    }
    if opts.bucket_bytes == 0
        || opts.nccl_chunk_bytes == 0
        || opts.nccl_call_s.is_nan()
        || opts.nccl_call_s < 0.0
    {
        return Err(SimError::BadCluster(format!(
            "baseline options must be positive: {opts:?}"
        )));
    }
    let bytes = model_bytes(table, cluster);
    let (plan, last, buckets): (SimPlan, _, u64) = match which {
        Baseline::GatherBroadcast => gather_broadcast::plan(table, cluster, opts, &bytes),
        Baseline::BucketedBroadcast => bucketed_broadcast::plan(table, cluster, opts, &bytes),
    };
    let out = engine::run(&plan)?;
    Ok(report::build(
        which.name(),
        &plan,
        &out,
        last,
        table.trainers.len() as u32,
        table.rollouts.len() as u32,
        buckets,
        cluster.cost.nic_bytes_per_s,
    ))
}

#[cfg(test)]
mod tests;
