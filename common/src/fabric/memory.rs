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
use super::shared_memory::SharedMemory;

/// Page size used for owned buffers (NICs and `MAP_*` pinning work on pages).
pub const PAGE_SIZE: usize = 4096;

/// Size of a transparent huge page on x86-64 (and arm64 with 4 KiB pages).
const HUGE_PAGE_SIZE: usize = 2 << 20;

/// Buffers asked for with huge pages get them from this size on (see
/// [`PageAlignedBuffer::with_huge_pages`]); smaller ones come from the heap.
const HUGE_PAGE_MIN: usize = 4 * HUGE_PAGE_SIZE;

/// Which pages back an owned buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageSize {
    /// The heap's small pages.
    Small,
    /// Transparent huge pages where the kernel has them (see
    /// [`PageAlignedBuffer::with_huge_pages`]).
    Huge,
}

/// An owned, zero-initialised, page-aligned host buffer. Freed on drop.
pub struct PageAlignedBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes of the buffer's own mapping (0: heap-allocated with [`PageAlignedBuffer::layout`]).
    mapped: usize,
}

// SAFETY: the buffer is plain owned bytes with no thread affinity; access goes through &/&mut or
// through a registration that serialises revocation (see `RegisteredMemory`).
unsafe impl Send for PageAlignedBuffer {}
// SAFETY: shared references only expose raw pointers and lengths; all byte access is done by code
// that documents its own synchronisation.
unsafe impl Sync for PageAlignedBuffer {}

