//! The discrete-event simulator: executes a [`RoutingTable`] (or a baseline's plan) on a
//! [`ClusterModel`] and predicts how long the sync takes, what bounds it and what dominates it.
//!
//! Why a simulator: no machine here has 256 GPUs, and the first-order cost model
//! ([`crate::cost`]) cannot see what happens *in time*: a receiving NIC that many trainers write
//! to at once, a pipeline that has to fill before its NIC is busy, a trainer waiting for
//! gathered fp8 rows, staging that runs out under the watermark. The simulator replays the
//! table's pieces through the same stages the worker runs (H2D, prepare, WRITE, barrier) and
//! shares every NIC max-min fairly between the transfers active at each instant, so its answer
//! can be checked against real loopback runs (`weightsync simulate --calibrate`) and then
//! trusted where no cluster is at hand. Pure: no I/O, no clock, deterministic.
//!
//! # Layout
//! - [`cluster`]: [`ClusterModel`] (the planner's [`CostModel`](crate::cost::CostModel) plus
//!   topology, watermark, overheads, the per-sync [`FixedCosts`] and an optional shared host).
//! - `engine`: operations, staging pools and max-min fair flows; the event loop.
//! - `lower`: a routing table as pipeline pieces and operations.
//! - [`report`]: [`SimReport`]: predicted time, bound, NIC utilisation, critical path, timeline;
//!   [`DeltaReport`] for a delta sync.
//! - [`delta`]: [`DeltaModel`]: what a delta sync's runs come to at a changed fraction (bytes on
//!   the wire, the trainer's encode, the engine's apply), from the codec's encodings.

pub mod cluster;
pub mod delta;
pub(crate) mod engine;
mod lower;
pub mod report;

use thiserror::Error;

pub use cluster::{ClusterModel, FixedCosts, HostModel, Placement, PrepRates};
pub use delta::DeltaModel;
pub use report::{
    CriticalShare, CriticalStep, DeltaReport, NicUse, SideSummary, SimEvent, SimReport, StageTotal,
};

use crate::table::RoutingTable;

/// Why a simulation could not run.
#[derive(Debug, Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum SimError {
    /// A cluster model parameter out of range (named).
    #[error("bad cluster model: {0}")]
    BadCluster(String),
    /// Operations wait on each other forever (a gather nobody sends, a cycle).
    #[error("simulation stuck at {at_s:.6} s with {left} operations left (e.g. {examples})")]
    Stuck {
        /// Simulated time when nothing could progress.
        at_s: f64,
        /// Operations not done.
        left: usize,
        /// A few of them.
        examples: String,
    },
    /// The table has nothing to simulate.
    #[error("the routing table has no {0}")]
    Empty(&'static str),
    /// A trainer's part of the table does not expand.
    #[error("the routing table: {0}")]
    BadTable(#[from] crate::error::PlanError),
}

/// Simulates one sync of `table` on `cluster`.
pub fn simulate(table: &RoutingTable, cluster: &ClusterModel) -> Result<SimReport, SimError> {
    run(table, cluster, None).map(|(report, _)| report)
}

/// Simulates one delta sync of `table` on `cluster` (every engine holds the previous version;
/// see [`delta`]): the sync's report, whose bound is the delta bytes over the links, and what
/// its deltas came to. The full sync's prediction is [`simulate`]'s.
pub fn simulate_delta(
    table: &RoutingTable,
    cluster: &ClusterModel,
    model: &DeltaModel,
) -> Result<DeltaReport, SimError> {
    model.validate()?;
    let (sync, low) = run(table, cluster, Some(model))?;
    let d = &low.delta;
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    Ok(DeltaReport {
        model: *model,
        dense_bytes: low.rollout_bytes,
        wire_bytes: d.wire_bytes.round() as u64,
        wire_fraction: d.wire_bytes / low.rollout_bytes.max(1) as f64,
        delta_writes: d.delta_writes.round() as u64,
        dense_writes: d.dense_writes.round() as u64,
        encode_bytes: d.encode_bytes.iter().sum::<f64>().round() as u64,
        max_encode_s: max(&d.encode_bytes) / model.scan_bytes_per_s,
        apply_bytes: d.apply_bytes.iter().sum::<f64>().round() as u64,
        max_apply_s: max(&d.apply_bytes) / model.scan_bytes_per_s,
        sync,
    })
}

fn run(
    table: &RoutingTable,
    cluster: &ClusterModel,
    delta: Option<&DeltaModel>,
) -> Result<(SimReport, lower::Lowered), SimError> {
    cluster.validate()?;
    if table.trainers.is_empty() {
        return Err(SimError::Empty("training ranks"));
    }
    if table.rollouts.is_empty() {
        return Err(SimError::Empty("inference ranks"));
    }
    let low = lower::lower(table, cluster, delta)?;
    let out = engine::run(&low.plan)?;
    let report = report::build(
        "weightsync",
        &low.plan,
        &out,
        low.barrier,
        table.trainers.len() as u32,
        table.rollouts.len() as u32,
        low.pieces,
        cluster.cost.nic_bytes_per_s,
    );
    Ok((report, low))
}

#[cfg(test)]
mod tests;
