//! Tests of the fp8 block quantiser: block rows against the whole tensor, error bounds, the
//! fast (AVX-512, AVX2) and portable paths bit for bit against an independent scalar reference
//! of every recipe (every 16-bit pattern included), reference bytes of the vLLM and transformers
//! recipes from torch, the scale of a zero block, and refused input.

use super::*;
use crate::prepare::convert::{E4M3_MAX, e4m3_to_f32};
use rand::{Rng, SeedableRng};

fn random_bf16(n: usize, seed: u64) -> Vec<u8> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .flat_map(|_| {
            let x: f32 = rng.random_range(-3.0..3.0);
            half::bf16::from_f32(x).to_le_bytes()
        })
        .collect()
}

/// The code paths every exactness test runs: the best for this CPU, the portable reference, and
/// the hand-written AVX2 code where the CPU has it (even beside AVX-512).
fn paths() -> Vec<Path> {
    let mut p = vec![Path::Best, Path::Portable];
    if crate::prepare::isa::avx2_available() {
        p.push(Path::Avx2);
    }
    p
}

#[test]
fn block_rows_equal_the_whole_tensor_result_and_threads_agree() {
    let shape = Fp8Shape {
        rows: 300,
        cols: 200,
    };
    let src = random_bf16(300 * 200, 1);
    let mut values = vec![0u8; 300 * 200];
    let mut scales = vec![0u8; 3 * 2 * 4];
    quantise_fp8(
        &src,
        DType::BF16,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    let mut v2 = vec![0u8; values.len()];
    let mut s2 = vec![0u8; scales.len()];
    quantise_fp8(&src, DType::BF16, shape, &mut v2, &mut s2, Threads::All).unwrap();
    assert_eq!(values, v2);
    assert_eq!(scales, s2);

    // Block rows 1..3 (rows 128..300) alone.
    let rows = shape.rows_of(1..3);
    assert_eq!(rows, 128..300);
    let mut v3 = vec![0u8; rows.len() * 200];
    let mut s3 = vec![0u8; 2 * 2 * 4];
    quantise_fp8_block_rows(
        &src[rows.start * 200 * 2..],
        DType::BF16,
        shape,
        1..3,
        &mut v3,
        &mut s3,
        Threads::All,
    )
    .unwrap();
    assert_eq!(v3, values[rows.start * 200..]);
    assert_eq!(s3, scales[2 * 4..]);
}

#[test]
fn dequantised_values_are_close_and_block_max_hits_448() {
    let shape = Fp8Shape {
        rows: 128,
        cols: 128,
    };
    let src = random_bf16(128 * 128, 2);
    let mut values = vec![0u8; 128 * 128];
    let mut scales = [0u8; 4];
    quantise_fp8(
        &src,
        DType::BF16,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    let scale = f32::from_le_bytes(scales);
    let xs: Vec<f32> = src
        .chunks_exact(2)
        .map(|c| bf16_to_f32(u16::from_le_bytes([c[0], c[1]])))
        .collect();
    let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert_eq!(scale, amax / 448.0);
    assert!(
        values.iter().any(|&v| v & 0x7f == 0x7e),
        "the amax element maps to ±448"
    );
    for (x, &v) in xs.iter().zip(&values) {
        let back = e4m3_to_f32(v) * scale;
        // e4m3 has 3 mantissa bits: relative error <= 2^-4 for normals, plus subnormal slack.
        assert!(
            (back - x).abs() <= x.abs() / 16.0 + scale * 2f32.powi(-9),
            "{x} -> {back}"
        );
    }
}

/// An independent element-by-element quantiser: the module doc's formula over each block,
/// written as plainly as possible (no keys, no row loops, no ISA dispatch), each recipe's two
/// scalars spelled out as its engine writes them (not through [`Fp8Recipe::block_scale`]).
fn reference(src: &[u8], dtype: DType, shape: Fp8Shape, recipe: Fp8Recipe) -> (Vec<u8>, Vec<u8>) {
    let x: Vec<f32> = src
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DType::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            DType::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
            _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        })
        .collect();
    let (rows, cols) = (shape.rows, shape.cols);
    let mut values = vec![0u8; rows * cols];
    let mut scales = Vec::new();
    for br in 0..shape.row_blocks() {
        for bc in 0..shape.col_blocks() {
            let rs = br * FP8_BLOCK..((br + 1) * FP8_BLOCK).min(rows);
            let cs = bc * FP8_BLOCK..((bc + 1) * FP8_BLOCK).min(cols);
            let mut amax = 0f32;
            for r in rs.clone() {
                for c in cs.clone() {
                    if x[r * cols + c].is_finite() {
                        amax = amax.max(x[r * cols + c].abs());
                    }
                }
            }
            let (inv, scale) = match recipe {
                // vLLM: x * (448 / amax), amax / 448, amax floored at 1e-4.
                Fp8Recipe::Vllm => (
                    E4M3_MAX / amax.max(FP8_AMAX_FLOOR),
                    amax.max(FP8_AMAX_FLOOR) / E4M3_MAX,
                ),
                // transformers: scales = 448.0 / safe (torch: reciprocal, times 448), 1 where
                // amax is 0; weight_scale_inv = 1.0 / scales.
                Fp8Recipe::Transformers => {
                    let safe = if amax > 0.0 { amax } else { 1.0 };
                    let scales = if amax > 0.0 {
                        safe.recip() * E4M3_MAX
                    } else {
                        1.0
                    };
                    (scales, scales.recip())
                }
                // DeepGEMM: sf = amax / 448, x * (1 / sf).
                Fp8Recipe::DeepGemm => {
                    let sf = amax.max(FP8_AMAX_FLOOR) / E4M3_MAX;
                    (1.0 / sf, sf)
                }
            };
            for r in rs {
                for c in cs.clone() {
                    values[r * cols + c] = f32_to_e4m3_saturating(x[r * cols + c] * inv);
                }
            }
            scales.extend_from_slice(&scale.to_le_bytes());
        }
    }
    (values, scales)
}

