//! Bucketed broadcast with engines reloading (checkpoint-engine).
//!
//! The model in its checkpoint format is cut, in parameter order, into buckets of at most
//! `bucket_bytes` (a tensor larger than a bucket is a bucket of its own). Training rank
//! `k mod T` owns bucket `k`: it gathers the bucket's full tensors (training dtype) from the
//! nodes holding them, quantises them (fp8 rate), and broadcasts the bucket (checkpoint bytes)
//! through every inference node into the engines' IPC buffers; each engine then copies its part
//! out of the buffer (copy rate). Broadcasts are serialised (one communicator); two buckets are
//! in flight at once (a bucket's buffer is free again once every engine reloaded it).

use std::collections::BTreeMap;

use weightsync_common::protocol::Stage;

use super::{BaselineOptions, ModelBytes, gather_hops, ring_hops};
use crate::simulate::ClusterModel;
use crate::simulate::engine::{NONE, OpId, SimPlan};
use crate::table::RoutingTable;

/// Buckets in flight (IPC buffers per engine).
const BUFFERS: u64 = 2;

/// One bucket: tensors, full bytes, checkpoint bytes, bytes per holding node.
#[derive(Debug, Default)]
struct Bucket {
    tensors: u64,
    full: f64,
    checkpoint: f64,
    per_node: BTreeMap<u32, f64>,
}

/// Cuts the model into buckets of at most `bucket_bytes` checkpoint bytes.
fn buckets(bytes: &ModelBytes, bucket_bytes: u64) -> Vec<Bucket> {
    let mut out = Vec::new();
    let mut cur = Bucket::default();
    for pb in &bytes.params {
        if cur.tensors > 0 && cur.checkpoint + pb.checkpoint as f64 > bucket_bytes as f64 {
            out.push(std::mem::take(&mut cur));
        }
        cur.tensors += 1;
        cur.full += pb.full as f64;
        cur.checkpoint += pb.checkpoint as f64;
        for (&n, &b) in &pb.per_node {
            *cur.per_node.entry(n).or_default() += b;
        }
    }
    if cur.tensors > 0 {
        out.push(cur);
    }
    out
}

/// Plans the baseline: (plan, the op that ends the sync, buckets).
pub(super) fn plan(
    table: &RoutingTable,
    cluster: &ClusterModel,
    opts: &BaselineOptions,
    bytes: &ModelBytes,
) -> (SimPlan, OpId, u64) {
    let nt = table.trainers.len() as u32;
    let mut p = SimPlan::default();
    let lanes: Vec<u32> = (0..nt).map(|t| p.lane(format!("trainer-{t}"))).collect();
    let engines = p.lane("engines".into());
    let ctl = p.lane("controller".into());
    let cost = &cluster.cost;
    let bks = buckets(bytes, opts.bucket_bytes);
    let pool = p.pool(BUFFERS);
    let (mut prev_bc, mut prev_reload) = (NONE, NONE);
    for (k, b) in bks.iter().enumerate() {
        let owner = (k as u64 % nt as u64) as u32;
        let lane = lanes[owner as usize];
        let node = cluster.node_of(owner, nt);
        let hops = gather_hops(cluster, opts, node, &b.per_node);
        let g = p.transfer(
            lane,
            Stage::GatherSend,
            k as u32,
            &hops,
            node,
            cost.nic_bytes_per_s,
            cost.per_wr_s,
            None,
        );
        p.ops[g as usize].latency_s = opts.nccl_call_s;
        p.ops[g as usize].acquire = Some((pool, 1));
        let prep_s = b.full / cluster.prep.fp8 + b.tensors as f64 * cluster.task_overhead_s;
        let q = p.op(
            lane,
            Stage::Prepare,
            k as u32,
            b.full as u64,
            prep_s,
            0.0,
            &[],
        );
        p.after(g, q);
        let hops = ring_hops(cluster, opts, node, &bytes.rollout_nodes, b.checkpoint);
        let bc = p.transfer(
            lane,
            Stage::Write,
            k as u32,
            &hops,
            node,
            cost.nic_bytes_per_s,
            cost.per_wr_s,
            None,
        );
        p.ops[bc as usize].latency_s = opts.nccl_call_s;
        p.after(q, bc);
        p.after(prev_bc, bc);
        p.lands.push((bc, engines));
        let reload_s = b.checkpoint * bytes.max_rank_share / cluster.prep.copy;
        let rl = p.op(
            engines,
            Stage::Land,
            k as u32,
            b.checkpoint as u64,
            reload_s,
            0.0,
            &[],
        );
        p.ops[rl as usize].release = Some((pool, 1));
        p.after(bc, rl);
        p.after(prev_reload, rl);
        prev_bc = bc;
        prev_reload = rl;
    }
    let barrier = p.op(ctl, Stage::Barrier, 0, 0, cost.barrier_s, 0.0, &[]);
    p.after(prev_bc, barrier);
    p.after(prev_reload, barrier);
    (p, barrier, bks.len() as u64)
}
