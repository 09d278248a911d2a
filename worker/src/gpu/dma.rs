//! Raw asynchronous copies between device memory and host memory the safe types own: the rows
//! of a strided box (`cuMemcpy2DAsync`), plain ranges (`cuMemcpyDtoHAsync`,
//! `cuMemcpyDtoDAsync`, `cuMemcpyHtoDAsync`).
//!
//! Why raw: the trainer's staging is one registered host arena leased in ranges, and a source
//! in device memory may be a mapping or a borrowed pointer, none of which are cudarc buffers.
//! The callers ([`super::device_source`], [`super::device_destination`]) own the memory, check every range
//! before calling, and wait for an event recorded after the copies before the memory is used or
//! released; these functions only state that contract and queue the copies.

use cudarc::driver::{CudaStream, sys};

use super::GpuError;

/// Queues a copy of `rows` rows of `width` bytes, row `r` read at `src + r * pitch` of device
/// memory, into host memory at `dst`, rows dense (`dst + r * width`). One `cuMemcpy2DAsync`
/// when `pitch` is within the device's `max_pitch` (a single row is a plain copy), else one
/// copy per row.
///
/// # Safety
/// `src + r * pitch .. + width` for every row must be device memory of `stream`'s context that
/// stays allocated and unwritten until the copy completed; `dst .. dst + rows * width` must be
/// host memory that stays allocated and is neither read nor written by anyone until then. The
/// context must be bound to the calling thread.
pub(crate) unsafe fn d2h_rows(
    stream: &CudaStream,
    src: sys::CUdeviceptr,
    pitch: usize,
    dst: *mut u8,
    width: usize,
    rows: usize,
    max_pitch: usize,
) -> Result<(), GpuError> {
    if rows == 0 || width == 0 {
        return Ok(());
    }
    if rows == 1 {
        // SAFETY: the caller's contract, for the one row.
        return unsafe { d2h(stream, dst, src, width) };
    }
    if pitch <= max_pitch && width <= pitch {
        let copy = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            srcHost: std::ptr::null(),
            srcDevice: src,
            srcArray: std::ptr::null_mut(),
            srcPitch: pitch,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            dstHost: dst.cast(),
            dstDevice: 0,
            dstArray: std::ptr::null_mut(),
            dstPitch: width,
            WidthInBytes: width,
            Height: rows,
        };
        // SAFETY: the descriptor names exactly the rows of the caller's contract (device rows
        // `pitch` apart, host rows dense); the driver reads it before returning.
        return unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream.cu_stream()) }
            .result()
            .map_err(Into::into);
    }
    for r in 0..rows {
        // SAFETY: row `r` of the caller's contract.
        unsafe { d2h(stream, dst.add(r * width), src + (r * pitch) as u64, width)? };
    }
    Ok(())
}

/// Queues a copy of `len` bytes of device memory at `src` to host memory at `dst`.
///
/// # Safety
/// As [`d2h_rows`], for one range.
pub(crate) unsafe fn d2h(
    stream: &CudaStream,
    dst: *mut u8,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), GpuError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract: both ranges valid and untouched until the copy completed.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, stream.cu_stream()) }.result()?;
    Ok(())
}

/// Queues a copy of `len` bytes of device memory from `src` to `dst` (same context).
///
/// # Safety
/// Both ranges must be device memory of `stream`'s context, not overlapping; `src` stays
/// unwritten and `dst` untouched by anyone else until the copy completed. The context must be
/// bound to the calling thread.
pub(crate) unsafe fn d2d(
    stream: &CudaStream,
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
) -> Result<(), GpuError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream.cu_stream()) }.result()?;
    Ok(())
}

/// Queues a copy of `len` bytes of host memory at `src` to device memory at `dst`.
///
/// # Safety
/// `src .. src + len` must be host memory that stays allocated and unwritten until the copy
/// completed; `dst .. dst + len` device memory of `stream`'s context that nobody else reads or
/// writes until then. The context must be bound to the calling thread.
pub(crate) unsafe fn h2d(
    stream: &CudaStream,
    dst: sys::CUdeviceptr,
    src: *const u8,
    len: usize,
) -> Result<(), GpuError> {
    if len == 0 {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), len, stream.cu_stream()) }.result()?;
    Ok(())
}
