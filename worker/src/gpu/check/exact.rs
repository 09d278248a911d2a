//! The CUDA kernels against the CPU kernels, bit for bit.

use serde_json::{Value, json};
use weightsync_common::DType;

use super::{device, emit, every_16_bit_pattern, hex, random_input};
use crate::gpu::{E4m3Conversion, GpuDevice};
use crate::prepare::{Fp8Shape, Threads, cast, quantise_fp8};

const DTYPES: [DType; 3] = [DType::BF16, DType::F16, DType::F32];

/// A byte no kernel output is expected to hold everywhere: outputs start as this, so an element
/// the kernel never wrote shows up as a difference.
const POISON: u8 = 0x5a;

/// Element-wise differences of `got` against `want` (elements of `out_size` bytes), with the
/// input element at the same index (`in_size` bytes): (count, first 8 as JSON).
fn differences(
    input: &[u8],
    in_size: usize,
    got: &[u8],
    want: &[u8],
    out_size: usize,
) -> (usize, Vec<Value>) {
    let mut count = 0;
    let mut first = Vec::new();
    if got.len() != want.len() {
        return (usize::MAX, vec![json!({"length": [got.len(), want.len()]})]);
    }
    for (i, (g, w)) in got.chunks(out_size).zip(want.chunks(out_size)).enumerate() {
        if g != w {
            count += 1;
            if first.len() < 8 {
                let x = input.get(i * in_size..(i + 1) * in_size).unwrap_or(&[]);
                first.push(json!({"index": i, "input": hex(x), "got": hex(g), "want": hex(w)}));
            }
        }
    }
    (count, first)
}

/// Where buffers sit: at the start of their allocation (16-byte loads where the shape allows)
/// or one element in (element-aligned only: the scalar path).
#[derive(Debug, Clone, Copy)]
enum Layout {
    Aligned,
    Offset,
}

impl Layout {
    fn elems(self) -> usize {
        match self {
            Layout::Aligned => 0,
            Layout::Offset => 1,
        }
    }
}

/// Runs one fp8 case; true if bit-exact.
fn fp8_case(
    dev: &GpuDevice,
    case: &str,
    input: &[u8],
    dtype: DType,
    shape: Fp8Shape,
    conversion: E4m3Conversion,
    layout: Layout,
) -> bool {
    let n = shape.rows * shape.cols;
    let mut want_v = vec![0u8; n];
    let mut want_s = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
    quantise_fp8(input, dtype, shape, &mut want_v, &mut want_s, Threads::All).unwrap();
    let pad = layout.elems();
    let mut src_host = vec![0u8; pad * dtype.size()];
    src_host.extend_from_slice(input);
    let src = dev.upload(&src_host).unwrap();
    let mut values = dev.upload(&vec![POISON; n + pad]).unwrap();
    let mut scales = dev.upload(&vec![POISON; want_s.len()]).unwrap();
    let src_view = src.slice(pad * dtype.size()..);
    let mut values_view = values.slice_mut(pad..);
    let run = dev.quantise_fp8_with(
        &src_view,
        dtype,
        shape,
        &mut values_view,
        &mut scales,
        conversion,
    );
    let (got_v, got_s) = match run.and_then(|_| dev.synchronize()) {
        Ok(()) => (
            dev.download(&values.slice(pad..)).unwrap(),
            dev.download(&scales).unwrap(),
        ),
        Err(e) => {
            emit(json!({"check": "fp8_exact", "case": case, "error": e.to_string()}));
            return false;
        }
    };
    let (dv, first_v) = differences(input, dtype.size(), &got_v, &want_v, 1);
    let (ds, first_s) = differences(&[], 0, &got_s, &want_s, 4);
    emit(json!({
        "check": "fp8_exact", "case": case, "dtype": dtype.to_string(),
        "shape": [shape.rows, shape.cols], "conversion": conversion, "layout": format!("{layout:?}"),
        "value_mismatches": dv, "scale_mismatches": ds,
        "first_values": first_v, "first_scales": first_s,
    }));
    dv == 0 && ds == 0
}

