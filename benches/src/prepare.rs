//! `weightsync bench prepare`: throughput of the preparation kernels beside memcpy, same run.
//!
//! Why: the prepare stage sits between H2D and WRITE in the trainer pipeline; if it is much
//! slower than a copy it becomes the pipeline's bottleneck. On a shared, noisy machine only the
//! ratio to a memcpy of the same bytes measured in the same run means anything, so every kernel
//! is reported as GB/s of *input* bytes and as `ratio_vs_memcpy` (memcpy of the same number of
//! input bytes), single-threaded and over the whole rayon pool. Each figure is the best of
//! `reps` timed runs after one untimed warm-up run (which also faults the output pages in).
//! The memcpy that a kernel's ratio divides by is timed *interleaved* with that kernel (memcpy,
//! kernel, memcpy, kernel, ...; best of each): neighbours' load on a shared machine drifts
//! over the seconds a whole report takes, and one memcpy figure taken at the start would
//! credit or charge that drift to whichever kernel ran at a quiet or busy moment.
//! Single-threaded runs are timed in CPU time of the calling thread (`CLOCK_THREAD_CPUTIME_ID`,
//! which counts memory stalls but not time the scheduler gave to other processes): on a shared
//! machine, wall time of a short run mostly measures the neighbours. All-thread runs are timed
//! in wall time.

use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use weightsync_common::DType;
use weightsync_worker as prepare;
use weightsync_worker::{Fp8Shape, PrepareError, Threads};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Config {
    /// Input size of each kernel, in MiB (bf16 unless the kernel says otherwise).
    pub input_mib: usize,
    /// Timed repetitions per figure (the best is kept).
    pub reps: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            input_mib: 64,
            reps: 5,
        }
    }
}

/// One thread setting of one kernel.
#[derive(Debug, Clone, Serialize)]
pub struct Figure {
    /// GB/s (1e9 bytes) of input bytes.
    pub gbps: f64,
    /// `gbps` divided by the GB/s of a memcpy of as many input bytes at the same thread setting,
    /// timed interleaved with this kernel.
    pub ratio_vs_memcpy: f64,
}

/// One kernel's result.
#[derive(Debug, Clone, Serialize)]
pub struct KernelResult {
    /// Kernel name.
    pub kernel: &'static str,
    /// dtype of the input whose bytes are counted.
    pub input_dtype: &'static str,
    /// What the kernel does.
    pub what: &'static str,
    /// On the calling thread.
    pub single_thread: Figure,
    /// Over the rayon pool.
    pub all_threads: Figure,
}

/// The whole report (the `--json` object).
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Always "prepare".
    pub bench: &'static str,
    /// Input bytes per kernel run.
    pub input_bytes: usize,
    /// Threads in the rayon pool.
    pub threads: usize,
    /// Timed repetitions per figure.
    pub reps: usize,
    /// How each setting is timed.
    pub timing: &'static str,
    /// memcpy first, then every kernel.
    pub kernels: Vec<KernelResult>,
}

impl Report {
    /// Human-readable table.
    pub fn human(&self) -> String {
        let mut s = format!(
            "prepare kernels: {} MiB input each, best of {}, {} threads in the pool\n\
             {:<22} {:>6} {:>10} {:>8} {:>10} {:>8}\n",
            self.input_bytes >> 20,
            self.reps,
            self.threads,
            "kernel",
            "input",
            "1T GB/s",
            "ratio",
            "all GB/s",
            "ratio"
        );
        for k in &self.kernels {
            s += &format!(
                "{:<22} {:>6} {:>10.2} {:>8.2} {:>10.2} {:>8.2}\n",
                k.kernel,
                k.input_dtype,
                k.single_thread.gbps,
                k.single_thread.ratio_vs_memcpy,
                k.all_threads.gbps,
                k.all_threads.ratio_vs_memcpy
            );
        }
        s
    }
}

/// CPU time of the calling thread, in seconds.
fn thread_cpu_secs() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Seconds of one call of `f`: thread CPU time for a single-threaded run, wall time otherwise.
fn time_once(
    threads: Threads,
    f: &mut impl FnMut() -> Result<(), PrepareError>,
) -> Result<f64, PrepareError> {
    Ok(match threads {
        Threads::One => {
            let t = thread_cpu_secs();
            f()?;
            thread_cpu_secs() - t
        }
        Threads::All => {
            let t = Instant::now();
            f()?;
            t.elapsed().as_secs_f64()
        }
    })
}

/// Best-of-`reps` seconds of `base` and of `f`, run alternately after one warm-up call of
/// each, so both see the same machine.
fn best_pair_secs(
    reps: usize,
    threads: Threads,
    mut base: impl FnMut() -> Result<(), PrepareError>,
    mut f: impl FnMut() -> Result<(), PrepareError>,
) -> Result<(f64, f64), PrepareError> {
    base()?;
    f()?;
    let (mut best_base, mut best) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..reps.max(1) {
        let b = time_once(threads, &mut base)?;
        let s = time_once(threads, &mut f)?;
        if b > 0.0 {
            best_base = best_base.min(b);
        }
        if s > 0.0 {
            best = best.min(s);
        }
    }
    Ok((best_base, best))
}

fn memcpy(src: &[u8], dst: &mut [u8], threads: Threads) {
    match threads {
        Threads::One => dst.copy_from_slice(src),
        Threads::All => dst
            .par_chunks_mut(1 << 18)
            .zip(src.par_chunks(1 << 18))
            .for_each(|(d, s)| d.copy_from_slice(s)),
    }
}