/// Random elements of every class: mostly ordinary values over a wide exponent range (so
/// that blocks produce e4m3 subnormals and ties), plus zeros, subnormals, the largest
/// finite values, infinities, NaNs with assorted payloads and fully random bit patterns.
fn random_elements(dtype: DType, n: usize, rng: &mut impl Rng) -> Vec<u8> {
    let (lo_exp, hi_exp) = (rng.random_range(-30..0), rng.random_range(0..12));
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let sign = if rng.random_bool(0.5) {
            0x8000_0000u32
        } else {
            0
        };
        let pick = rng.random_range(0..100);
        let f32_bits: u32 = match pick {
            0 => 0,
            1 => 0x7f80_0000,                                  // inf
            2 => 0x7f80_0000 | rng.random_range(1..0x80_0000), // NaN
            3 => rng.random_range(1..0x80_0000),               // f32 subnormal
            4 => 0x7f7f_ffff,                                  // f32 max
            5..=9 => rng.random(),                             // any pattern
            _ => {
                let e = rng.random_range(lo_exp..=hi_exp);
                ((127 + e) as u32) << 23 | rng.random_range(0..0x80_0000)
            }
        } | sign;
        let x = f32::from_bits(f32_bits);
        match dtype {
            DType::BF16 => {
                let h = match pick {
                    3 => rng.random_range(1..0x80u16), // bf16 subnormal
                    5..=9 => rng.random(),
                    _ => (f32_bits >> 16) as u16,
                };
                out.extend_from_slice(&h.to_le_bytes());
            }
            DType::F16 => {
                let h = match pick {
                    3 => rng.random_range(1..0x400u16), // f16 subnormal
                    4 => 0x7bff,                        // f16 max
                    5..=9 => rng.random(),
                    _ => half::f16::from_f32(x).to_bits(),
                };
                out.extend_from_slice(&(h | (sign >> 16) as u16).to_le_bytes());
            }
            _ => out.extend_from_slice(&f32_bits.to_le_bytes()),
        }
    }
    out
}

