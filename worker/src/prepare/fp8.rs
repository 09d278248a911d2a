//! float8 e4m3fn block quantisation of a 2-D `[rows, cols]` tensor, 128x128 blocks.
//!
//! Convention (DeepSeek-V3 checkpoints, as read by vLLM and SGLang): the tensor is cut into
//! 128x128 blocks (the last row/column of blocks may be partial); each block gets one f32
//! `weight_scale_inv` such that `dequant = fp8 * weight_scale_inv`; the scale tensor is
//! `[ceil(rows/128), ceil(cols/128)]` f32, row-major. Per block, in f32, as the engine's own
//! loader computes it ([`Fp8Recipe`]: the recipes differ only in the block's two scalars):
//!
//! ```text
//! amax            = max |x| over the block's finite elements
//! (factor, scale) = recipe.block_scale(amax)     // vLLM: 448 / max(amax, 1e-4), its inverse
//! q               = e4m3(x * factor)             // f32 multiply, round to nearest even
//! weight_scale_inv = scale
//! ```
//!
//! So with [`Fp8Recipe::Vllm`] (vLLM's / SGLang's `per_block_cast_to_fp8`, the default of
//! [`quantise_fp8`]) an all-zero block gets `scale = 1e-4 / 448` (about 2.2e-7) and all-zero
//! values; with [`Fp8Recipe::Transformers`] scale 1.0.
//!
//! Non-finite inputs (which a healthy training step never produces) are pinned down rather
//! than left to propagate: `amax` is taken over the *finite* elements only, so one stray inf
//! or NaN does not wipe out the precision of the other 16383 values of its block; then the
//! element conversion saturates: `+inf -> 448 (0x7e)`, `-inf -> -448 (0xfe)`, NaN -> NaN
//! (0x7f / 0xff, sign kept). Finite products can only exceed 448 by rounding of the factor,
//! and those saturate to 448 too. (The torch reference would instead produce an inf/NaN scale
//! for such a block; ml_dtypes and torch casts map overflow to NaN, hence the explicit clamp.)
//!
//! Against vLLM's / DeepGEMM's `per_block_cast_to_fp8` in torch (device review N16): blocks of
//! finite values are bit-identical (`amax.clamp(1e-4)`, `x * (448 / amax)` in f32, both
//! divisions correctly rounded, the bf16 -> f32 widening exact, subnormal e4m3 by the same
//! add-2^14 rounding as c10, `-0 -> 0x80`), on the CPU and in the CUDA kernel alike. The only
//! differences are for non-finite input, and they are deliberate: `amax` ignores inf/NaN where
//! `torch.amax` propagates them (an inf or NaN scale for the block); `±inf -> ±448` where c10's
//! conversion gives NaN; `-NaN -> 0xff` here (sign kept, pinned by tests) where torch on a GPU
//! gives `0x7f`. An engine-side comparison should not flag those as bugs.
//!
//! Speed: a block row is cut into column strips of at most [`STRIP_BYTES`] of input; each strip
//! is read twice (amax, then quantise), the second pass finding it in L2, and while a strip is
//! quantised the next one is prefetched, so the memory-bound amax pass of the next strip
//! overlaps the compute-bound quantise pass of this one instead of following it. The
//! plain-Rust loops are branch-free over fixed-size elements so they vectorise; on a CPU with
//! AVX-512 the two inner loops are hand-written instead ([`avx512`]: 16 or 32 elements per
//! step, the same integer and f32 steps as [`f32_to_e4m3_saturating`], so the bytes are
//! identical, which the tests check against an independent scalar reference), because LLVM's
//! own vectorisation of the per-lane select and the 32-to-8-bit narrowing stays far below
//! memory speed.

use std::marker::PhantomData;
use std::ops::Range;

use rayon::prelude::*;
use weightsync_common::{DType, Fp8Recipe};

use super::convert::{bf16_to_f32, f16_to_f32, f32_to_e4m3_saturating};
use super::isa::{Avx2, Avx512, Kernel, vectorised};
use super::{PrepareError, Threads, expect_len, pitched_span};

