//! weightsync-agent: the worker sidecars, the part of weightsync that runs beside a training
//! rank or an inference rank.
//!
//! An agent connects to the controller, proves it knows the job token, registers what its
//! [`SyncDriver`] holds, and then follows the version protocol: `Assign` → driver.assign;
//! `Prepare N` → driver.prepare, answer `Prepared` (rollouts then wait for N to land and answer
//! `Landed`); `Start N` → driver.run, answer `Written`; `Verify` → driver.verify, answer
//! `Verified`; `Commit` → driver.finish; `Abort` → driver.finish and driver.drain, answer
//! `Drained` (nothing of the aborted sync can land later).
//!
//! This crate is what an engine plugin or the Python package embeds: it depends on the worker
//! library, the planner's types and the protocol, never on the controller service, the CLI or
//! the benchmarks. It carries no command-line flags (the CLI derives its own and converts them
//! into [`config::WorkerSettings`]) and nothing of the demo (whose weights and independent
//! check wrap these drivers from outside, in `weightsync-demo`); `face_tests` holds it to that.
//!
//! # Layout
//! - [`control`]: the control-channel client ([`run_agent`]) and [`AgentConfig`].
//! - `driver_loop`: one step at a time, cancelled when the controller aborts its sync.
//! - [`driver`]: the [`SyncDriver`] trait, the seam between the protocol and the worker library;
//!   `driver_error`: [`DriverError`], a failure that keeps its [`FailureKind`] across the seam.
//! - [`trainer`], [`rollout`]: the production drivers over `weightsync_worker`; `source`: where
//!   a trainer's weights come from ([`trainer::SourceSpec`], or a program's own
//!   [`trainer::ProvideSource`]), attached once its slice arrives.
//! - [`config`]: settings (env vars, torchrun and Slurm variables, TOML), resolved into a worker.
//! - [`api_client`]: a minimal client of the controller's HTTP API (a training loop's trigger).
//! - [`embed`]: in-process trainers and engines over caller-owned tensors (what the Python
//!   package binds): [`embed::TrainerHandle`], [`embed::EngineHandle`].
#![deny(missing_docs)]

pub mod api_client;
pub mod config;
pub mod control;
pub mod driver;
mod driver_error;
mod driver_loop;
#[cfg(test)]
mod driver_tests;
pub mod embed;
#[cfg(test)]
mod face_tests;
pub mod rollout;
mod source;
pub mod trainer;

pub use control::{
    AGENT_MAX_FRAME, AgentConfig, AgentError, AgentEvent, AgentLink, LearnedJob, fetch_job,
    fetch_job_over, learn_job, run_agent, run_agent_with,
};
pub use driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
pub use weightsync_common::protocol::FailureKind;
