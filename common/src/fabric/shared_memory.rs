//! Memory shared by file descriptor: the same-host path for writers whose memory this process may
//! not read with `process_vm_readv`.
//!
//! Why: [`same_host`](super::tcp::same_host) pulls need ptrace access to the writer, and containers
//! and managed hosts refuse it (Yama `ptrace_scope` >= 1 between non-ancestors, a non-dumpable
//! writer, seccomp). A file descriptor needs no such permission: the writer's memory, allocated
//! as a `memfd`, is handed to the receiver over a UNIX socket (`SCM_RIGHTS`), and the receiver
//! maps it and copies out of the mapping, one copy as with a pull, while the ptrace check never
//! runs. The descriptor is the capability: only a process the writer handed it to can map it.
//!
//! What this module is: the one `unsafe` place for it, on `rustix`'s safe system-call wrappers
//! (`memfd_create`, seals, `mmap`, `sendmsg`/`recvmsg` with `SCM_RIGHTS`; only mapping, unmapping
//! and copying out of the mapping are `unsafe`). [`SharedMemory`] owns a descriptor and
//! its mapping (created sealed against shrinking, so a reader's mapping can never lose pages
//! under it and fault with `SIGBUS`; a descriptor received without that seal is refused), and
//! [`send_with_fd`] / [`recv_with_fd`] move one descriptor with a few bytes of message.
//!
//! Where it is used: the TCP backend allocates its sources here ([`Memory::Shared`](super::Memory))
//! when same-host transfers are on, and a lane whose receiver is refused ptrace access to the
//! writer hands the descriptors over instead (`tcp::shared_pulls`).

use std::io;
use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{Advice, MapFlags, ProtFlags};
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Seals a shared mapping must carry: neither side can shrink or grow it, so every mapped page
/// stays backed for as long as any mapping lives.
const SIZE_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// Mappings from this size on are advised to use huge pages (as the fabric's anonymous sources).
const HUGE_ADVICE_MIN: usize = 8 << 20;

/// A `memfd` and its mapping in this process (see the module docs). Unmapped on drop; the
/// memory lives until every process has dropped its descriptor and mapping.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping is plain shared bytes with no thread affinity; this type hands out only raw
// pointers and copies through `read_at`, whose callers document their own synchronisation.
unsafe impl Send for SharedMemory {}
// SAFETY: as above: no `&`-method exposes a Rust reference into the mapping.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// `len` zeroed bytes in a new sealed `memfd` named `name` (shown in `/proc/*/maps`),
    /// mapped read-write here.
    pub fn create(name: &str, len: usize) -> io::Result<SharedMemory> {
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "shared memory of 0 bytes",
            ));
        }
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        rustix::fs::fcntl_add_seals(&fd, SIZE_SEALS)?;
        let mem = Self::map(fd, len, true)?;
        if len >= HUGE_ADVICE_MIN {
            // Huge pages where the kernel's shmem policy takes advice (`shmem_enabled=advise`);
            // a refusal only leaves small pages.
            // SAFETY: advice on exactly the mapping just made.
            let _ =
                unsafe { rustix::mm::madvise(mem.ptr.as_ptr().cast(), len, Advice::LinuxHugepage) };
        }
        Ok(mem)
    }

    /// Maps a descriptor received from a writer, read-only. Refused when it is not sealed
    /// against shrinking and growing (its owner could then take pages away under the mapping).
    pub fn from_fd(fd: OwnedFd) -> io::Result<SharedMemory> {
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
            io::Error::other(format!(
                "the received descriptor is not a sealable memfd: {e}"
            ))
        })?;
        if !seals.contains(SIZE_SEALS) {
            return Err(io::Error::other(
                "the received memfd is not sealed against shrinking and growing",
            ));
        }
        let st = rustix::fs::fstat(&fd)?;
        let len = usize::try_from(st.st_size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| io::Error::other("the received memfd is empty"))?;
        Self::map(fd, len, false)
    }

    fn map(fd: OwnedFd, len: usize, writable: bool) -> io::Result<SharedMemory> {
        let prot = if writable {
            ProtFlags::READ | ProtFlags::WRITE
        } else {
            ProtFlags::READ
        };
        // SAFETY: a fresh shared mapping of `len` bytes of a descriptor we own, at an address of
        // the kernel's choosing (no existing mapping is replaced); the size seals keep all of it
        // backed (checked or set above).
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0) }?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(SharedMemory {
            fd,
            ptr,
            len,
            writable,
        })
    }

    /// Start of the mapping in this process.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (a mapping has at least one byte); for clippy's `len_without_is_empty`.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether this process mapped it writable (its creator) or read-only (a receiver).
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// The descriptor, to hand to a receiver with [`send_with_fd`].
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Copies `len` bytes from `offset` to `dst` (the same checks as [`read_at`](Self::read_at)).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes for the duration of the call, must not
    /// overlap this mapping, and nothing may hold a Rust reference to those bytes.
    pub unsafe fn copy_out(&self, offset: usize, dst: *mut u8, len: usize) -> io::Result<()> {
        offset
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "bytes {offset}..+{len} outside shared memory of {} bytes",
                        self.len
                    ),
                )
            })?;
        // SAFETY: the source range lies inside the mapping (checked above), which lives as long
        // as `self`; the caller guarantees `dst`.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), dst, len) };
        Ok(())
    }

    /// Copies `dst.len()` bytes from `offset`. The bytes are whatever the writer's last writes
    /// left (a shared mapping): the caller orders the copy after the writer's writes (the
    /// fabric's frames do).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> io::Result<()> {
        // SAFETY: `dst` is an exclusive borrow, so valid for writes and unaliased; it cannot
        // overlap the mapping (no Rust reference into the mapping is ever handed out).
        unsafe { self.copy_out(offset, dst.as_mut_ptr(), dst.len()) }
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, which nothing uses after this.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// Sends `data` (at least one byte) with `fd` attached (`SCM_RIGHTS`) on a UNIX stream.
pub fn send_with_fd(sock: &UnixStream, data: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    if data.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a descriptor needs at least one byte of message",
        ));
    }
    let fds = [fd];
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other(
            "no room for a descriptor in the control buffer",
        ));
    }
    let n = loop {
        match rustix::net::sendmsg(
            sock.as_fd(),
            &[IoSlice::new(data)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // A stream socket takes the first byte with the descriptor; the rest, if short, goes without.
    if n < data.len() {
        use std::io::Write;
        (&*sock).write_all(&data[n..])?;
    }
    Ok(())
}

/// Receives up to `buf.len()` bytes and the descriptor sent with them, if any (`Ok((0, None))`
/// at end of stream). A message carrying more than one descriptor is refused (all are closed).
pub fn recv_with_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    // Room for a few descriptors, so a peer sending more is seen (and refused), not truncated.
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let got = loop {
        match rustix::net::recvmsg(
            sock.as_fd(),
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(got) => break got,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    // Every descriptor received is owned here at once (closed on every path below).
    let mut fds: Vec<OwnedFd> = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    if got.flags.contains(ReturnFlags::CTRUNC) {
        return Err(io::Error::other(
            "a message with more descriptors than one (control data truncated)",
        ));
    }
    match fds.len() {
        0 => Ok((got.bytes, None)),
        1 => Ok((got.bytes, fds.pop())),
        k => Err(io::Error::other(format!(
            "a message with {k} descriptors where one was expected"
        ))),
    }
}

#[cfg(test)]
#[path = "shared_memory_tests.rs"]
pub(crate) mod tests;
