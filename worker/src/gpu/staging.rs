//! Staging memory for the H2D stage: pinned host buffers and device buffers, with async
//! copies queued on the device's stream.
//!
//! Pinned (page-locked) memory is what lets `cuMemcpyHtoDAsync` run truly asynchronously and
//! at full PCIe speed; cudarc's `PinnedHostSlice` records an event after each copy and makes
//! host access wait for it, so the host can never rewrite a buffer still being copied.

use cudarc::driver::{CudaSlice, PinnedHostSlice};

use super::{GpuDevice, GpuError};

/// Page-locked host staging.
#[derive(Debug)]
pub struct PinnedStaging {
    buf: PinnedHostSlice<u8>,
}

impl PinnedStaging {
    /// Allocates `len` bytes of pinned host memory, zeroed.
    pub fn new(dev: &GpuDevice, len: usize) -> Result<PinnedStaging, GpuError> {
        // SAFETY: the allocation is uninitialised; it is zeroed below before anything reads it.
        let mut buf = unsafe { dev.context().alloc_pinned_with_flags::<u8>(len.max(1), 0) }?;
        buf.as_mut_slice()?.fill(0);
        Ok(PinnedStaging { buf })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The buffer for the host to fill (waits for copies still reading it).
    pub fn as_mut_slice(&mut self) -> Result<&mut [u8], GpuError> {
        Ok(self.buf.as_mut_slice()?)
    }
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

    /// Queues an async copy of the whole pinned buffer to `offset` of this staging.
    pub fn h2d_async(
        &mut self,
        dev: &GpuDevice,
        src: &PinnedStaging,
        offset: usize,
    ) -> Result<(), GpuError> {
        let have = self.buf.len();
        if offset.checked_add(src.len()).is_none_or(|end| end > have) {
            return Err(GpuError::OutOfBounds {
                what: "device staging",
                offset,
                len: src.len(),
                have,
            });
        }
        let mut view = self.buf.slice_mut(offset..offset + src.len());
        dev.stream().memcpy_htod(&src.buf, &mut view)?;
        Ok(())
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