#[test]
fn fast_and_portable_paths_equal_an_independent_reference_on_random_data() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xf8);
    let mut cases = 0;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for round in 0..12 {
            // Mostly partial blocks, segment lengths that are no multiple of 16 or 32, and
            // now and then whole 128-multiples.
            // Round 1 mod 4 is wider than one L2 strip (`STRIP_BYTES`) for every dtype, so
            // a block row is cut into several column groups.
            let (rows, cols) = match round % 4 {
                0 => (256, 384),
                1 => (rng.random_range(1..260), rng.random_range(2049..2400)),
                _ => (rng.random_range(1..300), rng.random_range(1..420)),
            };
            let shape = Fp8Shape { rows, cols };
            let src = random_elements(dtype, rows * cols, &mut rng);
            // Each recipe meets each shape class over the 12 rounds.
            let recipe = Fp8Recipe::ALL[round % Fp8Recipe::ALL.len()];
            let (want_v, want_s) = reference(&src, dtype, shape, recipe);
            for path in paths() {
                for threads in [Threads::One, Threads::All] {
                    // Dense rows, and the same rows `gap` elements apart in a wider buffer
                    // whose gaps hold other values (read where they lie, never gathered).
                    for gap in [0, 1 + round % 3 * 61] {
                        let pitch = cols + gap;
                        let src = widen_rows(&src, dtype, shape, pitch, &mut rng);
                        let mut v = vec![0xAAu8; rows * cols];
                        let mut s = vec![0xAAu8; want_s.len()];
                        let blocks = 0..shape.row_blocks();
                        quantise_on_path(
                            &src, dtype, shape, blocks, pitch, recipe, &mut v, &mut s, threads,
                            path,
                        )
                        .unwrap();
                        let what = format!(
                            "{dtype} {rows}x{cols} pitch {pitch} {recipe} {path:?} {threads:?}"
                        );
                        if let Some(i) = (0..v.len()).find(|&i| v[i] != want_v[i]) {
                            panic!(
                                "{what}: value {i} is {:#04x}, want {:#04x}",
                                v[i], want_v[i]
                            );
                        }
                        assert_eq!(s, want_s, "{what}: scales");
                        cases += 1;
                    }
                }
            }
            // A block-row range alone equals its part of the whole.
            if shape.row_blocks() > 1 && recipe == Fp8Recipe::Vllm {
                let ncb = shape.col_blocks();
                let rs = shape.rows_of(1..shape.row_blocks());
                let mut v = vec![0u8; rs.len() * cols];
                let mut s = vec![0u8; (shape.row_blocks() - 1) * ncb * 4];
                let part = &src[rs.start * cols * dtype.size()..];
                let blocks = 1..shape.row_blocks();
                quantise_fp8_block_rows(part, dtype, shape, blocks, &mut v, &mut s, Threads::One)
                    .unwrap();
                assert_eq!(v, want_v[rs.start * cols..], "{dtype} {rows}x{cols} rows");
                assert_eq!(s, want_s[ncb * 4..], "{dtype} {rows}x{cols} rows scales");
            }
        }
    }
    assert_eq!(cases, 3 * 12 * 2 * 2 * paths().len());
}

/// `src`'s rows (`shape.cols` elements each) `pitch` elements apart, the gaps filled with
/// random elements; the last row ends the buffer.
fn widen_rows(
    src: &[u8],
    dtype: DType,
    shape: Fp8Shape,
    pitch: usize,
    rng: &mut rand::rngs::StdRng,
) -> Vec<u8> {
    let size = dtype.size();
    let span = (shape.rows - 1) * pitch + shape.cols;
    let mut out = random_elements(dtype, span, rng);
    for r in 0..shape.rows {
        let row = &src[r * shape.cols * size..(r + 1) * shape.cols * size];
        out[r * pitch * size..(r * pitch + shape.cols) * size].copy_from_slice(row);
    }
    out
}

#[test]
fn fast_path_equals_the_reference_for_every_16_bit_pattern() {
    // Every bf16 and f16 bit pattern, in blocks whose amax ranges from tiny to huge (each
    // 128x128 block holds 16384 patterns: four blocks cover all 65536 in order).
    for dtype in [DType::BF16, DType::F16] {
        let shape = Fp8Shape {
            rows: 512,
            cols: 128,
        };
        let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        for (recipe, path) in Fp8Recipe::ALL
            .into_iter()
            .flat_map(|r| paths().into_iter().map(move |p| (r, p)))
        {
            let (want_v, want_s) = reference(&src, dtype, shape, recipe);
            let mut v = vec![0u8; 512 * 128];
            let mut s = vec![0u8; 16];
            let blocks = 0..shape.row_blocks();
            quantise_on_path(
                &src,
                dtype,
                shape,
                blocks,
                128,
                recipe,
                &mut v,
                &mut s,
                Threads::One,
                path,
            )
            .unwrap();
            assert_eq!(s, want_s, "{dtype} {recipe} {path:?} scales");
            if let Some(i) = (0..v.len()).find(|&i| v[i] != want_v[i]) {
                panic!(
                    "{dtype} {recipe} {path:?} pattern {i:#06x}: {:#04x}, want {:#04x}",
                    v[i], want_v[i]
                );
            }
        }
    }
}

