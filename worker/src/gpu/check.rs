//! Device checks, `#[ignore]`d because they need a GPU (run by `worker/gpu-check.sh`):
//! the CUDA kernels against the CPU kernels, bit for bit, on random data; and the fp8 kernel's
//! throughput against a device-to-device copy of the same input bytes, timed with CUDA events.

use rand::{Rng, SeedableRng};
use weightsync_common::DType;

use super::GpuDevice;
use crate::prepare::{cast, quantise_fp8, Fp8Shape, Threads};

/// Random bit patterns of `dtype` (every class: normals, subnormals, inf, NaN), scaled
/// weight-like values mixed in so blocks have ordinary amax too.
fn random_input(n: usize, dtype: DType, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        let x: f32 = if i % 7 == 0 {
            f32::from_bits(rng.random())
        } else {
            rng.random_range(-1.0f32..1.0) * 0.02
        };
        match dtype {
            DType::BF16 => out.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes()),
            DType::F16 => out.extend_from_slice(&half::f16::from_f32(x).to_le_bytes()),
            _ => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    out
}

#[test]
#[ignore = "requires a CUDA GPU (worker/gpu-check.sh)"]
fn cuda_kernels_are_bit_exact_with_cpu() {
    let dev = GpuDevice::open(0).expect("a CUDA device");
    for (i, dtype) in [DType::BF16, DType::F16, DType::F32]
        .into_iter()
        .enumerate()
    {
        let shape = Fp8Shape {
            rows: 1000,
            cols: 1300,
        };
        let input = random_input(shape.rows * shape.cols, dtype, 11 + i as u64);
        let mut want_v = vec![0u8; shape.rows * shape.cols];
        let mut want_s = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
        quantise_fp8(&input, dtype, shape, &mut want_v, &mut want_s, Threads::All).unwrap();
        let src = dev.upload(&input).unwrap();
        let mut values = dev.alloc(want_v.len()).unwrap();
        let mut scales = dev.alloc(want_s.len()).unwrap();
        dev.quantise_fp8(&src, dtype, shape, &mut values, &mut scales)
            .unwrap();
        let got_s = dev.download(&scales).unwrap();
        let got_v = dev.download(&values).unwrap();
        assert_eq!(got_s, want_s, "{dtype}: scales differ");
        let diff = got_v.iter().zip(&want_v).filter(|(a, b)| a != b).count();
        assert_eq!(diff, 0, "{dtype}: {diff} fp8 values differ");
        for to in [DType::BF16, DType::F16, DType::F32] {
            let n = shape.rows * shape.cols;
            let mut want = vec![0u8; n * to.size()];
            cast(&input, dtype, &mut want, to, Threads::All).unwrap();
            let mut dst = dev.alloc(want.len()).unwrap();
            dev.cast(&src, dtype, &mut dst, to).unwrap();
            assert!(
                dev.download(&dst).unwrap() == want,
                "cast {dtype}->{to} differs"
            );
        }
        println!("gpu-check: {dtype}: fp8 values, scales and casts bit-exact with the CPU kernels");
    }
}

#[test]
#[ignore = "requires a CUDA GPU (worker/gpu-check.sh)"]
fn cuda_fp8_throughput_vs_device_copy() {
    let dev = GpuDevice::open(0).expect("a CUDA device");
    let shape = Fp8Shape {
        rows: 8192,
        cols: 16384,
    }; // 256 MiB of bf16
    let input = random_input(shape.rows * shape.cols, DType::BF16, 5);
    let src = dev.upload(&input).unwrap();
    let mut copy = dev.alloc(input.len()).unwrap();
    let mut values = dev.alloc(shape.rows * shape.cols).unwrap();
    let mut scales = dev
        .alloc(shape.row_blocks() * shape.col_blocks() * 4)
        .unwrap();
    let stream = dev.stream().clone();
    let time = |f: &mut dyn FnMut()| -> f64 {
        f();
        dev.synchronize().unwrap();
        let mut best = f64::INFINITY;
        for _ in 0..10 {
            let start = stream.record_event(None).unwrap();
            f();
            let end = stream.record_event(None).unwrap();
            best = best.min(start.elapsed_ms(&end).unwrap() as f64 / 1e3);
        }
        best
    };
    let t_copy = time(&mut || stream.memcpy_dtod(&src, &mut copy).unwrap());
    let t_quant = time(&mut || {
        dev.quantise_fp8(&src, DType::BF16, shape, &mut values, &mut scales)
            .unwrap()
    });
    let t_cast = {
        let mut f32_out = dev.alloc(input.len() * 2).unwrap();
        time(&mut || {
            dev.cast(&src, DType::BF16, &mut f32_out, DType::F32)
                .unwrap()
        })
    };
    let gb = input.len() as f64 / 1e9;
    println!(
        "gpu-check: d2d copy {:.1} GB/s, fp8 block quant {:.1} GB/s (ratio_vs_d2d {:.2}, target 0.7), \
         cast bf16->f32 {:.1} GB/s (ratio {:.2})",
        gb / t_copy,
        gb / t_quant,
        t_copy / t_quant,
        gb / t_cast,
        t_copy / t_cast
    );
}
