//! Reading one inbound lane: headers, payloads straight into registered memory, completions.
//!
//! What the receive thread's system calls are spent on decides how fast a lane is at small and
//! middle-sized frames, so the reader keeps them few:
//! - **The next header rides along with the payload.** The `recv` that can finish a payload
//!   also asks for the next frame's header (a second buffer of the same `recvmsg`), so a stream
//!   of frames costs one call per frame rather than two. Bytes beyond the payload never touch
//!   the region: they land in the header buffer.
//! - **Wake once per good share of payload.** While it waits for more of a payload it raises the
//!   socket's wake threshold (`SO_RCVLOWAT`) to what is still to come, capped at
//!   [`WAKE_BYTES`]: without it, loopback wakes the thread for every 64 KiB segment (a `poll`, a
//!   `recv` and a context switch each). It lowers the threshold again when the payload is in, so
//!   that a wait for the next header ends at its first byte.
//! - **Completions are coalesced** and sent when the lane runs dry, or when enough have piled up
//!   (by count or by bytes landed) that the writer should hear now.
//!
//! The safety rules of the receiver hold for every call: the region's revocation guard is held
//! only for one non-blocking `recv`, never across a wait, and before each chunk of payload the
//! reader checks that the writer has not reset the lane.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use super::frame::{Completion, COMPLETION_LEN, HEADER_LEN};
use super::same_host::{WriterProcess, PULL_CHUNK};
use super::socket::{IoFail, LaneSocket, Readiness};
use super::Shared;
use crate::fabric::region::RegisteredMemory;

/// Largest single `recv` while holding a region's guard.
const RECV_CHUNK: usize = 8 << 20;

/// Most payload bytes a receive thread waits to have queued before it wakes (`SO_RCVLOWAT`).
/// 256 KiB keeps one wake-up's copy within the L2 cache of this class of machine.
const WAKE_BYTES: usize = 256 << 10;

/// Completions sent at once at most (count), and payload bytes landed before the writer should
/// hear of them.
const ACK_BATCH: usize = 16;
const ACK_BATCH_BYTES: u64 = 256 << 10;

/// How a payload ended up.
pub(super) enum Landing {
    /// Every byte is in the region.
    Landed,
    /// The region was deregistered part-way; the rest was drained, nothing more landed.
    Revoked,
}

/// The reading state of one inbound lane.
pub(super) struct InboundLane<'a> {
    sock: &'a LaneSocket,
    shared: &'a Shared,
    /// The next header, `next_got` bytes of it already read.
    next: [u8; HEADER_LEN],
    next_got: usize,
    /// The socket's current `SO_RCVLOWAT`.
    wake_bytes: usize,
    /// Encoded completions not sent yet, and the payload bytes landed since the last flush.
    acks: Vec<u8>,
    landed: u64,
    scratch: Vec<u8>,
}

impl<'a> InboundLane<'a> {
    pub fn new(sock: &'a LaneSocket, shared: &'a Shared) -> Self {
        InboundLane {
            sock,
            shared,
            next: [0; HEADER_LEN],
            next_got: 0,
            wake_bytes: 1,
            acks: Vec::new(),
            landed: 0,
            scratch: Vec::new(),
        }
    }

    fn timeout(&self) -> Duration {
        self.shared.config.io_timeout()
    }

