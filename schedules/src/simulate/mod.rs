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
//! - [`report`]: [`SimReport`]: predicted time, bound, NIC utilisation, critical path, timeline.

pub mod cluster;
pub(crate) mod engine;
mod lower;
pub mod report;

use thiserror::Error;

pub use cluster::{ClusterModel, FixedCosts, HostModel, Placement, PrepRates};
pub use report::{
    CriticalShare, CriticalStep, NicUse, SideSummary, SimEvent, SimReport, StageTotal,
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
    cluster.validate()?;
    if table.trainers.is_empty() {
        return Err(SimError::Empty("training ranks"));
    }
    if table.rollouts.is_empty() {
        return Err(SimError::Empty("inference ranks"));
    }
    let low = lower::lower(table, cluster)?;
    let out = engine::run(&low.plan)?;
    Ok(report::build(
        "weightsync",
        &low.plan,
        &out,
        low.barrier,
        table.trainers.len() as u32,
        table.rollouts.len() as u32,
        low.pieces,
        cluster.cost.nic_bytes_per_s,
    ))
}

#[cfg(test)]
mod tests;
