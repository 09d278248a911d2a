//! Device checks, `#[ignore]`d because they need a CUDA GPU; `worker/gpu-check.sh` runs them
//! (with `--include-ignored`) on a GPU machine from a test binary built elsewhere.
//!
//! Each check collects everything before it asserts, so one bad case does not hide the others,
//! and prints one `gpu-check-json: {...}` line per case, which the script gathers into
//! `$OUT/gpu-check.jsonl`.
//!
//! - [`exact`]: the fp8 kernel and every cast, bit for bit against the CPU kernels, on random
//!   data (normals, subnormals, inf, NaN of both signs), every 16-bit pattern, awkward shapes,
//!   and views whose alignment forces the scalar path; the e4m3 self-test.
//! - [`throughput`]: the fp8 kernel against a device-to-device copy of the same input bytes
//!   (`ratio_vs_d2d`, target 0.7), timed with CUDA events over back-to-back launches.
//! - [`memory`]: pinned staging round trips, source copies (owned, borrowed), and an IPC
//!   mapping of another process's memory.
//! - [`sync`]: whole syncs from a source in device memory through the pipeline over TCP
//!   loopback, every byte verified (`device_sync`), and the pipeline's overlap speedup with real
//!   DMA, kernel and network stages (`device_overlap`).
//! - [`engine`]: an engine's CUDA tensors registered through the placement path (host staging
//!   copied to the device), three versions landed and copied back (`engine_device_destination`).
//! - [`host`] (no GPU; needs a C++20 compiler): `kernels.cu` run on the CPU under an emulation of
//!   the CUDA built-ins, against the CPU kernels.

mod engine;
mod exact;
mod host;
mod memory;
mod sync;
mod throughput;

use rand::{Rng, SeedableRng};
use weightsync_common::DType;

use super::GpuDevice;

/// Prints one machine-readable record (the script collects these lines).
fn emit(record: serde_json::Value) {
    println!("gpu-check-json: {record}");
}

/// GPU 0, or a panic that says why (these tests run only where a GPU is expected).
fn device() -> GpuDevice {
    GpuDevice::open(0).unwrap_or_else(|e| panic!("the device checks need a CUDA GPU: {e}"))
}

/// Hex of an element's bits.
fn hex(bytes: &[u8]) -> String {
    let mut v = 0u64;
    for (i, b) in bytes.iter().enumerate() {
        v |= (*b as u64) << (8 * i);
    }
    format!("{v:#0w$x}", w = 2 + 2 * bytes.len())
}

/// Special values of a dtype, as bits: ±inf, quiet and signalling NaNs of both signs with
/// payloads, ±0, the smallest subnormals, the largest finite values.
fn specials(dtype: DType) -> Vec<u32> {
    match dtype {
        DType::BF16 => vec![
            0x7f80, 0xff80, 0x7fc0, 0xffc1, 0x7f81, 0xff81, 0x0000, 0x8000, 0x0001, 0x8001, 0x7f7f,
            0xff7f,
        ],
        DType::F16 => vec![
            0x7c00, 0xfc00, 0x7e00, 0xfe01, 0x7c01, 0xfc01, 0x0000, 0x8000, 0x0001, 0x8001, 0x7bff,
            0xfbff,
        ],
        _ => vec![
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc1_0000,
            0x7f80_0001,
            0xff80_0001,
            0x0000_0000,
            0x8000_0000,
            0x0000_0001,
            0x8000_0001,
            0x7f7f_ffff,
            0xff7f_ffff,
        ],
    }
}

/// `n` random elements of `dtype` covering every class: rows of ordinary weights, of tiny values
/// (amax under the 1e-4 floor), of values that are subnormal in the dtype, of large values, of
/// zeros; one element in 8 with uniformly random bits and one in 32 from [`specials`].
fn random_input(n: usize, cols: usize, dtype: DType, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n * dtype.size());
    let mut scale = 0.02f32;
    for i in 0..n {
        if i % cols.max(1) == 0 {
            scale = match rng.random_range(0..6) {
                0 => 1e-6,
                1 => match dtype {
                    DType::F16 => 3e-6, // below f16's smallest normal, 6.1e-5
                    _ => 1e-39,         // below f32's (and bf16's) smallest normal
                },
                2 => 3e3,
                3 => 0.0,
                _ => 0.02,
            };
        }
        let random_bits = rng.random_range(0..8) == 0;
        let x: f32 = rng.random_range(-1.0f32..1.0) * scale;
        if rng.random_range(0..32) == 0 {
            let sp = specials(dtype);
            let b = sp[rng.random_range(0..sp.len())];
            out.extend_from_slice(&b.to_le_bytes()[..dtype.size()]);
            continue;
        }
        match dtype {
            DType::BF16 => {
                let b = if random_bits {
                    rng.random()
                } else {
                    half::bf16::from_f32(x).to_bits()
                };
                out.extend_from_slice(&b.to_le_bytes())
            }
            DType::F16 => {
                let b = if random_bits {
                    rng.random()
                } else {
                    half::f16::from_f32(x).to_bits()
                };
                out.extend_from_slice(&b.to_le_bytes())
            }
            _ => {
                let b = if random_bits {
                    rng.random()
                } else {
                    x.to_bits()
                };
                out.extend_from_slice(&b.to_le_bytes())
            }
        }
    }
    out
}

/// Every bit pattern of a 16-bit dtype, little-endian, in order.
fn every_16_bit_pattern() -> Vec<u8> {
    (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect()
}

#[test]
fn helpers_cover_every_class_of_input() {
    // Runs without a GPU: the inputs the device checks use hold what they claim to.
    let input = random_input(64 * 256, 256, DType::BF16, 3);
    let bits: Vec<u16> = input
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    let nan = |b: u16| b & 0x7fff > 0x7f80;
    assert!(
        bits.iter().any(|&b| nan(b) && b & 0x8000 != 0),
        "negative NaN"
    );
    assert!(
        bits.iter().any(|&b| nan(b) && b & 0x8000 == 0),
        "positive NaN"
    );
    assert!(bits.iter().any(|&b| b & 0x7fff == 0x7f80), "inf");
    assert!(
        bits.iter().any(|&b| b & 0x7f80 == 0 && b & 0x7f != 0),
        "subnormal"
    );
    assert_eq!(every_16_bit_pattern().len(), 1 << 17);
    assert_eq!(hex(&[0x80, 0xff]), "0xff80");
}
