//! What can be wrong with a declared model's declarations: each error names the tensor and
//! both sides (the trainer rank that holds it, the inference rank that wants it), so that a
//! model the engine and the trainer disagree on fails before any byte moves, with the reason.

use thiserror::Error;
use weightsync_common::DType;

/// A declaration refused, or two that disagree.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeclaredError {
    /// A declared model's parameters or a layout were asked of its config or a layout string.
    #[error(
        "{model} is a declared model (an architecture the planner does not know): its {side} \
         comes from what its workers register, not from a config or a layout string"
    )]
    LayoutFromSpec {
        /// `parameter list`, `training layout` or `inference layout`.
        side: &'static str,
        /// The model.
        model: String,
    },
    /// The job's inference layout cannot hold a declared model.
    #[error("inference layout {spec}: {reason}")]
    Spec {
        /// The layout string.
        spec: String,
        /// Why.
        reason: String,
    },
    /// One declaration is malformed (its box outside its shape, dims that do not agree).
    #[error("tensor {tensor}: {side} rank {rank} declares it {reason}")]
    Malformed {
        /// The tensor.
        tensor: String,
        /// `trainer` or `inference`.
        side: &'static str,
        /// The rank.
        rank: u32,
        /// What is wrong.
        reason: String,
    },
    /// One rank declares a name twice.
    #[error("tensor {tensor}: {side} rank {rank} declares it twice")]
    Twice {
        /// The tensor.
        tensor: String,
        /// `trainer` or `inference`.
        side: &'static str,
        /// The rank.
        rank: u32,
    },
    /// Two trainers disagree on a tensor's dtype or whole shape.
    #[error(
        "tensor {tensor}: trainer rank {rank_a} declares {what} {a}, trainer rank {rank_b} {b}"
    )]
    TrainersDisagree {
        /// The tensor.
        tensor: String,
        /// `dtype` or `global shape`.
        what: &'static str,
        /// The first rank.
        rank_a: u32,
        /// What it says.
        a: String,
        /// The other rank.
        rank_b: u32,
        /// What it says.
        b: String,
    },
    /// Two trainers' boxes of one tensor overlap without being the same box (replicas hold the
    /// same box; shards hold disjoint ones).
    #[error(
        "tensor {tensor} {shape}: trainer rank {rank_a} holds {box_a} and trainer rank {rank_b} \
         holds {box_b}, which overlap (shards must tile the tensor; replicas hold the same box)"
    )]
    Overlap {
        /// The tensor.
        tensor: String,
        /// Its whole shape.
        shape: String,
        /// One rank.
        rank_a: u32,
        /// Its box.
        box_a: String,
        /// The other.
        rank_b: u32,
        /// Its box.
        box_b: String,
    },
    /// The trainers' boxes of a tensor leave part of it uncovered.
    #[error(
        "tensor {tensor} {shape}: no trainer holds {gap} (the trainers' boxes cover {covered} of \
         its {total} elements)"
    )]
    Gap {
        /// The tensor.
        tensor: String,
        /// Its whole shape.
        shape: String,
        /// A region nobody holds (or `part of it` when it was not worth locating).
        gap: String,
        /// Elements covered.
        covered: u64,
        /// Elements it has.
        total: u64,
    },
    /// An engine declares a tensor no trainer holds.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares it ({dtype} {shape}) but no \
         trainer holds it (a tensor the engine does not take from the trainers belongs in its \
         skip list)"
    )]
    NoTrainerHolds {
        /// The tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// Its declared dtype.
        dtype: DType,
        /// Its declared shape.
        shape: String,
    },
    /// A trainer holds a tensor an engine neither declares nor skips.
    #[error(
        "tensor {tensor}: trainer rank {trainer_rank} holds it ({dtype} {shape}) but inference \
         rank {engine_rank} neither declares it nor skips it"
    )]
    NoEngineWants {
        /// The tensor.
        tensor: String,
        /// The first trainer rank holding it.
        trainer_rank: u32,
        /// The inference rank.
        engine_rank: u32,
        /// The trainers' dtype.
        dtype: DType,
        /// Its whole shape.
        shape: String,
    },
    /// Two engines take one tensor in different dtypes (each box is prepared once for every
    /// engine that takes it).
    #[error(
        "tensor {tensor}: inference rank {rank_a} declares {a}, inference rank {rank_b} {b} \
         (every engine takes a tensor in one dtype)"
    )]
    EnginesDisagree {
        /// The tensor.
        tensor: String,
        /// The first engine.
        rank_a: u32,
        /// Its dtype.
        a: DType,
        /// The other.
        rank_b: u32,
        /// Its dtype.
        b: DType,
    },
    /// An engine's tensor has another shape than the trainers' whole tensor.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares shape {engine_shape}, trainer \
         rank {trainer_rank} holds a tensor of shape {trainer_shape} (an engine tensor that \
         declares no source is the trainers' tensor of its name, whole)"
    )]
    ShapeMismatch {
        /// The tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The engine's shape.
        engine_shape: String,
        /// The first trainer rank holding it.
        trainer_rank: u32,
        /// The trainers' whole shape.
        trainer_shape: String,
    },
    /// An engine's dtype is neither the trainers' nor the job's.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares {engine_dtype}, trainer rank \
         {trainer_rank} holds {trainer_dtype}; {reason}"
    )]
    DTypeMismatch {
        /// The tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The engine's dtype.
        engine_dtype: DType,
        /// The first trainer rank holding it.
        trainer_rank: u32,
        /// The trainers' dtype.
        trainer_dtype: DType,
        /// What the job allows.
        reason: String,
    },

    /// An engine tensor's parts do not fit it or the trainers' tensors (boxed: its fields name
    /// both sides at length).
    #[error(transparent)]
    Part(Box<PartError>),
    /// A trainer tensor no rank of a tensor-parallel engine takes any of.
    #[error(
        "tensor {tensor}: trainer rank {trainer_rank} holds it ({dtype} {shape}) but no rank of \
         engine {engine} (inference ranks {first_rank}..={last_rank}) declares a tensor made of \
         it or skips it"
    )]
    NoEngineRankWants {
        /// The tensor.
        tensor: String,
        /// The first trainer rank holding it.
        trainer_rank: u32,
        /// The engine.
        engine: u32,
        /// Its first inference rank.
        first_rank: u32,
        /// Its last inference rank.
        last_rank: u32,
        /// The trainers' dtype.
        dtype: DType,
        /// Its whole shape.
        shape: String,
    },
}