/// The conversions to check here: the emulation everywhere, the hardware one where chosen.
fn conversions(dev: &GpuDevice) -> Vec<E4m3Conversion> {
    let mut out = vec![E4m3Conversion::Emulated];
    if dev.fp8_conversion().unwrap() == E4m3Conversion::Hardware {
        out.push(E4m3Conversion::Hardware);
    }
    out
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn device_and_kernel_report() {
    let dev = device();
    let img = dev.kernel_image().expect("the kernels compile and load");
    let conversion = dev.fp8_conversion().unwrap();
    let selftest = dev.e4m3_selftest().unwrap();
    emit(json!({
        "check": "device", "device": dev.info(),
        "nvrtc": {"version": img.nvrtc_version, "path": img.nvrtc_path},
        "target": format!("{:?}", img.compiled.target), "image_bytes": img.compiled.image.len(),
        "fp8_conversion": conversion, "e4m3_selftest": selftest,
    }));
    // The choice follows the self-test: hardware exactly when it ran and found no difference.
    match selftest {
        None => assert!(dev.info().arch < 89 && conversion == E4m3Conversion::Emulated),
        Some(r) => assert_eq!(
            conversion == E4m3Conversion::Hardware,
            r.mismatches == 0,
            "{r:?}"
        ),
    }
    if dev.info().arch == 90 {
        assert!(img.is_cubin(), "Hopper gets its own machine code");
    }
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn fp8_is_bit_exact_with_the_cpu() {
    let dev = device();
    let shapes = [
        (1, 1),
        (3, 5),
        (1, 1000),
        (255, 1),
        (127, 129),
        (128, 128),
        (130, 8),
        (129, 136),
        (256, 384),
        (1000, 1300),
    ];
    let mut failed = Vec::new();
    for (d, &dtype) in DTYPES.iter().enumerate() {
        for (s, &(rows, cols)) in shapes.iter().enumerate() {
            let shape = Fp8Shape { rows, cols };
            let input = random_input(rows * cols, cols, dtype, (d * 100 + s) as u64);
            for conversion in conversions(&dev) {
                for layout in [Layout::Aligned, Layout::Offset] {
                    let case = format!("{dtype} {rows}x{cols} {conversion:?} {layout:?}");
                    if !fp8_case(&dev, &case, &input, dtype, shape, conversion, layout) {
                        failed.push(case);
                    }
                }
            }
        }
    }
    // Every 16-bit pattern, in order, as 4 tiles (each with its own amax).
    for dtype in [DType::BF16, DType::F16] {
        let shape = Fp8Shape {
            rows: 512,
            cols: 128,
        };
        for conversion in conversions(&dev) {
            let case = format!("{dtype} every pattern {conversion:?}");
            let input = every_16_bit_pattern();
            if !fp8_case(
                &dev,
                &case,
                &input,
                dtype,
                shape,
                conversion,
                Layout::Aligned,
            ) {
                failed.push(case);
            }
        }
    }
    // Review G3: a negative NaN keeps its sign (0xff), as on the CPU.
    let g3: Vec<u8> = [0x3f80u16, 0xffc1, 0x7fc1, 0xbf80]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    let shape = Fp8Shape { rows: 1, cols: 4 };
    for conversion in conversions(&dev) {
        let mut values = dev.alloc(4).unwrap();
        let mut scales = dev.alloc(4).unwrap();
        let src = dev.upload(&g3).unwrap();
        dev.quantise_fp8_with(
            &src,
            DType::BF16,
            shape,
            &mut values,
            &mut scales,
            conversion,
        )
        .unwrap();
        let got = dev.download(&values).unwrap();
        emit(
            json!({"check": "fp8_exact", "case": "G3 negative NaN", "conversion": conversion,
                    "got": hex(&got), "want": hex(&[0x7e, 0xff, 0x7f, 0xfe])}),
        );
        if got != [0x7e, 0xff, 0x7f, 0xfe] {
            failed.push(format!("G3 {conversion:?}"));
        }
    }
    assert!(failed.is_empty(), "fp8 differs from the CPU in: {failed:?}");
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn casts_are_bit_exact_with_the_cpu() {
    let dev = device();
    let mut failed = Vec::new();
    for (i, &from) in DTYPES.iter().enumerate() {
        let mut inputs: Vec<(String, Vec<u8>)> = [1usize, 7, 8, 9, 4099, 1_000_003]
            .iter()
            .map(|&n| {
                (
                    format!("{n} random"),
                    random_input(n, 1000, from, 7 + i as u64),
                )
            })
            .collect();
        if from.size() == 2 {
            inputs.push(("every pattern".into(), every_16_bit_pattern()));
        }
        for (what, input) in &inputs {
            let n = input.len() / from.size();
            for &to in &DTYPES {
                let mut want = vec![0u8; n * to.size()];
                cast(input, from, &mut want, to, Threads::All).unwrap();
                for layout in [Layout::Aligned, Layout::Offset] {
                    let case = format!("{from}->{to} {what} {layout:?}");
                    let pad = layout.elems();
                    let mut src_host = vec![0u8; pad * from.size()];
                    src_host.extend_from_slice(input);
                    let src = dev.upload(&src_host).unwrap();
                    let mut dst = dev.upload(&vec![POISON; (n + pad) * to.size()]).unwrap();
                    let src_view = src.slice(pad * from.size()..);
                    let mut dst_view = dst.slice_mut(pad * to.size()..);
                    let run = dev.cast(&src_view, from, &mut dst_view, to);
                    let got = match run.and_then(|_| dev.synchronize()) {
                        Ok(()) => dev.download(&dst.slice(pad * to.size()..)).unwrap(),
                        Err(e) => {
                            emit(
                                json!({"check": "cast_exact", "case": case, "error": e.to_string()}),
                            );
                            failed.push(case);
                            continue;
                        }
                    };
                    let (d, first) = differences(input, from.size(), &got, &want, to.size());
                    emit(json!({"check": "cast_exact", "case": case, "elements": n,
                                "mismatches": d, "first": first}));
                    if d != 0 {
                        failed.push(case);
                    }
                }
            }
        }
    }
    assert!(
        failed.is_empty(),
        "casts differ from the CPU in: {failed:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU (worker/gpu-check.sh)"]
fn bad_arguments_are_errors_before_any_launch() {
    let dev = device();
    let src = dev.upload(&[0u8; 64]).unwrap();
    let mut out = dev.alloc(128).unwrap();
    // A bf16 view at an odd byte address would be a misaligned access (a sticky error).
    let odd = src.slice(1..33);
    let mut out_view = out.slice_mut(0..32);
    let e = dev
        .cast(&odd, DType::BF16, &mut out_view, DType::F16)
        .unwrap_err();
    assert!(matches!(e, crate::gpu::GpuError::Misaligned { .. }), "{e}");
    // Wrong output length.
    let e = dev
        .cast(&src, DType::BF16, &mut out, DType::F16)
        .unwrap_err();
    assert!(e.to_string().contains("cast output"), "{e}");
    // Scales too short for the block grid.
    let mut values = dev.alloc(32).unwrap();
    let mut scales = dev.alloc(2).unwrap();
    let e = dev
        .quantise_fp8(
            &src,
            DType::BF16,
            Fp8Shape { rows: 4, cols: 8 },
            &mut values,
            &mut scales,
        )
        .unwrap_err();
    assert!(e.to_string().contains("fp8 scales"), "{e}");
    // The device is still healthy after all of that.
    dev.synchronize().unwrap();
    emit(json!({"check": "bad_arguments", "ok": true}));
}
