//! weightsync-benches: the code behind `weightsync bench ...`.
//!
//! Every benchmark here measures weightsync beside a baseline in the same run (a plain TCP
//! stream, a memcpy, a serialised pipeline, a broadcast), because this machine is shared and
//! noisy: only ratios measured side by side mean anything. Criterion benches for the kernels and
//! the planner live under `benches/benches/`.
#![deny(missing_docs)]

pub mod e2e;
pub mod fabric;
pub mod pipeline;
pub mod prepare;
