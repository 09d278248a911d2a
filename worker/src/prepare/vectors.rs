//! Bit-exactness against ml_dtypes' float8_e4m3fn: the committed vectors from
//! `worker/testdata/gen_fp8_vectors.py` (elements of every class, and whole-block cases with
//! their expected `weight_scale_inv`), compared byte for byte.

use serde::Deserialize;
use weightsync_common::DType;

use super::convert::{bf16_to_f32, f16_to_f32, f32_to_e4m3_saturating};
use super::{Fp8Shape, Threads, quantise_fp8, quantise_fp8_block_rows};

#[derive(Deserialize)]
struct Vectors {
    elements: Vec<ElementCase>,
    blocks: Vec<BlockCase>,
}

#[derive(Deserialize)]
struct ElementCase {
    dtype: String,
    count: usize,
    input_hex: String,
    expected_hex: String,
}

#[derive(Deserialize)]
struct BlockCase {
    name: String,
    dtype: String,
    rows: usize,
    cols: usize,
    input: [usize; 2],
    values: [usize; 2],
    scales: [usize; 2],
}

fn load() -> (Vectors, Vec<u8>) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/testdata");
    let json =
        std::fs::read_to_string(format!("{dir}/fp8_vectors.json")).expect("fp8_vectors.json");
    let blob = std::fs::read(format!("{dir}/fp8_blocks.bin")).expect("fp8_blocks.bin");
    (
        serde_json::from_str(&json).expect("valid vectors json"),
        blob,
    )
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

fn to_f32(dtype: DType, b: &[u8]) -> f32 {
    match dtype {
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        DType::F16 => f16_to_f32(u16::from_le_bytes([b[0], b[1]])),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

#[test]
fn element_conversion_matches_ml_dtypes_saturating() {
    let (v, _) = load();
    assert_eq!(v.elements.len(), 3, "bf16, f16 and f32 element cases");
    for case in &v.elements {
        let dtype: DType = case.dtype.parse().unwrap();
        let input = unhex(&case.input_hex);
        let expected = unhex(&case.expected_hex);
        assert_eq!(input.len(), case.count * dtype.size());
        assert_eq!(expected.len(), case.count);
        for (i, (e, &want)) in input.chunks_exact(dtype.size()).zip(&expected).enumerate() {
            let x = to_f32(dtype, e);
            let got = f32_to_e4m3_saturating(x);
            assert_eq!(
                got, want,
                "{dtype} element {i}: {x:e} ({:02x?}) -> {got:#04x}, ml_dtypes {want:#04x}",
                e
            );
        }
    }
}

#[test]
fn block_quantisation_matches_reference_values_and_scales() {
    let (v, blob) = load();
    assert!(v.blocks.len() >= 4);
    let range = |r: [usize; 2]| &blob[r[0]..r[0] + r[1]];
    for case in &v.blocks {
        let dtype: DType = case.dtype.parse().unwrap();
        let shape = Fp8Shape {
            rows: case.rows,
            cols: case.cols,
        };
        let want_values = range(case.values);
        let want_scales = range(case.scales);
        for threads in [Threads::One, Threads::All] {
            let mut values = vec![0u8; case.rows * case.cols];
            let mut scales = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
            quantise_fp8(
                range(case.input),
                dtype,
                shape,
                &mut values,
                &mut scales,
                threads,
            )
            .unwrap();
            for (i, (w, g)) in want_scales
                .chunks_exact(4)
                .zip(scales.chunks_exact(4))
                .enumerate()
            {
                assert_eq!(w, g, "{}: scale {i}", case.name);
            }
            if let Some(i) = (0..values.len()).find(|&i| values[i] != want_values[i]) {
                panic!(
                    "{} {threads:?}: value at row {} col {}: got {:#04x}, want {:#04x}",
                    case.name,
                    i / case.cols,
                    i % case.cols,
                    values[i],
                    want_values[i]
                );
            }
        }
    }
}

#[test]
fn block_row_subrange_matches_reference() {
    let (v, blob) = load();
    let case = v
        .blocks
        .iter()
        .find(|b| b.name == "bf16_two_block_rows")
        .expect("case present");
    let shape = Fp8Shape {
        rows: case.rows,
        cols: case.cols,
    };
    let input = &blob[case.input[0]..case.input[0] + case.input[1]];
    let want_values = &blob[case.values[0]..case.values[0] + case.values[1]];
    let want_scales = &blob[case.scales[0]..case.scales[0] + case.scales[1]];
    let rows = shape.rows_of(1..2);
    let mut values = vec![0u8; rows.len() * case.cols];
    let mut scales = vec![0u8; shape.col_blocks() * 4];
    quantise_fp8_block_rows(
        &input[rows.start * case.cols * 2..rows.end * case.cols * 2],
        DType::BF16,
        shape,
        1..2,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    assert_eq!(values, want_values[rows.start * case.cols..]);
    assert_eq!(scales, want_scales[shape.col_blocks() * 4..]);
}
