//! In-process workers: what the Python package (and any program that holds its own tensors)
//! embeds. A training rank's [`TrainerHandle`] registers the rank's parameter shards in place and
//! pushes versions; an inference rank's [`EngineHandle`] registers the engine's own parameter
//! tensors as the destinations, with hooks around each version. Neither restates the job: both
//! learn it from the controller ([`crate::fetch_job`]) and lay out their own side from it.
//!
//! Every call blocks; each handle owns a small tokio runtime, its fabric and its agent session
//! (the same control loop and drivers the sidecars use, over caller-owned memory: a
//! [`weightsync_worker::TensorSet`] as the trainer's source, a receiver built over the engine's
//! regions with a placement map). Errors are [`EmbedError`]s that name the worker and, where
//! there is one, the tensor.
//!
//! # A job to run it against
//! The controller is the `weightsync` binary:
//! ```text
//! export WEIGHTSYNC_JOB_TOKEN=secret WEIGHTSYNC_API_TOKEN=api
//! weightsync controller --control 127.0.0.1:7070 --http 127.0.0.1:8080 \
//!     --model path/to/config.json --train fsdp=2,experts=transformers --infer tp=1,dp=2,format=hf --dtype bf16
//! ```
//! `--model` takes a preset name or a Hugging Face `config.json` (a transformers Qwen3 or
//! Qwen3-MoE config as `save_pretrained` writes it; the controller reads it and sends its text
//! to every worker with the job). The training layout must name parameters as the training
//! model's `named_parameters()` does (`experts=transformers` for transformers' stacked experts,
//! see `weightsync_schedules::job`), and `format=hf` lays the engines out as transformers holds
//! its weights. Then, in every training rank and every inference rank:
//! ```text
//! let t = TrainerHandle::connect(TrainerOptions::new("127.0.0.1:7070", rank))?;
//! t.register(tensors_matching(t.layout()))?;          // once
//! loop { step(); t.push(version)?.wait(None)?; }
//! let e = EngineHandle::connect(EngineOptions::new("127.0.0.1:7070", rank))?;
//! e.set_hooks(Some(pause), Some(resume));
//! e.register(engine_tensors_matching(e.layout()))?;   // once
//! // per version, once its spans are known: what the dashboard and the trace show beside the
//! // landing (times from e.now_ns())
//! let spans = [(Stage::Pause, t0, t3), (Stage::Load, t1, t2), (Stage::Resume, t2, t3)];
//! e.report_stages(version, &spans)?;
//! ```
//!
//! # Declared models (any architecture)
//! When the job's model is one the planner does not lay out (a `config.json` of another
//! `model_type`, or `--model declared[:NAME]`; see `weightsync_schedules::declared`), both
//! handles say so ([`TrainerHandle::is_declared`], [`EngineHandle::is_declared`]), `layout()` is
//! empty, and each registers what it holds instead; the controller plans once every worker
//! registered, from those declarations:
//! ```text
//! // every named parameter's local shard, with its place in the whole parameter
//! t.declare_and_register(vec![DeclaredShard { tensor, global_shape, offset }, ...])?;
//! // every tensor the engine holds, whole (format=hf, tp=1), and what it takes nothing of
//! e.declare_and_register(engine_tensors, vec!["model.rotary_emb.inv_freq".into()])?;
//! // or, a fused or tensor-parallel engine: what some tensors are made of (by name)
//! e.declare_and_register_sources(engine_tensors, skip, sources)?;  // box_source for a tp box
//! t.wait_plan(None)?;   // or e.wait_plan: the plan's failure, naming the tensor and both ranks
//! ```
//!
//! # Layout
//! - this file: the shared types and [`EmbedError`].
//! - `session`: the runtime, learning the job, starting the agent, and the ends of syncs.
//! - `trainer`: [`TrainerHandle`], [`PushHandle`].
//! - `engine`: [`EngineHandle`] and its driver (hooks, state).
//! - `declare`: what a declared model's engine declares (its tensors, skips and sources),
//!   checked and laid out before it registers.
//! - `engine_stages`: an engine's own stages (pause, load, resume), checked and put on the time
//!   base of their sync before they go to the controller.
//! - `client`: [`ApiClient`], the HTTP trigger as a blocking call.
//! - `regions`: an engine's tensors checked against its planned layout and merged into regions.
//! - `device_regions` (feature `cuda`): an engine's CUDA tensors placed in host staging regions
//!   copied to them once a version landed.

