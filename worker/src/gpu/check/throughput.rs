//! The fp8 kernel's throughput against a device-to-device copy of the same input bytes.
//!
//! Method (the device README's METHOD.md): 1 GiB of input, many times the 60 MB L2; CUDA events
//! created with timing enabled around `REPS` back-to-back launches (so host enqueue time between
//! launches does not land in the interval), the median of `RUNS` such intervals, the operations
//! alternating run by run so clock drift hits all alike. Reported per operation: bytes moved
//! (reads plus writes), TB/s, `ratio_vs_d2d` = t_copy / t_op (the target: >= 0.7 for the
//! bf16 fp8 kernel), and `fraction_of_copy_bandwidth` = (bytes_op / t_op) / (bytes_copy / t_copy).
//! At equal bandwidth fp8 from bf16 would reach a ratio of 4/3 (3 bytes moved per element
//! against the copy's 4).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg, sys};
use cudarc::nvrtc::Ptx;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;
use serde_json::json;
use weightsync_common::DType;

use super::{device, emit};
use crate::gpu::kernels::build_options;
use crate::gpu::nvrtc::{Nvrtc, choose_target};
use crate::gpu::{E4m3Conversion, GpuDevice};
use crate::prepare::{Fp8Shape, Threads, cast, quantise_fp8};

/// A timed operation: its name and one launch of it.
type Op<'a> = (&'static str, Box<dyn FnMut() + 'a>);

const REPS: usize = 10;
const RUNS: usize = 9;
const TARGET_RATIO_VS_D2D: f64 = 0.7;

/// Weight-like values with one element in 4096 of random bits (specials included), generated in
/// parallel: never zeros, which would time faster than real data.
fn weights(n: usize, dtype: DType, seed: u64) -> Vec<u8> {
    let size = dtype.size();
    let mut out = vec![0u8; n * size];
    out.par_chunks_mut(1 << 20).enumerate().for_each(|(i, c)| {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37));
        for e in c.chunks_mut(size) {
            let x = rng.random_range(-1.0f32..1.0) * 0.02;
            let special = rng.random_range(0..4096) == 0;
            match dtype {
                DType::BF16 => {
                    let b = if special {
                        rng.random()
                    } else {
                        half::bf16::from_f32(x).to_bits()
                    };
                    e.copy_from_slice(&b.to_le_bytes())
                }
                DType::F16 => {
                    let b = if special {
                        rng.random()
                    } else {
                        half::f16::from_f32(x).to_bits()
                    };
                    e.copy_from_slice(&b.to_le_bytes())
                }
                _ => {
                    let b = if special { rng.random() } else { x.to_bits() };
                    e.copy_from_slice(&b.to_le_bytes())
                }
            }
        }
    });
    out
}

/// Seconds per operation of each op: the median over `RUNS` runs of `REPS` back-to-back
/// launches between two timing events, the ops taking turns run by run.
fn time_alternating(dev: &GpuDevice, ops: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    let stream = dev.stream().clone();
    for op in ops.iter_mut() {
        op();
        op();
    }
    dev.synchronize().unwrap();
    let mut samples = vec![Vec::with_capacity(RUNS); ops.len()];
    for _ in 0..RUNS {
        for (i, op) in ops.iter_mut().enumerate() {
            let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
            let start = stream.record_event(flags).unwrap();
            for _ in 0..REPS {
                op();
            }
            let end = stream.record_event(flags).unwrap();
            let ms = start.elapsed_ms(&end).unwrap() as f64;
            samples[i].push(ms / 1e3 / REPS as f64);
        }
    }
    dev.synchronize().unwrap();
    samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect()
}

/// The pre-issue-15 kernel (two passes, 2-byte loads), compiled for this device.
fn two_pass_reference(dev: &GpuDevice) -> CudaFunction {
    let driver_major = Some(dev.info().driver_version / 1000);
    let nvrtc = Nvrtc::global(driver_major).unwrap();
    let target = choose_target(dev.info().arch, nvrtc.supported_archs()).unwrap();
    let img = nvrtc
        .compile(
            include_str!("two_pass.cu"),
            "two_pass.cu",
            target,
            &build_options(),
        )
        .unwrap();
    let module = dev
        .context()
        .load_module(Ptx::from_binary(img.image))
        .unwrap();
    module.load_function("ws_fp8_block_quant").unwrap()
}

