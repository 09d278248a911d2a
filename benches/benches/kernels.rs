//! Criterion benches of the preparation kernels (bf16 input, 16 MiB), single-threaded, with a
//! memcpy of the same bytes in the same group so the ratio can be read off one report.
//! The whole-system figure with `ratio_vs_memcpy` is `weightsync bench prepare`.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use weightsync_common::DType;
use weightsync_worker::{Fp8Shape, Threads, cast, gather_box, quantise_fp8};

const ROWS: usize = 2048;
const COLS: usize = 4096;

fn input() -> Vec<u8> {
    (0..ROWS * COLS)
        .flat_map(|i| {
            let x = ((i * 2654435761) % 1000) as f32 / 1000.0 - 0.5;
            ((x.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

fn kernels(c: &mut Criterion) {
    let src = input();
    let mut g = c.benchmark_group("prepare_bf16_16MiB");
    g.throughput(Throughput::Bytes(src.len() as u64));
    g.sample_size(20);
    let mut out16 = vec![0u8; src.len()];
    g.bench_function("memcpy", |b| b.iter(|| out16.copy_from_slice(&src)));
    let mut out32 = vec![0u8; src.len() * 2];
    g.bench_function("cast_bf16_to_f32", |b| {
        b.iter(|| cast(&src, DType::BF16, &mut out32, DType::F32, Threads::One).unwrap())
    });
    let mut values = vec![0u8; ROWS * COLS];
    let shape = Fp8Shape {
        rows: ROWS,
        cols: COLS,
    };
    let mut scales = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
    g.bench_function("fp8_block_quant", |b| {
        b.iter(|| {
            quantise_fp8(
                &src,
                DType::BF16,
                shape,
                &mut values,
                &mut scales,
                Threads::One,
            )
            .unwrap()
        })
    });
    g.bench_function("gather_all_columns", |b| {
        b.iter(|| {
            gather_box(
                &src,
                2,
                &[ROWS, COLS],
                &[0, 0],
                &[ROWS, COLS],
                &mut out16,
                Threads::One,
            )
            .unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
