//! Same-host pulls from memory shared by file descriptor, for a receiver the kernel refuses
//! ptrace access to the writer (`same_host` pulls need it; containers, Yama `ptrace_scope`, a
//! non-dumpable writer and seccomp refuse it).
//!
//! The lane is the same as for `process_vm_readv` pulls: PULL frames name their source by its
//! address in the writer, the receiver checks and lands them under the same guards and counts the
//! immediate after the last byte, and the writer pins the source until the completion. Only the
//! copy differs: the writer's sources are sealed `memfd`s (the TCP backend allocates them so,
//! [`Memory::Shared`](crate::fabric::Memory)), and before the first PULL frame from one of them
//! the writer hands its descriptor, with its address and length, to the receiver over a UNIX
//! socket ([`SharedExporter`]); the receiver maps it read-only and copies out of the mapping
//! ([`SharedWriter`]). Frames from memory that is not shared (a caller's tensors registered in
//! place) stay payloads on such a lane.
//!
//! Why order is safe: a descriptor is sent (and queued in the receiver's socket, which a UNIX
//! stream does synchronously) before the PULL frame that needs it goes on the TCP lane, so a
//! receiver that drains its UNIX socket after reading a PULL header has every mapping that
//! frame can name. A newer export over the same addresses (memory freed and allocated again)
//! replaces the older mapping.
//!
//! Agreeing on it (after authentication, in the lane handshake, `handshake`): the writer offers
//! shared memory with its pull offer; the receiver, when it will not read with
//! `process_vm_readv` (refused, or [`SameHostPath::Shared`]), binds an abstract UNIX socket of a
//! random name, answers [`ANSWER_SHARED`] with that name and a random secret, and the writer
//! connects and proves the secret (sent only on the authenticated lane), then confirms on the
//! lane. Any failure (another network namespace, no memfd) confirms no: the lane carries
//! payloads.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::same_host::{ANSWER_SHARED, PULL_MIN_BYTES, WriterProcess};
use crate::fabric::RegisteredMemory;
use crate::fabric::config::SameHostPath;
use crate::fabric::shared_memory::{SharedMemory, recv_with_fd, send_with_fd};

/// The secret the writer proves on the UNIX socket.
const SECRET_LEN: usize = 32;
/// The abstract socket name's random part (hex).
const NAME_LEN: usize = 32;
/// What follows [`ANSWER_SHARED`] on the lane: the secret, then the name.
pub(super) const SHARED_ANSWER_LEN: usize = SECRET_LEN + NAME_LEN;
/// The writer's confirmation on the lane after it connected (or could not).
pub(super) const CONFIRM_LEN: usize = 8;
const CONFIRM_YES: [u8; CONFIRM_LEN] = *b"SHM-YES!";
const CONFIRM_NO: [u8; CONFIRM_LEN] = *b"SHM-NO!!";
/// One export: the source's address in the writer and its length (the descriptor rides along).
const EXPORT_LEN: usize = 16;

/// How a lane's receiver reads the sources of its PULL frames, as its writer sees it.
#[derive(Debug)]
pub enum PullMode {
    /// No pulls: every frame carries its payload.
    Payloads,
    /// The receiver copies with `process_vm_readv`.
    Ptrace,
    /// The receiver copies from memory this writer shares by descriptor.
    Shared(SharedExporter),
}

impl PullMode {
    /// Whether PULL frames may be sent at all.
    pub fn pulls(&self) -> bool {
        !matches!(self, PullMode::Payloads)
    }

    /// Frames shorter than this travel as payloads: a `process_vm_readv` pins pages per call,
    /// a copy out of a mapping does not, so on a shared lane every frame from shared memory is
    /// pulled (no byte of it crosses the socket).
    pub fn min_bytes(&self) -> u64 {
        match self {
            PullMode::Shared(_) => 1,
            _ => PULL_MIN_BYTES,
        }
    }

    /// The name of the path, for logs and reports: `payloads`, `ptrace` or `shared_memory`.
    pub fn name(&self) -> &'static str {
        match self {
            PullMode::Payloads => "payloads",
            PullMode::Ptrace => "ptrace",
            PullMode::Shared(_) => "shared_memory",
        }
    }
}

