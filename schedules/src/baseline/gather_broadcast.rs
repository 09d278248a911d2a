//! Gather to rank 0, then broadcast to every engine (verl, OpenRLHF with NCCL).
//!
//! Per mesh group (layer) in order: an NCCL gather of the group's full tensors onto training
//! rank 0's node (training dtype, one call per tensor), then an NCCL broadcast of them from
//! rank 0 through every inference node (one call per tensor); the next layer starts only after
//! this one was broadcast (the calls are serialised on one stream). Engines cut and quantise
//! their part of each layer while the next one moves (a `land` span per layer on the `engines`
//! lane, as long as the busiest rank's share takes at the fp8 preparation rate).

use std::collections::BTreeMap;

use weightsync_common::protocol::Stage;

use super::{BaselineOptions, ModelBytes, gather_hops, ring_hops};
use crate::simulate::ClusterModel;
use crate::simulate::engine::{NONE, OpId, SimPlan};
use crate::table::RoutingTable;

/// Plans the baseline: (plan, the op that ends the sync, layers).
pub(super) fn plan(
    table: &RoutingTable,
    cluster: &ClusterModel,
    opts: &BaselineOptions,
    bytes: &ModelBytes,
) -> (SimPlan, OpId, u64) {
    let nt = table.trainers.len() as u32;
    let mut p = SimPlan::default();
    let root_lane = p.lane("trainer-0".into());
    let engines = p.lane("engines".into());
    let ctl = p.lane("controller".into());
    let root = cluster.node_of(0, nt);
    let cost = &cluster.cost;

    // Per group: tensors, full bytes, bytes per holding node.
    let mut groups: BTreeMap<u16, (u64, f64, BTreeMap<u32, f64>)> = BTreeMap::new();
    for pb in &bytes.params {
        let g = groups.entry(pb.group).or_default();
        g.0 += 1;
        g.1 += pb.full as f64;
        for (&n, &b) in &pb.per_node {
            *g.2.entry(n).or_default() += b;
        }
    }
    let (mut prev_bc, mut prev_reload) = (NONE, NONE);
    let mut layers = 0;
    for (gid, (tensors, full, per_node)) in groups {
        layers += 1;
        let calls = tensors as f64 * opts.nccl_call_s;
        let hops = gather_hops(cluster, opts, root, &per_node);
        let g = p.transfer(
            root_lane,
            Stage::GatherSend,
            gid as u32,
            &hops,
            root,
            cost.nic_bytes_per_s,
            cost.per_wr_s,
            None,
        );
        // NCCL call latency before the flow.
        p.ops[g as usize].latency_s = calls;
        p.after(prev_bc, g);
        let hops = ring_hops(cluster, opts, root, &bytes.rollout_nodes, full);
        let bc = p.transfer(
            root_lane,
            Stage::Write,
            gid as u32,
            &hops,
            root,
            cost.nic_bytes_per_s,
            cost.per_wr_s,
            None,
        );
        p.ops[bc as usize].latency_s = calls;
        p.after(g, bc);
        p.lands.push((bc, engines));
        let reload_s = full * bytes.max_rank_share / cluster.prep.fp8;
        let rl = p.op(
            engines,
            Stage::Land,
            gid as u32,
            full as u64,
            reload_s,
            0.0,
            &[],
        );
        p.after(bc, rl);
        p.after(prev_reload, rl);
        prev_bc = bc;
        prev_reload = rl;
    }
    let barrier = p.op(ctl, Stage::Barrier, 0, 0, cost.barrier_s, 0.0, &[]);
    p.after(prev_bc, barrier);
    p.after(prev_reload, barrier);
    (p, barrier, layers)
}
