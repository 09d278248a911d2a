//! The preparation kernels' source, build options and geometry, and their compiled images.
//!
//! Why the geometry lives here: the kernels (`kernels.cu`) and the launches (`device.rs`) must
//! agree on the tile edge and the threads per block, so both come from the constants below,
//! passed to NVRTC as `-D` options; the `.cu` file refuses to compile without them.
//!
//! Why a process-wide cache: compiling takes a few hundred milliseconds, and every device of one
//! architecture (every [`super::GpuDevice`] opened in a process, every test) can share the image.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use weightsync_common::DType;

use super::GpuError;
use super::nvrtc::{Compiled, Nvrtc, Target, choose_target};
use crate::prepare::FP8_BLOCK;

/// The CUDA source.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// Threads per block of the fp8 kernel (one block per 128 x 128 tile).
pub const QUANT_THREADS: u32 = 256;

/// Threads per block of the cast kernels.
pub const CAST_THREADS: u32 = 256;

/// Elements each cast thread converts per step (one 16-byte load of 16-bit elements).
pub const CAST_ELEMS_PER_STEP: usize = 8;

/// The name of the e4m3 self-test kernel.
pub const SELFTEST_FN: &str = "ws_e4m3_hw_selftest";

/// Options for every compile: IEEE arithmetic throughout (the bit-exactness with the CPU rests
/// on it) and the geometry.
pub fn build_options() -> Vec<String> {
    vec![
        "--ftz=false".into(),
        "--prec-div=true".into(),
        "--prec-sqrt=true".into(),
        "--fmad=false".into(),
        format!("-DWS_TILE={FP8_BLOCK}"),
        format!("-DWS_QUANT_THREADS={QUANT_THREADS}"),
        format!("-DWS_CAST_THREADS={CAST_THREADS}"),
    ]
}

fn short(d: DType) -> Option<&'static str> {
    match d {
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        DType::F32 => Some("f32"),
        _ => None,
    }
}

/// The kernel that casts `from` to `to` (none for equal or unsupported dtypes).
pub fn cast_fn(from: DType, to: DType) -> Option<String> {
    if from == to {
        return None;
    }
    Some(format!("ws_cast_{}_{}", short(from)?, short(to)?))
}

/// The fp8 kernel for `dtype` input.
pub fn fp8_fn(dtype: DType) -> Option<String> {
    Some(format!("ws_fp8_{}", short(dtype)?))
}

/// Every kernel the module defines (what a load must find).
pub fn all_fns() -> Vec<String> {
    let d = [DType::BF16, DType::F16, DType::F32];
    let mut out: Vec<String> = d
        .iter()
        .flat_map(|&a| d.iter().filter_map(move |&b| cast_fn(a, b)))
        .collect();
    out.extend(d.iter().filter_map(|&a| fp8_fn(a)));
    out.push(SELFTEST_FN.into());
    out
}

/// A compiled image of the kernels and how it was made.
#[derive(Debug)]
pub struct KernelImage {
    /// The cubin or PTX.
    pub compiled: Compiled,
    /// NVRTC's (major, minor).
    pub nvrtc_version: (u32, u32),
    /// Where NVRTC was loaded from.
    pub nvrtc_path: String,
}

/// Compiles the kernels for compute capability `arch` (10 * major + minor) with `nvrtc`.
pub fn compile(nvrtc: &Nvrtc, arch: u32) -> Result<KernelImage, GpuError> {
    let target = choose_target(arch, nvrtc.supported_archs())?;
    let compiled = nvrtc.compile(
        KERNELS_CU,
        "weightsync_prepare.cu",
        target,
        &build_options(),
    )?;
    Ok(KernelImage {
        compiled,
        nvrtc_version: nvrtc.version(),
        nvrtc_path: nvrtc.path().into(),
    })
}

/// The image for `arch` from the process-wide NVRTC, compiled once per process and architecture.
pub fn image_for(arch: u32, driver_major: Option<u32>) -> Result<Arc<KernelImage>, GpuError> {
    static CACHE: Mutex<Option<HashMap<u32, Arc<KernelImage>>>> = Mutex::new(None);
    if let Some(img) = CACHE
        .lock()
        .expect("kernel cache lock")
        .as_ref()
        .and_then(|m| m.get(&arch).cloned())
    {
        return Ok(img);
    }
    let nvrtc = Nvrtc::global(driver_major)?;
    let img = Arc::new(compile(nvrtc, arch)?);
    let mut cache = CACHE.lock().expect("kernel cache lock");
    Ok(cache
        .get_or_insert_with(HashMap::new)
        .entry(arch)
        .or_insert(img)
        .clone())
}

impl KernelImage {
    /// Whether the image is machine code (else PTX for the driver to JIT).
    pub fn is_cubin(&self) -> bool {
        matches!(self.compiled.target, Target::Cubin(_))
    }
}

#[cfg(test)]
mod tests {
    //! These compile the real kernels and run wherever an NVRTC can be found (no GPU needed):
    //! point `WEIGHTSYNC_NVRTC` at one, e.g. a `nvidia-cuda-nvrtc` wheel's `libnvrtc.so.13`.
    //! Where none is found they check that the miss is the clean `NoNvrtc` error, unless
    //! `WEIGHTSYNC_REQUIRE_NVRTC` is set (the GPU check sets it), which makes a miss a failure.

    use super::*;

    /// Set (to anything) where NVRTC must be found: the GPU check and CI with the wheel.
    const REQUIRE_ENV: &str = "WEIGHTSYNC_REQUIRE_NVRTC";