/// The writer's end of a shared lane: which of its sources the receiver has mapped.
#[derive(Debug)]
pub struct SharedExporter {
    sock: UnixStream,
    /// Memory whose descriptor went to the receiver (weak: a freed source is pruned, and its
    /// allocation is not reused while it is listed, so pointer identity is exact).
    sent: Vec<Weak<RegisteredMemory>>,
}

impl SharedExporter {
    /// Whether PULL frames from `memory` may go on this lane: it is shared memory, and its
    /// descriptor is with the receiver (sent now if it was not yet).
    pub fn export(&mut self, memory: &Arc<RegisteredMemory>) -> io::Result<bool> {
        let Some(shared) = memory.shared() else {
            return Ok(false);
        };
        self.sent.retain(|w| w.strong_count() > 0);
        if self
            .sent
            .iter()
            .any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(memory)))
        {
            return Ok(true);
        }
        let mut msg = [0u8; EXPORT_LEN];
        msg[..8].copy_from_slice(&(memory.as_ptr() as u64).to_le_bytes());
        msg[8..].copy_from_slice(&(memory.len() as u64).to_le_bytes());
        send_with_fd(&self.sock, &msg, shared.fd())?;
        self.sent.push(Arc::downgrade(memory));
        Ok(true)
    }
}

/// The receiver's end of a shared lane: the writer's sources mapped here, by their address in
/// the writer.
#[derive(Debug)]
pub struct SharedWriter {
    sock: UnixStream,
    /// (address in the writer, mapping), newest last; no two overlap.
    maps: Vec<(u64, SharedMemory)>,
}

impl SharedWriter {
    /// Maps every descriptor the writer sent so far (never blocks).
    fn refresh(&mut self) -> io::Result<()> {
        self.sock.set_nonblocking(true)?;
        loop {
            let mut msg = [0u8; EXPORT_LEN];
            let (n, fd) = match recv_with_fd(&self.sock, &mut msg) {
                Ok(got) => got,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            };
            if n == 0 {
                return Ok(()); // the writer closed its end; what it sent is mapped
            }
            if n < EXPORT_LEN {
                // A stream may split a message; the rest carries no descriptor.
                self.sock.set_nonblocking(false)?;
                self.sock.set_read_timeout(Some(Duration::from_secs(5)))?;
                (&self.sock).read_exact(&mut msg[n..])?;
                self.sock.set_nonblocking(true)?;
            }
            let base = u64::from_le_bytes(msg[..8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(msg[8..].try_into().expect("8 bytes"));
            let fd = fd.ok_or_else(|| {
                io::Error::new(io::ErrorKind::InvalidData, "an export without a descriptor")
            })?;
            let mapped = SharedMemory::from_fd(fd)?;
            if (mapped.len() as u64) < len || base.checked_add(len).is_none() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "an export of {len} bytes at {base:#x} whose memfd holds {}",
                        mapped.len()
                    ),
                ));
            }
            let end = base + len;
            self.maps
                .retain(|(b, m)| b + m.len() as u64 <= base || *b >= end);
            self.maps.push((base, mapped));
        }
    }

    /// The mapping holding the writer's byte `at`, and where in it.
    fn find(&self, at: u64) -> Option<(&SharedMemory, usize)> {
        self.maps
            .iter()
            .find(|(b, m)| at >= *b && at < b + m.len() as u64)
            .map(|(b, m)| (m, (at - b) as usize))
    }

    /// Copies ranges of the writer's shared memory as [`WriterProcess::pull_run`] does: the
    /// bytes of `remote` (in order) fill `local` (in order); returns the bytes copied, a
    /// prefix (0 bytes, or a range the writer never shared, is an error).
    ///
    /// # Safety
    /// Every `dst` must be valid for writes of its `len` bytes for the duration of the call,
    /// the ranges must not overlap, and nothing in this process may hold a Rust reference to
    /// them.
    pub unsafe fn pull_run(
        &mut self,
        local: &[(*mut u8, usize)],
        remote: &[(u64, usize)],
    ) -> io::Result<usize> {
        self.refresh()?;
        let (mut li, mut loff, mut total) = (0usize, 0usize, 0usize);
        for &(source, len) in remote {
            let mut soff = 0usize;
            while soff < len {
                while li < local.len() && loff == local[li].1 {
                    (li, loff) = (li + 1, 0);
                }
                if li == local.len() {
                    return Ok(total);
                }
                let at = source + soff as u64;
                let Some((map, offset)) = self.find(at) else {
                    if total > 0 {
                        return Ok(total);
                    }
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("a PULL frame names {at:#x}, which the writer did not share"),
                    ));
                };
                let n = (len - soff).min(local[li].1 - loff).min(map.len() - offset);
                // SAFETY: the caller guarantees `local[li]` writable for its length and not
                // aliased; `loff + n <= local[li].1`; the mapping is read-only here and never
                // overlaps registered memory (a mapping of its own).
                unsafe { map.copy_out(offset, local[li].0.add(loff), n)? };
                soff += n;
                loff += n;
                total += n;
            }
        }
        Ok(total)
    }

    /// Mappings held (for tests).
    #[cfg(test)]
    pub fn mapped(&self) -> usize {
        self.maps.len()
    }
}

