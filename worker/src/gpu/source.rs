//! The trainer's source arena in GPU memory: a buffer this process owns; one the training
//! process exported with `cudaIpcGetMemHandle` and this worker maps with `cuIpcOpenMemHandle`;
//! or one it borrows in the same process (an engine plugin handing over a tensor's pointer).
//!
//! Why every copy out of a mapped or borrowed arena is tracked: the copies are asynchronous,
//! and unmapping (or the owner freeing) memory that a queued copy still reads is an
//! illegal-address fault that ends the context. So each copy records an event, and dropping the
//! source waits for those events before it unmaps or hands the memory back.
//!
//! What an exporter must provide (legacy CUDA IPC): memory from `cudaMalloc`/`cuMemAlloc`, not
//! from a stream-ordered pool (`cudaMallocAsync`, which cudarc's `alloc_zeros` uses) and not
//! from PyTorch's `expandable_segments` (those export VMM handles instead); the handle maps the
//! exporter's *whole allocation*, so a tensor carved from a larger block (PyTorch's caching
//! allocator: `storage._share_cuda_()` returns the block's handle and an offset) is passed with
//! its offset; and a process cannot open its own handle, hence [`BorrowedDevice`]. The exporter
//! must keep the allocation alive until every importer has dropped its mapping.
//!
//! An IPC mapping is checked against the size the routing table needs with
//! `cuMemGetAddressRange` (a handle carries no length), so a short source is refused at attach
//! time, before any copy.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use weightsync_common::fabric::MemoryOwner;

use super::pending::PendingCopies;
use super::{GpuDevice, GpuError};

/// Size of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = sys::CU_IPC_HANDLE_SIZE as usize;

/// The allocation containing `ptr`: (base, size), in the current context.
fn address_range(ptr: sys::CUdeviceptr) -> Result<(sys::CUdeviceptr, usize), GpuError> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: out-pointers are valid; the driver only looks `ptr` up.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }.result()?;
    Ok((base, size))
}

/// A device allocation of another process, mapped through its IPC handle; waits for queued
/// copies and unmaps on drop.
#[derive(Debug)]
pub struct IpcMapping {
    ctx: Arc<CudaContext>,
    mapped: sys::CUdeviceptr,
    arena: sys::CUdeviceptr,
    len: usize,
    pending: PendingCopies,
}

impl IpcMapping {
    /// Maps the allocation behind `handle` and checks that `need` bytes are available from
    /// `offset` into it (the arena's place in the exporter's allocation).
    pub fn open(
        dev: &GpuDevice,
        handle: &[u8; IPC_HANDLE_BYTES],
        offset: usize,
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
        // bound to this thread above. On success the mapping is owned by the value built next,
        // whose Drop closes it exactly once (also on the error returns below).
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()?;
        let mut mapping = IpcMapping {
            ctx: dev.context().clone(),
            mapped: ptr,
            arena: ptr,
            len: 0,
            pending: PendingCopies::default(),
        };
        let (base, size) = address_range(ptr)?;
        let have = (base as usize + size).saturating_sub(ptr as usize);
        if offset.checked_add(need).is_none_or(|end| end > have) {
            return Err(GpuError::OutOfBounds {
                what: "IPC-mapped source arena",
                offset,
                len: need,
                have,
            });
        }
        mapping.arena = ptr + offset as u64;
        mapping.len = need;
        Ok(mapping)
    }

    /// Arena bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // A failed copy no longer reads the mapping, so an error here does not stop the unmap.
        let _ = self.pending.wait();
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `mapped` came from a successful `cuIpcOpenMemHandle` and is closed only
            // here, after every copy queued from it has completed (`wait` above).
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.mapped) };
        }
    }
}

/// Device memory this process does not own and must not free: a range of another library's
/// allocation in the same process (a PyTorch tensor's storage). Waits on drop for the copies
/// queued from it, after which its owner may free or rewrite it.
#[derive(Debug)]
pub struct BorrowedDevice {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    pending: PendingCopies,
    /// What keeps the memory alive (a Python tensor), released after Drop waited.
    owner: Option<MemoryOwner>,
}