mod client;
mod declare;
#[cfg(feature = "cuda")]
mod device_regions;
mod engine;
mod engine_driver;
mod engine_stages;
mod regions;
mod session;
mod trainer;

use weightsync_common::protocol::Failure;
pub use weightsync_common::protocol::FailureKind;

pub use crate::api_client::{ClientError, SyncFailure, SyncResult};
pub use client::ApiClient;
pub use declare::{EngineSources, box_source};
pub use engine::{EngineHandle, EngineOptions, Hook};
pub use trainer::{PushHandle, TrainerHandle, TrainerOptions};
pub use weightsync_common::DType;
pub use weightsync_common::protocol::Stage;
#[cfg(feature = "cuda")]
pub use weightsync_worker::{
    DeviceTensor,
    gpu::{DeviceMemory, driver_present},
};
pub use weightsync_worker::{HostMemory, SourceTensor};

/// One shard a training rank must register: the parameter, its global shape, and the rank's
/// local box of it (`offset`, `shape`: torch.chunk semantics along the sharded dims).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardInfo {
    /// The parameter's name (`name#k` for its k-th shard after the first on this rank).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// The parameter's global shape.
    pub global_shape: Vec<u64>,
    /// Where the local box starts in the global tensor.
    pub offset: Vec<u64>,
    /// The local box's extents: the shape of the tensor to register.
    pub shape: Vec<u64>,
}

/// One shard a training rank of a declared model holds, with the box it is of its parameter
/// (what [`TrainerHandle::declare_and_register`] takes): `tensor` is the local shard (its
/// `shape` the box's extents), `global_shape` the whole parameter's shape and `offset` where
/// the box starts in it (both empty: the tensor is whole).
#[derive(Debug)]
pub struct DeclaredShard {
    /// The local shard: name (the parameter's), dtype, local shape and memory.
    pub tensor: SourceTensor,
    /// The whole parameter's shape (empty: `tensor.shape`).
    pub global_shape: Vec<u64>,
    /// Where the shard starts in the parameter (empty: at its origin).
    pub offset: Vec<u64>,
}

/// One tensor of an inference rank, as planned.
///
/// `global_shape` and `offset` place it in the training parameter it is cut from (named as
/// [`ShardInfo`] names a trainer's box): the parameter's whole shape and where the tensor
/// starts in it; `shape` and zeros for a tensor the rank holds whole. Both are `None` when the
/// tensor is not one box of one parameter: a fused tensor (`qkv_proj`, `gate_up_proj`,
/// `w13_weight`), an fp8 block-scale tensor, a tp-split packed expert tensor (see
/// [`weightsync_schedules::layout_infer::ParamBox`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DstTensorInfo {
    /// The engine's name for it.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// The whole shape of the parameter it is a box of.
    pub global_shape: Option<Vec<u64>>,
    /// Where the box starts in that parameter.
    pub offset: Option<Vec<u64>>,
}

/// One of the engine's own tensors, registered as a destination.
#[derive(Debug)]
pub struct DstTensor {
    /// The engine's name for it.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Its memory (writable).
    pub memory: HostMemory,
}

/// One of the engine's own tensors in CUDA device memory, registered as a destination (feature
/// `cuda`; [`EngineHandle::register_device`]).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceDstTensor {
    /// The engine's name for it.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Its memory (written by host-to-device copies once a version landed).
    pub memory: DeviceMemory,
}

/// What a committed version cost this trainer.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncOutcome {
    /// The version.
    pub version: u64,
    /// Bytes this trainer wrote.
    pub bytes: u64,
    /// Source bytes copied into staging before being written.
    pub staged_bytes: u64,
    /// Bytes written straight from the registered tensors.
    pub direct_bytes: u64,
    /// From `push` to the controller's commit, seconds.
    pub seconds: f64,
    /// Per stage of this trainer's part, its span in seconds (first start to last end).
    pub stages: Vec<(String, f64)>,
    /// `Some(why)`: the version never synced because a newer version (or run) was pushed
    /// first; not a failure (the figures are zero).
    pub superseded: Option<String>,
    /// How this trainer's bytes reached their receivers (`TransferPaths::name` names the path:
    /// `payloads`, `process_vm_readv`, `shared_memory` or `mixed`); `None` where the fabric
    /// does not count them.
    pub paths: Option<weightsync_common::fabric::TransferPaths>,
}

