//! dtype casts between bf16, fp16 and fp32 over byte slices.
//!
//! Each (from, to) pair is its own monomorphised loop over fixed-size chunks so the compiler
//! vectorises the branch-free conversions of [`super::convert`]. Same-dtype "casts" are copies.

use rayon::prelude::*;
use weightsync_common::DType;

use super::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use super::isa::{Kernel, vectorised};
use super::{PrepareError, Threads, expect_len, pitched_span};

/// Elements per rayon task: large enough to amortise scheduling, small enough to balance.
const PAR_CHUNK_ELEMS: usize = 1 << 16;

/// Casts `src` (elements of `from`) into `dst` (elements of `to`), element for element.
///
/// Supports every pair among bf16, fp16 and fp32 (fp8 output goes through
/// [`super::quantise_fp8`], which needs block scales). `dst` must hold exactly as many
/// elements as `src`.
pub fn cast(
    src: &[u8],
    from: DType,
    dst: &mut [u8],
    to: DType,
    threads: Threads,
) -> Result<(), PrepareError> {
    check_dtypes(from, to)?;
    if !src.len().is_multiple_of(from.size()) {
        return Err(PrepareError::Shape(format!(
            "source of {} bytes is not a whole number of {from} elements",
            src.len()
        )));
    }
    let n = src.len() / from.size();
    expect_len("cast output", n * to.size(), dst.len())?;
    dispatch(src, from, dst, to, Runs::dense(n), threads);
    Ok(())
}

/// [`cast`] of runs that lie apart: `dst` receives, dense, runs of `run` elements of which the
/// k-th starts at element `k * pitch` of `src` (a column slice of a matrix, read where it lies
/// rather than gathered into staging first). `src` spans exactly from the first run's start
/// to the last one's end, `(runs - 1) * pitch + run` elements, with `runs = dst elements / run`.
pub fn cast_pitched(
    src: &[u8],
    from: DType,
    run: usize,
    pitch: usize,
    dst: &mut [u8],
    to: DType,
    threads: Threads,
) -> Result<(), PrepareError> {
    check_dtypes(from, to)?;
    if run == 0 || pitch < run {
        return Err(PrepareError::Shape(format!(
            "runs of {run} elements {pitch} apart: a run must be non-empty and no longer than \
             its pitch"
        )));
    }
    if !dst.len().is_multiple_of(run * to.size()) {
        return Err(PrepareError::Shape(format!(
            "cast output of {} bytes is not a whole number of runs of {run} {to} elements",
            dst.len()
        )));
    }
    let runs = dst.len() / (run * to.size());
    let span = pitched_span(runs, run, pitch);
    expect_len("pitched cast input", span * from.size(), src.len())?;
    dispatch(src, from, dst, to, Runs { run, pitch, runs }, threads);
    Ok(())
}

fn check_dtypes(from: DType, to: DType) -> Result<(), PrepareError> {
    let supported = |d: DType| matches!(d, DType::BF16 | DType::F16 | DType::F32);
    if supported(from) && supported(to) {
        Ok(())
    } else {
        Err(PrepareError::UnsupportedDType { from, to })
    }
}

/// Where a cast's elements lie in its source: `runs` runs of `run` elements, `pitch` apart
/// (dense: one run, or `pitch == run`).
#[derive(Debug, Clone, Copy)]
struct Runs {
    run: usize,
    pitch: usize,
    runs: usize,
}

impl Runs {
    fn dense(n: usize) -> Runs {
        Runs {
            run: n,
            pitch: n,
            runs: 1,
        }
    }
}