fn record(name: &str, moved: usize, t: f64, t_copy: f64, copy_moved: usize) -> serde_json::Value {
    json!({
        "op": name, "seconds": t, "bytes_moved": moved, "tb_per_s": moved as f64 / t / 1e12,
        "ratio_vs_d2d": t_copy / t,
        "fraction_of_copy_bandwidth": (moved as f64 / t) / (copy_moved as f64 / t_copy),
    })
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn fp8_throughput_against_a_device_copy() {
    let dev = device();
    let reference = two_pass_reference(&dev);
    let production = dev.fp8_conversion().unwrap();
    let mut failures = Vec::new();
    for (seed, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let input_bytes = 1usize << 30;
        let cols = 32768 / dtype.size() * 2; // 1 GiB as [rows, cols], cols a multiple of 128
        let rows = input_bytes / dtype.size() / cols;
        let shape = Fp8Shape { rows, cols };
        let n = rows * cols;
        let tiles = shape.row_blocks() * shape.col_blocks();
        let input = weights(n, dtype, 5 + seed as u64);
        let src = dev.upload(&input).unwrap();
        let mut copy: CudaSlice<u8> = dev.alloc(input.len()).unwrap();
        let mut values = dev.alloc(n).unwrap();
        let mut scales = dev.alloc(tiles * 4).unwrap();
        let mut ref_values = dev.alloc(n).unwrap();
        let mut ref_scales = dev.alloc(tiles * 4).unwrap();
        let stream = dev.stream().clone();

        // The production kernel is also checked bit for bit at this size.
        dev.quantise_fp8(&src, dtype, shape, &mut values, &mut scales)
            .unwrap();
        let mut want_v = vec![0u8; n];
        let mut want_s = vec![0u8; tiles * 4];
        quantise_fp8(&input, dtype, shape, &mut want_v, &mut want_s, Threads::All).unwrap();
        let exact =
            dev.download(&values).unwrap() == want_v && dev.download(&scales).unwrap() == want_s;
        drop((want_v, want_s));

        let mut emulated_values = dev.alloc(n).unwrap();
        let mut emulated_scales = dev.alloc(tiles * 4).unwrap();
        let mut cast_out = if dtype == DType::BF16 {
            Some(dev.alloc(n * 4).unwrap())
        } else {
            None
        };
        let mut ops: Vec<Op<'_>> = Vec::new();
        let copy_ref = &mut copy;
        let s1 = stream.clone();
        let src_ref = &src;
        ops.push((
            "d2d_copy",
            Box::new(move || s1.memcpy_dtod(src_ref, copy_ref).unwrap()),
        ));
        let dev_ref = &dev;
        let (v1, c1) = (&mut values, &mut scales);
        ops.push((
            "fp8",
            Box::new(move || {
                dev_ref
                    .quantise_fp8_with(src_ref, dtype, shape, v1, c1, production)
                    .unwrap()
            }),
        ));
        if production == E4m3Conversion::Hardware {
            let (v2, c2) = (&mut emulated_values, &mut emulated_scales);
            ops.push((
                "fp8_emulated_conversion",
                Box::new(move || {
                    dev_ref
                        .quantise_fp8_with(src_ref, dtype, shape, v2, c2, E4m3Conversion::Emulated)
                        .unwrap()
                }),
            ));
        }
        let (rv, rs, s3, f) = (&mut ref_values, &mut ref_scales, stream.clone(), &reference);
        let code: i32 = match dtype {
            DType::BF16 => 0,
            DType::F16 => 1,
            _ => 2,
        };
        ops.push((
            "fp8_two_pass_reference",
            Box::new(move || {
                let cfg = LaunchConfig {
                    grid_dim: (shape.col_blocks() as u32, shape.row_blocks() as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                let (r, c) = (rows as u32, cols as u32);
                let mut l = s3.launch_builder(f);
                l.arg(src_ref)
                    .arg(&mut *rv)
                    .arg(&mut *rs)
                    .arg(&r)
                    .arg(&c)
                    .arg(&code);
                // SAFETY: the arguments match `ws_fp8_block_quant(const u8*, u8*, float*, u32,
                // u32, int)`; the buffers hold rows x cols elements and the scale grid; the grid
                // is the block grid (row_blocks <= 65535 here).
                unsafe { l.launch(cfg) }.unwrap();
            }),
        ));
        if let Some(out) = cast_out.as_mut() {
            ops.push((
                "cast_bf16_to_f32",
                Box::new(move || dev_ref.cast(src_ref, DType::BF16, out, DType::F32).unwrap()),
            ));
        }
        let names: Vec<&str> = ops.iter().map(|(n, _)| *n).collect();
        let mut fns: Vec<&mut dyn FnMut()> = ops.iter_mut().map(|(_, f)| f.as_mut() as _).collect();
        let times = time_alternating(&dev, &mut fns);
        drop(fns);
        drop(ops);

        let fp8_moved = input.len() + n + tiles * 4;
        let copy_moved = 2 * input.len();
        let t_copy = times[0];
        let mut results = Vec::new();
        for (name, t) in names.iter().zip(&times) {
            let moved = match *name {
                "d2d_copy" => copy_moved,
                "cast_bf16_to_f32" => input.len() + n * 4,
                _ => fp8_moved,
            };
            results.push(record(name, moved, *t, t_copy, copy_moved));
        }
        let ratio = t_copy / times[1];
        let cast_exact = cast_out.as_ref().map(|out| {
            let mut want = vec![0u8; n * 4];
            cast(&input, DType::BF16, &mut want, DType::F32, Threads::All).unwrap();
            dev.download(out).unwrap() == want
        });
        let pass = exact
            && cast_exact != Some(false)
            && (dtype != DType::BF16 || ratio >= TARGET_RATIO_VS_D2D);
        emit(json!({
            "check": "fp8_throughput", "dtype": dtype.to_string(), "shape": [rows, cols],
            "input_bytes": input.len(), "conversion": production, "reps": REPS, "runs": RUNS,
            "bit_exact_with_cpu": exact, "cast_bit_exact_with_cpu": cast_exact,
            "ratio_vs_d2d": ratio,
            "target_ratio_vs_d2d": if dtype == DType::BF16 { Some(TARGET_RATIO_VS_D2D) } else { None },
            "pass": pass, "ops": results,
        }));
        if !pass {
            failures.push(format!(
                "{dtype}: exact {exact}, cast exact {cast_exact:?}, ratio {ratio:.3}"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:?}");
}

#[test]
fn weights_are_never_all_zero_and_hold_specials() {
    // Runs without a GPU.
    let w = weights(1 << 16, DType::BF16, 1);
    let bits: Vec<u16> = w
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert!(bits.iter().filter(|&&b| b & 0x7fff == 0).count() < bits.len() / 100);
    // About one element in 4096 has random bits: half of those lie outside the weights' range.
    assert!(
        bits.iter().any(|&b| b & 0x7fff > 0x3f80),
        "values beyond the weights' range"
    );
}
