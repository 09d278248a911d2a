//! weightsync-controller: the controller service of one job: registration, planning, the
//! version protocol and its barrier, the HTTP API, the dashboard and metrics.
//!
//! It depends on the protocol (`weightsync_common`) and the planner (`weightsync_schedules`)
//! only: the worker side (`weightsync_agent`, `weightsync_worker`) and the `weightsync` binary
//! (`weightsync_cli`) sit beside and above it.
//!
//! # Using it
//! ```text
//! # the controller of a two-host job (see docs/operations.md for the workers)
//! export WEIGHTSYNC_JOB_TOKEN=$(openssl rand -hex 16) WEIGHTSYNC_API_TOKEN=$(openssl rand -hex 16)
//! weightsync controller --http 0.0.0.0:8080 --control 0.0.0.0:7070 \
//!     --model qwen3-0.6b --train fsdp=4 --infer tp=2,dp=2 --dtype fp8
//!
//! # the training loop, after each optimizer step
//! curl -sf -X POST "http://10.0.0.1:8080/v1/syncs?wait=true" \
//!      -H "Authorization: Bearer $WEIGHTSYNC_API_TOKEN" -H 'Content-Type: application/json' \
//!      -d '{"version": 42}'
//! curl -s http://10.0.0.1:8080/v1/syncs/7          # state, stage durations, bytes, GB/s, failure
//! curl -s http://10.0.0.1:8080/v1/syncs/7/trace > sync7.json   # open in ui.perfetto.dev
//! curl -s http://10.0.0.1:8080/metrics
//! ```
//! In a program: `AppState::new(ControllerConfig::for_job(..)?, Box::new(SchedulesPlanner))`,
//! then [`run`]`(http_listener, control_listener, state, shutdown)`.
//!
//! # Layout
//! - [`coordinator`]: the pure state machine (membership, plan, version protocol, timeouts).
//! - [`sync_record`]: one sync's record and its JSON views.
//! - [`planning`]: the [`planning::Planner`] seam between the coordinator and the routing table.
//! - [`schedules_planner`]: the production planner over `weightsync_schedules`.
//! - [`service`]: the shared state, the I/O of the coordinator's effects, planning off the lock.
//! - [`secrets`]: the credential of each role, and which one a request or a worker needs.
//! - [`control_channel`]: the workers' connections (bounded before authentication) and the
//!   clock that drives timeouts.
//! - [`metrics`]: Prometheus metrics recorded as syncs end.
//! - [`http`]: `app(state) -> Router`: the JSON API, metrics, traces and the dashboard.
//! - [`http_server`]: the router served with header timeouts and connection caps.
//! - [`server`]: [`run`], the service and the router served together.
#![deny(missing_docs)]

pub mod control_channel;
pub mod coordinator;
pub mod http;
pub mod http_server;
pub mod metrics;
pub mod planning;
pub mod schedules_planner;
pub mod secrets;
pub mod server;
pub mod service;
pub mod state_file;
pub mod sync_record;

pub use coordinator::DeltaMode;
pub use http::app;
pub use schedules_planner::SchedulesPlanner;
pub use secrets::ControllerSecrets;
pub use server::run;
pub use service::{AppState, ControllerConfig};