/// The monomorphised kernel of `(from, to)`, run over `runs` (the dtypes are checked).
fn dispatch(src: &[u8], from: DType, dst: &mut [u8], to: DType, runs: Runs, threads: Threads) {
    match (from, to) {
        (a, b) if a == b => run(src, dst, from, to, runs, threads, Copy),
        (DType::BF16, DType::F32) => run(src, dst, from, to, runs, threads, |s, d| {
            Widen(s, d, bf16_to_f32)
        }),
        (DType::F16, DType::F32) => run(src, dst, from, to, runs, threads, |s, d| {
            Widen(s, d, f16_to_f32)
        }),
        (DType::F32, DType::BF16) => run(src, dst, from, to, runs, threads, |s, d| {
            Narrow(s, d, f32_to_bf16)
        }),
        (DType::F32, DType::F16) => run(src, dst, from, to, runs, threads, |s, d| {
            Narrow(s, d, f32_to_f16)
        }),
        (DType::BF16, DType::F16) => run(src, dst, from, to, runs, threads, |s, d| {
            Half(s, d, bf16_to_f16)
        }),
        (DType::F16, DType::BF16) => run(src, dst, from, to, runs, threads, |s, d| {
            Half(s, d, f16_to_bf16)
        }),
        _ => unreachable!("dtypes checked before dispatch"),
    }
}

#[inline(always)]
fn bf16_to_f16(h: u16) -> u16 {
    f32_to_f16(bf16_to_f32(h))
}

#[inline(always)]
fn f16_to_bf16(h: u16) -> u16 {
    f32_to_bf16(f16_to_f32(h))
}

/// Splits the work (or not) and runs the kernel `job` builds for each piece, vectorised: dense
/// in chunks of [`PAR_CHUNK_ELEMS`], pitched runs a run at a time, in groups of about as many
/// elements per rayon task.
#[inline(always)]
fn run<'a, K: Kernel<Out = ()>>(
    src: &'a [u8],
    dst: &'a mut [u8],
    from: DType,
    to: DType,
    runs: Runs,
    threads: Threads,
    job: impl Fn(&'a [u8], &'a mut [u8]) -> K + Sync,
) {
    if runs.pitch == runs.run || runs.runs <= 1 {
        let n = dst.len() / to.size();
        let src = &src[..n * from.size()];
        return match threads {
            Threads::One => vectorised(job(src, dst)),
            Threads::All => src
                .par_chunks(PAR_CHUNK_ELEMS * from.size())
                .zip(dst.par_chunks_mut(PAR_CHUNK_ELEMS * to.size()))
                .for_each(|(s, d)| vectorised(job(s, d))),
        };
    }
    let (run_in, pitch_in) = (runs.run * from.size(), runs.pitch * from.size());
    let run_out = runs.run * to.size();
    // Runs `first..` of `src` into `d`, dense.
    let group = |first: usize, mut d: &'a mut [u8]| {
        let mut k = first;
        while !d.is_empty() {
            let (out, rest) = std::mem::take(&mut d).split_at_mut(run_out);
            let at = k * pitch_in;
            vectorised(job(&src[at..at + run_in], out));
            d = rest;
            k += 1;
        }
    };
    match threads {
        Threads::One => group(0, dst),
        Threads::All => {
            let per_task = (PAR_CHUNK_ELEMS / runs.run).max(1);
            dst.par_chunks_mut(per_task * run_out)
                .enumerate()
                .for_each(|(i, d)| group(i * per_task, d));
        }
    }
}

struct Copy<'a>(&'a [u8], &'a mut [u8]);
struct Widen<'a, F>(&'a [u8], &'a mut [u8], F);
struct Narrow<'a, F>(&'a [u8], &'a mut [u8], F);
struct Half<'a, F>(&'a [u8], &'a mut [u8], F);

impl Kernel for Copy<'_> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        self.1.copy_from_slice(self.0)
    }
}

impl<F: Fn(u16) -> f32> Kernel for Widen<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        widen(self.0, self.1, self.2)
    }
}

impl<F: Fn(f32) -> u16> Kernel for Narrow<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        narrow(self.0, self.1, self.2)
    }
}

impl<F: Fn(u16) -> u16> Kernel for Half<'_, F> {
    type Out = ();
    #[inline(always)]
    fn run(self) {
        half_to_half(self.0, self.1, self.2)
    }
}

/// Elements per inner chunk: a fixed trip count lets LLVM drop bounds checks and vectorise.
const LANES: usize = 64;

