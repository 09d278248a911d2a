//! Same-host pulls: a receiver on the writer's own machine copies a frame's bytes out of the
//! writer's memory itself, once, instead of the kernel copying them into and out of a socket.
//!
//! Why: on one host a TCP lane copies every byte twice (the sender's `sendmsg` into socket
//! buffers, the receiver's `recv` out of them), and on a loaded machine those two copies are the
//! whole cost of a lane (the fabric bench's profile: the kernel's two copies at 35% of all
//! samples, weightsync's own code under 2%). Training and inference processes sharing a node
//! (colocated RL, or several engines on one host) are common, and so is a writer on the same
//! host as its reader in tests and demos. `process_vm_readv(2)` (cross-memory attach, what MPI
//! and UCX use for the same job) copies from another process's memory straight into this
//! one's: one copy, no socket buffers.
//!
//! Why the *receiver* copies (a pull) rather than the writer pushing into the receiver's memory:
//! the receiver keeps every guarantee it has for socket payloads, because it is still the only
//! one that touches its registered memory. It checks rkey, bounds and permission before the
//! first byte, holds the region's revocation guard across each bounded copy (so deregistration
//! takes effect at once), checks between copies that the writer has not reset the lane, and
//! counts the immediate only after the last byte. A writer pushing into another process's
//! memory would need that process's cooperation to stop writes into memory it frees. What the
//! writer must do instead is keep its source alive until the receiver is done: it pins the
//! source registration ([`RegisteredMemory::pin`](crate::fabric::RegisteredMemory::pin)) from
//! the moment it sends a PULL frame until that frame's completion arrives or its lane is
//! aborted, and deregistering the source waits for the pins.
//!
//! Agreeing on it, per lane, after authentication: the writer offers its pid, its kernel's boot
//! id and the address of the handshake nonce in its memory; the receiver, on the same boot id,
//! reads those 32 bytes from that pid and address and compares them with the nonce it was sent.
//! Equal, they prove that the pid names the writer (same pid namespace) and that this process may
//! read its memory (the kernel's ptrace access check: same user, and not refused by Yama's
//! `ptrace_scope` or a seccomp policy); then the receiver answers yes and accepts PULL frames on
//! that lane. Any failure answers no, and the lane carries payloads as before. Either side can
//! turn pulls off ([`FabricConfig::same_host`](crate::fabric::FabricConfig::same_host)).
//!
//! This module holds the offer and answer wire formats and the one system call (its `unsafe`).

use std::io;
use std::sync::OnceLock;

/// Size of [`PullOffer`] on the wire.
pub const OFFER_LEN: usize = 32;
/// Size of the receiver's answer on the wire.
pub const ANSWER_LEN: usize = 8;
/// The receiver will pull this lane's PULL frames.
pub const ANSWER_YES: [u8; ANSWER_LEN] = *b"PULL-YES";
/// The receiver will not: the writer sends payloads.
pub const ANSWER_NO: [u8; ANSWER_LEN] = *b"PULL-NO!";
/// The receiver will pull, from memory the writer shares by descriptor (`shared_pulls`): the
/// answer is followed by where and how to hand the descriptors over.
pub const ANSWER_SHARED: [u8; ANSWER_LEN] = *b"PULL-SHM";

/// Most bytes one pull copies while holding the destination's revocation guard (the same bound
/// as one payload `recv`).
pub const PULL_CHUNK: usize = 8 << 20;

/// Most frames landed by one pull (one `process_vm_readv` with this many ranges): a run of
/// PULL headers that arrived together is landed at once, so a stream of middle-sized frames
/// pays one system call, one reset check and one completion flush per run, not per frame.
pub const PULL_RUN: usize = 64;

/// Most source ranges of one pull: the kernel's limit on one call's iovecs (`IOV_MAX`). A frame
/// from a strided source takes one per run.
pub const PULL_IOVS: usize = 1024;