mod avx2;
mod row_loops;
// The AVX-512 intrinsics are stable since Rust 1.89: why the workspace's `rust-version` is 1.89.
mod avx512;

/// Block edge, in elements, along both dims.
pub const FP8_BLOCK: usize = 128;

/// Floor applied to a block's amax before computing its scale (the `clamp(1e-4)` of the
/// reference quantisers), so an all-zero block has a finite, non-zero scale.
pub use weightsync_common::fp8_recipe::FP8_AMAX_FLOOR;

/// Shape of the whole 2-D tensor being quantised (the block grid is anchored at its origin).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Shape {
    /// Rows (dim 0).
    pub rows: usize,
    /// Columns (dim 1, contiguous).
    pub cols: usize,
}

impl Fp8Shape {
    /// Number of block rows, `ceil(rows / 128)`.
    pub fn row_blocks(&self) -> usize {
        self.rows.div_ceil(FP8_BLOCK)
    }
    /// Number of block columns, `ceil(cols / 128)`.
    pub fn col_blocks(&self) -> usize {
        self.cols.div_ceil(FP8_BLOCK)
    }
    /// Shape of `weight_scale_inv`: `[row_blocks, col_blocks]`.
    pub fn scale_shape(&self) -> [usize; 2] {
        [self.row_blocks(), self.col_blocks()]
    }
    /// The tensor rows covered by a range of block rows.
    pub fn rows_of(&self, row_blocks: Range<usize>) -> Range<usize> {
        (row_blocks.start * FP8_BLOCK).min(self.rows)..(row_blocks.end * FP8_BLOCK).min(self.rows)
    }
}

/// Quantises a whole `[rows, cols]` tensor with [`Fp8Recipe::Vllm`]: `values` gets
/// `rows * cols` e4m3fn bytes, `scales` gets `ceil(rows/128) * ceil(cols/128)` little-endian
/// f32 `weight_scale_inv`.
pub fn quantise_fp8(
    src: &[u8],
    src_dtype: DType,
    shape: Fp8Shape,
    values: &mut [u8],
    scales: &mut [u8],
    threads: Threads,
) -> Result<(), PrepareError> {
    quantise_fp8_as(
        Fp8Recipe::Vllm,
        src,
        src_dtype,
        shape,
        values,
        scales,
        threads,
    )
}

/// [`quantise_fp8`] following `recipe` (the engine's own loader's arithmetic).
pub fn quantise_fp8_as(
    recipe: Fp8Recipe,
    src: &[u8],
    src_dtype: DType,
    shape: Fp8Shape,
    values: &mut [u8],
    scales: &mut [u8],
    threads: Threads,
) -> Result<(), PrepareError> {
    quantise_fp8_block_rows_pitched(
        src,
        src_dtype,
        shape,
        0..shape.row_blocks(),
        shape.cols,
        recipe,
        values,
        scales,
        threads,
    )
}

/// [`quantise_fp8_block_rows`] reading rows that lie `pitch` elements apart in `src` (a
/// column slice of a wider row-major matrix, read where it lies instead of gathered first):
/// row `r` of the block rows is `src[r * pitch .. r * pitch + cols]` (in elements), so `src`
/// spans `(rows - 1) * pitch + cols` elements. `pitch == cols` with [`Fp8Recipe::Vllm`] is
/// [`quantise_fp8_block_rows`]; `recipe` says whose arithmetic the block scales follow.
#[allow(clippy::too_many_arguments)]
pub fn quantise_fp8_block_rows_pitched(
    src: &[u8],
    src_dtype: DType,
    shape: Fp8Shape,
    row_blocks: Range<usize>,
    pitch: usize,
    recipe: Fp8Recipe,
    values: &mut [u8],
    scales: &mut [u8],
    threads: Threads,
) -> Result<(), PrepareError> {
    quantise_on_path(
        src,
        src_dtype,
        shape,
        row_blocks,
        pitch,
        recipe,
        values,
        scales,
        threads,
        Path::Best,
    )
}