impl BorrowedDevice {
    /// Borrows `[ptr, ptr + len)` of device memory in `dev`'s context; checks that the range
    /// is covered by live allocations of that context, one or several back to back (as
    /// `cuMemGetAddressRange` sees them: for memory from a stream-ordered pool the allocation
    /// it reports may be larger, and the check weaker; see [`covered_by_allocations`]).
    ///
    /// # Safety
    /// The range must stay allocated, and must not be written by anyone else while a copy from
    /// it may be queued, until the returned value is dropped.
    pub unsafe fn new(
        dev: &GpuDevice,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<BorrowedDevice, GpuError> {
        dev.context().bind_to_thread()?;
        covered_by_allocations(ptr, len)?;
        Ok(BorrowedDevice {
            ctx: dev.context().clone(),
            ptr,
            len,
            pending: PendingCopies::default(),
            owner: None,
        })
    }

    /// Keeps `owner` (what keeps the memory alive) until this is dropped, after its copies.
    pub fn with_owner(mut self, owner: MemoryOwner) -> BorrowedDevice {
        self.owner = Some(owner);
        self
    }
}

/// Checks that every byte of `[ptr, ptr + len)` lies in a live allocation of the current
/// context, walking `cuMemGetAddressRange` from `ptr`, then from the end of each allocation it
/// reports, until the range is covered. Several allocations back to back are PyTorch's
/// expandable segments (`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`): one reserved VA
/// range with physical chunks `cuMemMap`ped into it, for which `cuMemGetAddressRange` reports
/// only the chunk holding the address, so a tensor straddling two chunks is legal memory that a
/// one-allocation check refuses (device review N4; libfabric dropped that check for the same
/// reason). An unmapped gap in the range is refused, naming where it starts.
fn covered_by_allocations(ptr: sys::CUdeviceptr, len: usize) -> Result<(), GpuError> {
    let end = ptr
        .checked_add(len as sys::CUdeviceptr)
        .ok_or(GpuError::OutOfBounds {
            what: "borrowed device arena (address overflow)",
            offset: 0,
            len,
            have: 0,
        })?;
    let mut at = ptr;
    while at < end {
        let (base, size) = address_range(at).map_err(|_| GpuError::OutOfBounds {
            what: "borrowed device arena (a gap in its allocations after the bytes it has)",
            offset: 0,
            len,
            have: (at - ptr) as usize,
        })?;
        let next = base + size as sys::CUdeviceptr;
        if size == 0 || next <= at {
            return Err(GpuError::OutOfBounds {
                what: "borrowed device arena (an empty allocation after the bytes it has)",
                offset: 0,
                len,
                have: (at - ptr) as usize,
            });
        }
        at = next;
    }
    Ok(())
}

impl Drop for BorrowedDevice {
    fn drop(&mut self) {
        // Errors are ignored: a failed copy no longer reads the memory.
        let _ = self.pending.wait();
        // Only now may the owner free the memory.
        drop(self.owner.take());
    }
}

/// Device memory owned by someone else in this process (a torch CUDA tensor's storage), kept
/// alive by an owner object: what a caller hands over to register a tensor in device memory
/// ([`crate::TensorSet::register_device`]). Nothing is checked or opened until registration.
#[derive(Debug)]
pub struct DeviceMemory {
    pub(crate) ordinal: usize,
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    pub(crate) owner: MemoryOwner,
}

impl DeviceMemory {
    /// Wraps `len` bytes at device address `ptr` of GPU `ordinal`, kept alive by `owner`.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of GPU `ordinal`'s primary context that stays
    /// allocated while `owner` is alive, and is not written while a sync reads it. Work that
    /// wrote it on other streams must have completed before a sync starts (the caller
    /// synchronises its stream first).
    pub unsafe fn from_raw(
        ordinal: usize,
        ptr: sys::CUdeviceptr,
        len: usize,
        owner: MemoryOwner,
    ) -> DeviceMemory {
        DeviceMemory {
            ordinal,
            ptr,
            len,
            owner,
        }
    }

