//! The worker's error type: every way a sync can be refused or fail, naming what was wrong.
//!
//! Input errors (a source shorter than the table says, a dtype that does not match, a watermark
//! too small for a task's smallest piece, a destination nobody described) are found when the
//! worker is built, before any byte is written. Run-time errors (a refused write, a lane that
//! died, a checksum mismatch, a timeout) fail the sync and say which task, destination or tensor.
//!
//! [`SourceError`], why a source could not be attached or read, lives here too (not in `source/`):
//! [`WorkerError`] wraps it, and the sources return [`Result`], so with both here every module
//! imports its errors from the floor below it.

use std::path::PathBuf;

use weightsync_common::DType;
use weightsync_common::fabric::FabricError;

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
    #[error(
        "task {task} ({param}): source holds {source_dtype} but the transform reads {transform_dtype}"
    )]
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
    #[error(
        "watermark of {watermark} bytes is below the smallest piece of task {task} ({param}): {min_piece} bytes ({unit}); raise the watermark"
    )]
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
    #[error(
        "checksums for rollout rank {rank} cover {covered} of {expected} destination bytes: {detail}"
    )]
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
    /// A delta cannot be applied: the engine does not hold its base, or its record or encoding
    /// is malformed. The destination may be partly rewritten: the next sync must be full.
    #[error("rollout rank {rank}: delta for MR {mr} bytes at {offset} refused: {detail}")]
    Delta {
        /// Rollout rank.
        rank: u32,
        /// Region of the run.
        mr: u16,
        /// Offset of the run.
        offset: u64,
        /// What is wrong.
        detail: String,
    },
    /// A source does not hold what the plan reads (a tensor missing, of another dtype or shape).
    #[error(transparent)]
    Source(#[from] SourceError),
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

/// Why a source could not be attached or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// Opening, reading or mapping a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The source holds fewer bytes than the table needs.
    #[error("{what} is {have} bytes, but the routing table needs {need}")]
    TooShort {
        /// Which source.
        what: String,
        /// Bytes required.
        need: u64,
        /// Bytes present.
        have: u64,
    },
    /// A read outside the arena.
    #[error("read of {len} bytes at offset {offset} is outside the {arena}-byte source arena")]
    OutOfBounds {
        /// Start of the read.
        offset: u64,
        /// Length of the read.
        len: u64,
        /// Arena length.
        arena: u64,
    },
    /// A tensor the table expects is not in the file.
    #[error("{path}: tensor {name:?} is missing")]
    MissingTensor {
        /// The file.
        path: PathBuf,
        /// The tensor.
        name: String,
    },
    /// A tensor has another dtype than the table says.
    #[error("tensor {name:?}: the table says {expected}, the source holds {found}")]
    DTypeMismatch {
        /// The tensor.
        name: String,
        /// dtype in the table.
        expected: DType,
        /// dtype found (as the source spells it).
        found: String,
    },
    /// A tensor has another shape than the table says.
    #[error("tensor {name:?}: the table says shape {expected:?}, the source holds {found:?}")]
    ShapeMismatch {
        /// The tensor.
        name: String,
        /// Shape in the table.
        expected: Vec<usize>,
        /// Shape found.
        found: Vec<usize>,
    },
    /// The expected layout itself is inconsistent (tensor outside the arena, duplicate name).
    #[error("bad arena layout: {0}")]
    Layout(String),
    /// The file is not a valid safetensors file.
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        message: String,
    },
    /// Host bytes were asked of a source that lives on a GPU.
    #[error("the source arena is in GPU memory; read it with a device copy, not as host bytes")]
    OnDevice,
    /// A CUDA call failed (feature `cuda`).
    #[error("cuda: {0}")]
    Gpu(String),
    /// A shared-memory file shrank under its mapping (reading it would fault).
    #[error(
        "{path}: truncated to {now} bytes while {mapped} are mapped (the training process must \
         not shrink the file while a sync may read it)"
    )]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes mapped.
        mapped: u64,
        /// Its length now.
        now: u64,
    },
    /// The path names another file than the one mapped (replaced, e.g. renamed over).
    #[error(
        "{path} was replaced after the worker mapped it: the mapping holds the old file's bytes \
         (write the file in place, or restart the worker to attach the new one)"
    )]
    Replaced {
        /// The file.
        path: PathBuf,
    },
    /// A stamped shared-memory file stayed mid-write (odd generation) past the wait.
    #[error("{path}: still being written (generation {generation} is odd) when the sync began")]
    BeingWritten {
        /// The file.
        path: PathBuf,
        /// The odd generation seen.
        generation: u64,
    },
    /// A stamped shared-memory file was written while a sync read it: what was read may mix
    /// two versions.
    #[error(
        "{path} was written while the sync read it (generation {before} -> {after}): what was \
         read mixes two versions"
    )]
    Torn {
        /// The file.
        path: PathBuf,
        /// Generation when the sync began.
        before: u64,
        /// Generation when it ended.
        after: u64,
    },
}