/// Quantises only the block rows `row_blocks` of a `[rows, cols]` tensor (a task that produces
/// part of a destination tensor).
///
/// `src` holds just those rows (`shape.rows_of(row_blocks)`, all columns, in `src_dtype`),
/// `values` receives the same rows as e4m3fn, and `scales` the matching rows of the scale
/// grid (`row_blocks.len() * col_blocks` f32). The result equals the corresponding part of
/// [`quantise_fp8`] on the whole tensor ([`Fp8Recipe::Vllm`]).
pub fn quantise_fp8_block_rows(
    src: &[u8],
    src_dtype: DType,
    shape: Fp8Shape,
    row_blocks: Range<usize>,
    values: &mut [u8],
    scales: &mut [u8],
    threads: Threads,
) -> Result<(), PrepareError> {
    let pitch = shape.cols;
    quantise_fp8_block_rows_pitched(
        src,
        src_dtype,
        shape,
        row_blocks,
        pitch,
        Fp8Recipe::Vllm,
        values,
        scales,
        threads,
    )
}

/// [`quantise_fp8_block_rows_pitched`] on a chosen code path.
#[allow(clippy::too_many_arguments)]
fn quantise_on_path(
    src: &[u8],
    src_dtype: DType,
    shape: Fp8Shape,
    row_blocks: Range<usize>,
    pitch: usize,
    recipe: Fp8Recipe,
    values: &mut [u8],
    scales: &mut [u8],
    threads: Threads,
    path: Path,
) -> Result<(), PrepareError> {
    if !matches!(src_dtype, DType::BF16 | DType::F16 | DType::F32) {
        return Err(PrepareError::UnsupportedDType {
            from: src_dtype,
            to: DType::F8E4M3,
        });
    }
    if row_blocks.start > row_blocks.end || row_blocks.end > shape.row_blocks() {
        return Err(PrepareError::Shape(format!(
            "block rows {row_blocks:?} outside 0..{} of a {}x{} tensor",
            shape.row_blocks(),
            shape.rows,
            shape.cols
        )));
    }
    let rows = shape.rows_of(row_blocks.clone()).len();
    let cols = shape.cols;
    if pitch < cols {
        return Err(PrepareError::Shape(format!(
            "row pitch {pitch} shorter than the {cols} columns of a row"
        )));
    }
    let span = pitched_span(rows, cols, pitch);
    expect_len("fp8 source", span * src_dtype.size(), src.len())?;
    expect_len("fp8 values", rows * cols, values.len())?;
    expect_len(
        "fp8 scales",
        row_blocks.len() * shape.col_blocks() * 4,
        scales.len(),
    )?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let job = Job {
        cols,
        pitch,
        recipe,
        threads,
        path,
    };
    match src_dtype {
        DType::BF16 => job.run::<Bf16>(src, values, scales),
        DType::F16 => job.run::<F16>(src, values, scales),
        _ => job.run::<F32>(src, values, scales),
    }
    Ok(())
}

/// Which code quantises the blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// The fastest this CPU allows (hand-written AVX-512, else plain Rust built for AVX2).
    Best,
    /// Plain Rust built for the baseline ISA: the reference the fast paths are tested against.
    #[cfg_attr(not(test), allow(dead_code))]
    Portable,
    /// The hand-written AVX2 code even where AVX-512 is present (plain Rust where the CPU
    /// lacks AVX2), so tests cover it on every x86 machine.
    #[cfg_attr(not(test), allow(dead_code))]
    Avx2,
}

/// Elements per inner chunk: a fixed trip count over a fixed-size array lets LLVM drop the
/// bounds checks and vectorise.
const LANES: usize = 32;