/// Where an engine's weights stand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineStatus {
    /// Nothing has landed yet.
    Idle,
    /// A version is landing: the engine must not read its weights.
    Landing,
    /// The last version landed, was verified and committed.
    Committed,
    /// A sync failed while landing: the weights are a mix; invalid until a later version commits.
    Invalid,
}

/// An engine's state: its last committed version, its status, and why it is invalid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineState {
    /// The last committed version.
    pub version: Option<u64>,
    /// The job's run that version belongs to: `(run, version)` never goes back.
    pub run: u64,
    /// Status.
    pub status: EngineStatus,
    /// Why it is invalid (or why the last sync failed).
    pub cause: Option<String>,
}

/// Why an embedded worker's call failed. Each names the worker and, where there is one, the
/// tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EmbedError {
    /// The controller could not be reached, or refused the job-token proof.
    #[error("{worker}: cannot reach the controller: {reason}")]
    Connect {
        /// This worker.
        worker: String,
        /// Why.
        reason: String,
    },
    /// Registration failed (the tensors, the fabric, or the controller refused it).
    #[error("{worker}: registration failed{}: {reason}", tensor.as_ref().map(|t| format!(" (tensor {t})")).unwrap_or_default())]
    Registration {
        /// This worker.
        worker: String,
        /// The tensor, when one is to blame.
        tensor: Option<String>,
        /// Why.
        reason: String,
    },
    /// A tensor differs from what the job's layout expects.
    #[error("{worker}: tensor {tensor}: expected {expected}, got {actual}")]
    LayoutMismatch {
        /// This worker.
        worker: String,
        /// The tensor.
        tensor: String,
        /// What the layout expects.
        expected: String,
        /// What was registered.
        actual: String,
    },
    /// The world is complete but the controller could not plan it: for a declared model, the
    /// reason names the tensor the engines and trainers disagree on and both ranks.
    #[error("{worker}: the job could not be planned: {reason}")]
    PlanFailed {
        /// This worker.
        worker: String,
        /// The controller's reason.
        reason: String,
    },
    /// A registered tensor's storage moved since registration.
    #[error("{worker}: tensor {tensor} moved since it was registered; re-register with register()")]
    StaleTensor {
        /// This worker.
        worker: String,
        /// The tensor.
        tensor: String,
    },
    /// The sync of a version failed.
    #[error("version {version} failed on {worker}: {cause}{}", tensor.as_ref().map(|t| format!(" (tensor {t})")).unwrap_or_default())]
    SyncFailed {
        /// The version.
        version: u64,
        /// The worker that failed (e.g. `rollout-1`), or `controller`.
        worker: String,
        /// What kind of failure (a checksum mismatch, a timeout, a peer lost...).
        kind: FailureKind,
        /// The tensor to blame, when one is.
        tensor: Option<String>,
        /// Why.
        cause: String,
    },
    /// A push while the sync of this trainer's previous push is still reading its tensors.
    #[error(
        "{worker}: cannot push version {version} while the sync of version {running} is running \
         (its tensors are being read): wait for it first"
    )]
    Busy {
        /// This worker.
        worker: String,
        /// The version pushed.
        version: u64,
        /// The version whose sync runs.
        running: u64,
    },
    /// A wait ran out of time (retryable).
    #[error("timed out waiting for {what}")]
    Timeout {
        /// What was waited for.
        what: String,
    },
    /// The worker was closed, or its session with the controller ended.
    #[error("{worker} is closed")]
    Closed {
        /// This worker.
        worker: String,
    },
    /// An engine's report of its own stages was refused before it was sent: a stage it does
    /// not report, a span ending before it starts or in the future, a version it never
    /// prepared.
    #[error("{worker}: stages of version {version} refused: {reason}")]
    InvalidStageReport {
        /// This worker.
        worker: String,
        /// The version the report named.
        version: u64,
        /// What was wrong, naming the span.
        reason: String,
    },
}

/// The [`EmbedError::SyncFailed`] of `version` from the controller's abort.
fn sync_failed(version: u64, reason: &str, failure: Option<&Failure>) -> EmbedError {
    match failure {
        Some(f) => EmbedError::SyncFailed {
            version,
            worker: f.worker.to_string(),
            kind: f.kind,
            tensor: f.tensor.clone(),
            cause: f.cause.clone(),
        },
        None => EmbedError::SyncFailed {
            version,
            worker: "controller".into(),
            kind: FailureKind::Other,
            tensor: None,
            cause: reason.to_string(),
        },
    }
}
