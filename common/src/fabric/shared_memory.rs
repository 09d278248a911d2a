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
//! What this module is: the one `unsafe` place for it. [`SharedMemory`] owns a descriptor and
//! its mapping (created sealed against shrinking, so a reader's mapping can never lose pages
//! under it and fault with `SIGBUS`; a descriptor received without that seal is refused), and
//! [`send_with_fd`] / [`recv_with_fd`] move one descriptor with a few bytes of message.
//!
//! Where it is used: the TCP backend allocates its sources here ([`Memory::Shared`](super::Memory))
//! when same-host transfers are on, and a lane whose receiver is refused ptrace access to the
//! writer hands the descriptors over instead (`tcp::shared_pulls`).

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;

/// Seals a shared mapping must carry: neither side can shrink or grow it, so every mapped page
/// stays backed for as long as any mapping lives.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

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
        let cname = std::ffi::CString::new(name)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in the memfd name"))?;
        // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
        let raw = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a descriptor memfd_create just returned, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "size overflows off_t"))?;
        // SAFETY: plain system calls on a descriptor this function owns.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: as above; F_ADD_SEALS takes an int argument.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let mem = Self::map(fd, len, true)?;
        if len >= HUGE_ADVICE_MIN {
            // Huge pages where the kernel's shmem policy takes advice (`shmem_enabled=advise`);
            // a refusal only leaves small pages.
            // SAFETY: advice on exactly the mapping just made.
            unsafe { libc::madvise(mem.ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        Ok(mem)
    }

    /// Maps a descriptor received from a writer, read-only. Refused when it is not sealed
    /// against shrinking and growing (its owner could then take pages away under the mapping).
    pub fn from_fd(fd: OwnedFd) -> io::Result<SharedMemory> {
        // SAFETY: plain system call on a descriptor this function owns.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(io::Error::other(format!(
                "the received descriptor is not a sealable memfd: {}",
                io::Error::last_os_error()
            )));
        }
        if seals & SIZE_SEALS != SIZE_SEALS {
            return Err(io::Error::other(
                "the received memfd is not sealed against shrinking and growing",
            ));
        }
        // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a live, exclusively borrowed stat buffer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let len = usize::try_from(st.st_size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| io::Error::other("the received memfd is empty"))?;
        Self::map(fd, len, false)
    }

    fn map(fd: OwnedFd, len: usize, writable: bool) -> io::Result<SharedMemory> {
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: a fresh shared mapping of `len` bytes of a descriptor we own, at an address of
        // the kernel's choosing; the size seals keep all of it backed (checked or set above).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
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
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
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
    let raw = fd.as_raw_fd();
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `control` (space for one int's cmsg), so CMSG_FIRSTHDR is non-null
    // and its header and data lie inside `control`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>(), raw);
    }
    loop {
        // SAFETY: `msg` describes live buffers (`data`, `control`) for the duration of the call.
        let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            // A stream socket takes the first byte with the descriptor; the rest, if short, goes
            // without it.
            let n = n as usize;
            if n < data.len() {
                use std::io::Write;
                (&*sock).write_all(&data[n..])?;
            }
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives up to `buf.len()` bytes and the descriptor sent with them, if any (`Ok((0, None))`
/// at end of stream). A message carrying more than one descriptor is refused (all are closed).
pub fn recv_with_fd(sock: &UnixStream, buf: &mut [u8]) -> io::Result<(usize, Option<OwnedFd>)> {
    // Room for a few descriptors, so a peer sending more is seen (and refused), not truncated.
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(4 * std::mem::size_of::<libc::c_int>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; the fields are set below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: `msg` describes live, exclusively borrowed buffers for the duration of the
        // call; MSG_CMSG_CLOEXEC marks received descriptors close-on-exec.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR/NXTHDR walk `control` within
    // `msg_controllen`, and SCM_RIGHTS data is an array of ints, each a descriptor now owned by
    // this process (wrapped at once, so every one is closed on every path).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c);
                let bytes = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(io::Error::other(
            "a message with more descriptors than one (control data truncated)",
        ));
    }
    match fds.len() {
        0 => Ok((n, None)),
        1 => Ok((n, fds.pop())),
        k => Err(io::Error::other(format!(
            "a message with {k} descriptors where one was expected"
        ))),
    }
}

#[cfg(test)]
#[path = "shared_memory_tests.rs"]
pub(crate) mod tests;
