//! A registration: memory peers may write into, with a handle whose drop revokes access.
//!
//! Two objects make up a registration:
//! - [`RegisteredMemory`], shared by the owner and the backend (the TCP receive threads hold it
//!   while they copy a payload in). It carries a revocation lock: a backend touches the bytes only
//!   while holding a [`LiveMemory`] guard, and [`RegisteredMemory::revoke`] takes the lock
//!   exclusively, so once revocation returns no byte will ever land again, even from a write that
//!   was half-way through. That is how "deregistration takes effect at once" is made true without
//!   trusting timing. A *source* whose bytes another process on the same host copies out itself
//!   (the TCP backend's same-host pulls) is held by [`SourcePin`]s instead, for as long as that
//!   process may still read it: revocation also waits until every pin is dropped, so the memory
//!   is never given back while a peer may be copying from it.
//! - [`Region`], the owner's handle (cheap to clone; a [`WriteOp`](super::WriteOp) holds a clone of
//!   its source). Dropping the last clone, or calling [`Region::deregister`], revokes the memory and
//!   runs the backend's deregistration hook (remove the rkey from the TCP table, `ibv_dereg_mr`).
//!
//! Reading and filling: the owner fills a source with [`Region::write_at`] and reads a receive
//! region with [`Region::read_at`] / [`Region::copy_to_vec`] once the writes are known to have
//! landed (an [`ImmCounter`](super::ImmCounter) expectation resolved). These copy through raw
//! pointers and never create a Rust reference to bytes a peer may be changing; bytes read while a
//! remote write to them is still landing are unspecified (as with DMA), but every `u8` value is
//! valid so no undefined value is ever produced. A borrowed view is offered only as `unsafe`
//! ([`Region::as_slice`]).

use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex, RwLock, RwLockReadGuard};

use super::descriptor::{Access, RegionDescriptor};
use super::error::{FabricError, Result};
use super::landing_log::{LandingLog, LandingTicket, LogAttachment};
use super::memory::{Memory, MemoryLocation};
use super::shared_memory::SharedMemory;

/// The memory of one registration plus the lock that revokes the backend's access to it.
#[derive(Debug)]
pub struct RegisteredMemory {
    memory: Memory,
    live: RwLock<bool>,
    /// The backend reports every frame landing here through [`RegisteredMemory::landing`].
    reports_landings: bool,
    /// The owner's landing log, once attached ([`Region::log_landings`]).
    log: OnceLock<LogAttachment>,
    /// Pins held by peers that copy out of this memory: (revoked, pins).
    pins: Mutex<(bool, usize)>,
    unpinned: Condvar,
}

/// Keeps a registration's memory from being revoked while a peer process may still be copying
/// out of it (see [`RegisteredMemory::pin`]). Dropping it releases the pin.
#[derive(Debug)]
pub struct SourcePin {
    memory: Arc<RegisteredMemory>,
}

impl SourcePin {
    /// The pinned memory.
    pub fn memory(&self) -> &Arc<RegisteredMemory> {
        &self.memory
    }
}

impl Drop for SourcePin {
    fn drop(&mut self) {
        let mut pins = self.memory.pins.lock();
        pins.1 -= 1;
        if pins.1 == 0 {
            self.memory.unpinned.notify_all();
        }
    }
}

/// Proof that a registration is live; the backend may touch the bytes while holding it.
/// Revocation waits until every guard is dropped, so hold it only for one bounded copy
/// (e.g. one non-blocking `recv`), never across a blocking wait.
#[derive(Debug)]
pub struct LiveMemory<'a> {
    _guard: RwLockReadGuard<'a, bool>,
    ptr: *mut u8,
    len: usize,
}

