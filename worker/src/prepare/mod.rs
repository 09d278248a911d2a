//! Preparation kernels: turn a slice of the trainer's source arena into exactly the bytes the
//! destination expects, contiguous, ready to be written.
//!
//! Why this exists: a training shard rarely has the inference layout. A destination tensor is a
//! sub-box of the source (tensor-parallel re-sharding), often in another dtype (bf16 training,
//! fp32 master weights) or fp8 e4m3fn with 128x128 block scales (DeepSeek-V3 convention). The
//! pipeline runs these kernels between the H2D stage and the WRITE stage, so their throughput
//! must stay near memcpy.
//!
//! # Layout
//! - [`convert`]: scalar, branch-free element conversions (shared with the NVRTC kernels).
//! - [`cast`]: dtype casts between bf16, fp16 and fp32.
//! - [`gather`]: strided N-d sub-box gather into a contiguous output.
//! - [`fp8`]: float8 e4m3fn 128x128 block quantisation writing values and `weight_scale_inv`.
//!
//! Every kernel works on byte slices (little-endian elements), checks every length before
//! writing anything, and takes a [`Threads`] choice: `One` runs on the calling thread,
//! `All` splits the work over the rayon pool.

pub mod cast;
pub mod convert;
pub mod fp8;
pub mod gather;
mod isa;

#[cfg(test)]
mod vectors;

pub use cast::{cast, cast_pitched};
pub use fp8::{
    FP8_AMAX_FLOOR, Fp8Shape, quantise_fp8, quantise_fp8_as, quantise_fp8_block_rows,
    quantise_fp8_block_rows_pitched,
};
// The GPU kernels share the block edge.
#[cfg(feature = "cuda")]
pub(crate) use fp8::FP8_BLOCK;
pub use gather::gather_box;

use weightsync_common::DType;

/// Where a kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Threads {
    /// On the calling thread only.
    One,
    /// Split over the global rayon pool.
    #[default]
    All,
}

/// Why a preparation kernel refused its input. Nothing is written when one is returned.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrepareError {
    /// The kernel does not handle this pair of dtypes.
    #[error("unsupported conversion {from} -> {to}")]
    UnsupportedDType {
        /// Input dtype.
        from: DType,
        /// Output dtype.
        to: DType,
    },
    /// A buffer has the wrong length for the shape and dtype given.
    #[error("{what}: expected {expected} bytes, got {actual}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Bytes required.
        expected: usize,
        /// Bytes supplied.
        actual: usize,
    },
    /// A shape, box or block range is inconsistent.
    #[error("bad shape: {0}")]
    Shape(String),
}

/// Elements from the first of `count` runs of `run` elements, `pitch` apart, to the end of the
/// last: what a source read at a pitch spans (0 for no runs).
pub(crate) fn pitched_span(count: usize, run: usize, pitch: usize) -> usize {
    count.checked_sub(1).map_or(0, |k| k * pitch + run)
}

/// Checks a buffer's length, naming it in the error.
pub(crate) fn expect_len(
    what: &'static str,
    expected: usize,
    actual: usize,
) -> Result<(), PrepareError> {
    if expected == actual {
        Ok(())
    } else {
        Err(PrepareError::Length {
            what,
            expected,
            actual,
        })
    }
}
