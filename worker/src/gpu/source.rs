//! The trainer's source arena in GPU memory: a buffer this process owns, or one the training
//! process exported with `cudaIpcGetMemHandle` and this worker maps with `cuIpcOpenMemHandle`.
//!
//! An IPC mapping is checked against the size the routing table needs with
//! `cuMemGetAddressRange` (a handle carries no length), so a short source is refused at attach
//! time, before any copy.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaSlice, DevicePtrMut};

use super::{GpuDevice, GpuError};

/// Size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = sys::CU_IPC_HANDLE_SIZE as usize;

/// A device allocation of another process, mapped through its IPC handle; unmapped on drop.
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` and checks that `need` bytes are available from
    /// its start.
    pub fn open(
        dev: &GpuDevice,
        handle: &[u8; IPC_HANDLE_BYTES],
        need: usize,
    ) -> Result<IpcMapping, GpuError> {
        dev.context().bind_to_thread()?;
        let mut h = sys::CUipcMemHandle_st {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (d, s) in h.reserved.iter_mut().zip(handle) {
            *d = *s as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `ptr` is a valid out-pointer; the handle is passed by value; the context is
        // bound to this thread above. On success the mapping is owned by the returned value,
        // whose Drop closes it exactly once.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()?;
        let mapping = IpcMapping {
            ctx: dev.context().clone(),
            ptr,
            len: 0,
        };
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers are valid; `ptr` is a live device pointer just mapped.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
        let have = (base as usize + size).saturating_sub(ptr as usize);
        if have < need {
            return Err(GpuError::OutOfBounds {
                what: "IPC-mapped source arena",
                offset: 0,
                len: need,
                have,
            });
        }
        let mut mapping = mapping;
        mapping.len = have;
        Ok(mapping)
    }

    /// Bytes mapped.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from a successful `cuIpcOpenMemHandle` and is closed only here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// The source arena in device memory.
#[derive(Debug)]
pub enum GpuSource {
    /// A buffer this process owns.
    Owned(CudaSlice<u8>),
    /// Another process's buffer, mapped by IPC handle.
    Ipc(IpcMapping),
}

impl GpuSource {
    /// Arena bytes.
    pub fn len(&self) -> usize {
        match self {
            GpuSource::Owned(b) => b.len(),
            GpuSource::Ipc(m) => m.len(),
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues a device-to-device copy of `[offset, offset + len)` of the arena into `dst` at
    /// `dst_offset` (the H2D stage's equivalent for a GPU-resident source).
    pub fn copy_to(
        &self,
        dev: &GpuDevice,
        offset: usize,
        len: usize,
        dst: &mut CudaSlice<u8>,
        dst_offset: usize,
    ) -> Result<(), GpuError> {
        let oob = |what, offset, have| GpuError::OutOfBounds {
            what,
            offset,
            len,
            have,
        };
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(oob("gpu source arena", offset, self.len()));
        }
        if dst_offset.checked_add(len).is_none_or(|e| e > dst.len()) {
            return Err(oob("device staging", dst_offset, dst.len()));
        }
        if len == 0 {
            return Ok(());
        }
        let stream = dev.stream();
        let mut dst_view = dst.slice_mut(dst_offset..dst_offset + len);
        match self {
            GpuSource::Owned(b) => {
                stream.memcpy_dtod(&b.slice(offset..offset + len), &mut dst_view)?
            }
            GpuSource::Ipc(m) => {
                let (dptr, _sync) = dst_view.device_ptr_mut(stream);
                // SAFETY: both ranges were bounds-checked above; the source mapping outlives the
                // copy (the caller synchronises the stream before dropping `self`, and
                // `_sync` records the destination's use on the stream).
                unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dptr, m.ptr + offset as u64, len, stream.cu_stream())
                }
                .result()?;
            }
        }
        Ok(())
    }
}