impl LiveMemory<'_> {
    /// Pointer to the region's first byte, valid for `len()` bytes while the guard lives.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl RegisteredMemory {
    /// Wraps memory that is about to be registered.
    pub fn new(memory: Memory) -> Arc<Self> {
        Arc::new(RegisteredMemory {
            memory,
            live: RwLock::new(true),
            reports_landings: false,
            log: OnceLock::new(),
            pins: Mutex::new((false, 0)),
            unpinned: Condvar::new(),
        })
    }

    /// Wraps memory for a backend whose receive path calls [`landing`](Self::landing) for every
    /// frame it lands here, so that the owner may log what lands ([`Region::log_landings`]).
    pub fn new_reporting_landings(memory: Memory) -> Arc<Self> {
        Arc::new(RegisteredMemory {
            memory,
            live: RwLock::new(true),
            reports_landings: true,
            log: OnceLock::new(),
            pins: Mutex::new((false, 0)),
            unpinned: Condvar::new(),
        })
    }

    /// A frame of `len` bytes is about to land at `offset` (before its first byte touches the
    /// memory): logged when the owner attached a log; the frame's end is logged when the ticket
    /// is dropped, after its last byte landed or it stopped.
    pub fn landing(&self, offset: u64, len: u64) -> Option<LandingTicket> {
        self.log.get().map(|a| a.begin(offset, len))
    }

    /// Returns a guard if the registration is still live.
    pub fn live(&self) -> Option<LiveMemory<'_>> {
        let guard = self.live.read();
        if !*guard {
            return None;
        }
        Some(LiveMemory {
            _guard: guard,
            ptr: self.memory.as_ptr(),
            len: self.memory.len(),
        })
    }

    /// Pins the memory for a peer that copies out of it outside any [`LiveMemory`] guard (a
    /// same-host pull), until the pin is dropped; `None` once revoked.
    pub fn pin(self: &Arc<Self>) -> Option<SourcePin> {
        let mut pins = self.pins.lock();
        if pins.0 {
            return None;
        }
        pins.1 += 1;
        Some(SourcePin {
            memory: self.clone(),
        })
    }

    /// Revokes access: waits for every [`LiveMemory`] guard to be dropped, then marks the
    /// registration dead so no further guard or pin is handed out, then waits for every
    /// [`SourcePin`] to be dropped (their holders drop them once the peer is done or cut off).
    pub fn revoke(&self) {
        *self.live.write() = false;
        let mut pins = self.pins.lock();
        pins.0 = true;
        while pins.1 > 0 {
            self.unpinned.wait(&mut pins);
        }
    }

    /// Whether the registration is still live.
    pub fn is_live(&self) -> bool {
        *self.live.read()
    }

    /// Pointer to the first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.memory.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.memory.len()
    }

    /// Whether the memory is empty.
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Where the memory lives.
    pub fn location(&self) -> MemoryLocation {
        self.memory.location()
    }

    /// The shared memory behind it, when it is a [`Memory::Shared`] (a same-host receiver may
    /// map it through its descriptor).
    pub fn shared(&self) -> Option<&SharedMemory> {
        self.memory.shared()
    }
}

/// Hook a backend runs once when a region is deregistered.
pub type DeregisterHook = Box<dyn FnOnce() + Send>;

struct RegionHandle {
    memory: Arc<RegisteredMemory>,
    access: Access,
    descriptor: RegionDescriptor,
    on_deregister: Mutex<Option<DeregisterHook>>,
}

impl RegionHandle {
    fn deregister(&self) {
        self.memory.revoke();
        if let Some(hook) = self.on_deregister.lock().take() {
            hook();
        }
    }
}

impl Drop for RegionHandle {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// The owner's handle to a registration. Clones share it; the last drop deregisters.
#[derive(Clone)]
pub struct Region {
    inner: Arc<RegionHandle>,
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("descriptor", &self.inner.descriptor)
            .field("access", &self.inner.access)
            .field("live", &self.inner.memory.is_live())
            .finish()
    }
}

impl Region {
    /// Builds the handle (backends call this from `register`). `on_deregister` runs once, after
    /// the memory has been revoked.
    pub fn new(
        memory: Arc<RegisteredMemory>,
        access: Access,
        descriptor: RegionDescriptor,
        on_deregister: DeregisterHook,
    ) -> Region {
        Region {
            inner: Arc::new(RegionHandle {
                memory,
                access,
                descriptor,
                on_deregister: Mutex::new(Some(on_deregister)),
            }),
        }
    }

    /// What a peer needs to write here.
    pub fn descriptor(&self) -> &RegionDescriptor {
        &self.inner.descriptor
    }

    /// The rkey.
    pub fn rkey(&self) -> u64 {
        self.inner.descriptor.rkey
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.inner.memory.len() as u64
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.memory.is_empty()
    }