/// An engine tensor made of parts that do not fit: each names the engine tensor, the inference
/// rank, the part and the trainer side.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartError {
    /// An engine tensor's part names a tensor no trainer holds.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares it made of {source_tensor} \
         {part}, but no trainer holds {source_tensor}"
    )]
    NoTrainerHoldsPart {
        /// The engine tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The part's trainer tensor.
        source_tensor: String,
        /// The part's box, as declared.
        part: String,
    },
    /// An engine tensor's part is a box outside the trainers' tensor it names.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares it made of {source_tensor} \
         {part}, outside the {source_tensor} of shape {trainer_shape} trainer rank \
         {trainer_rank} holds"
    )]
    PartOutside {
        /// The engine tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The part's trainer tensor.
        source_tensor: String,
        /// The part's box.
        part: String,
        /// The first trainer rank holding it.
        trainer_rank: u32,
        /// The trainers' whole shape.
        trainer_shape: String,
    },
    /// An engine tensor's part does not fit the tensor: in a dim it spans whole, it is another
    /// size, or it has more dims than the tensor.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares shape {engine_shape} \
         concatenated along dim {dim}, but {part}, {reason}"
    )]
    PartShape {
        /// The engine tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The engine tensor's shape.
        engine_shape: String,
        /// The concatenation dim.
        dim: u32,
        /// The part: its position, trainer tensor and box, and the trainer side (rank, shape).
        part: String,
        /// How it does not fit.
        reason: String,
    },
    /// Two parts of an engine tensor overlap: a part runs past the end of its place along the
    /// concatenation dim, into the next part's (or past the tensor's end).
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares shape {engine_shape} \
         concatenated along dim {dim}, but {part}, {overlaps}"
    )]
    PartOverlap {
        /// The engine tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The engine tensor's shape.
        engine_shape: String,
        /// The concatenation dim.
        dim: u32,
        /// The part: its position, trainer tensor and box, and the trainer side (rank, shape).
        part: String,
        /// Where it starts and what it overlaps.
        overlaps: String,
    },
    /// An engine tensor's parts leave part of it unfilled.
    #[error(
        "tensor {tensor}: inference rank {engine_rank} declares shape {engine_shape}, but \
         {parts} fill {filled} of its {total} elements: nothing fills {gap}"
    )]
    PartGap {
        /// The engine tensor.
        tensor: String,
        /// The inference rank.
        engine_rank: u32,
        /// The engine tensor's shape.
        engine_shape: String,
        /// Its parts: how many, the dim, the last one and its trainer side.
        parts: String,
        /// Elements the parts fill.
        filled: u64,
        /// Elements of the tensor.
        total: u64,
        /// The first box nothing fills.
        gap: String,
    },
}

impl From<PartError> for DeclaredError {
    fn from(e: PartError) -> Self {
        DeclaredError::Part(Box::new(e))
    }
}
