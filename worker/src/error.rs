//! The worker's error type: every way a sync can be refused or fail, naming what was wrong.
//!
//! Input errors (a source shorter than the table says, a dtype that does not match, a watermark
//! too small for a task's smallest piece, a destination nobody described) are found when the
//! worker is built, before any byte is written. Run-time errors (a refused write, a lane that
//! died, a checksum mismatch, a timeout) fail the sync and say which task, destination or tensor.

use weightsync_common::fabric::FabricError;
use weightsync_common::DType;

use crate::imm_tag::UnitOutOfRange;
use crate::prepare::PrepareError;
use crate::watermark::WatermarkError;

/// Errors of the trainer pipeline and the rollout receiver.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The source memory is shorter than the plan needs.
    #[error("source memory of {have} bytes is shorter than the plan needs ({need} bytes: {what})")]
    SourceTooShort {
        /// What needed the bytes (a shard, the arena).
        what: String,
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The source holds a different dtype from what the task's transform reads.
    #[error("task {task} ({param}): source holds {source_dtype} but the transform reads {transform_dtype}")]
    DTypeMismatch {
        /// Task index.
        task: u32,
        /// Parameter name.
        param: String,
        /// dtype of the source.
        source_dtype: DType,
        /// dtype the transform expects.
        transform_dtype: DType,
    },
    /// The watermark cannot hold the smallest piece of some task.
    #[error("watermark of {watermark} bytes is below the smallest piece of task {task} ({param}): {min_piece} bytes ({unit}); raise the watermark")]
    WatermarkTooSmall {
        /// Task index.
        task: u32,
        /// Parameter name.
        param: String,
        /// Staging bytes of the smallest piece.
        min_piece: u64,
        /// What the smallest piece is (one row, one 128-row block strip).
        unit: String,
        /// The configured watermark.
        watermark: u64,
    },
    /// The plan is inconsistent (a write outside the prepared bytes, a box outside its shard...).
    #[error("invalid plan: {0}")]
    InvalidPlan(String),
    /// A destination the plan writes to has no descriptor.
    #[error(
        "no descriptor for {0}: the controller must pass every destination's registered memory"
    )]
    MissingDestination(String),
    /// An immediate unit too large for the tag layout.
    #[error(transparent)]
    Unit(#[from] UnitOutOfRange),
    /// A preparation kernel refused its input.
    #[error("task {task} ({param}): preparation failed: {source}")]
    Prepare {
        /// Task index.
        task: u32,
        /// Parameter name.
        param: String,
        /// The kernel's error.
        #[source]
        source: PrepareError,
    },
    /// A staging lease could not be had.
    #[error(transparent)]
    Watermark(#[from] WatermarkError),
    /// A fabric operation failed.
    #[error("{context}: {source}")]
    Fabric {
        /// What the worker was doing.
        context: String,
        /// The fabric's error.
        #[source]
        source: FabricError,
    },
    /// What landed differs from what the trainer prepared.
    #[error("checksum mismatch in {tensors} on rollout rank {rank} (MR {mr}, bytes {offset}..{}): expected xxh3 {expected:#018x}, landed {actual:#018x}", offset + len)]
    ChecksumMismatch {
        /// The destination tensor(s) the mismatched run covers.
        tensors: String,
        /// Rollout rank.
        rank: u32,
        /// Memory region.
        mr: u16,
        /// Byte offset of the run.
        offset: u64,
        /// Length of the run.
        len: u64,
        /// Checksum the trainer computed.
        expected: u64,
        /// Checksum of the landed bytes.
        actual: u64,
    },
    /// The checksums handed to verification do not cover this rank's tensors exactly.
    #[error("checksums for rollout rank {rank} cover {covered} of {expected} destination bytes: {detail}")]
    ChecksumCoverage {
        /// Rollout rank.
        rank: u32,
        /// Bytes covered by the records.
        covered: u64,
        /// Bytes of all destination tensors.
        expected: u64,
        /// What is off.
        detail: String,
    },
    /// A source does not hold what the plan reads (a tensor missing, of another dtype or shape).
    #[error(transparent)]
    Source(#[from] crate::source::SourceError),
    /// A call out of protocol order (await before arm, a second arm...).
    #[error("{0}")]
    Protocol(String),
    /// The sync was cancelled by its caller (the controller aborted it) before it finished;
    /// no piece task is left and nothing more will be posted for it.
    #[error("the sync was cancelled before it finished")]
    Cancelled,
    /// A CUDA operation of a source or destination in device memory failed (feature `cuda`).
    #[cfg(feature = "cuda")]
    #[error("{context}: {source}")]
    Gpu {
        /// What the worker was doing.
        context: String,
        /// The driver's (or the kernels') error.
        #[source]
        source: crate::gpu::GpuError,
    },
    /// A stage's thread died (a bug, reported rather than hidden).
    #[error("pipeline stage {stage} failed: {detail}")]
    Stage {
        /// The stage.
        stage: &'static str,
        /// What happened.
        detail: String,
    },
}

impl WorkerError {
    /// Wraps a fabric error with what the worker was doing.
    pub fn fabric(context: impl Into<String>, source: FabricError) -> Self {
        WorkerError::Fabric {
            context: context.into(),
            source,
        }
    }
}

/// Result alias for the worker.
pub type Result<T, E = WorkerError> = std::result::Result<T, E>;
