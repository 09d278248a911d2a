//! `kernels.cu` run on the CPU (`host_emulation.cpp`: a std::thread per CUDA thread, barriers
//! for `__syncthreads` and the shuffles) against the CPU kernels, bit for bit: the kernels' tile
//! mapping, packing, partial tiles, vector and scalar paths and reductions, checked without a
//! GPU. Not checked here: the GPU's own arithmetic and the hardware e4m3 conversion (the
//! device checks and the device's self-test do those).
//!
//! Needs a C++20 compiler (`c++`, or `$CXX`); `worker/gpu-check.sh --build` runs it before
//! packaging, so a kernel change that breaks the logic is caught before any device time.

use std::path::{Path, PathBuf};
use std::process::Command;

use weightsync_common::{DType, Fp8Recipe};

use super::{every_16_bit_pattern, random_input};
use crate::gpu::kernels::{CAST_THREADS, QUANT_THREADS};
use crate::prepare::{FP8_BLOCK, Fp8Shape, Threads, cast, quantise_fp8_as};

fn code(d: DType) -> u32 {
    match d {
        DType::BF16 => 0,
        DType::F16 => 1,
        _ => 2,
    }
}

/// Compiles the emulation into `dir`.
fn build(dir: &Path) -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/gpu/check/host_emulation.cpp");
    let exe = dir.join("host_emulation");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = Command::new(&cxx)
        .args([
            "-std=c++20",
            "-O2",
            "-ffp-contract=off",
            "-pthread",
            "-Wall",
        ])
        .arg("-Wno-unknown-pragmas")
        .arg(format!("-DWS_TILE={FP8_BLOCK}"))
        .arg(format!("-DWS_QUANT_THREADS={QUANT_THREADS}"))
        .arg(format!("-DWS_CAST_THREADS={CAST_THREADS}"))
        .arg(&here)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{cxx} (a C++20 compiler) is needed: {e}"));
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "{cxx} failed or warned:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn run(exe: &Path, args: &[String]) {
    let out = Command::new(exe).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "host_emulation {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Index and (got, want) of the first differing element.
fn first_difference(got: &[u8], want: &[u8], size: usize) -> Option<(usize, String)> {
    if got.len() != want.len() {
        return Some((
            usize::MAX,
            format!("lengths {} vs {}", got.len(), want.len()),
        ));
    }
    got.chunks(size)
        .zip(want.chunks(size))
        .position(|(g, w)| g != w)
        .map(|i| {
            let r = i * size..(i + 1) * size;
            (i, format!("{:02x?} vs {:02x?}", &got[r.clone()], &want[r]))
        })
}

#[test]
#[ignore = "needs a C++20 compiler (c++); run by worker/gpu-check.sh --build"]
fn the_cuda_kernels_run_on_the_cpu_match_the_cpu_kernels() {
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path());
    let p = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
    let mut failed = Vec::new();

    let shapes = [
        (1, 1),
        (3, 5),
        (1, 1000),
        (255, 1),
        (127, 129),
        (130, 8),
        (129, 136),
        (256, 384),
        (300, 520),
    ];
    let dtypes = [DType::BF16, DType::F16, DType::F32];
    let mut cases: Vec<(String, DType, Fp8Shape, Vec<u8>)> = Vec::new();
    for (d, &dtype) in dtypes.iter().enumerate() {
        for (s, &(rows, cols)) in shapes.iter().enumerate() {
            let input = random_input(rows * cols, cols, dtype, (d * 100 + s) as u64);
            cases.push((
                format!("{dtype} {rows}x{cols}"),
                dtype,
                Fp8Shape { rows, cols },
                input,
            ));
        }
    }
    for dtype in [DType::BF16, DType::F16] {
        let shape = Fp8Shape {
            rows: 512,
            cols: 128,
        };
        cases.push((
            format!("{dtype} every pattern"),
            dtype,
            shape,
            every_16_bit_pattern(),
        ));
    }
    // Review G3: a negative NaN keeps its sign.
    let g3: Vec<u8> = [0x3f80u16, 0xffc1, 0x7fc1, 0xbf80]
        .iter()
        .flat_map(|b| b.to_le_bytes())
        .collect();
    cases.push(("G3".into(), DType::BF16, Fp8Shape { rows: 1, cols: 4 }, g3));

    // Every case under every recipe (the block's two scalars differ; the rest is shared).
    let cases: Vec<_> = cases
        .iter()
        .flat_map(|c| Fp8Recipe::ALL.map(|r| (c, r)))
        .map(|((name, dtype, shape, input), recipe)| {
            let name = if recipe == Fp8Recipe::Vllm {
                name.clone()
            } else {
                format!("{name} {recipe}")
            };
            (name, *dtype, *shape, input.clone(), recipe)
        })
        .collect();
    for (name, dtype, shape, input, recipe) in &cases {
        let mut want_v = vec![0u8; shape.rows * shape.cols];
        let mut want_s = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
        quantise_fp8_as(
            *recipe,
            input,
            *dtype,
            *shape,
            &mut want_v,
            &mut want_s,
            Threads::All,
        )
        .unwrap();
        std::fs::write(p("in"), input).unwrap();
        let vec_modes: &[u32] = if shape.cols.is_multiple_of(8) {
            &[1, 0]
        } else {
            &[0]
        };
        for &vec in vec_modes {
            let args = [
                "fp8".to_string(),
                code(*dtype).to_string(),
                shape.rows.to_string(),
                shape.cols.to_string(),
                vec.to_string(),
                p("in"),
                p("values"),
                p("scales"),
                recipe.code().to_string(),
            ];
            run(&exe, &args);
            let got_v = std::fs::read(p("values")).unwrap();
            let got_s = std::fs::read(p("scales")).unwrap();
            let path = if vec == 1 { "vector" } else { "scalar" };
            if let Some(d) = first_difference(&got_v, &want_v, 1) {
                failed.push(format!("fp8 {name} {path}: value {d:?}"));
            }
            if let Some(d) = first_difference(&got_s, &want_s, 4) {
                failed.push(format!("fp8 {name} {path}: scale {d:?}"));
            }
        }
        if name == "G3" && want_v != [0x7e, 0xff, 0x7f, 0xfe] {
            failed.push(format!("G3 on the CPU: {want_v:02x?}"));
        }
    }

    for (i, &from) in dtypes.iter().enumerate() {
        let mut inputs = vec![
            random_input(9, 1000, from, 70 + i as u64),
            random_input(100_003, 1000, from, 80 + i as u64),
        ];
        if from.size() == 2 {
            inputs.push(every_16_bit_pattern());
        }
        for input in &inputs {
            let n = input.len() / from.size();
            std::fs::write(p("in"), input).unwrap();
            for &to in dtypes.iter().filter(|&&t| t != from) {
                let mut want = vec![0u8; n * to.size()];
                cast(input, from, &mut want, to, Threads::All).unwrap();
                // Offset 0: 16-byte loads and stores; offset 1 element: the scalar path.
                for offset in [0usize, 1] {
                    let args = [
                        "cast".to_string(),
                        code(from).to_string(),
                        code(to).to_string(),
                        n.to_string(),
                        offset.to_string(),
                        p("in"),
                        p("out"),
                    ];
                    run(&exe, &args);
                    let got = std::fs::read(p("out")).unwrap();
                    if let Some(d) = first_difference(&got, &want, to.size()) {
                        failed.push(format!("cast {from}->{to} n={n} offset {offset}: {d:?}"));
                    }
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}