    /// Access rights given at registration.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// The shared memory (for backends).
    pub fn memory(&self) -> &Arc<RegisteredMemory> {
        &self.inner.memory
    }

    /// Whether the region is still registered.
    pub fn is_registered(&self) -> bool {
        self.inner.memory.is_live()
    }

    /// Deregisters now: when this returns, no peer write will land in the memory any more, writes
    /// still in flight into it fail with [`RemoteAccessKind::Deregistered`](super::RemoteAccessKind),
    /// and writes using it as a source fail. The memory stays readable through this handle.
    pub fn deregister(&self) {
        self.inner.deregister();
    }

    /// Logs every frame that lands here from now on in `log`, under `tag` (see
    /// [`super::landing_log`]); call it before any peer may write. Refused when the backend
    /// cannot see writes land (an RDMA NIC places them without the receiver's CPU) or when the
    /// region already logs elsewhere.
    pub fn log_landings(&self, log: &Arc<LandingLog>, tag: u16) -> Result<()> {
        let memory = &self.inner.memory;
        if !memory.reports_landings {
            return Err(FabricError::Unsupported(
                "this backend does not see writes land, so it cannot log them".into(),
            ));
        }
        let attached = memory.log.get_or_init(|| LogAttachment {
            log: log.clone(),
            tag,
        });
        if !Arc::ptr_eq(&attached.log, log) || attached.tag != tag {
            return Err(FabricError::Unsupported(
                "the region already logs its landings elsewhere".into(),
            ));
        }
        Ok(())
    }