/// Where a receiver's pulls read a writer's memory.
#[derive(Debug)]
pub enum PullSource {
    /// `process_vm_readv` from the writer's process.
    Process(WriterProcess),
    /// Copies out of the writer's shared memory, mapped here.
    Shared(SharedWriter),
}

impl PullSource {
    /// Copies a run (see [`WriterProcess::pull_run`]).
    ///
    /// # Safety
    /// As for [`WriterProcess::pull_run`].
    pub unsafe fn pull_run(
        &mut self,
        local: &[(*mut u8, usize)],
        remote: &[(u64, usize)],
    ) -> io::Result<usize> {
        match self {
            // SAFETY: the caller's guarantee, passed on.
            PullSource::Process(w) => unsafe { w.pull_run(local, remote) },
            // SAFETY: the caller's guarantee, passed on.
            PullSource::Shared(w) => unsafe { w.pull_run(local, remote) },
        }
    }

    /// Whether bytes come from shared memory (counted apart in the fabric's statistics).
    pub fn is_shared(&self) -> bool {
        matches!(self, PullSource::Shared(_))
    }
}

/// Whether a receiver with `path` uses shared memory for a writer that offered it, given how
/// the ptrace probe went (`ptrace_refused`: the kernel said `EPERM`).
pub(super) fn receiver_wants_shared(path: SameHostPath, ptrace_refused: bool) -> bool {
    match path {
        SameHostPath::Shared => true,
        SameHostPath::Auto => ptrace_refused,
        SameHostPath::Ptrace => false,
    }
}

/// Whether this process's write sources go in shared memory (`TcpFabric::alloc`): always with
/// [`SameHostPath::Shared`], never with `Ptrace`; with `Auto` where it costs nothing or where
/// `process_vm_readv` is likely refused. Cost: shared memory gets huge pages only where the
/// kernel's shmem policy takes advice (`shmem_enabled`: `always`, `within_size`, `advise`,
/// `force`; many distributions ship `never`), and `process_vm_readv` pulls huge-page sources
/// about 10% faster (docs/fabric.md). Likely refused: Yama `ptrace_scope` >= 1 (a receiver may
/// read only its descendants; colocated trainer and engine are siblings), or this process is
/// non-dumpable. Elsewhere a receiver that is refused all the same gets payloads, as before
/// (set `same_host_path = "shared"` for such a host).
pub(super) fn sources_shared(path: SameHostPath) -> bool {
    match path {
        SameHostPath::Shared => true,
        SameHostPath::Ptrace => false,
        SameHostPath::Auto => shmem_takes_huge_pages() || ptrace_likely_refused(),
    }
}

fn shmem_takes_huge_pages() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .is_ok_and(|s| shmem_policy_huge(&s))
}

/// Whether a `shmem_enabled` setting (the selected word in brackets) gives advised shared
/// memory huge pages.
fn shmem_policy_huge(setting: &str) -> bool {
    setting
        .split_whitespace()
        .find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
        .is_some_and(|w| matches!(w, "always" | "within_size" | "advise" | "force"))
}

