//! Why a plan could not be made. Every variant names what was wrong (the parameter, the ranks,
//! the numbers) so bad input is a clear message, never a panic.

use thiserror::Error;

/// Errors of model parsing, layout building and planning.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// A rank outside the table or layout.
    #[error("no {side} rank {rank} (there are {ranks})")]
    NoSuchRank {
        /// `training` or `inference`.
        side: &'static str,
        /// The rank asked for.
        rank: u32,
        /// How many there are.
        ranks: u32,
    },
    /// A hand-built table shape ([`crate::synthetic`]) that cannot be laid out.
    #[error("synthetic table: {0}")]
    Synthetic(String),
    /// A table could not be decoded.
    #[error("routing table does not decode: {0}")]
    Decode(String),
    /// A decoded table whose task refers outside its trainer's writes or copies.
    #[error("routing table is inconsistent: training rank {rank}, task {task}: {reason}")]
    BadTable {
        /// Training rank.
        rank: u32,
        /// Task index in that rank's plan.
        task: u32,
        /// What is wrong.
        reason: String,
    },
    /// config.json names a model family this planner does not know.
    #[error(
        "unknown model family {family:?} (known: llama, qwen2, qwen3, qwen3_moe, deepseek_v3, kimi_k2; any other architecture is planned from what its workers declare, with format=hf)"
    )]
    UnknownFamily {
        /// The `model_type` / architecture found.
        family: String,
    },
    /// A preset name that is not known.
    #[error("unknown model preset {name:?} (known: {known})")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// The known presets.
        known: String,
    },
    /// config.json is not valid JSON or misses a field.
    #[error("bad model config: {0}")]
    BadConfig(String),
    /// A layout specification string (`pp=2,fsdp=16`) that does not parse.
    #[error("bad layout spec {spec:?}: {reason}")]
    BadSpec {
        /// The spec given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A parallel degree that does not divide what it splits.
    #[error("{what}: {degree_name}={degree} does not divide {dividend_name}={dividend}")]
    NotDivisible {
        /// Which parameter or layer, and which side.
        what: String,
        /// Name of the degree (`tp`, `ep`, `pp`).
        degree_name: &'static str,
        /// Its value.
        degree: u32,
        /// Name of what it splits (`num_attention_heads`, `num_experts`).
        dividend_name: &'static str,
        /// Its value.
        dividend: u64,
    },
    /// A training shard's box lies (partly) outside its tensor.
    #[error(
        "training rank {rank}: shard of {param} has box {region} outside the tensor's shape {shape}"
    )]
    BoxOutsideTensor {
        /// Parameter name.
        param: String,
        /// Training rank.
        rank: u32,
        /// The box.
        region: String,
        /// The tensor's shape.
        shape: String,
    },
    /// A shard names a parameter the model does not have.
    #[error("training rank {rank}: shard names parameter id {param}, the model has {params}")]
    NoSuchParam {
        /// Training rank.
        rank: u32,
        /// The parameter id.
        param: u32,
        /// Parameter count.
        params: u32,
    },
    /// Part of a tensor is held by no training rank.
    #[error(
        "{param}: region {region} is held by no training rank (ranks holding parts: {holders})"
    )]
    Uncovered {
        /// Parameter name.
        param: String,
        /// The uncovered region.
        region: String,
        /// Ranks that hold other parts of it.
        holders: String,
    },
    /// Two shards on one rank overlap in the source arena.
    #[error("training rank {rank}: shards of {a} and {b} overlap in the source arena")]
    ArenaOverlap {
        /// Training rank.
        rank: u32,
        /// One parameter.
        a: String,
        /// The other.
        b: String,
    },
    /// Two training replicas of the same region disagree on dtype.
    #[error("{param}: training ranks {a} and {b} hold it in different dtypes")]
    DtypeMismatch {
        /// Parameter name.
        param: String,
        /// One rank.
        a: u32,
        /// The other.
        b: u32,
    },
    /// An fp8 destination piece not aligned to 128x128 blocks.
    #[error(
        "{param} on inference rank {rank}: shard {region} is not aligned to {block}x{block} fp8 blocks"
    )]
    Fp8Misaligned {
        /// Parameter name.
        param: String,
        /// Inference rank.
        rank: u32,
        /// The piece's box.
        region: String,
        /// Block edge.
        block: u32,
    },
    /// The inference layout is inconsistent (a piece outside its tensor or parameter).
    #[error("inference rank {rank}: {reason}")]
    BadInferenceLayout {
        /// Inference rank.
        rank: u32,
        /// What is wrong.
        reason: String,
    },
    /// A destination byte would be written more than once or not at all.
    #[error("{param}: inference rank {rank} tensor {tensor}: {reason}")]
    DestinationCoverage {
        /// Parameter name.
        param: String,
        /// Inference rank.
        rank: u32,
        /// Destination tensor name.
        tensor: String,
        /// What is wrong.
        reason: String,
    },
    /// Something exceeds what the table's compact integers can hold.
    #[error("too large: {0}")]
    TooLarge(String),
    /// The workers' declarations of a declared model disagree or cannot be planned (each
    /// names the tensor and both sides: see [`crate::declared_error::DeclaredError`]).
    #[error(transparent)]
    Declared(#[from] crate::declared_error::DeclaredError),
}