#[test]
fn a_pitch_shorter_than_a_row_or_a_source_of_the_wrong_span_is_refused() {
    let shape = Fp8Shape { rows: 3, cols: 4 };
    let (mut v, mut s) = (vec![0u8; 12], vec![0u8; 4]);
    let src = vec![0u8; (2 * 6 + 4) * 2];
    let mut quantise = |src: &[u8], pitch: usize| {
        quantise_fp8_block_rows_pitched(
            src,
            DType::BF16,
            shape,
            0..1,
            pitch,
            Fp8Recipe::Vllm,
            &mut v,
            &mut s,
            Threads::One,
        )
    };
    let err = quantise(&src, 3).unwrap_err();
    assert!(err.to_string().contains("pitch 3"), "{err}");
    // Rows 6 apart span 2 * 6 + 4 elements: one fewer is refused, exactly that is quantised.
    let err = quantise(&src[2..], 6).unwrap_err();
    assert!(err.to_string().contains("fp8 source"), "{err}");
    quantise(&src, 6).unwrap();
}

#[test]
fn zero_block_gets_the_floor_scale() {
    let shape = Fp8Shape { rows: 3, cols: 5 };
    let src = vec![0u8; 15 * 4];
    let mut values = vec![0xAAu8; 15];
    let mut scales = [0u8; 4];
    quantise_fp8(
        &src,
        DType::F32,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    assert!(values.iter().all(|&v| v == 0));
    assert_eq!(f32::from_le_bytes(scales), FP8_AMAX_FLOOR / 448.0);
}

/// Reference bytes from torch 2.13 (each engine's expression on f32 CPU tensors, then
/// `clamp(-448, 448).to(float8_e4m3fn)`): a 2x130 bf16 tensor whose first block has amax 3.0,
/// where vLLM's factor `448 / 3` and transformers' `448.0 / t` (reciprocal times 448) are one
/// ulp apart and round three of the five values differently, and whose second block (columns
/// 128..130) is all zero: scale `1e-4 / 448` for vLLM, 1.0 for transformers.
#[test]
fn vllm_and_transformers_recipes_give_their_engines_bytes() {
    let shape = Fp8Shape { rows: 2, cols: 130 };
    let mut x = vec![0u16; 2 * 130];
    x[..3].copy_from_slice(&[0x4040, 0x3910, 0x3b10]); // 3.0, 1.373e-4, 2.197e-3
    x[130..132].copy_from_slice(&[0xbfc0, 0xbb90]); // -1.5, -4.395e-3
    let src: Vec<u8> = x.iter().flat_map(|h| h.to_le_bytes()).collect();
    let cases = [
        (
            Fp8Recipe::Vllm,
            [0x7e, 0x0a, 0x2a, 0xf6, 0xb2],
            [0x3bdb_6db7, (1e-4f32 / 448.0).to_bits()],
        ),
        (
            Fp8Recipe::Transformers,
            [0x7e, 0x0b, 0x2b, 0xf6, 0xb3],
            [0x3bdb_6db6, 1.0f32.to_bits()],
        ),
        (
            Fp8Recipe::DeepGemm,
            [0x7e, 0x0a, 0x2a, 0xf6, 0xb2],
            [0x3bdb_6db7, (1e-4f32 / 448.0).to_bits()],
        ),
    ];
    for (recipe, want_v, want_s) in cases {
        for path in paths() {
            let mut v = vec![0xAAu8; 260];
            let mut s = vec![0xAAu8; 8];
            quantise_on_path(
                &src,
                DType::BF16,
                shape,
                0..1,
                130,
                recipe,
                &mut v,
                &mut s,
                Threads::One,
                path,
            )
            .unwrap();
            let got = [v[0], v[1], v[2], v[130], v[131]];
            assert_eq!(got, want_v, "{recipe} {path:?} values");
            let zeros = v
                .iter()
                .enumerate()
                .filter(|&(i, _)| ![0, 1, 2, 130, 131].contains(&i));
            assert!(
                zeros.clone().all(|(_, &b)| b == 0),
                "{recipe} {path:?}: zeros"
            );
            let scales: Vec<u32> = s
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(scales, want_s, "{recipe} {path:?} scales");
        }
    }
}

#[test]
fn refuses_bad_input_without_writing() {
    let shape = Fp8Shape {
        rows: 256,
        cols: 128,
    };
    let src = vec![0u8; 256 * 128 * 2];
    let mut values = vec![0xAAu8; 256 * 128];
    let mut scales = vec![0xAAu8; 8];
    let err = quantise_fp8(
        &src[..100],
        DType::BF16,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap_err();
    assert!(err.to_string().contains("fp8 source"), "{err}");
    let err = quantise_fp8(
        &src,
        DType::F8E4M3,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap_err();
    assert!(matches!(err, PrepareError::UnsupportedDType { .. }));
    let err = quantise_fp8_block_rows(
        &src,
        DType::BF16,
        shape,
        1..3,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap_err();
    assert!(err.to_string().contains("block rows"), "{err}");
    assert!(values.iter().chain(&scales).all(|&b| b == 0xAA));
}
