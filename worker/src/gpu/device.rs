//! [`GpuDevice`]: one CUDA context and stream with the preparation kernels compiled by NVRTC.

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use weightsync_common::DType;

use super::{driver_present, nvrtc_present, GpuError};
use crate::prepare::{Fp8Shape, PrepareError};

/// The CUDA source of the kernels.
pub const KERNELS_CU: &str = include_str!("kernels.cu");

/// A GPU with its stream and compiled preparation kernels.
#[derive(Debug)]
pub struct GpuDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    cast_fn: CudaFunction,
    quant_fn: CudaFunction,
}

fn code(d: DType) -> i32 {
    match d {
        DType::BF16 => 0,
        DType::F16 => 1,
        _ => 2,
    }
}

impl GpuDevice {
    /// Opens GPU `ordinal`: checks the libraries, creates a stream, compiles the kernels.
    pub fn open(ordinal: usize) -> Result<GpuDevice, GpuError> {
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        if !nvrtc_present() {
            return Err(GpuError::NoNvrtc);
        }
        let ctx = CudaContext::new(ordinal)?;
        let stream = ctx.new_stream()?;
        let opts = CompileOptions {
            ftz: Some(false),
            prec_div: Some(true),
            prec_sqrt: Some(true),
            fmad: Some(false),
            name: Some("weightsync_prepare.cu".into()),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(KERNELS_CU, opts)
            .map_err(|e| GpuError::Compile(e.to_string()))?;
        let module = ctx.load_module(ptx)?;
        let cast_fn = module.load_function("ws_cast")?;
        let quant_fn = module.load_function("ws_fp8_block_quant")?;
        Ok(GpuDevice {
            ctx,
            stream,
            cast_fn,
            quant_fn,
        })
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every operation of this device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// A zeroed device buffer.
    pub fn alloc(&self, len: usize) -> Result<CudaSlice<u8>, GpuError> {
        Ok(self.stream.alloc_zeros::<u8>(len)?)
    }

    /// Copies host bytes into a new device buffer.
    pub fn upload(&self, bytes: &[u8]) -> Result<CudaSlice<u8>, GpuError> {
        Ok(self.stream.clone_htod(bytes)?)
    }

    /// Copies a device buffer back to the host (waits).
    pub fn download(&self, buf: &CudaSlice<u8>) -> Result<Vec<u8>, GpuError> {
        Ok(self.stream.clone_dtoh(buf)?)
    }

    /// Casts `src` (elements of `from`) into `dst` (elements of `to`) on the stream; bit-
    /// identical to [`crate::prepare::cast`].
    pub fn cast(
        &self,
        src: &CudaSlice<u8>,
        from: DType,
        dst: &mut CudaSlice<u8>,
        to: DType,
    ) -> Result<(), GpuError> {
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
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(256).min(1 << 16) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, f, t) = (n as u64, code(from), code(to));
        let mut launch = self.stream.launch_builder(&self.cast_fn);
        launch.arg(src).arg(dst).arg(&n).arg(&f).arg(&t);
        // SAFETY: the arguments match `ws_cast(const u8*, u8*, u64, int, int)`; `src` holds `n`
        // elements of `from` and `dst` exactly `n` elements of `to` (checked above), and the
        // kernel touches indices below `n` only.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// fp8 e4m3fn block quantisation of a whole `[rows, cols]` tensor on the stream;
    /// bit-identical to [`crate::prepare::quantise_fp8`]. For a range of block rows, pass the
    /// rows of that range as a smaller tensor: the block grid is anchored at multiples of 128.
    pub fn quantise_fp8(
        &self,
        src: &CudaSlice<u8>,
        dtype: DType,
        shape: Fp8Shape,
        values: &mut CudaSlice<u8>,
        scales: &mut CudaSlice<u8>,
    ) -> Result<(), GpuError> {
        if !matches!(dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(PrepareError::UnsupportedDType {
                from: dtype,
                to: DType::F8E4M3,
            }
            .into());
        }
        let (rows, cols) = (shape.rows, shape.cols);
        if rows > u32::MAX as usize || cols > u32::MAX as usize || shape.row_blocks() > 65535 {
            return Err(
                PrepareError::Shape(format!("{rows}x{cols} is too large for one launch")).into(),
            );
        }
        crate::prepare::expect_len("fp8 source", rows * cols * dtype.size(), src.len())?;
        crate::prepare::expect_len("fp8 values", rows * cols, values.len())?;
        crate::prepare::expect_len(
            "fp8 scales",
            shape.row_blocks() * shape.col_blocks() * 4,
            scales.len(),
        )?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (shape.col_blocks() as u32, shape.row_blocks() as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (r, c, d) = (rows as u32, cols as u32, code(dtype));
        let mut launch = self.stream.launch_builder(&self.quant_fn);
        launch
            .arg(src)
            .arg(values)
            .arg(scales)
            .arg(&r)
            .arg(&c)
            .arg(&d);
        // SAFETY: the arguments match `ws_fp8_block_quant(const u8*, u8*, float*, u32, u32,
        // int)`; the buffer lengths were checked against rows x cols and the scale grid above,
        // the grid is exactly the block grid, and the kernel bounds every index by rows/cols.
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }
}
