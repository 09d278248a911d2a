//! weightsync-controller: registration, planning, the HTTP trigger, the barrier, the dashboard
//! and metrics; the worker agents; and the command modules behind the `weightsync` binary.
//!
//! # Using it
//! ```text
//! # everything on one machine (controller + 4 trainer and 4 rollout processes, Qwen3-0.6B, fp8)
//! cargo run --release -- demo                 # then open the dashboard URL it prints
//! cargo run --release -- demo --exit --json   # CI form: one JSON summary, exit code 0
//!
//! # two hosts: the controller and trainers on host A (10.0.0.1), rollouts on host B (10.0.0.2)
//! export WEIGHTSYNC_JOB_TOKEN=$(openssl rand -hex 16) WEIGHTSYNC_API_TOKEN=$(openssl rand -hex 16)
//! A$ weightsync controller --http 0.0.0.0:8080 --control 0.0.0.0:7070 \
//!        --model qwen3-0.6b --train fsdp=4 --infer tp=2,dp=2 --dtype fp8
//! A$ torchrun --nproc-per-node 4 ... &   # each rank also starts its sidecar (RANK from torchrun):
//! A$ weightsync worker trainer --controller 10.0.0.1:7070 --fabric-listen 10.0.0.1:0 \
//!        --model qwen3-0.6b --train fsdp=4 --infer tp=2,dp=2 --dtype fp8 --source shm:/dev/shm/ws-$RANK
//! B$ for r in 0 1 2 3; do weightsync worker rollout --rank $r --controller 10.0.0.1:7070 \
//!        --fabric-listen 10.0.0.2:0 --model qwen3-0.6b --train fsdp=4 --infer tp=2,dp=2 --dtype fp8 & done
//!
//! # the training loop, after each optimizer step
//! curl -sf -X POST "http://10.0.0.1:8080/v1/syncs?wait=true" \
//!      -H "Authorization: Bearer $WEIGHTSYNC_API_TOKEN" -H 'Content-Type: application/json' \
//!      -d '{"version": 42}'
//! curl -s http://10.0.0.1:8080/v1/syncs/7          # state, stage durations, bytes, GB/s, failure
//! curl -s http://10.0.0.1:8080/v1/syncs/7/trace > sync7.json   # open in ui.perfetto.dev
//! curl -s http://10.0.0.1:8080/metrics
//! ```
//! Workers also read `--config worker.toml` (same keys as the flags) and the torchrun / Slurm
//! variables `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `SLURM_PROCID`, `SLURM_NTASKS`.
//!
//! # Layout
//! - [`coordinator`]: the pure state machine (membership, plan, version protocol, timeouts).
//! - [`sync_record`]: one sync's record and its JSON views.
//! - [`planning`]: the [`planning::Planner`] seam between the coordinator and the routing table.
//! - [`routing`]: the job's routing table from its spec; the production planner.
//! - [`service`]: shared state, the control-channel server, the clock, and [`service::run`].
//! - [`http`]: `app(state) -> Router`: the JSON API, metrics, traces and the dashboard.
//! - [`agent`]: the worker side: control loop, drivers over the worker library, config.
//! - [`api_client`]: a minimal client of the HTTP API (the demo's training loop).
//! - [`logging`]: stderr tracing for the commands.
//! - [`cmd`]: one module per `weightsync` subcommand; `main.rs` is only the clap front.

pub mod agent;
pub mod api_client;
pub mod cmd;
pub mod coordinator;
pub mod http;
pub mod logging;
pub mod planning;
pub mod routing;
pub mod service;
pub mod sync_record;

pub use http::app;
pub use service::{run, AppState, ControllerConfig};