    fn stop(&self) -> &'a AtomicBool {
        &self.shared.stop
    }

    /// Reads the rest of the next frame header, flushing pending completions whenever the lane
    /// runs dry. Returns `None` on a clean close before the header's first byte.
    pub fn read_header(&mut self) -> Result<Option<[u8; HEADER_LEN]>, IoFail> {
        while self.next_got < HEADER_LEN {
            let got = self.next_got;
            // SAFETY: next[got..] is a valid, exclusively borrowed byte range.
            let rc = unsafe {
                self.sock
                    .recv_raw(self.next[got..].as_mut_ptr(), HEADER_LEN - got)
            };
            match rc {
                Ok(0) if got == 0 => {
                    let _ = self.flush_acks();
                    return Ok(None);
                }
                Ok(0) => return Err(IoFail::Eof),
                Ok(n) => self.next_got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !self.acks.is_empty() {
                        self.flush_acks()?;
                        continue;
                    }
                    let limit = if got == 0 { None } else { Some(self.timeout()) };
                    self.sock.wait(Readiness::Read, limit, self.stop())?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
        self.next_got = 0;
        Ok(Some(self.next))
    }

    /// Receives `len` payload bytes into `memory` at `offset` (checked against the registration
    /// by the caller). If the region is revoked part-way, stops writing to it at once, drains
    /// the rest and returns `Revoked`. The owner's landing log, if any, sees the frame begin
    /// before its first byte and end after its last (or when it stopped).
    pub fn land(
        &mut self,
        memory: &RegisteredMemory,
        offset: u64,
        len: u64,
    ) -> Result<Landing, IoFail> {
        let _logged = memory.landing(offset, len);
        let landing = self.land_bytes(memory, offset, len);
        self.set_wake(1)?;
        landing
    }

    fn land_bytes(
        &mut self,
        memory: &RegisteredMemory,
        offset: u64,
        len: u64,
    ) -> Result<Landing, IoFail> {
        let mut done: u64 = 0;
        while done < len {
            if self.sock.reset_by_peer() {
                return Err(IoFail::PeerReset);
            }
            let rc = {
                let Some(live) = memory.live() else {
                    self.set_wake(1)?;
                    self.drain(len - done)?;
                    return Ok(Landing::Revoked);
                };
                let want = ((len - done) as usize).min(RECV_CHUNK);
                // SAFETY: the registration table checked offset + len <= region length, and
                // done < len, so [offset + done, offset + done + want) lies inside the region.
                // The live guard keeps revocation (and so the end of the backend's right to the
                // memory) from happening during the call; the memory itself outlives the guard
                // (Arc). The header buffer is exclusively borrowed and empty (next_got is 0
                // between a header and its payload).
                unsafe {
                    let dst = live.as_ptr().add((offset + done) as usize);
                    if done + want as u64 == len {
                        self.sock
                            .recv_two_raw((dst, want), (self.next.as_mut_ptr(), HEADER_LEN))
                    } else {
                        self.sock.recv_raw(dst, want)
                    }
                }
            };
            match rc {
                Ok(0) => return Err(IoFail::Eof),
                Ok(n) => {
                    let rest = len - done;
                    if n as u64 > rest {
                        self.next_got = n - rest as usize;
                        done = len;
                    } else {
                        done += n as u64;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.set_wake(((len - done) as usize).min(WAKE_BYTES))?;
                    self.sock
                        .wait(Readiness::Read, Some(self.timeout()), self.stop())?;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
        Ok(Landing::Landed)
    }

    /// Lands a PULL frame: copies `len` bytes from `source` in the writer's memory into `memory`
    /// at `offset` (checked against the registration by the caller), in chunks of at most
    /// [`PULL_CHUNK`], each under the region's revocation guard and after checking that the
    /// writer has not reset the lane (its source pin may be gone once it has). If the region is
    /// revoked part-way, stops at once and returns `Revoked`; nothing is on the wire to drain.
    pub fn pull(
        &mut self,
        memory: &RegisteredMemory,
        offset: u64,
        len: u64,
        writer: WriterProcess,
        source: u64,
    ) -> Result<Landing, IoFail> {
        let _logged = memory.landing(offset, len);
        let mut done: u64 = 0;
        while done < len {
            if self.sock.reset_by_peer() {
                return Err(IoFail::PeerReset);
            }
            let Some(live) = memory.live() else {
                return Ok(Landing::Revoked);
            };
            let want = ((len - done) as usize).min(PULL_CHUNK);
            // SAFETY: the registration table checked offset + len <= region length and done <
            // len, so [offset + done, offset + done + want) lies inside the region; the live
            // guard keeps revocation from happening during the call, and the memory outlives the
            // guard (Arc). Only the writer's memory is read by the kernel.
            let got = unsafe {
                writer.pull_into(
                    live.as_ptr().add((offset + done) as usize),
                    source + done,
                    want,
                )
            };
            drop(live);
            match got {
                Ok(n) => done += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
        Ok(Landing::Landed)
    }

    /// Reads and discards `len` bytes (the payload of a refused frame, or the rest of one whose
    /// region was revoked).
    pub fn drain(&mut self, len: u64) -> Result<(), IoFail> {
        if self.scratch.is_empty() {
            self.scratch.resize(64 << 10, 0);
        }
        let (timeout, stop) = (self.timeout(), self.stop());
        let mut left = len;
        while left > 0 {
            let n = (left as usize).min(self.scratch.len());
            self.sock
                .read_exact(&mut self.scratch[..n], Some(timeout), timeout, stop)?;
            left -= n as u64;
        }
        Ok(())
    }

    /// Counts `len` payload bytes as landed (or refused) towards the next completion flush.
    pub fn count_landed(&mut self, len: u64) {
        self.landed += len;
    }

    /// Queues a completion; sends the queue if enough has piled up.
    pub fn complete(&mut self, completion: Completion) -> Result<(), IoFail> {
        self.acks.extend_from_slice(&completion.encode());
        if self.acks.len() >= ACK_BATCH * COMPLETION_LEN || self.landed >= ACK_BATCH_BYTES {
            self.flush_acks()?;
        }
        Ok(())
    }

    fn flush_acks(&mut self) -> Result<(), IoFail> {
        if !self.acks.is_empty() {
            self.sock
                .write_all(&self.acks, self.timeout(), self.stop())?;
            self.acks.clear();
        }
        self.landed = 0;
        Ok(())
    }

    fn set_wake(&mut self, bytes: usize) -> Result<(), IoFail> {
        let bytes = bytes.max(1);
        if bytes != self.wake_bytes {
            self.sock.set_rcvlowat(bytes).map_err(IoFail::Os)?;
            self.wake_bytes = bytes;
        }
        Ok(())
    }
}