/// Most bytes of one run of PULL frames: a run's completions go out after its last byte, so a
/// run of large frames would hold back the writer's window (frames of 1 MiB and more land one
/// per call, as before runs; a run pays off for the smaller ones, whose per-call costs it
/// shares).
pub const PULL_RUN_BYTES: u64 = 1 << 20;

/// Runs shorter than this are not worth pulling from a strided source: `process_vm_readv`
/// pins and unpins the pages of every remote range on its own, so a frame of short runs costs
/// a page-table walk per run. Measured on the 2-core development VM, 64 MiB in 1 MiB frames
/// from runs at twice their length apart, against a memcpy gathering the runs into a buffer and
/// one pull of it: runs of 2 KiB pulled at 3.2-3.9 GB/s against 4.6-5.4, 3 KiB at 3.8-4.4
/// against 4.8-5.3, 8 KiB at 5.3-6.0 against 5.2-5.7 (even), 16 KiB at 6.1-6.6 against
/// 5.5-5.6, and contiguous 1 MiB frames at 6.1-7.4. A payload lane gathers with `sendmsg`,
/// which copies each range without pinning, so this holds only where lanes may pull.
pub const MIN_STRIDED_RUN: u64 = 8 << 10;

/// Frames shorter than this travel as payloads even on a pulling lane: below it the system
/// call's fixed cost (pinning the source pages) outweighs the copy it saves.
pub const PULL_MIN_BYTES: u64 = 16 << 10;

/// What a writer offers after authentication.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PullOffer {
    /// Whether the writer offers pulls at all (all other fields are zero when not).
    pub offered: bool,
    /// Whether it can also hand its sources over as shared memory (`fabric::shared_memory`)
    /// when the receiver may not read its memory with `process_vm_readv`.
    pub shared: bool,
    /// The writer's process id.
    pub pid: u32,
    /// The writer's kernel boot id (`/proc/sys/kernel/random/boot_id`): equal ids mean one
    /// machine.
    pub boot_id: [u8; 16],
    /// Where the writer holds the 32-byte nonce of its hello while it waits for the answer.
    pub probe: u64,
}

impl PullOffer {
    /// No offer (pulls off, or no boot id to compare).
    pub const NONE: PullOffer = PullOffer {
        offered: false,
        shared: false,
        pid: 0,
        boot_id: [0; 16],
        probe: 0,
    };

    /// Encodes the offer.
    pub fn encode(&self) -> [u8; OFFER_LEN] {
        let mut b = [0u8; OFFER_LEN];
        let flag = u32::from(self.offered) | (u32::from(self.offered && self.shared) << 1);
        b[0..4].copy_from_slice(&flag.to_le_bytes());
        b[4..8].copy_from_slice(&self.pid.to_le_bytes());
        b[8..24].copy_from_slice(&self.boot_id);
        b[24..32].copy_from_slice(&self.probe.to_le_bytes());
        b
    }

    /// Decodes an offer; any bytes give an offer or an error naming the bad field.
    pub fn decode(b: &[u8; OFFER_LEN]) -> Result<PullOffer, String> {
        let flag = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let pid = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let mut boot_id = [0u8; 16];
        boot_id.copy_from_slice(&b[8..24]);
        let mut probe = [0u8; 8];
        probe.copy_from_slice(&b[24..32]);
        let probe = u64::from_le_bytes(probe);
        match flag {
            0 if pid == 0 && probe == 0 && boot_id == [0; 16] => Ok(PullOffer::NONE),
            0 => Err("a pull offer that is not offered carries fields".into()),
            1 | 3 if pid == 0 || probe == 0 || pid > i32::MAX as u32 => {
                Err(format!("a pull offer with pid {pid} and probe {probe:#x}"))
            }
            1 | 3 => Ok(PullOffer {
                offered: true,
                shared: flag == 3,
                pid,
                boot_id,
                probe,
            }),
            other => Err(format!("pull offer flag {other}")),
        }
    }