#[inline(always)]
fn widen(src: &[u8], dst: &mut [u8], f: impl Fn(u16) -> f32) {
    let mut s_chunks = src.chunks_exact(2 * LANES);
    let mut d_chunks = dst.chunks_exact_mut(4 * LANES);
    for (s, d) in (&mut s_chunks).zip(&mut d_chunks) {
        let s: &[u8; 2 * LANES] = s.try_into().expect("exact chunk");
        let d: &mut [u8; 4 * LANES] = d.try_into().expect("exact chunk");
        for i in 0..LANES {
            let x = f(u16::from_le_bytes([s[2 * i], s[2 * i + 1]]));
            d[4 * i..4 * i + 4].copy_from_slice(&x.to_le_bytes());
        }
    }
    for (s, d) in s_chunks
        .remainder()
        .chunks_exact(2)
        .zip(d_chunks.into_remainder().chunks_exact_mut(4))
    {
        d.copy_from_slice(&f(u16::from_le_bytes([s[0], s[1]])).to_le_bytes());
    }
}

#[inline(always)]
fn narrow(src: &[u8], dst: &mut [u8], f: impl Fn(f32) -> u16) {
    let mut s_chunks = src.chunks_exact(4 * LANES);
    let mut d_chunks = dst.chunks_exact_mut(2 * LANES);
    for (s, d) in (&mut s_chunks).zip(&mut d_chunks) {
        let s: &[u8; 4 * LANES] = s.try_into().expect("exact chunk");
        let d: &mut [u8; 2 * LANES] = d.try_into().expect("exact chunk");
        for i in 0..LANES {
            let x = f32::from_le_bytes([s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]]);
            d[2 * i..2 * i + 2].copy_from_slice(&f(x).to_le_bytes());
        }
    }
    for (s, d) in s_chunks
        .remainder()
        .chunks_exact(4)
        .zip(d_chunks.into_remainder().chunks_exact_mut(2))
    {
        d.copy_from_slice(&f(f32::from_le_bytes([s[0], s[1], s[2], s[3]])).to_le_bytes());
    }
}

