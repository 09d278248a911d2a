//! [`GpuDevice`]: one CUDA context and stream, and the preparation kernels launched on it.
//!
//! Why the kernels are loaded lazily: pinned staging, copies and IPC mapping need no kernel, so
//! [`GpuDevice::open`] needs no NVRTC and does not pay a compile; the first cast or quantisation
//! compiles (once per process and architecture, [`super::kernels::image_for`]) and loads them.
//!
//! Why launches take device pointers of views: the pipeline's pieces are sub-ranges of one
//! staging arena, so [`GpuDevice::cast`] and [`GpuDevice::quantise_fp8`] accept any
//! `CudaSlice`/`CudaView`/`CudaViewMut`, and check before launching what a kernel's reads and
//! writes need: the element alignment of every pointer (a misaligned access is a sticky error
//! that ends the context), and that every buffer belongs to this device's context.
//!
//! Why a self-test decides the fp8 conversion: on sm_89 and later the kernels can convert two
//! values to e4m3 with one instruction, far cheaper than the integer emulation that mirrors the
//! CPU. It is used only after `ws_e4m3_hw_selftest` has found it equal to the emulation for all
//! 2^32 f32 inputs on this device (a few milliseconds once), so the bytes stay the CPU's.
//!
//! Opening the device creates a stream; cudarc's first `new_stream` on a context synchronises
//! that (primary) context once, so in a training process open it at start-up, not mid-step.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
    LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;
use weightsync_common::{DType, Fp8Recipe};

use super::kernels::{self, CAST_ELEMS_PER_STEP, CAST_THREADS, KernelImage, QUANT_THREADS};
use super::{GpuError, driver_present};
use crate::prepare::{FP8_BLOCK, Fp8Shape, PrepareError};

/// What a device is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Marketing name.
    pub name: String,
    /// Compute capability, 10 * major + minor (90 for Hopper).
    pub arch: u32,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// The driver's CUDA version, 1000 * major + 10 * minor (13000 for 13.0).
    pub driver_version: u32,
}

/// How the fp8 kernel converts f32 to e4m3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum E4m3Conversion {
    /// Integer steps mirroring the CPU's `f32_to_e4m3_saturating` (any GPU).
    Emulated,
    /// `cvt.rn.satfinite.e4m3x2.f32` (sm_89+), where the self-test found it exact.
    Hardware,
}

/// The result of comparing the hardware e4m3 conversion with the emulation on every f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SelftestReport {
    /// f32 bit patterns whose magnitudes differ.
    pub mismatches: u32,
    /// The smallest such pattern.
    pub first_mismatch: Option<u32>,
}

/// The loaded kernels of one device.
#[derive(Debug)]
struct Kernels {
    image: Arc<KernelImage>,
    _module: Arc<CudaModule>,
    casts: Vec<(DType, DType, CudaFunction)>,
    fp8: Vec<(DType, CudaFunction)>,
    selftest: CudaFunction,
    conversion: E4m3Conversion,
    report: Option<SelftestReport>,
}

/// A GPU with its stream and (lazily) its preparation kernels.
#[derive(Debug)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    kernels: OnceLock<Kernels>,
}

fn ptr_aligned(what: &'static str, addr: u64, align: u64) -> Result<(), GpuError> {
    if addr.is_multiple_of(align) {
        Ok(())
    } else {
        Err(GpuError::Misaligned { what, addr, align })
    }
}