    /// The offer this process makes, with `nonce` (alive until the answer comes) as the probe
    /// and shared memory offered when `shared`; no offer when pulls are off or the boot id
    /// cannot be read.
    pub fn of_this_process(enabled: bool, shared: bool, nonce: &[u8; 32]) -> PullOffer {
        match (enabled, boot_id()) {
            (true, Some(boot_id)) => PullOffer {
                offered: true,
                shared,
                pid: std::process::id(),
                boot_id,
                probe: nonce.as_ptr() as u64,
            },
            _ => PullOffer::NONE,
        }
    }
}

/// This kernel's boot id, read once; `None` where /proc does not have it.
pub fn boot_id() -> Option<[u8; 16]> {
    static ID: OnceLock<Option<[u8; 16]>> = OnceLock::new();
    *ID.get_or_init(|| {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        parse_boot_id(&text)
    })
}

fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text.trim().bytes().filter(|&c| c != b'-').collect();
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        id[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(id)
}

/// Why a receiver does not pull from a writer (the lane then carries payloads).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Declined {
    /// The writer offered nothing (pulls off on its side).
    #[error("the writer did not offer pulls")]
    NotOffered,
    /// Different boot ids: the normal case between two machines.
    #[error("the writer runs on another machine")]
    OtherMachine,
    /// This machine's boot id cannot be read.
    #[error("this machine's boot id cannot be read")]
    NoBootId,
    /// Same machine, but the kernel refused this process ptrace access to the writer (`EPERM`:
    /// another user, Yama `ptrace_scope`, a non-dumpable writer, a seccomp policy): the case
    /// memory shared by descriptor ([`super::shared_memory`]) is for.
    #[error("{0}")]
    PtraceRefused(String),
    /// Same machine, but the probe failed otherwise (another pid namespace, ...).
    #[error("{0}")]
    ProbeFailed(String),
}

/// A writer this process may pull from (its offer checked by [`WriterProcess::verify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterProcess {
    pid: libc::pid_t,
}

impl WriterProcess {
    /// Checks `offer` against the nonce the writer sent in its hello: same machine, and the
    /// writer's memory really holds that nonce at the probe address (readable by this process).
    pub fn verify(offer: &PullOffer, nonce: &[u8; 32]) -> Result<WriterProcess, Declined> {
        if !offer.offered {
            return Err(Declined::NotOffered);
        }
        match boot_id() {
            Some(id) if id == offer.boot_id => {}
            Some(_) => return Err(Declined::OtherMachine),
            None => return Err(Declined::NoBootId),
        }
        let writer = WriterProcess {
            pid: offer.pid as libc::pid_t,
        };
        let mut seen = [0u8; 32];
        // SAFETY: `seen` is a live, exclusively borrowed 32-byte buffer.
        let got = unsafe { writer.pull_into(seen.as_mut_ptr(), offer.probe, seen.len()) };
        match got {
            Ok(32) if seen == *nonce => Ok(writer),
            Ok(32) => Err(Declined::ProbeFailed(format!(
                "pid {} does not hold the writer's nonce (another pid namespace?)",
                offer.pid
            ))),
            Ok(n) => Err(Declined::ProbeFailed(format!(
                "reading the probe gave {n} of 32 bytes"
            ))),
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {
                Err(Declined::PtraceRefused(format!(
                    "reading pid {}'s memory was refused: {e} (ptrace access: another user, Yama \
                     ptrace_scope, a non-dumpable writer, or a seccomp policy)",
                    offer.pid
                )))
            }
            Err(e) => Err(Declined::ProbeFailed(format!(
                "reading pid {}'s memory was refused: {e} (ptrace access: another user, Yama \
                 ptrace_scope, or a seccomp policy)",
                offer.pid
            ))),
        }
    }

    /// Copies up to `len` bytes from `source` in the writer's memory to `dst` in this process;
    /// returns how many were copied (fewer when a page of the source is not mapped after the
    /// first; an error when none is, or the writer is gone).
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes for the duration of the call, and nothing
    /// in this process may hold a Rust reference to those bytes.
    pub unsafe fn pull_into(&self, dst: *mut u8, source: u64, len: usize) -> io::Result<usize> {
        // SAFETY: the caller's guarantee for `dst` is pull_run's for its one range.
        unsafe { self.pull_run(&[(dst, len)], &[(source, len)]) }
    }

