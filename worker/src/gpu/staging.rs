//! Staging memory: pinned host buffers and device buffers, with async copies of byte ranges
//! between them queued on the device's stream.
//!
//! Pinned (page-locked) memory is what lets `cuMemcpyHtoDAsync` / `cuMemcpyDtoHAsync` run truly
//! asynchronously and at full PCIe speed. The host must not rewrite a range still being copied
//! to the device, nor read one still being copied from it: every copy records an event
//! ([`super::pending`]), and [`PinnedStaging::as_mut_slice`] / [`PinnedStaging::as_slice`] wait
//! for them. This does not rely on cudarc's per-allocation events, which exist only while the
//! context tracks events in multi-stream mode and cover the whole buffer, not a range.

use std::ops::Range;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice, sys};

use super::pending::PendingCopies;
use super::{GpuDevice, GpuError};

/// Page-locked host staging.
#[derive(Debug)]
pub struct PinnedStaging {
    buf: PinnedHostSlice<u8>,
    /// The buffer's host address, taken once at allocation (cudarc's accessors wait on its
    /// event, which would serialise queuing copies).
    host: usize,
    len: usize,
    pending: PendingCopies,
}

impl PinnedStaging {
    /// Allocates `len` bytes of pinned host memory, zeroed.
    pub fn new(dev: &GpuDevice, len: usize) -> Result<PinnedStaging, GpuError> {
        // SAFETY: the allocation is uninitialised; it is zeroed below before anything reads it.
        let mut buf = unsafe { dev.context().alloc_pinned_with_flags::<u8>(len.max(1), 0) }?;
        buf.as_mut_slice()?.fill(0);
        let host = buf.as_mut_ptr()? as usize;
        Ok(PinnedStaging {
            buf,
            host,
            len,
            pending: PendingCopies::default(),
        })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The buffer for the host to fill (waits for copies still reading or writing it).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], GpuError> {
        self.pending.wait()?;
        Ok(&mut self.buf.as_mut_slice()?[..self.len])
    }

    /// The buffer for the host to read (waits for copies still writing it).
    pub fn as_slice(&self) -> Result<&[u8], GpuError> {
        self.pending.wait()?;
        Ok(&self.buf.as_slice()?[..self.len])
    }

    fn check(&self, dev: &GpuDevice, r: &Range<usize>) -> Result<(), GpuError> {
        if **self.buf.context() != **dev.context() {
            return Err(GpuError::WrongContext {
                what: "pinned staging",
            });
        }
        in_bounds("pinned staging", r, self.len)
    }
}

fn in_bounds(what: &'static str, r: &Range<usize>, have: usize) -> Result<(), GpuError> {
    if r.start > r.end || r.end > have {
        return Err(GpuError::OutOfBounds {
            what,
            offset: r.start,
            len: r.end.saturating_sub(r.start),
            have,
        });
    }
    Ok(())
}

/// Device staging.
#[derive(Debug)]
pub struct DeviceStaging {
    buf: CudaSlice<u8>,
}

impl DeviceStaging {
    /// Allocates `len` bytes of zeroed device memory.
    pub fn new(dev: &GpuDevice, len: usize) -> Result<DeviceStaging, GpuError> {
        Ok(DeviceStaging {
            buf: dev.alloc(len.max(1))?,
        })
    }

    fn check(&self, dev: &GpuDevice, r: &Range<usize>) -> Result<(), GpuError> {
        if **self.buf.context() != **dev.context() {
            return Err(GpuError::WrongContext {
                what: "device staging",
            });
        }
        in_bounds("device staging", r, self.buf.len())
    }

    /// Queues an async copy of `src[src_range]` to `dst_offset` of this staging.
    pub fn h2d_async(
        &mut self,
        dev: &GpuDevice,
        src: &PinnedStaging,
        src_range: Range<usize>,
        dst_offset: usize,
    ) -> Result<(), GpuError> {
        let len = src_range.end.saturating_sub(src_range.start);
        let dst_range = dst_offset..dst_offset.saturating_add(len);
        src.check(dev, &src_range)?;
        self.check(dev, &dst_range)?;
        if len == 0 {
            return Ok(());
        }
        dev.context().bind_to_thread()?;
        let stream = dev.stream();
        {
            let mut view = self.buf.slice_mut(dst_range);
            let (dptr, _write) = view.device_ptr_mut(stream);
            // SAFETY: both ranges were bounds-checked and belong to this context; the pinned
            // range stays allocated and unwritten by the host until the event recorded below
            // completes (`PinnedStaging`'s accessors and Drop wait for it; Drop of the cudarc
            // buffer synchronises too); `_write` orders the copy after earlier users of `view`.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dptr,
                    (src.host + src_range.start) as *const std::ffi::c_void,
                    len,
                    stream.cu_stream(),
                )
            }
            .result()?;
        }
        src.pending.record(stream)
    }

    /// Queues an async copy of `self[src_range]` into `dst` at `dst_offset`.
    pub fn d2h_async(
        &self,
        dev: &GpuDevice,
        src_range: Range<usize>,
        dst: &mut PinnedStaging,
        dst_offset: usize,
    ) -> Result<(), GpuError> {
        let len = src_range.end.saturating_sub(src_range.start);
        let dst_range = dst_offset..dst_offset.saturating_add(len);
        self.check(dev, &src_range)?;
        dst.check(dev, &dst_range)?;
        if len == 0 {
            return Ok(());
        }
        dev.context().bind_to_thread()?;
        let stream = dev.stream();
        {
            let view = self.buf.slice(src_range);
            let (sptr, _read) = view.device_ptr(stream);
            // SAFETY: both ranges were bounds-checked and belong to this context; the host
            // range is neither read nor rewritten by the host until the event recorded below
            // completes (`PinnedStaging`'s accessors wait for it, and `dst` is borrowed mutably
            // here so no host slice of it is alive); `_read` orders the copy after earlier
            // writers of `view`.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(
                    (dst.host + dst_range.start) as *mut std::ffi::c_void,
                    sptr,
                    len,
                    stream.cu_stream(),
                )
            }
            .result()?;
        }
        dst.pending.record(stream)
    }

    /// The device buffer (for kernels and WRITEs).
    pub fn buffer(&self) -> &CudaSlice<u8> {
        &self.buf
    }

    /// The device buffer, mutably.
    pub fn buffer_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.buf
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // The cudarc buffer frees the memory after this; no copy may still use it. Errors are
        // ignored: a failed copy no longer touches the memory.
        let _ = self.pending.wait();
    }
}