fn ptrace_likely_refused() -> bool {
    let yama = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .is_some_and(|scope| scope >= 1);
    let non_dumpable = rustix::process::dumpable_behavior()
        .is_ok_and(|d| d == rustix::process::DumpableBehavior::NotDumpable);
    yama || non_dumpable
}

fn random_name() -> String {
    let bytes: [u8; NAME_LEN / 2] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn abstract_address(name: &str) -> io::Result<SocketAddr> {
    SocketAddr::from_abstract_name(format!("weightsync-shm/{name}").as_bytes())
}

/// The receiver's side, after the writer offered shared memory: a listener for the writer to
/// connect to, and the answer to send on the lane (`ANSWER_SHARED`, the secret, the name).
pub(super) struct SharedInvite {
    listener: UnixListener,
    secret: [u8; SECRET_LEN],
    name: String,
}

impl SharedInvite {
    /// Binds the abstract socket (an error: no shared memory on this lane).
    pub fn open() -> io::Result<SharedInvite> {
        let name = random_name();
        let listener = UnixListener::bind_addr(&abstract_address(&name)?)?;
        Ok(SharedInvite {
            listener,
            secret: rand::random(),
            name,
        })
    }

    /// What goes on the lane after the pull answer.
    pub fn answer(&self) -> Vec<u8> {
        let mut out = ANSWER_SHARED.to_vec();
        out.extend_from_slice(&self.secret);
        out.extend_from_slice(self.name.as_bytes());
        out
    }

    /// Reads the writer's confirmation from the lane and, when it connected, takes its
    /// connection once it proved the secret. `Ok(None)`: the writer could not connect.
    pub fn accept(
        self,
        lane: &mut impl Read,
        timeout: Duration,
    ) -> io::Result<Option<SharedWriter>> {
        let mut confirm = [0u8; CONFIRM_LEN];
        lane.read_exact(&mut confirm)?;
        match confirm {
            CONFIRM_NO => return Ok(None),
            CONFIRM_YES => {}
            other => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("bad shared-memory confirmation {other:?}"),
                ));
            }
        }
        // The writer connected before confirming: its connection is in the backlog (any
        // other process's connection to the name is dropped for a wrong secret).
        self.listener.set_nonblocking(true)?;
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((sock, _)) => {
                    sock.set_nonblocking(false)?;
                    sock.set_read_timeout(Some(timeout))?;
                    let mut secret = [0u8; SECRET_LEN];
                    if (&sock).read_exact(&mut secret).is_ok()
                        && blake3::hash(&secret) == blake3::hash(&self.secret)
                    {
                        return Ok(Some(SharedWriter {
                            sock,
                            maps: Vec::new(),
                        }));
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(io::Error::new(
                            io::ErrorKind::TimedOut,
                            "the writer confirmed shared memory but never connected",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// The writer's side, after the receiver answered [`ANSWER_SHARED`]: reads the secret and the
/// name from the lane, connects, proves the secret, and confirms on the lane. `Ok(None)` (after
/// confirming no) when it could not connect.
pub(super) fn join_shared(lane: &mut TcpStream) -> io::Result<Option<SharedExporter>> {
    let mut b = [0u8; SHARED_ANSWER_LEN];
    lane.read_exact(&mut b)?;
    let name = std::str::from_utf8(&b[SECRET_LEN..])
        .ok()
        .filter(|n| n.bytes().all(|c| c.is_ascii_hexdigit()))
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "a bad shared-memory socket name",
            )
        })?
        .to_string();
    let joined = abstract_address(&name)
        .and_then(|a| UnixStream::connect_addr(&a))
        .and_then(|mut s| s.write_all(&b[..SECRET_LEN]).map(|()| s));
    match joined {
        Ok(sock) => {
            lane.write_all(&CONFIRM_YES)?;
            Ok(Some(SharedExporter {
                sock,
                sent: Vec::new(),
            }))
        }
        Err(e) => {
            tracing::info!(error = %e, "shared memory offered but not reachable; the lane carries payloads");
            lane.write_all(&CONFIRM_NO)?;
            Ok(None)
        }
    }
}

#[cfg(test)]
#[path = "shared_pulls_tests.rs"]
mod tests;