    /// The GPU.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Borrows the memory on `dev` (checked to lie in one allocation of its context).
    pub(crate) fn borrow_on(self, dev: &GpuDevice) -> Result<GpuSource, GpuError> {
        // SAFETY: `from_raw`'s contract: the range stays allocated while the owner lives, and
        // the owner moves into the BorrowedDevice, released only after its Drop waited for
        // every copy queued from the range; nobody writes it while a sync reads it.
        let b = unsafe { BorrowedDevice::new(dev, self.ptr, self.len) }?;
        Ok(GpuSource::Borrowed(b.with_owner(self.owner)))
    }
}

/// The source arena in device memory.
#[derive(Debug)]
pub enum GpuSource {
    /// A buffer this process owns.
    Owned(CudaSlice<u8>),
    /// Another process's buffer, mapped by IPC handle.
    Ipc(IpcMapping),
    /// A range of memory another part of this process owns.
    Borrowed(BorrowedDevice),
}

impl GpuSource {
    /// Arena bytes.
    pub fn len(&self) -> usize {
        match self {
            GpuSource::Owned(b) => b.len(),
            GpuSource::Ipc(m) => m.len(),
            GpuSource::Borrowed(b) => b.len,
        }
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Queues a device-to-device copy of `[offset, offset + len)` of the arena into `dst` at
    /// `dst_offset` on `dev`'s stream (the "source to staging" stage for a GPU-resident source).
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
        let src_ctx = match self {
            GpuSource::Owned(b) => b.context(),
            GpuSource::Ipc(m) => &m.ctx,
            GpuSource::Borrowed(b) => &b.ctx,
        };
        if **src_ctx != **dev.context() {
            return Err(GpuError::WrongContext {
                what: "gpu source arena",
            });
        }
        if **dst.context() != **dev.context() {
            return Err(GpuError::WrongContext {
                what: "device staging",
            });
        }
        if len == 0 {
            return Ok(());
        }
        dev.context().bind_to_thread()?;
        let stream = dev.stream();
        let mut dst_view = dst.slice_mut(dst_offset..dst_offset + len);
        let (base, pending) = match self {
            GpuSource::Owned(b) => {
                stream.memcpy_dtod(&b.slice(offset..offset + len), &mut dst_view)?;
                return Ok(());
            }
            GpuSource::Ipc(m) => (m.arena, &m.pending),
            GpuSource::Borrowed(b) => (b.ptr, &b.pending),
        };
        {
            let (dptr, _write) = dst_view.device_ptr_mut(stream);
            // SAFETY: both ranges were bounds-checked above and belong to this context (checked
            // above; the context is bound); the source stays mapped (or borrowed) until its Drop
            // has waited for the event recorded below, and `_write` orders the copy after
            // earlier users of the destination.
            unsafe {
                sys::cuMemcpyDtoDAsync_v2(dptr, base + offset as u64, len, stream.cu_stream())
            }
            .result()?;
        }
        pending.record(stream)?;
        Ok(())
    }
}

impl GpuSource {
    /// The context the arena belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        match self {
            GpuSource::Owned(b) => b.context(),
            GpuSource::Ipc(m) => &m.ctx,
            GpuSource::Borrowed(b) => &b.ctx,
        }
    }

    /// Runs `queue` with the device address of `[offset, offset + len)` of the arena, for it to
    /// queue reads of that range on `stream` (raw copies), and tracks them: an owned buffer
    /// orders them after its earlier writers (cudarc's events), a mapped or borrowed arena
    /// records an event its Drop waits for before unmapping or handing the memory back.
    pub(crate) fn read_on<R>(
        &self,
        stream: &Arc<CudaStream>,
        offset: usize,
        len: usize,
        queue: impl FnOnce(sys::CUdeviceptr) -> Result<R, GpuError>,
    ) -> Result<R, GpuError> {
        if offset.checked_add(len).is_none_or(|e| e > self.len()) {
            return Err(GpuError::OutOfBounds {
                what: "gpu source arena",
                offset,
                len,
                have: self.len(),
            });
        }
        if **self.context() != **stream.context() {
            return Err(GpuError::WrongContext {
                what: "gpu source arena",
            });
        }
        stream.context().bind_to_thread()?;
        let (base, pending) = match self {
            GpuSource::Owned(b) => {
                let (ptr, _read) = b.device_ptr(stream);
                return queue(ptr + offset as u64);
            }
            GpuSource::Ipc(m) => (m.arena, &m.pending),
            GpuSource::Borrowed(b) => (b.ptr, &b.pending),
        };
        let out = queue(base + offset as u64);
        // Recorded whether or not every copy was queued: those that were must be waited for.
        pending.record(stream)?;
        out
    }
}