/// One input element type: its finite-|x| ordering key and its f32 value, element-wise and
/// over fixed chunks of [`LANES`] elements.
trait Elem {
    const SIZE: usize;
    /// An integer whose order is the order of |x| for finite x, and 0 for inf / NaN.
    type Key: Copy + Ord + Default + Send;
    fn key(b: &[u8]) -> Self::Key;
    fn key_to_f32(k: Self::Key) -> f32;
    fn to_f32(b: &[u8]) -> f32;
    /// Max key of exactly `LANES` elements.
    fn chunk_key_max(c: &[u8]) -> Self::Key;
    /// Quantises exactly `LANES` elements.
    fn chunk_quantise(c: &[u8], inv: f32, out: &mut [u8]);
}

/// Implements the chunk methods with the element size as a literal, so the arrays are fixed.
macro_rules! chunk_methods {
    ($size:literal) => {
        #[inline(always)]
        fn chunk_key_max(c: &[u8]) -> Self::Key {
            let c: &[u8; $size * LANES] = c.try_into().expect("exact chunk");
            let mut m = Self::Key::default();
            for i in 0..LANES {
                m = m.max(Self::key(&c[$size * i..$size * i + $size]));
            }
            m
        }
        #[inline(always)]
        fn chunk_quantise(c: &[u8], inv: f32, out: &mut [u8]) {
            let c: &[u8; $size * LANES] = c.try_into().expect("exact chunk");
            let out: &mut [u8; LANES] = out.try_into().expect("exact chunk");
            for i in 0..LANES {
                out[i] =
                    f32_to_e4m3_saturating(Self::to_f32(&c[$size * i..$size * i + $size]) * inv);
            }
        }
    };
}

struct Bf16;
struct F16;
struct F32;

impl Elem for Bf16 {
    const SIZE: usize = 2;
    type Key = i16;
    #[inline(always)]
    fn key(b: &[u8]) -> i16 {
        let a = u16::from_le_bytes([b[0], b[1]]) & 0x7fff;
        (if a < 0x7f80 { a } else { 0 }) as i16
    }
    #[inline(always)]
    fn key_to_f32(k: i16) -> f32 {
        bf16_to_f32(k as u16)
    }
    #[inline(always)]
    fn to_f32(b: &[u8]) -> f32 {
        // A plain widening shift: it differs from `bf16_to_f32` only in the quiet bit of a
        // NaN, and every NaN quantises to the same 0x7f / 0xff.
        f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)
    }
    chunk_methods!(2);
}

impl Elem for F16 {
    const SIZE: usize = 2;
    type Key = i16;
    #[inline(always)]
    fn key(b: &[u8]) -> i16 {
        let a = u16::from_le_bytes([b[0], b[1]]) & 0x7fff;
        (if a < 0x7c00 { a } else { 0 }) as i16
    }
    #[inline(always)]
    fn key_to_f32(k: i16) -> f32 {
        f16_to_f32(k as u16)
    }
    #[inline(always)]
    fn to_f32(b: &[u8]) -> f32 {
        f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
    }
    chunk_methods!(2);
}

impl Elem for F32 {
    const SIZE: usize = 4;
    type Key = i32;
    #[inline(always)]
    fn key(b: &[u8]) -> i32 {
        let a = (u32::from_le_bytes([b[0], b[1], b[2], b[3]]) & 0x7fff_ffff) as i32;
        if a < 0x7f80_0000 { a } else { 0 }
    }
    #[inline(always)]
    fn key_to_f32(k: i32) -> f32 {
        f32::from_bits(k as u32)
    }
    #[inline(always)]
    fn to_f32(b: &[u8]) -> f32 {
        f32::from_le_bytes([b[0], b[1], b[2], b[3]])
    }
    chunk_methods!(4);
}

/// One quantisation over whole block rows of a tensor with `cols` columns, rows `pitch`
/// elements apart in the source.
#[derive(Debug, Clone, Copy)]
struct Job {
    cols: usize,
    pitch: usize,
    recipe: Fp8Recipe,
    threads: Threads,
    path: Path,
}