    fn nvrtc_or_clean_miss() -> Option<&'static Nvrtc> {
        match Nvrtc::global(None) {
            Ok(n) => Some(n),
            Err(e) if std::env::var_os(REQUIRE_ENV).is_some() => {
                panic!("{REQUIRE_ENV} is set but NVRTC was not found: {e}")
            }
            Err(GpuError::NoNvrtc { searched, .. }) => {
                assert!(searched.contains("libnvrtc.so.13"), "{searched}");
                eprintln!(
                    "no NVRTC here ({searched}); set {}",
                    super::super::nvrtc::NVRTC_ENV
                );
                None
            }
            Err(e) => panic!("finding NVRTC must succeed or be NoNvrtc, got {e}"),
        }
    }

    /// The per-kernel `ptxas -v` lines: (kernel, registers, stack frame, spill stores, spill loads).
    fn ptxas_report(log: &str) -> Vec<(String, u32, u32, u32, u32)> {
        let mut out = Vec::new();
        let mut current: Option<String> = None;
        let mut frame = (0, 0, 0);
        let num = |s: &str, before: &str| -> u32 {
            let end = s.find(before).expect("field");
            s[..end]
                .trim_end()
                .rsplit(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        };
        for line in log.lines() {
            if let Some(i) = line.find("Function properties for ") {
                current = Some(line[i + 24..].trim().to_string());
            } else if line.contains("bytes stack frame") {
                frame = (
                    num(line, "bytes stack frame"),
                    num(line, "bytes spill stores"),
                    num(line, "bytes spill loads"),
                );
            } else if line.contains("Used ")
                && line.contains(" registers")
                && let Some(k) = current.take()
            {
                let regs = num(&line[line.find("Used ").unwrap()..], " registers");
                out.push((k, regs, frame.0, frame.1, frame.2));
            }
        }
        out
    }

    #[test]
    fn the_kernels_compile_to_machine_code_without_warnings() {
        let Some(nvrtc) = nvrtc_or_clean_miss() else {
            return;
        };
        for arch in [80u32, 89, 90, 100] {
            if !nvrtc.supported_archs().contains(&arch) {
                continue;
            }
            let img = compile(nvrtc, arch).unwrap_or_else(|e| panic!("sm_{arch}: {e}"));
            assert!(img.is_cubin());
            assert_eq!(
                &img.compiled.image[..4],
                b"\x7fELF",
                "sm_{arch}: a cubin is an ELF"
            );
            assert!(
                img.compiled.log.is_empty(),
                "sm_{arch} log: {}",
                img.compiled.log
            );
        }
    }

    #[test]
    fn the_fp8_kernels_keep_their_tile_in_registers_on_hopper() {
        let Some(nvrtc) = nvrtc_or_clean_miss() else {
            return;
        };
        let mut opts = build_options();
        opts.push("--ptxas-options=-v".into());
        let c = nvrtc
            .compile(KERNELS_CU, "k.cu", Target::Cubin(90), &opts)
            .unwrap();
        let report = ptxas_report(&c.log);
        let names = all_fns();
        assert_eq!(
            report.len(),
            names.len(),
            "one report per kernel: {}",
            c.log
        );
        for (k, regs, frame, st, ld) in &report {
            assert!(names.contains(k), "unexpected kernel {k}");
            assert_eq!(
                (*frame, *st, *ld),
                (0, 0, 0),
                "{k}: stack or spills: {}",
                c.log
            );
            // __launch_bounds__(256, n): n blocks of 256 threads share 64 Ki registers.
            let blocks_per_sm = match k.as_str() {
                "ws_fp8_bf16" => 3,
                k if k.starts_with("ws_fp8_") => 2,
                _ => 1,
            };
            assert!(
                *regs * QUANT_THREADS * blocks_per_sm <= 65536,
                "{k}: {regs} registers leave fewer than {blocks_per_sm} blocks per SM"
            );
        }
    }

    #[test]
    fn the_kernels_compile_to_ptx_for_a_gpu_newer_than_nvrtc() {
        let Some(nvrtc) = nvrtc_or_clean_miss() else {
            return;
        };
        let newest = *nvrtc.supported_archs().iter().max().unwrap();
        let img = compile(nvrtc, newest + 10).unwrap();
        assert_eq!(img.compiled.target, Target::Ptx(newest));
        let ptx = String::from_utf8_lossy(&img.compiled.image);
        assert!(
            ptx.contains(&format!(".target sm_{newest}")),
            "{}",
            &ptx[..400]
        );
        assert_eq!(
            img.compiled.image.last(),
            Some(&0),
            "PTX is NUL-terminated for the driver"
        );
        for f in all_fns() {
            assert!(
                ptx.contains(&format!(".entry {f}(")),
                "{f} missing from the PTX"
            );
        }
    }

    #[test]
    fn a_compile_error_returns_nvrtcs_log() {
        let Some(nvrtc) = nvrtc_or_clean_miss() else {
            return;
        };
        // Without the geometry the source refuses to compile, naming what is missing.
        match nvrtc.compile(KERNELS_CU, "k.cu", Target::Cubin(90), &[]) {
            Err(GpuError::Compile { log, nvrtc, .. }) => {
                assert!(log.contains("WS_TILE"), "{log}");
                assert!(nvrtc.contains("NVRTC 1"), "{nvrtc}");
            }
            other => panic!("expected a compile error, got {other:?}"),
        }
    }

    #[test]
    fn kernel_names_cover_every_dtype_pair() {
        assert_eq!(
            cast_fn(DType::BF16, DType::F32).as_deref(),
            Some("ws_cast_bf16_f32")
        );
        assert_eq!(cast_fn(DType::F16, DType::F16), None);
        assert_eq!(cast_fn(DType::F8E4M3, DType::F32), None);
        assert_eq!(fp8_fn(DType::F32).as_deref(), Some("ws_fp8_f32"));
        assert_eq!(all_fns().len(), 6 + 3 + 1);
    }
}