impl PageAlignedBuffer {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_SIZE`], on small pages. `len` may be
    /// zero.
    pub fn new(len: usize) -> Result<Self> {
        Self::with_pages(len, PageSize::Small)
    }

    /// Allocates `len` zeroed bytes backed by transparent huge pages where the kernel gives
    /// them: from [`HUGE_PAGE_MIN`] on (on Linux) the buffer is its own anonymous mapping,
    /// aligned to and a whole number of huge pages, advised `MADV_HUGEPAGE` before its first
    /// touch; a smaller one, or one the kernel will not map so, is [`PageAlignedBuffer::new`]'s.
    ///
    /// Why: a NIC translates every page a WRITE reads or lands in, and one 2 MiB entry in place
    /// of 512 small ones keeps its translation cache warm; pinning (registration, and the
    /// kernel's per-copy pinning of `process_vm_readv`) walks one entry instead of 512. But a
    /// CPU copy between two huge-page buffers at different offsets within a page ran slower
    /// here than with either side on small pages (4.4-5.5 GB/s at 64-512 bytes apart, against
    /// 6.5 co-aligned and 6.2-6.6 with one side small), so which regions take them is each
    /// backend's choice ([`FabricBackend::page_size`](super::FabricBackend::page_size)).
    pub fn with_huge_pages(len: usize) -> Result<Self> {
        Self::with_pages(len, PageSize::Huge)
    }

    /// Allocates `len` zeroed bytes on `pages`.
    pub fn with_pages(len: usize, pages: PageSize) -> Result<Self> {
        if len == 0 {
            return Ok(PageAlignedBuffer {
                ptr: NonNull::<u8>::dangling(),
                len: 0,
                mapped: 0,
            });
        }
        if pages == PageSize::Huge
            && len >= HUGE_PAGE_MIN
            && let Some((ptr, mapped)) = huge_page_mapping(len)
        {
            return Ok(PageAlignedBuffer { ptr, len, mapped });
        }
        let layout = Self::layout(len)?;
        // SAFETY: layout has a non-zero size (len > 0) and a valid power-of-two alignment.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| FabricError::Registration {
            len: len as u64,
            detail: "allocation failed".into(),
            hint: Some("not enough memory for the buffer".into()),
        })?;
        Ok(PageAlignedBuffer {
            ptr,
            len,
            mapped: 0,
        })
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
        if self.mapped > 0 {
            unmap(self.ptr.as_ptr(), self.mapped);
            return;
        }
        if let Ok(layout) = Self::layout(self.len) {
            // SAFETY: ptr was returned by alloc_zeroed with exactly this layout and not freed yet.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// A fresh anonymous mapping of `len` bytes rounded up to whole huge pages, at a huge-page
/// aligned address, advised `MADV_HUGEPAGE` before anything touches it (so its first-touch
/// faults can take huge pages): `(start, mapped bytes)`, or `None` where the kernel refuses the
/// mapping (the caller falls back to the heap). Zeroed, as every fresh anonymous mapping is.
/// Whether huge pages back it is the kernel's choice (THP off, fragmented memory): the advice
/// changes only how fast it is, never what it holds.
#[cfg(target_os = "linux")]
fn huge_page_mapping(len: usize) -> Option<(NonNull<u8>, usize)> {
    let size = len.checked_next_multiple_of(HUGE_PAGE_SIZE)?;
    // One huge page more than needed, so that an aligned start lies inside; the slack on
    // either side is unmapped again.
    let reserve = size.checked_add(HUGE_PAGE_SIZE)?;
    // SAFETY: a new private anonymous mapping at an address of the kernel's choosing: it
    // aliases nothing of this process.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            reserve,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let base = raw as usize;
    let start = base.next_multiple_of(HUGE_PAGE_SIZE);
    let (head, tail) = (start - base, base + reserve - (start + size));
    if head > 0 {
        unmap(raw.cast(), head);
    }
    if tail > 0 {
        unmap((start + size) as *mut u8, tail);
    }
    // SAFETY: `[start, start + size)` is the part of the mapping just made that stays mapped,
    // owned by the buffer being built; MADV_HUGEPAGE changes how the kernel backs it, never
    // its contents.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(
            size,
            error = %std::io::Error::last_os_error(),
            "no huge pages for a registered buffer; it keeps small pages"
        );
    }
    Some((NonNull::new(start as *mut u8)?, size))
}

#[cfg(not(target_os = "linux"))]
fn huge_page_mapping(_len: usize) -> Option<(NonNull<u8>, usize)> {
    None
}

/// Unmaps `[ptr, ptr + len)`, a part of a mapping [`huge_page_mapping`] made.
#[cfg(target_os = "linux")]
fn unmap(ptr: *mut u8, len: usize) {
    // SAFETY: the range is page-aligned, mapped by `huge_page_mapping` and no longer used: the
    // slack around a new buffer, or a dropped buffer's whole mapping (no registration can
    // outlive its buffer, see `RegisteredMemory`).
    let rc = unsafe { libc::munmap(ptr.cast(), len) };
    debug_assert_eq!(rc, 0, "munmap of an owned mapping failed");
}

#[cfg(not(target_os = "linux"))]
fn unmap(_ptr: *mut u8, _len: usize) {}

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
    /// A sealed `memfd` the registration owns, which a same-host receiver may map through a
    /// descriptor this process hands it ([`SharedMemory`]; the TCP backend's sources).
    Shared(SharedMemory),
}

impl Memory {
    /// Allocates an owned, zeroed, page-aligned buffer of `len` bytes.
    pub fn alloc(len: usize) -> Result<Memory> {
        Ok(Memory::Owned(PageAlignedBuffer::new(len)?))
    }

    /// Allocates an owned, zeroed buffer of `len` bytes on `pages`.
    pub fn alloc_on(len: usize, pages: PageSize) -> Result<Memory> {
        Ok(Memory::Owned(PageAlignedBuffer::with_pages(len, pages)?))
    }

    /// Allocates `len` zeroed bytes of shared memory (a sealed `memfd` named `name`), which a
    /// same-host peer may map ([`SharedMemory`]).
    pub fn alloc_shared(name: &str, len: usize) -> Result<Memory> {
        SharedMemory::create(name, len)
            .map(Memory::Shared)
            .map_err(|e| FabricError::io(format!("allocating {len} bytes of shared memory"), e))
    }

    /// Writes a zero into every page of an owned buffer that nothing references yet, so each
    /// page is the process's own (not the shared zero page) before a NIC pins it (the fabric's
    /// `alloc` of write sources; device review N1). A no-op for memory it does not own.
    pub fn write_touch(&self) {
        if let Memory::Owned(b) = self {
            let p = b.as_ptr();
            for off in (0..b.len()).step_by(PAGE_SIZE) {
                // SAFETY: `off < len` of a live buffer this value owns; the caller has handed
                // it to nobody yet (fresh from `alloc_on`), so no reference aliases the write,
                // and the buffer is zeroed already, so the bytes do not change.
                unsafe { p.add(off).write_volatile(0) };
            }
        }
    }

    /// The shared memory behind it, if it is shared ([`Memory::Shared`]).
    pub fn shared(&self) -> Option<&SharedMemory> {
        match self {
            Memory::Shared(m) => Some(m),
            _ => None,
        }
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        match self {
            Memory::Owned(b) => b.as_ptr(),
            Memory::Raw(r) => r.as_ptr(),
            Memory::Shared(m) => m.as_ptr(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        match self {
            Memory::Owned(b) => b.len(),
            Memory::Raw(r) => r.len(),
            Memory::Shared(m) => m.len(),
        }
    }

    /// Whether the memory is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        match self {
            Memory::Owned(_) | Memory::Shared(_) => MemoryLocation::Host,
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

    /// Kilobytes of the mapping holding `addr` that are the process's own anonymous pages
    /// (`Anonymous:` in /proc/self/smaps; pages mapped to the shared zero page are not).
    fn anonymous_kb_at(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let head = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
            } else if inside && let Some(kb) = line.strip_prefix("Anonymous:") {
                return kb.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
        None
    }

    #[test]
    fn write_touch_makes_every_page_the_process_own() {
        // A fresh mapping of its own (huge pages: the fabric's sources), read only: every page
        // maps the shared (huge) zero page, which is not anonymous memory.
        let len = 8 << 20;
        let m = Memory::alloc_on(len, PageSize::Huge).unwrap();
        let p = m.as_ptr();
        let mut sum = 0u64;
        for off in (0..len).step_by(PAGE_SIZE) {
            // SAFETY: inside the live buffer; a read of zeroed bytes.
            sum += u64::from(unsafe { p.add(off).read_volatile() });
        }
        assert_eq!(sum, 0);
        let Some(before) = anonymous_kb_at(p as usize) else {
            return; // no smaps here
        };
        m.write_touch();
        let after = anonymous_kb_at(p as usize).unwrap();
        assert!(
            after >= before + (len / 1024) as u64,
            "anonymous {before} kB -> {after} kB: the pages were not made the process's own"
        );
        let Memory::Owned(b) = &m else {
            unreachable!("alloc_on owns its buffer")
        };
        assert!(
            b.as_slice().iter().all(|&x| x == 0),
            "the bytes are unchanged"
        );
    }

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

    /// The `smaps` entry of the mapping holding `addr`: its lines after the header.
    #[cfg(target_os = "linux")]
    fn smaps_of(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut found = None;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                if found.is_some() {
                    break;
                }
                if (a..b).contains(&addr) {
                    found = Some(Vec::new());
                }
                continue;
            }
            if let Some(lines) = found.as_mut() {
                lines.push(line.to_string());
            }
        }
        found.expect("the buffer's mapping is in smaps")
    }

    #[test]
    fn a_large_buffer_is_its_own_huge_page_mapping_and_zeroed() {
        let len = HUGE_PAGE_MIN + 12_345;
        let mut b = PageAlignedBuffer::with_huge_pages(len).unwrap();
        assert_eq!(b.len(), len);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        b.as_mut_slice()[len - 1] = 9;
        assert_eq!(b.as_slice()[len - 1], 9);
        #[cfg(target_os = "linux")]
        {
            let addr = b.as_ptr() as usize;
            assert_eq!(addr % HUGE_PAGE_SIZE, 0);
            assert_eq!(b.mapped, len.next_multiple_of(HUGE_PAGE_SIZE));
            // Where the kernel offers THP at all, the advice made the mapping eligible (whether
            // a fault then gets a huge page depends on free memory, so that is not asserted).
            let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
                .unwrap_or_default();
            if thp.contains("[madvise]") || thp.contains("[always]") {
                let entry = smaps_of(addr);
                assert!(
                    entry
                        .iter()
                        .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["THPeligible:", "1"]),
                    "{entry:?}"
                );
            }
            // Dropping it unmaps the whole mapping (`unmap` asserts that munmap succeeded).
            drop(b);
        }
    }

    #[test]
    fn small_pages_and_small_buffers_come_from_the_heap() {
        for b in [
            PageAlignedBuffer::with_huge_pages(HUGE_PAGE_MIN - 1).unwrap(),
            PageAlignedBuffer::new(HUGE_PAGE_MIN * 2).unwrap(),
        ] {
            assert_eq!(b.mapped, 0);
            assert_eq!(b.as_ptr() as usize % PAGE_SIZE, 0);
            assert!(b.as_slice().iter().all(|&x| x == 0));
        }
    }
}