impl Job {
    /// Quantises whole block rows: `src`/`values` hold `k` block rows of `cols` columns (the
    /// last possibly partial), `scales` their `k * col_blocks` f32.
    fn run<E: Elem>(self, src: &[u8], values: &mut [u8], scales: &mut [u8])
    where
        Avx512: RowOps<E>,
        Avx2: RowOps<E>,
    {
        let (cols, pitch, recipe) = (self.cols, self.pitch, self.recipe);
        let ncb = cols.div_ceil(FP8_BLOCK);
        let (src_step, val_step, scale_step) =
            (FP8_BLOCK * pitch * E::SIZE, FP8_BLOCK * cols, ncb * 4);
        match self.threads {
            Threads::One => {
                // The next block row directly follows in `src`: while one block row is being
                // quantised, the next one is prefetched (see `RowOps::prefetch`).
                let last = src.len().div_ceil(src_step).saturating_sub(1);
                src.chunks(src_step)
                    .zip(values.chunks_mut(val_step))
                    .zip(scales.chunks_mut(scale_step))
                    .enumerate()
                    .for_each(|(i, ((s, v), sc))| {
                        let ahead = if i < last { src_step } else { 0 };
                        block_row::<E>(s, cols, pitch, recipe, v, sc, false, ahead, self.path)
                    })
            }
            Threads::All => src
                .par_chunks(src_step)
                .zip(values.par_chunks_mut(val_step))
                .zip(scales.par_chunks_mut(scale_step))
                .for_each(|((s, v), sc)| {
                    block_row::<E>(s, cols, pitch, recipe, v, sc, true, 0, self.path)
                }),
        }
    }
}

/// Most input bytes one column group of a block row may span: the group is read twice (amax,
/// then quantise) and the next group is prefetched while it is quantised, so two groups plus
/// their output must stay in L2 (2 MiB per core on current server cores; the 1 MiB strips of a
/// 4096-column bf16 block row measured ~15% slower than 512 KiB ones).
const STRIP_BYTES: usize = 512 << 10;

/// One block row (up to 128 rows, `pitch` elements apart in `src`): every column block, in
/// parallel when `parallel`. `ahead` is the distance in bytes from `src` to the next block
/// row, if the caller will quantise it next on this thread (0 otherwise).
#[allow(clippy::too_many_arguments)]
fn block_row<E: Elem>(
    src: &[u8],
    cols: usize,
    pitch: usize,
    recipe: Fp8Recipe,
    values: &mut [u8],
    scales: &mut [u8],
    parallel: bool,
    ahead: usize,
    path: Path,
) where
    Avx512: RowOps<E>,
    Avx2: RowOps<E>,
{
    let ncb = cols.div_ceil(FP8_BLOCK);
    let rows = values.len() / cols;
    // Column groups (runs of whole column blocks) of at most `STRIP_BYTES`, and over the pool
    // a few per pool thread, so that even a single block row spreads over the pool.
    let strip_blocks = (STRIP_BYTES / (FP8_BLOCK * FP8_BLOCK * E::SIZE)).max(1);
    let groups = if parallel {
        ncb.min(rayon::current_num_threads() * 2).max(1)
    } else {
        1
    }
    .max(ncb.div_ceil(strip_blocks));
    let group_cols = ncb.div_ceil(groups) * FP8_BLOCK;
    let groups = cols.div_ceil(group_cols);
    // Transpose the output rows into per-group segments, so that groups can be filled
    // independently (and in parallel) without aliasing.
    let mut segments: Vec<Vec<&mut [u8]>> = (0..groups).map(|_| Vec::with_capacity(rows)).collect();
    for row in values.chunks_mut(cols) {
        for (g, seg) in row.chunks_mut(group_cols).enumerate() {
            segments[g].push(seg);
        }
    }
    let quantise = |(g, segs): (usize, Vec<&mut [u8]>)| -> Vec<f32> {
        let c0 = g * group_cols;
        let width = (cols - c0).min(group_cols);
        // What this thread quantises next: the next group of this block row, or after the
        // last one the first group of the next block row (when there is one).
        let ahead = if g + 1 < groups {
            group_cols * E::SIZE
        } else if ahead != 0 {
            ahead - c0 * E::SIZE
        } else {
            0
        };
        let group = Group::<E> {
            src,
            pitch,
            recipe,
            c0,
            width,
            ahead,
            out_rows: segs,
            elem: PhantomData,
        };
        match path {
            Path::Best => vectorised(group),
            Path::Portable => group.run(),
            #[cfg(test)]
            Path::Avx2 => super::isa::with_avx2(group)
                .expect("tests pick Path::Avx2 only on a CPU with AVX2 and F16C"),
            #[cfg(not(test))]
            Path::Avx2 => vectorised(group),
        }
    };
    let segments = segments
        .into_iter()
        .filter(|s| !s.is_empty() && !s[0].is_empty());
    let block_scales: Vec<Vec<f32>> = if parallel {
        segments
            .collect::<Vec<_>>()
            .into_par_iter()
            .enumerate()
            .map(quantise)
            .collect()
    } else {
        segments.enumerate().map(quantise).collect()
    };
    for (out, s) in scales
        .chunks_exact_mut(4)
        .zip(block_scales.into_iter().flatten())
    {
        out.copy_from_slice(&s.to_le_bytes());
    }
}

