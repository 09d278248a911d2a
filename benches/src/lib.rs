//! weightsync-benches: the code behind `weightsync bench ...`.
//!
//! Every benchmark here measures weightsync beside a baseline in the same run (a plain TCP
//! stream, a memcpy, a serialised pipeline, a broadcast), because this machine is shared and
//! noisy: only ratios measured side by side mean anything.
//!
//! # Layout
//! - [`fabric`]: one-sided writes between two processes beside one TCP stream and memcpy.
//! - [`prepare`]: each preparation kernel beside a memcpy of the same bytes.
//! - [`pipeline`]: the trainer pipeline overlapped beside serialised, same tasks.
//! - [`plan`]: whole `weightsync plan` processes beside a baseline binary, alternately.
//! - [`e2e`]: a real model's job on loopback beside gather-and-broadcast and the TCP limit; the
//!   simulator's calibration against it.
//! - [`controller_load`]: a real controller under thousands of simulated heartbeating workers
//!   beside itself idle (`/healthz` latency, resident memory).
//! - `cpu_clock`: the one process CPU clock the benches read.
//! - `benches/`: criterion benches of the kernels and the planner.
#![deny(missing_docs)]

pub mod controller_load;
mod cpu_clock;
pub mod e2e;
pub mod fabric;
pub mod pipeline;
pub mod plan;
pub mod prepare;