/// Device memory allocated with `cuMemAlloc` (never pool memory) and exported through a CUDA
/// IPC handle: what a training process (or a test standing in for one) hands the worker. Freed
/// on drop; importers must have unmapped it by then.
#[derive(Debug)]
pub struct IpcExport {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
}

impl IpcExport {
    /// Allocates `len` bytes (at least 1), zeroed.
    pub fn new(dev: &GpuDevice, len: usize) -> Result<IpcExport, GpuError> {
        dev.context().bind_to_thread()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer, context bound; the allocation is owned by the value built
        // next, whose Drop frees it once.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, len.max(1)) }.result()?;
        let out = IpcExport {
            ctx: dev.context().clone(),
            ptr,
            len,
        };
        // SAFETY: `ptr` is a live allocation of at least len.max(1) bytes in the bound context.
        unsafe { sys::cuMemsetD8_v2(ptr, 0, len.max(1)) }.result()?;
        out.settle()?;
        Ok(out)
    }

    /// Waits for this process's synchronous-looking memset and copies on the legacy default
    /// stream: a host-to-device `cuMemcpy` from pageable memory may return before its DMA has
    /// landed, and another process must not see the memory until it has.
    fn settle(&self) -> Result<(), GpuError> {
        // SAFETY: the null stream is the context's legacy default stream; the context is bound.
        unsafe { sys::cuStreamSynchronize(std::ptr::null_mut()) }.result()?;
        Ok(())
    }

    /// The allocation's device address (for a same-process borrower, [`BorrowedDevice`]).
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The IPC handle another process passes to [`IpcMapping::open`].
    pub fn handle(&self) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
        self.ctx.bind_to_thread()?;
        let mut h = sys::CUipcMemHandle_st {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: valid out-pointer; `ptr` is the base of a live cuMemAlloc allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) }.result()?;
        let mut out = [0u8; IPC_HANDLE_BYTES];
        for (d, s) in out.iter_mut().zip(h.reserved) {
            *d = s as u8;
        }
        Ok(out)
    }

    fn check(&self, offset: usize, len: usize) -> Result<(), GpuError> {
        if offset.checked_add(len).is_none_or(|e| e > self.len) {
            return Err(GpuError::OutOfBounds {
                what: "IPC export",
                offset,
                len,
                have: self.len,
            });
        }
        Ok(())
    }

    /// Writes `bytes` at `offset` (synchronous).
    pub fn write(&mut self, offset: usize, bytes: &[u8]) -> Result<(), GpuError> {
        self.check(offset, bytes.len())?;
        if bytes.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the range was bounds-checked; a synchronous copy from a live host slice.
        unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset as u64, bytes.as_ptr().cast(), bytes.len())
        }
        .result()?;
        self.settle()
    }

    /// Reads `len` bytes at `offset` (synchronous).
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>, GpuError> {
        self.check(offset, len)?;
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        self.ctx.bind_to_thread()?;
        // SAFETY: the range was bounds-checked; a synchronous copy into a live host buffer.
        unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.ptr + offset as u64, len) }
            .result()?;
        Ok(out)
    }
}

impl Drop for IpcExport {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from a successful cuMemAlloc and is freed once, here; this
            // process queued no asynchronous work on it (its copies are synchronous).
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}