/// Deterministic weight-like bf16 values (a cheap LCG; the distribution only matters so that
/// blocks have ordinary, varied magnitudes).
fn weights_bf16(n: usize) -> Vec<u8> {
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let u = ((state >> 40) as f32) / (1u64 << 24) as f32 - 0.5;
        let bits = (u * 0.05).to_bits();
        out.extend_from_slice(&((bits >> 16) as u16).to_le_bytes());
    }
    out
}

/// Times kernels against a memcpy of the same source, alternately, with one thread and with
/// all of them.
struct Bench<'a> {
    src: &'a [u8],
    memcpy_out: Vec<u8>,
    reps: usize,
    kernels: Vec<KernelResult>,
}

impl Bench<'_> {
    /// Measures `f` (which processes `input_bytes`) beside the memcpy baseline.
    fn measure(
        &mut self,
        kernel: &'static str,
        input_dtype: &'static str,
        what: &'static str,
        input_bytes: usize,
        f: &mut dyn FnMut(Threads) -> Result<(), PrepareError>,
    ) -> Result<(), PrepareError> {
        let gbps = |b: usize, s: f64| b as f64 / s / 1e9;
        let mut fig = Vec::new();
        for t in [Threads::One, Threads::All] {
            let (src, out) = (self.src, &mut self.memcpy_out);
            let base = || {
                memcpy(src, out, t);
                Ok(())
            };
            let (base_s, s) = best_pair_secs(self.reps, t, base, || f(t))?;
            let g = gbps(input_bytes, s);
            fig.push(Figure {
                gbps: g,
                ratio_vs_memcpy: g / gbps(self.src.len(), base_s),
            });
        }
        let all_threads = fig.pop().expect("two settings");
        let single_thread = fig.pop().expect("two settings");
        self.kernels.push(KernelResult {
            kernel,
            input_dtype,
            what,
            single_thread,
            all_threads,
        });
        Ok(())
    }
}

/// Runs the benchmark.
pub fn run(cfg: &Config) -> Result<Report, PrepareError> {
    let bytes = (cfg.input_mib.max(1) << 20) & !(256 * 2 - 1);
    let cols = 4096;
    let rows = bytes / 2 / cols;
    let src = weights_bf16(rows * cols);
    let bytes = src.len();
    let mut f32_buf = vec![0u8; rows * cols * 4];
    prepare::cast(&src, DType::BF16, &mut f32_buf, DType::F32, Threads::All)?;
    let mut out16 = vec![0u8; bytes];
    let mut values = vec![0u8; rows * cols];
    let shape = Fp8Shape { rows, cols };
    let mut scales = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
    let mut b = Bench {
        src: &src,
        memcpy_out: vec![0u8; bytes],
        reps: cfg.reps,
        kernels: Vec::new(),
    };
    b.measure(
        "memcpy",
        "bf16",
        "copy_from_slice baseline",
        bytes,
        &mut |t| {
            memcpy(&src, &mut out16, t);
            Ok(())
        },
    )?;
    // The columns cols/4 .. 3cols/4 of the [rows, cols] tensor: one strided run per row.
    let half = &mut out16[..bytes / 2];
    b.measure(
        "gather_dim1_half",
        "bf16",
        "sub-box gather of half the columns (bytes counted: the box)",
        bytes / 2,
        &mut |t| {
            let (start, extent) = ([0, cols / 4], [rows, cols / 2]);
            prepare::gather_box(&src, 2, &[rows, cols], &start, &extent, half, t)
        },
    )?;
    b.measure(
        "cast_bf16_to_f32",
        "bf16",
        "widening cast",
        bytes,
        &mut |t| prepare::cast(&src, DType::BF16, &mut f32_buf, DType::F32, t),
    )?;
    let f32_src = f32_buf.clone();
    b.measure(
        "cast_f32_to_bf16",
        "f32",
        "narrowing cast, round to nearest even (bytes counted: f32 input)",
        f32_src.len(),
        &mut |t| prepare::cast(&f32_src, DType::F32, &mut out16, DType::BF16, t),
    )?;
    b.measure(
        "fp8_block_quant",
        "bf16",
        "e4m3fn 128x128 block quantisation, values + weight_scale_inv",
        bytes,
        &mut |t| prepare::quantise_fp8(&src, DType::BF16, shape, &mut values, &mut scales, t),
    )?;
    Ok(Report {
        bench: "prepare",
        input_bytes: bytes,
        threads: rayon::current_num_threads(),
        reps: cfg.reps,
        timing: "single_thread: thread CPU time; all_threads: wall time",
        kernels: b.kernels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_reports_every_kernel_with_positive_ratios() {
        let report = run(&Config {
            input_mib: 1,
            reps: 1,
        })
        .unwrap();
        let names: Vec<_> = report.kernels.iter().map(|k| k.kernel).collect();
        assert_eq!(
            names,
            [
                "memcpy",
                "gather_dim1_half",
                "cast_bf16_to_f32",
                "cast_f32_to_bf16",
                "fp8_block_quant"
            ]
        );
        for k in &report.kernels {
            assert!(
                k.single_thread.gbps > 0.0 && k.all_threads.ratio_vs_memcpy > 0.0,
                "{k:?}"
            );
        }
        let json = serde_json::to_value(&report).unwrap();
        assert!(json["kernels"][4]["single_thread"]["ratio_vs_memcpy"].is_number());
    }
}