    /// Copies ranges out of the writer in one call, gathering as it goes: the bytes of
    /// `remote` (`(source, len)`, in order) fill the ranges of `local` (`(dst, len)`, in order),
    /// so several frames, each gathered from a strided source, land at once. Returns the bytes
    /// copied, a prefix of that stream (the kernel stops at the first remote range it cannot
    /// read whole or in part; 0 bytes is an error, as for [`pull_into`](Self::pull_into)).
    /// At most [`PULL_RUN`] local and [`PULL_IOVS`] remote ranges.
    ///
    /// # Safety
    /// Every `dst` must be valid for writes of its `len` bytes for the duration of the call, the
    /// ranges must not overlap, and nothing in this process may hold a Rust reference to them.
    pub unsafe fn pull_run(
        &self,
        local: &[(*mut u8, usize)],
        remote: &[(u64, usize)],
    ) -> io::Result<usize> {
        let (nl, nr) = (local.len().min(PULL_RUN), remote.len().min(PULL_IOVS));
        if local[..nl].iter().all(|p| p.1 == 0) || remote[..nr].iter().all(|p| p.1 == 0) {
            return Ok(0);
        }
        let local: Vec<libc::iovec> = local[..nl]
            .iter()
            .map(|&(dst, len)| libc::iovec {
                iov_base: dst.cast(),
                iov_len: len,
            })
            .collect();
        let remote: Vec<libc::iovec> = remote[..nr]
            .iter()
            .map(|&(source, len)| libc::iovec {
                iov_base: source as usize as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        // SAFETY: `local` describes memory the caller guarantees writable and disjoint; the
        // remote ranges are only read, by the kernel, from the writer's address space (a bad
        // address there gives EFAULT or a short count, never a fault here).
        let rc = unsafe {
            libc::process_vm_readv(
                self.pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else if rc == 0 {
            Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the writer's source range is not mapped",
            ))
        } else {
            Ok(rc as usize)
        }
    }

    /// The writer's process id.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip_and_bad_ones_are_named() {
        let offer = PullOffer {
            offered: true,
            shared: false,
            pid: 4242,
            boot_id: [7; 16],
            probe: 0x7fff_0000_1000,
        };
        assert_eq!(PullOffer::decode(&offer.encode()), Ok(offer));
        let shared = PullOffer {
            shared: true,
            ..offer
        };
        assert_eq!(PullOffer::decode(&shared.encode()), Ok(shared));
        assert_eq!(
            PullOffer::decode(&PullOffer::NONE.encode()),
            Ok(PullOffer::NONE)
        );
        let mut b = offer.encode();
        b[0] = 9;
        assert!(PullOffer::decode(&b).unwrap_err().contains("flag"));
        let mut b = offer.encode();
        b[4..8].copy_from_slice(&0u32.to_le_bytes());
        assert!(PullOffer::decode(&b).unwrap_err().contains("pid 0"));
        let mut b = PullOffer::NONE.encode();
        b[30] = 1;
        assert!(PullOffer::decode(&b).unwrap_err().contains("carries"));
    }

    #[test]
    fn boot_ids_parse_from_the_kernel_format() {
        assert_eq!(
            parse_boot_id("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n"),
            Some([
                0x0f, 0x1e, 0x2d, 0x3c, 0x4b, 0x5a, 0x69, 0x78, 0x87, 0x96, 0xa5, 0xb4, 0xc3, 0xd2,
                0xe1, 0xf0
            ])
        );
        assert_eq!(parse_boot_id("not-an-id"), None);
        assert_eq!(parse_boot_id("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"), None);
    }

    #[test]
    fn this_process_verifies_its_own_offer_and_refuses_a_wrong_nonce() {
        let nonce: [u8; 32] = rand::random();
        let offer = PullOffer::of_this_process(true, false, &nonce);
        if boot_id().is_none() {
            assert_eq!(offer, PullOffer::NONE);
            return;
        }
        let writer = WriterProcess::verify(&offer, &nonce).expect("own memory is readable");
        assert_eq!(writer.pid(), std::process::id());
        let other: [u8; 32] = rand::random();
        let err = WriterProcess::verify(&offer, &other).unwrap_err();
        assert!(err.to_string().contains("nonce"), "{err}");
        let elsewhere = PullOffer {
            boot_id: [0xAB; 16],
            ..offer
        };
        assert_eq!(
            WriterProcess::verify(&elsewhere, &nonce).unwrap_err(),
            Declined::OtherMachine
        );
        assert_eq!(
            WriterProcess::verify(&PullOffer::NONE, &nonce).unwrap_err(),
            Declined::NotOffered
        );
        assert_eq!(
            PullOffer::of_this_process(false, false, &nonce),
            PullOffer::NONE
        );
    }

    /// This process as a writer it may pull from (`None` where pulls are never agreed).
    fn this_process() -> Option<WriterProcess> {
        let nonce: [u8; 32] = rand::random();
        WriterProcess::verify(&PullOffer::of_this_process(true, false, &nonce), &nonce).ok()
    }

    #[test]
    fn pulls_copy_from_the_writer_and_refuse_unmapped_sources() {
        let Some(writer) = this_process() else {
            return; // no boot id here: nothing to pull with
        };
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 31) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        // SAFETY: dst is a live buffer of that length, not borrowed elsewhere during the call.
        let n = unsafe { writer.pull_into(dst.as_mut_ptr(), src.as_ptr() as u64, dst.len()) };
        assert_eq!(n.unwrap(), src.len());
        assert_eq!(dst, src);
        // SAFETY: as above; the source address is never mapped (the first page).
        let err = unsafe { writer.pull_into(dst.as_mut_ptr(), 8, 16) }.unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT), "{err}");
    }

    #[test]
    fn a_run_fills_its_pieces_in_order_and_stops_at_an_unreadable_one() {
        let Some(writer) = this_process() else {
            return; // no boot id here: nothing to pull with
        };
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 17 + 3) as u8).collect();
        let mut dst = vec![0u8; 60_000];
        let base = dst.as_mut_ptr();
        let from = |i: usize| src.as_ptr() as u64 + i as u64;
        // Three pieces, gathered out of order from the source into consecutive ranges; the
        // second from two source ranges (a strided source).
        // SAFETY: the pieces are disjoint ranges of dst, which nothing borrows during the call.
        let n = unsafe {
            writer.pull_run(
                &[
                    (base, 20_000),
                    (base.add(20_000), 30_000),
                    (base.add(50_000), 10_000),
                ],
                &[
                    (from(50_000), 20_000),
                    (from(0), 10_000),
                    (from(30_000), 20_000),
                    (from(90_000), 10_000),
                ],
            )
        };
        assert_eq!(n.unwrap(), 60_000);
        assert_eq!(dst[..20_000], src[50_000..70_000]);
        assert_eq!(dst[20_000..30_000], src[..10_000]);
        assert_eq!(dst[30_000..50_000], src[30_000..50_000]);
        assert_eq!(dst[50_000..], src[90_000..]);
        // An unmapped source in the middle: the pieces before it are copied and counted, the
        // ones after it are not.
        dst.fill(0);
        let base = dst.as_mut_ptr();
        // SAFETY: as above; the second piece's source is the never-mapped first page.
        let n = unsafe {
            writer.pull_run(
                &[(base, 1000), (base.add(1000), 1000), (base.add(2000), 1000)],
                &[(from(0), 1000), (8, 1000), (from(0), 1000)],
            )
        };
        assert_eq!(n.unwrap(), 1000);
        assert_eq!(dst[..1000], src[..1000]);
        assert!(dst[1000..].iter().all(|&b| b == 0));
    }
}
