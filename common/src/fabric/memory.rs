//! Memory that can be registered with the fabric.
//!
//! RDMA registers memory once, at start-up, and keeps it at a stable address for the whole job:
//! the NIC (or, for TCP, the receiving lane thread) writes into it without asking the owner. So a
//! registration takes either memory it owns ([`PageAlignedBuffer`], freed when the last handle to
//! the registration is gone) or a raw range the caller promises to keep alive ([`RawMemory`], e.g.
//! a pinned staging buffer or a CUDA allocation for verbs with GPUDirect). The raw constructor is
//! the one `unsafe` entry point: the fabric cannot check a pointer's lifetime.

use std::alloc::Layout;
use std::ptr::NonNull;

use super::error::{FabricError, Result};

/// Page size used for owned buffers (NICs and `MAP_*` pinning work on pages).
pub const PAGE_SIZE: usize = 4096;

/// An owned, zero-initialised, page-aligned host buffer. Freed on drop.
pub struct PageAlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned bytes with no thread affinity; access goes through &/&mut or
// through a registration that serialises revocation (see `RegisteredMemory`).
unsafe impl Send for PageAlignedBuffer {}
// SAFETY: shared references only expose raw pointers and lengths; all byte access is done by code
// that documents its own synchronisation.
unsafe impl Sync for PageAlignedBuffer {}

impl PageAlignedBuffer {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_SIZE`]. `len` may be zero.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(PageAlignedBuffer {
                ptr: NonNull::<u8>::dangling(),
                len: 0,
            });
        }
        let layout = Self::layout(len)?;
        // SAFETY: layout has a non-zero size (len > 0) and a valid power-of-two alignment.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| FabricError::Registration {
            len: len as u64,
            detail: "allocation failed".into(),
            hint: Some("not enough memory for the buffer".into()),
        })?;
        Ok(PageAlignedBuffer { ptr, len })
    }

    fn layout(len: usize) -> Result<Layout> {
        Layout::from_size_align(len, PAGE_SIZE).map_err(|e| FabricError::Registration {
            len: len as u64,
            detail: format!("bad layout: {e}"),
            hint: None,
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes (allocated, zero-initialised) or dangling with len 0,
        // and &self guarantees no &mut alias exists.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably (before registration, e.g. to fill a source).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for PageAlignedBuffer {
    fn drop(&mut self) {
        if self.len == 0 {
            return;
        }
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: ptr was returned by alloc_zeroed with exactly this layout and not freed yet.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl std::fmt::Debug for PageAlignedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageAlignedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

/// Where raw memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemoryLocation {
    /// Host memory the CPU can read and write.
    Host,
    /// Device memory of a CUDA GPU (only verbs with GPUDirect can register it; host accessors
    /// on such a region return [`FabricError::Unsupported`]).
    CudaDevice {
        /// CUDA device ordinal.
        ordinal: u32,
    },
}

/// What keeps a raw range's memory alive (see [`RawMemory::owning`]).
pub type MemoryOwner = Box<dyn std::any::Any + Send + Sync>;

/// A raw memory range the caller keeps alive (see [`RawMemory::new`]), or that an owner it
/// carries keeps alive (see [`RawMemory::owning`]).
pub struct RawMemory {
    ptr: *mut u8,
    len: usize,
    location: MemoryLocation,
    /// Dropped with the registration (after every clone of its region and every write from it).
    _owner: Option<MemoryOwner>,
}

impl std::fmt::Debug for RawMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawMemory")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("location", &self.location)
            .field("owned", &self._owner.is_some())
            .finish()
    }
}

// SAFETY: the creator of a RawMemory promised (in `new`'s contract) that the range is valid for
// reads and writes from any thread for the life of the registration.
unsafe impl Send for RawMemory {}
// SAFETY: as for Send; shared references only expose the pointer.
unsafe impl Sync for RawMemory {}

impl RawMemory {
    /// Wraps a memory range for registration.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, from any thread, and stay valid
    /// (not freed, not moved, not unmapped) until the [`Region`](super::Region) registered from it
    /// and every clone of that region (including those held by in-flight
    /// [`WriteOp`](super::WriteOp)s) have been dropped. While registered with
    /// [`Access::REMOTE_WRITE`](super::Access::REMOTE_WRITE), peers may change its bytes at any
    /// time; the caller must not hold Rust references to it across that time.
    pub unsafe fn new(ptr: *mut u8, len: usize, location: MemoryLocation) -> Self {
        RawMemory {
            ptr,
            len,
            location,
            _owner: None,
        }
    }

    /// Wraps a memory range that `owner` keeps alive (e.g. a reference to the Python object of
    /// a tensor): the registration holds `owner` and drops it only after the last clone of its
    /// region (in-flight writes included) is gone.
    ///
    /// # Safety
    /// As for [`RawMemory::new`], except that the range must stay valid (not freed, not moved,
    /// not unmapped) while `owner` is alive, rather than until the region is dropped.
    pub unsafe fn owning(
        ptr: *mut u8,
        len: usize,
        location: MemoryLocation,
        owner: MemoryOwner,
    ) -> Self {
        RawMemory {
            ptr,
            len,
            location,
            _owner: Some(owner),
        }
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        self.location
    }
}

/// Memory handed to [`FabricBackend::register`](super::FabricBackend::register).
#[derive(Debug)]
pub enum Memory {
    /// A buffer the registration owns and frees.
    Owned(PageAlignedBuffer),
    /// A range the caller keeps alive.
    Raw(RawMemory),
}

impl Memory {
    /// Allocates an owned, zeroed, page-aligned buffer of `len` bytes.
    pub fn alloc(len: usize) -> Result<Memory> {
        Ok(Memory::Owned(PageAlignedBuffer::new(len)?))
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        match self {
            Memory::Owned(b) => b.as_ptr(),
            Memory::Raw(r) => r.as_ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Memory::Owned(b) => b.len(),
            Memory::Raw(r) => r.len(),
        }
    }

    /// Whether the memory is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        match self {
            Memory::Owned(_) => MemoryLocation::Host,
            Memory::Raw(r) => r.location(),
        }
    }
}

impl From<PageAlignedBuffer> for Memory {
    fn from(b: PageAlignedBuffer) -> Self {
        Memory::Owned(b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owned_buffer_is_page_aligned_and_zeroed() {
        let mut b = PageAlignedBuffer::new(10_000).unwrap();
        assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[9_999] = 7;
        assert_eq!(b.as_slice()[9_999], 7);
        let empty = PageAlignedBuffer::new(0).unwrap();
        assert!(empty.is_empty());
        assert!(empty.as_slice().is_empty());
    }
}