/// A column group of one block row as a [`Kernel`], so it is compiled for the CPU's vector
/// ISA.
struct Group<'a, 'o, E> {
    src: &'a [u8],
    /// Elements from one row's start to the next's in `src`.
    pitch: usize,
    recipe: Fp8Recipe,
    c0: usize,
    width: usize,
    ahead: usize,
    out_rows: Vec<&'o mut [u8]>,
    elem: PhantomData<E>,
}

impl<E: Elem> Group<'_, '_, E> {
    /// Runs the group with the row loops of `ops`.
    #[inline(always)]
    fn with<R: RowOps<E>>(self, ops: R) -> Vec<f32> {
        let Group {
            src,
            pitch,
            recipe,
            c0,
            width,
            ahead,
            out_rows,
            ..
        } = self;
        group::<E, _>(ops, src, pitch, recipe, c0, width, ahead, out_rows)
    }
}

impl<E: Elem> Kernel for Group<'_, '_, E>
where
    Avx512: RowOps<E>,
    Avx2: RowOps<E>,
{
    type Out = Vec<f32>;
    #[inline(always)]
    fn run(self) -> Vec<f32> {
        self.with(Portable)
    }
    #[inline(always)]
    fn run_avx2(self, isa: Avx2) -> Vec<f32> {
        self.with(isa)
    }
    #[inline(always)]
    fn run_avx512(self, isa: Avx512) -> Vec<f32> {
        self.with(isa)
    }
}

/// The two inner loops over one row segment of one column block (at most 128 elements): plain
/// Rust ([`Portable`], vectorised by the compiler for the ISA [`vectorised`] picked) or
/// hand-written AVX-512 ([`avx512`]). Both must give identical bytes.
trait RowOps<E: Elem>: Copy {
    /// A running max of finite-|x| keys, one per column block.
    type Acc: Copy;
    /// The max of nothing (key 0).
    fn acc_new(self) -> Self::Acc;
    /// Folds one row segment into the running max.
    fn acc_row(self, acc: Self::Acc, seg: &[u8]) -> Self::Acc;
    /// The key of the running max.
    fn acc_key(self, acc: Self::Acc) -> E::Key;
    /// Quantises one row segment: `out[i] = e4m3(x[i] * inv)`.
    fn quantise(self, seg: &[u8], inv: f32, out: &mut [u8]);
    /// Hints the cache to fetch the bytes `ahead` bytes past `seg` (the same segment of the
    /// next block row), so that the next amax pass, which otherwise stalls on memory while the
    /// vector units idle, overlaps with this quantise pass. Never reads: a hint only.
    #[inline(always)]
    fn prefetch(self, _seg: &[u8], _ahead: usize) {}
}