#[inline(always)]
fn half_to_half(src: &[u8], dst: &mut [u8], f: impl Fn(u16) -> u16) {
    let mut s_chunks = src.chunks_exact(2 * LANES);
    let mut d_chunks = dst.chunks_exact_mut(2 * LANES);
    for (s, d) in (&mut s_chunks).zip(&mut d_chunks) {
        let s: &[u8; 2 * LANES] = s.try_into().expect("exact chunk");
        let d: &mut [u8; 2 * LANES] = d.try_into().expect("exact chunk");
        for i in 0..LANES {
            let h = f(u16::from_le_bytes([s[2 * i], s[2 * i + 1]]));
            d[2 * i..2 * i + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    for (s, d) in s_chunks
        .remainder()
        .chunks_exact(2)
        .zip(d_chunks.into_remainder().chunks_exact_mut(2))
    {
        d.copy_from_slice(&f(u16::from_le_bytes([s[0], s[1]])).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};
    use rand::{Rng, SeedableRng};

    fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n).map(|_| rng.random()).collect()
    }

    #[test]
    fn every_pair_matches_half_single_and_all_threads() {
        let dtypes = [DType::BF16, DType::F16, DType::F32];
        let n = 3 * PAR_CHUNK_ELEMS + 17; // several rayon chunks plus a ragged tail
        for from in dtypes {
            let src = random_bytes(n * from.size(), from.size() as u64);
            let as_f32: Vec<f32> = src
                .chunks_exact(from.size())
                .map(|c| match from {
                    DType::BF16 => bf16::from_le_bytes([c[0], c[1]]).to_f32(),
                    DType::F16 => f16::from_le_bytes([c[0], c[1]]).to_f32(),
                    _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                })
                .collect();
            for to in dtypes {
                let want: Vec<u8> = if from == to {
                    src.clone()
                } else {
                    as_f32
                        .iter()
                        .flat_map(|&x| match to {
                            DType::BF16 => bf16::from_f32(x).to_le_bytes().to_vec(),
                            DType::F16 => f16::from_f32(x).to_le_bytes().to_vec(),
                            _ => x.to_le_bytes().to_vec(),
                        })
                        .collect()
                };
                for threads in [Threads::One, Threads::All] {
                    let mut dst = vec![0u8; n * to.size()];
                    cast(&src, from, &mut dst, to, threads).unwrap();
                    // Compare bit patterns element by element for a readable failure.
                    if let Some(i) = (0..n).find(|&i| {
                        dst[i * to.size()..(i + 1) * to.size()]
                            != want[i * to.size()..(i + 1) * to.size()]
                    }) {
                        panic!("{from}->{to} {threads:?}: element {i} differs");
                    }
                }
            }
        }
    }

    #[test]
    fn refuses_bad_lengths_and_fp8_without_writing() {
        let src = vec![0u8; 10];
        let mut dst = vec![0xAAu8; 8];
        let err = cast(&src, DType::BF16, &mut dst, DType::F32, Threads::One).unwrap_err();
        assert_eq!(
            err,
            PrepareError::Length {
                what: "cast output",
                expected: 20,
                actual: 8
            }
        );
        assert!(dst.iter().all(|&b| b == 0xAA));
        let err = cast(&src[..9], DType::BF16, &mut dst, DType::F32, Threads::One).unwrap_err();
        assert!(matches!(err, PrepareError::Shape(_)), "{err}");
        let err = cast(&src, DType::BF16, &mut dst, DType::F8E4M3, Threads::One).unwrap_err();
        assert!(err.to_string().contains("f8_e4m3"), "{err}");
    }

    #[test]
    fn pitched_runs_cast_as_their_gathered_elements_do() {
        let dtypes = [DType::BF16, DType::F16, DType::F32];
        // (run, pitch, runs): short runs; runs longer than a rayon task; a run at its pitch.
        let layouts = [
            (3, 7, 40),
            (64, 100, 9),
            (PAR_CHUNK_ELEMS + 5, PAR_CHUNK_ELEMS + 9, 3),
        ];
        for from in dtypes {
            for to in dtypes {
                for (run, pitch, runs) in layouts.into_iter().chain([(8, 8, 5)]) {
                    let span = (runs - 1) * pitch + run;
                    let src = random_bytes(span * from.size(), (run + pitch) as u64);
                    let mut gathered = Vec::new();
                    for k in 0..runs {
                        let at = k * pitch * from.size();
                        gathered.extend_from_slice(&src[at..at + run * from.size()]);
                    }
                    let mut want = vec![0u8; runs * run * to.size()];
                    cast(&gathered, from, &mut want, to, Threads::One).unwrap();
                    for threads in [Threads::One, Threads::All] {
                        let mut dst = vec![0xAAu8; want.len()];
                        cast_pitched(&src, from, run, pitch, &mut dst, to, threads).unwrap();
                        assert!(
                            dst == want,
                            "{from}->{to} {threads:?}, runs of {run} at {pitch}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn pitched_casts_refuse_a_bad_layout_without_writing() {
        let src = vec![0u8; 2 * (7 + 3)]; // two bf16 runs of 3, 7 apart
        let mut dst = vec![0xAAu8; 4 * 6];
        let f = |src: &[u8], run, pitch, dst: &mut [u8]| {
            cast_pitched(src, DType::BF16, run, pitch, dst, DType::F32, Threads::One)
                .unwrap_err()
                .to_string()
        };
        assert!(f(&src, 3, 2, &mut dst).contains("no longer than its pitch"));
        assert!(f(&src, 0, 2, &mut dst).contains("non-empty"));
        assert!(f(&src, 4, 7, &mut dst).contains("whole number of runs of 4"));
        let short = f(&src[..18], 3, 7, &mut dst);
        assert!(short.contains("pitched cast input"), "{short}");
        assert!(dst.iter().all(|&b| b == 0xAA));
        cast_pitched(&src, DType::BF16, 3, 7, &mut dst, DType::F32, Threads::One).unwrap();
        assert!(dst.iter().all(|&b| b == 0));
    }
}