impl GpuDevice {
    /// Number of CUDA devices, or [`GpuError::NoDriver`].
    pub fn count() -> Result<usize, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        Ok(CudaContext::device_count()?.max(0) as usize)
    }

    /// Opens GPU `ordinal` (its primary context) and creates a stream.
    pub fn open(ordinal: usize) -> Result<GpuDevice, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let (major, minor) = ctx.compute_capability()?;
        let sm_count =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let mut driver_version: std::ffi::c_int = 0;
        // SAFETY: valid out-pointer; the driver is initialised (CudaContext::new called cuInit).
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }.result()?;
        let info = DeviceInfo {
            ordinal,
            name: ctx.name()?,
            arch: (major * 10 + minor) as u32,
            sm_count: sm_count.max(1) as u32,
            driver_version: driver_version.max(0) as u32,
        };
        Ok(GpuDevice {
            ctx,
            stream,
            info,
            kernels: OnceLock::new(),
        })
    }

    /// What this device is.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of this device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on the stream, and reports an error any earlier
    /// asynchronous operation left behind.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.stream.synchronize()?;
        self.ctx.check_err()?;
        Ok(())
    }

    /// A zeroed device buffer (from the stream-ordered pool where the device has one).
    pub fn alloc(&self, len: usize) -> Result<CudaSlice<u8>, GpuError> {
        Ok(self.stream.alloc_zeros::<u8>(len)?)
    }

    /// Copies host bytes into a new device buffer.
    pub fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>, GpuError> {
        Ok(self.stream.clone_htod(bytes)?)
    }

    /// Copies device bytes (a buffer or a view) back to the host; waits.
    pub fn download<S: DevicePtr<u8>>(&self, buf: &S) -> Result<Vec<u8>, GpuError> {
        self.same_context("download source", buf.stream())?;
        let v = self.stream.clone_dtoh(buf)?;
        self.synchronize()?;
        Ok(v)
    }

    fn same_context(&self, what: &'static str, s: &Arc<CudaStream>) -> Result<(), GpuError> {
        if **s.context() == *self.ctx {
            Ok(())
        } else {
            Err(GpuError::WrongContext { what })
        }
    }

    /// The compiled kernels (compiling and loading them on first use).
    fn kernels(&self) -> Result<&Kernels, GpuError> {
        if let Some(k) = self.kernels.get() {
            return Ok(k);
        }
        let k = self.load_kernels()?;
        Ok(self.kernels.get_or_init(|| k))
    }

    fn load_kernels(&self) -> Result<Kernels, GpuError> {
        let driver_major = Some(self.info.driver_version / 1000).filter(|&m| m > 0);
        let image = kernels::image_for(self.info.arch, driver_major)?;
        let module = self
            .ctx
            .load_module(Ptx::from_binary(image.compiled.image.clone()))
            .map_err(|source| GpuError::Load {
                what: format!(
                    "{:?} built by NVRTC {}.{} ({}) on a CUDA {}.{} driver",
                    image.compiled.target,
                    image.nvrtc_version.0,
                    image.nvrtc_version.1,
                    image.nvrtc_path,
                    self.info.driver_version / 1000,
                    self.info.driver_version % 1000 / 10
                ),
                source,
            })?;
        let d = [DType::BF16, DType::F16, DType::F32];
        let mut casts = Vec::new();
        for &a in &d {
            for &b in &d {
                if let Some(name) = kernels::cast_fn(a, b) {
                    casts.push((a, b, module.load_function(&name)?));
                }
            }
        }
        let mut fp8 = Vec::new();
        for &a in &d {
            let name = kernels::fp8_fn(a).expect("fp8 kernel for every float dtype");
            fp8.push((a, module.load_function(&name)?));
        }
        let selftest = module.load_function(kernels::SELFTEST_FN)?;
        let mut k = Kernels {
            image,
            _module: module,
            casts,
            fp8,
            selftest,
            conversion: E4m3Conversion::Emulated,
            report: None,
        };
        if self.info.arch >= 89 {
            let report = self.run_selftest(&k.selftest)?;
            if report.mismatches == 0 {
                k.conversion = E4m3Conversion::Hardware;
            } else {
                tracing::warn!(
                    mismatches = report.mismatches,
                    first = ?report.first_mismatch,
                    "the hardware e4m3 conversion differs from the CPU's; fp8 uses the emulation"
                );
            }
            k.report = Some(report);
        }
        Ok(k)
    }

    fn run_selftest(&self, f: &CudaFunction) -> Result<SelftestReport, GpuError> {
        let mut result = self
            .stream
            .clone_htod(&[0u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff])?;
        let cfg = LaunchConfig {
            grid_dim: (self.info.sm_count * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut launch = self.stream.launch_builder(f);
        launch.arg(&mut result);
        // SAFETY: the argument matches `ws_e4m3_hw_selftest(u32*)`, and `result` holds the two
        // u32 the kernel updates.
        unsafe { launch.launch(cfg) }?;
        let bytes = self.download(&result)?;
        let word = |i: usize| u32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap());
        Ok(SelftestReport {
            mismatches: word(0),
            first_mismatch: Some(word(1)).filter(|_| word(0) > 0),
        })
    }

    /// The compiled kernel image (compiles and loads the kernels if not done yet).
    pub fn kernel_image(&self) -> Result<Arc<KernelImage>, GpuError> {
        Ok(self.kernels()?.image.clone())
    }

    /// The e4m3 conversion [`GpuDevice::quantise_fp8`] uses here.
    pub fn fp8_conversion(&self) -> Result<E4m3Conversion, GpuError> {
        Ok(self.kernels()?.conversion)
    }

    /// The hardware conversion's self-test on this device (None below sm_89).
    pub fn e4m3_selftest(&self) -> Result<Option<SelftestReport>, GpuError> {
        Ok(self.kernels()?.report)
    }

    /// Casts `src` (elements of `from`) into `dst` (elements of `to`) on the stream; bit-
    /// identical to [`crate::prepare::cast`]. Same-dtype casts are device copies.
    pub fn cast<S, D>(&self, src: &S, from: DType, dst: &mut D, to: DType) -> Result<(), GpuError>
    where
        S: DevicePtr<u8>,
        D: DevicePtrMut<u8>,
    {
        let ok = |d: DType| matches!(d, DType::BF16 | DType::F16 | DType::F32);
        if !ok(from) || !ok(to) {
            return Err(PrepareError::UnsupportedDType { from, to }.into());
        }
        if !src.len().is_multiple_of(from.size()) {
            return Err(PrepareError::Shape(format!(
                "source of {} bytes is not a whole number of {from}",
                src.len()
            ))
            .into());
        }
        let n = src.len() / from.size();
        crate::prepare::expect_len("cast output", n * to.size(), dst.len())?;
        self.same_context("cast source", src.stream())?;
        self.same_context("cast output", dst.stream())?;
        if n == 0 {
            return Ok(());
        }
        if from == to {
            self.stream.memcpy_dtod(src, dst)?;
            return Ok(());
        }
        let k = self.kernels()?;
        let f = &k
            .casts
            .iter()
            .find(|(a, b, _)| (*a, *b) == (from, to))
            .expect("a kernel for every pair of distinct float dtypes")
            .2;
        let (src_ptr, _read) = src.device_ptr(&self.stream);
        let (dst_ptr, _write) = dst.device_ptr_mut(&self.stream);
        ptr_aligned("cast source", src_ptr, from.size() as u64)?;
        ptr_aligned("cast output", dst_ptr, to.size() as u64)?;
        let steps = n.div_ceil(CAST_ELEMS_PER_STEP) as u64;
        let max_blocks = u64::from(self.info.sm_count) * 8;
        let blocks = steps.div_ceil(u64::from(CAST_THREADS)).clamp(1, max_blocks) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (CAST_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let n = n as u64;
        let mut launch = self.stream.launch_builder(f);
        launch.arg(&src_ptr).arg(&dst_ptr).arg(&n);
        // SAFETY: the arguments match `ws_cast_*(const u8*, u8*, u64)`; `src` holds `n`
        // elements of `from` and `dst` exactly `n` elements of `to` (checked above), both are of
        // this context and element-aligned (checked above); the kernel uses 16-byte accesses
        // only when both pointers are 16-byte aligned and touches indices below `n` only. The
        // `_read`/`_write` guards order the launch after earlier writers/readers of the buffers.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// fp8 e4m3fn block quantisation of a whole `[rows, cols]` tensor on the stream, with the
    /// conversion chosen for this device; bit-identical to [`crate::prepare::quantise_fp8`]. For
    /// a range of block rows, pass the rows of that range as a smaller tensor: the block grid is
    /// anchored at multiples of 128.
    pub fn quantise_fp8<S, V, C>(
        &self,
        src: &S,
        dtype: DType,
        shape: Fp8Shape,
        values: &mut V,
        scales: &mut C,
    ) -> Result<(), GpuError>
    where
        S: DevicePtr<u8>,
        V: DevicePtrMut<u8>,
        C: DevicePtrMut<u8>,
    {
        self.quantise_fp8_as(Fp8Recipe::Vllm, src, dtype, shape, values, scales)
    }

    /// [`GpuDevice::quantise_fp8`] following `recipe`; bit-identical to
    /// [`crate::prepare::quantise_fp8_as`].
    pub fn quantise_fp8_as<S, V, C>(
        &self,
        recipe: Fp8Recipe,
        src: &S,
        dtype: DType,
        shape: Fp8Shape,
        values: &mut V,
        scales: &mut C,
    ) -> Result<(), GpuError>
    where
        S: DevicePtr<u8>,
        V: DevicePtrMut<u8>,
        C: DevicePtrMut<u8>,
    {
        let conversion = self.fp8_conversion()?;
        self.quantise_fp8_recipe_with(src, dtype, shape, values, scales, conversion, recipe)
    }

    /// [`GpuDevice::quantise_fp8`] with an explicit conversion (the hardware one only where the
    /// self-test passed).
    pub fn quantise_fp8_with<S, V, C>(
        &self,
        src: &S,
        dtype: DType,
        shape: Fp8Shape,
        values: &mut V,
        scales: &mut C,
        conversion: E4m3Conversion,
    ) -> Result<(), GpuError>
    where
        S: DevicePtr<u8>,
        V: DevicePtrMut<u8>,
        C: DevicePtrMut<u8>,
    {
        let vllm = Fp8Recipe::Vllm;
        self.quantise_fp8_recipe_with(src, dtype, shape, values, scales, conversion, vllm)
    }

    /// [`GpuDevice::quantise_fp8_with`] following `recipe`.
    #[allow(clippy::too_many_arguments)]
    fn quantise_fp8_recipe_with<S, V, C>(
        &self,
        src: &S,
        dtype: DType,
        shape: Fp8Shape,
        values: &mut V,
        scales: &mut C,
        conversion: E4m3Conversion,
        recipe: Fp8Recipe,
    ) -> Result<(), GpuError>
    where
        S: DevicePtr<u8>,
        V: DevicePtrMut<u8>,
        C: DevicePtrMut<u8>,
    {
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(PrepareError::UnsupportedDType {
                from: dtype,
                to: DType::F8E4M3,
            }
            .into());
        }
        let (rows, cols) = (shape.rows, shape.cols);
        let tiles = shape.row_blocks().saturating_mul(shape.col_blocks());
        if rows > u32::MAX as usize || cols > u32::MAX as usize || tiles > i32::MAX as usize {
            return Err(
                PrepareError::Shape(format!("{rows}x{cols} is too large for one launch")).into(),
            );
        }
        crate::prepare::expect_len("fp8 source", rows * cols * dtype.size(), src.len())?;
        crate::prepare::expect_len("fp8 values", rows * cols, values.len())?;
        crate::prepare::expect_len("fp8 scales", tiles * 4, scales.len())?;
        self.same_context("fp8 source", src.stream())?;
        self.same_context("fp8 values", values.stream())?;
        self.same_context("fp8 scales", scales.stream())?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let k = self.kernels()?;
        if conversion == E4m3Conversion::Hardware && k.conversion != E4m3Conversion::Hardware {
            return Err(GpuError::HardwareConversion(match k.report {
                None => format!("sm_{} has no e4m3 conversion instruction", self.info.arch),
                Some(r) => format!("the self-test found {} differing inputs", r.mismatches),
            }));
        }
        let f = &k
            .fp8
            .iter()
            .find(|(d, _)| *d == dtype)
            .expect("a kernel per float dtype")
            .1;
        let (src_ptr, _read) = src.device_ptr(&self.stream);
        let (val_ptr, _write_values) = values.device_ptr_mut(&self.stream);
        let (scale_ptr, _write_scales) = scales.device_ptr_mut(&self.stream);
        ptr_aligned("fp8 source", src_ptr, dtype.size() as u64)?;
        ptr_aligned("fp8 scales", scale_ptr, 4)?;
        let vec = cols.is_multiple_of(8) && src_ptr.is_multiple_of(16) && val_ptr.is_multiple_of(8);
        let cfg = LaunchConfig {
            grid_dim: (tiles as u32, 1, 1),
            block_dim: (QUANT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, cb) = (rows as u32, cols as u32, shape.col_blocks() as u32);
        let (vec, hw, recipe) = (
            i32::from(vec),
            i32::from(conversion == E4m3Conversion::Hardware),
            recipe.code() as i32,
        );
        debug_assert_eq!(FP8_BLOCK, 128);
        let mut launch = self.stream.launch_builder(f);
        launch
            .arg(&src_ptr)
            .arg(&val_ptr)
            .arg(&scale_ptr)
            .arg(&r)
            .arg(&c)
            .arg(&cb)
            .arg(&vec)
            .arg(&hw)
            .arg(&recipe);
        // SAFETY: the arguments match `ws_fp8_*(const u8*, u8*, float*, u32, u32, u32, int,
        // int, int)` (`recipe`: a code of `Fp8Recipe`, any value is a valid one); the buffer lengths were checked against rows x cols and the scale grid, the
        // pointers are of this context and element-aligned (scales 4-byte), `vec` is set only
        // when the 16-byte loads and 8-byte stores it selects are aligned (cols % 8 == 0 keeps
        // every row start aligned), the grid is exactly one block per tile, and the kernel
        // bounds every index by rows/cols. The hardware conversion is only passed where the
        // device supports it. The guards order the launch after earlier users of the buffers.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