/// The plain-Rust row loops.
#[derive(Debug, Clone, Copy)]
struct Portable;

impl<E: Elem> RowOps<E> for Portable {
    type Acc = E::Key;
    #[inline(always)]
    fn acc_new(self) -> E::Key {
        E::Key::default()
    }
    #[inline(always)]
    fn acc_row(self, acc: E::Key, seg: &[u8]) -> E::Key {
        acc.max(row_key_max::<E>(seg))
    }
    #[inline(always)]
    fn acc_key(self, acc: E::Key) -> E::Key {
        acc
    }
    #[inline(always)]
    fn quantise(self, seg: &[u8], inv: f32, out: &mut [u8]) {
        quantise_row::<E>(seg, inv, out)
    }
}

/// Columns `c0 .. c0 + width` (whole column blocks) of every row of `src` (rows `pitch`
/// elements apart): writes `out_rows` (one segment per row) and returns the blocks'
/// `weight_scale_inv`, left to right, each block's two scalars as `recipe` computes them.
///
/// Both passes walk the rows in order, each row across the group's blocks: sequential reads
/// that the prefetcher follows, and the second pass finds the rows still in L2. (Walking one
/// 128x128 block at a time instead strides by a whole row per 256 bytes, and when rows are a
/// multiple of 4 KiB apart every line of the block falls in the same L1 set.)
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn group<E: Elem, R: RowOps<E>>(
    ops: R,
    src: &[u8],
    pitch: usize,
    recipe: Fp8Recipe,
    c0: usize,
    width: usize,
    ahead: usize,
    mut out_rows: Vec<&mut [u8]>,
) -> Vec<f32> {
    let row_in = |r: usize| &src[(r * pitch + c0) * E::SIZE..(r * pitch + c0 + width) * E::SIZE];
    let mut accs = vec![ops.acc_new(); width.div_ceil(FP8_BLOCK)];
    for r in 0..out_rows.len() {
        for (acc, seg) in accs.iter_mut().zip(row_in(r).chunks(FP8_BLOCK * E::SIZE)) {
            *acc = ops.acc_row(*acc, seg);
        }
    }
    let (inv, scales): (Vec<f32>, Vec<f32>) = accs
        .iter()
        .map(|&acc| recipe.block_scale(E::key_to_f32(ops.acc_key(acc))))
        .unzip();
    for (r, out) in out_rows.iter_mut().enumerate() {
        let blocks = row_in(r)
            .chunks(FP8_BLOCK * E::SIZE)
            .zip(out.chunks_mut(FP8_BLOCK));
        for ((seg, o), &inv) in blocks.zip(&inv) {
            if ahead != 0 {
                ops.prefetch(seg, ahead);
            }
            ops.quantise(seg, inv, o);
        }
    }
    scales
}

/// Max of the finite-|x| keys of one row segment.
#[inline(always)]
fn row_key_max<E: Elem>(seg: &[u8]) -> E::Key {
    let mut m = E::Key::default();
    let mut chunks = seg.chunks_exact(LANES * E::SIZE);
    for chunk in &mut chunks {
        m = m.max(E::chunk_key_max(chunk));
    }
    for e in chunks.remainder().chunks_exact(E::SIZE) {
        m = m.max(E::key(e));
    }
    m
}

#[inline(always)]
fn quantise_row<E: Elem>(seg: &[u8], inv: f32, out: &mut [u8]) {
    let mut chunks = seg.chunks_exact(LANES * E::SIZE);
    let mut outs = out.chunks_exact_mut(LANES);
    for (c, o) in (&mut chunks).zip(&mut outs) {
        E::chunk_quantise(c, inv, o);
    }
    for (e, o) in chunks
        .remainder()
        .chunks_exact(E::SIZE)
        .zip(outs.into_remainder())
    {
        *o = f32_to_e4m3_saturating(E::to_f32(e) * inv);
    }
}

#[cfg(test)]
mod tests;