    /// Whether two handles are clones of the same registration.
    pub fn same_registration(&self, other: &Region) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn host_range(&self, what: &'static str, offset: u64, len: usize) -> Result<*mut u8> {
        if self.inner.memory.location() != MemoryLocation::Host {
            return Err(FabricError::Unsupported(format!(
                "{what}: region is not host memory"
            )));
        }
        let region_len = self.len();
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > region_len)
        {
            return Err(FabricError::LocalOutOfBounds {
                what,
                offset,
                len: len as u64,
                region_len,
            });
        }
        // SAFETY: offset + len <= region length, so the offset pointer stays inside (or one past)
        // the allocation.
        Ok(unsafe { self.inner.memory.as_ptr().add(offset as usize) })
    }

    /// Copies `data` into the region at `offset` (the owner filling a source buffer).
    pub fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let dst = self.host_range("write_at", offset, data.len())?;
        // SAFETY: dst is valid for data.len() bytes of host memory (bounds checked above; the
        // memory lives as long as this handle). `data` is a Rust slice, so it cannot overlap bytes
        // we never hand out as references. Concurrent remote writes to the same bytes behave like
        // DMA: plain u8 values, last writer wins.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }

    /// Copies `out.len()` bytes at `offset` out of the region (the owner reading landed data).
    pub fn read_at(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let src = self.host_range("read_at", offset, out.len())?;
        // SAFETY: src is valid for out.len() bytes of host memory (bounds checked above), and
        // `out` is an exclusive Rust slice so it cannot overlap. Any byte value is a valid u8.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `len` bytes at `src_offset` of `src` (host memory, possibly this region) to
    /// `offset` here: one copy, as a collective's local step does, with no buffer between.
    pub fn copy_from(&self, offset: u64, src: &Region, src_offset: u64, len: usize) -> Result<()> {
        let from = src.host_range("copy_from (source)", src_offset, len)?;
        let to = self.host_range("copy_from", offset, len)?;
        // SAFETY: both ranges are valid for `len` bytes of host memory (bounds checked above;
        // each memory lives as long as its handle). They may be the same region, so the copy is
        // `copy` (overlap allowed), not `copy_nonoverlapping`. Concurrent remote writes to the
        // same bytes behave like DMA: plain u8 values, last writer wins.
        unsafe { std::ptr::copy(from, to, len) };
        Ok(())
    }

    /// Copies `len` bytes at `offset` into a new vector.
    pub fn copy_to_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; len];
        self.read_at(offset, &mut out)?;
        Ok(out)
    }

    /// Copies the whole region into a new vector.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        self.copy_to_vec(0, self.len() as usize)
    }

    /// Pointer to the region's first byte (for kernels that fill or read it in place).
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.memory.as_ptr()
    }

    /// Borrows the region's bytes.
    ///
    /// # Safety
    /// The memory must be host memory, and for the whole life of the returned slice no peer write
    /// may land in the region and no local write (`write_at`, raw pointers) may change it: e.g. all
    /// writes of this round were awaited through the [`ImmCounter`](super::ImmCounter) and the
    /// protocol guarantees no writer targets the region until the slice is dropped.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the memory is valid for len bytes while this handle lives; the caller guarantees
        // nothing mutates it while the slice is borrowed.
        unsafe { std::slice::from_raw_parts(self.inner.memory.as_ptr(), self.len() as usize) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn region(len: usize, hook_calls: Arc<AtomicUsize>) -> Region {
        let mem = RegisteredMemory::new(Memory::alloc(len).unwrap());
        let desc = RegionDescriptor {
            endpoint: "test:0".into(),
            base: mem.as_ptr() as u64,
            len: len as u64,
            rkey: 42,
        };
        Region::new(
            mem,
            Access::RECEIVE,
            desc,
            Box::new(move || {
                hook_calls.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    #[test]
    fn fill_and_read_back_with_bounds() {
        let r = region(64, Arc::default());
        r.write_at(60, &[1, 2, 3, 4]).unwrap();
        assert_eq!(r.copy_to_vec(59, 5).unwrap(), vec![0, 1, 2, 3, 4]);
        assert!(matches!(
            r.write_at(61, &[0; 4]),
            Err(FabricError::LocalOutOfBounds { .. })
        ));
        assert!(r.read_at(u64::MAX, &mut [0; 2]).is_err());
    }

    #[test]
    fn copy_from_another_region_and_within_one_with_bounds() {
        let a = region(64, Arc::default());
        let b = region(32, Arc::default());
        a.write_at(8, &[1, 2, 3, 4, 5]).unwrap();
        b.copy_from(30, &a, 8, 2).unwrap();
        assert_eq!(b.copy_to_vec(29, 3).unwrap(), vec![0, 1, 2]);
        // Overlapping, within one region: as memmove.
        a.copy_from(10, &a, 8, 5).unwrap();
        assert_eq!(a.copy_to_vec(8, 7).unwrap(), vec![1, 2, 1, 2, 3, 4, 5]);
        // Either side out of bounds: refused, nothing written.
        assert!(matches!(
            b.copy_from(31, &a, 0, 2),
            Err(FabricError::LocalOutOfBounds { .. })
        ));
        assert!(matches!(
            b.copy_from(0, &a, 63, 2),
            Err(FabricError::LocalOutOfBounds { .. })
        ));
        assert_eq!(b.copy_to_vec(0, 2).unwrap(), vec![0, 0]);
    }

    #[test]
    fn revocation_waits_for_pins_and_refuses_new_ones() {
        let calls = Arc::new(AtomicUsize::new(0));
        let r = region(16, calls.clone());
        let pin = r.memory().pin().expect("live memory pins");
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let deregistering = {
            let (r, released) = (r.clone(), released.clone());
            std::thread::spawn(move || {
                r.deregister();
                // Deregistration returned: the pin must have been released before.
                assert!(released.load(Ordering::SeqCst), "revoked under a pin");
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert_eq!(calls.load(Ordering::SeqCst), 0, "deregistered under a pin");
        released.store(true, Ordering::SeqCst);
        drop(pin);
        deregistering.join().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(r.memory().pin().is_none(), "a revoked region pins nothing");
    }

    #[test]
    fn deregister_revokes_once_and_drop_is_idempotent() {
        let calls = Arc::new(AtomicUsize::new(0));
        let r = region(16, calls.clone());
        let mem = r.memory().clone();
        let clone = r.clone();
        assert!(mem.live().is_some());
        r.deregister();
        assert!(mem.live().is_none());
        assert!(!clone.is_registered());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        drop(r);
        drop(clone);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // The memory itself is still valid while the backend holds it.
        assert_eq!(mem.len(), 16);
    }

    #[test]
    fn last_drop_deregisters() {
        let calls = Arc::new(AtomicUsize::new(0));
        let r = region(16, calls.clone());
        let mem = r.memory().clone();
        let c = r.clone();
        drop(r);
        assert!(mem.is_live());
        drop(c);
        assert!(!mem.is_live());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
