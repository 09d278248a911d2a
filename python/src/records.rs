//! What the native module returns, as frozen classes with named, typed fields.
//!
//! Why not tuples: a positional tuple read as `v, total, staged, direct, secs, stages = ...`
//! shifts every position in two languages when a field is added, and nothing notices. These
//! classes are read by attribute (`outcome.staged_bytes`), declared field by field in
//! `weightsync/_native.pyi` (so mypy checks every reader), and the public Python classes are
//! built from them by name.

use pyo3::prelude::*;

/// A finished sync as one trainer saw it (`PushCore.wait`).
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
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
    /// Each stage of this trainer's part and its span, seconds.
    pub stages: Vec<(String, f64)>,
    /// Why the version never synced (a newer version or run was pushed first), if it did not.
    pub superseded: Option<String>,
    /// The path its bytes took to the engines (`payloads`, `process_vm_readv`,
    /// `shared_memory`, `mixed`, `none`); `None` where the fabric does not count them.
    pub path: Option<&'static str>,
    /// Bytes per path (the same names), empty where not counted.
    pub path_bytes: Vec<(&'static str, u64)>,
}

/// How weightsync sees a tensor-like object (`tensor_info`).
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct TensorMemory {
    /// Address of its first byte.
    pub address: usize,
    /// Its length in bytes.
    pub bytes: usize,
    /// Element type (`bf16`, `f8_e4m3`...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// How it was read: `torch`, `dlpack` or `buffer`.
    pub kind: &'static str,
}

/// One registered tensor (`register`).
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct Registered {
    /// Its name in the job.
    pub name: String,
    /// Address of its first byte.
    pub address: usize,
    /// Its length in bytes.
    pub bytes: usize,
    /// How it was read: `torch`, `dlpack` or `buffer`.
    pub kind: &'static str,
}

/// One shard a training rank must register (`TrainerCore.layout`).
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct Shard {
    /// The parameter's name (`name#k` for its k-th shard after the first on this rank).
    pub name: String,
    /// Element type.
    pub dtype: String,
    /// The parameter's whole shape.
    pub global_shape: Vec<u64>,
    /// Where this rank's box starts in it.
    pub offset: Vec<u64>,
    /// The box's extents: the shape of the tensor to register.
    pub shape: Vec<u64>,
}

/// One tensor an inference rank must register (`EngineCore.layout`). `global_shape` and
/// `offset` are None for a tensor that is not one box of one training parameter.
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct PlannedTensor {
    /// The engine's name for it.
    pub name: String,
    /// Element type.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// The whole shape of the parameter it is a box of.
    pub global_shape: Option<Vec<u64>>,
    /// Where the box starts in that parameter.
    pub offset: Option<Vec<u64>>,
}

/// An engine's state (`EngineCore.state`, `wait_for_version`).
#[pyclass(frozen, get_all, module = "weightsync._native")]
#[derive(Debug, Clone)]
pub(crate) struct State {
    /// The last committed version.
    pub version: Option<u64>,
    /// The job's run it belongs to.
    pub run: u64,
    /// `idle`, `landing`, `committed` or `invalid`.
    pub state: &'static str,
    /// Why it is invalid.
    pub cause: Option<String>,
}
