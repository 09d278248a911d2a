//! Reading one inbound lane: headers, payloads straight into registered memory, completions.
//!
//! What the receive thread's system calls are spent on decides how fast a lane is at small and
//! middle-sized frames, so the reader keeps them few:
//! - **Headers are read ahead on a pulling lane.** A header `recv` takes whatever the socket
//!   holds, up to [`AHEAD`] bytes, into a read-ahead buffer: a writer with a queue sends up to
//!   32 frames per `sendmsg`, and a run of PULL headers (64 bytes each, no payload) then costs
//!   one `recv`, not one each. Payload bytes that came along are copied from the buffer into
//!   the region first. A lane that carries payloads only reads one header at a time: its
//!   headers come one per payload anyway, and read-ahead would copy payload bytes twice
//!   (measured: 10-30% slower at 4 and 64 KiB).
//! - **The next headers ride along with the payload.** The `recv` that can finish a payload
//!   also asks for what follows (a second buffer of the same `recvmsg`: the read-ahead buffer),
//!   so a stream of frames costs one call per frame rather than two. Bytes beyond the payload
//!   never touch the region.
//! - **Runs of pulls land in one call.** The PULL headers that are already in the read-ahead
//!   buffer, checked one by one, land with one vectored `process_vm_readv` ([`PULL_RUN`] at
//!   most), after one reset check.
//! - **Wake once per good share of payload.** While it waits for more of a payload it raises the
//!   socket's wake threshold (`SO_RCVLOWAT`) to what is still to come, capped at
//!   [`WAKE_BYTES`]: without it, loopback wakes the thread for every 64 KiB segment (a `poll`, a
//!   `recv` and a context switch each). It lowers the threshold again when the payload is in, so
//!   that a wait for the next header ends at its first byte.
//! - **Completions are coalesced** and sent when the lane runs dry, or when enough have piled up
//!   (by count or by bytes landed) that the writer should hear now.
//!
//! The safety rules of the receiver hold for every call: the region's revocation guard is held
//! only for one non-blocking `recv` or one pull (or one copy out of the read-ahead buffer), never
//! across a wait, and before each chunk of payload or pull the reader checks that the writer has
//! not reset the lane.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::Shared;
use super::frame::{COMPLETION_LEN, Completion, HEADER_LEN};
use super::same_host::{PULL_CHUNK, PULL_IOVS, PULL_RUN};
use super::shared_pulls::PullSource;
use super::socket::{IoFail, LaneSocket, Readiness};
use crate::fabric::region::RegisteredMemory;
use crate::fabric::stride::Stride;

/// Largest single `recv` while holding a region's guard.
const RECV_CHUNK: usize = 8 << 20;

/// Most payload bytes a receive thread waits to have queued before it wakes (`SO_RCVLOWAT`).
/// 256 KiB keeps one wake-up's copy within the L2 cache of this class of machine.
const WAKE_BYTES: usize = 256 << 10;

/// Bytes a header `recv` reads ahead at most: a run of [`PULL_RUN`] PULL headers.
pub(super) const AHEAD: usize = PULL_RUN * HEADER_LEN;

/// Completions sent at once at most (count), and payload bytes landed before the writer should
/// hear of them.
const ACK_BATCH: usize = 16;
const ACK_BATCH_BYTES: u64 = 256 << 10;

/// One PULL frame of a run: where it lands in the region, how long it is, and where its bytes
/// lie in the writer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PullRange {
    /// Offset in the registration.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Address of the first byte in the writer.
    pub source: u64,
    /// Set when the source is strided (the frame's runs are gathered by the copy).
    pub stride: Option<Stride>,
}

/// How a payload ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    /// Bytes read ahead of the frame being handled: `ahead[pos..end]` is the stream's next
    /// bytes (headers, and any payload that came along with them).
    ahead: Box<[u8]>,
    pos: usize,
    end: usize,
    /// The socket's current `SO_RCVLOWAT`.
    wake_bytes: usize,
    /// Encoded completions not sent yet, and the payload bytes landed since the last flush.
    acks: Vec<u8>,
    landed: u64,
    scratch: Vec<u8>,
}

impl<'a> InboundLane<'a> {
    /// A reader that reads up to `read_ahead` bytes past a frame's end ([`AHEAD`] on a lane
    /// that pulls; [`HEADER_LEN`] on one that does not: its headers come one per payload, and
    /// bytes of the next payload read ahead would only be copied once more).
    pub fn new(sock: &'a LaneSocket, shared: &'a Shared, read_ahead: usize) -> Self {
        InboundLane {
            sock,
            shared,
            ahead: vec![0; read_ahead.max(HEADER_LEN)].into_boxed_slice(),
            pos: 0,
            end: 0,
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

    /// Reads the next frame header (and whatever follows it that has arrived, up to [`AHEAD`]
    /// bytes), flushing pending completions whenever the lane runs dry. Returns `None` on a
    /// clean close before the header's first byte.
    pub fn read_header(&mut self) -> Result<Option<[u8; HEADER_LEN]>, IoFail> {
        while self.end - self.pos < HEADER_LEN {
            if self.pos > 0 {
                self.ahead.copy_within(self.pos..self.end, 0);
                self.end -= self.pos;
                self.pos = 0;
            }
            let got = self.end;
            // SAFETY: ahead[got..] is a valid, exclusively borrowed byte range.
            let rc = unsafe {
                self.sock
                    .recv_raw(self.ahead[got..].as_mut_ptr(), self.ahead.len() - got)
            };
            match rc {
                Ok(0) if got == 0 => {
                    let _ = self.flush_acks();
                    return Ok(None);
                }
                Ok(0) => return Err(IoFail::Eof),
                Ok(n) => self.end += n,
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
        let header = self.peek_header();
        self.skip_header();
        Ok(header)
    }

    /// The next frame header if it has already arrived whole (read ahead), without consuming
    /// it and without a system call.
    pub fn peek_header(&self) -> Option<[u8; HEADER_LEN]> {
        (self.end - self.pos >= HEADER_LEN).then(|| {
            self.ahead[self.pos..self.pos + HEADER_LEN]
                .try_into()
                .expect("HEADER_LEN bytes")
        })
    }

    /// Consumes the header [`peek_header`](Self::peek_header) returned.
    pub fn skip_header(&mut self) {
        debug_assert!(self.end - self.pos >= HEADER_LEN);
        self.pos += HEADER_LEN;
        if self.pos == self.end {
            (self.pos, self.end) = (0, 0);
        }
    }

    /// Takes up to `len` read-ahead bytes off the front of the buffer (the start of a payload):
    /// the range of `ahead` they are in.
    fn take_ahead(&mut self, len: u64) -> std::ops::Range<usize> {
        let n = ((self.end - self.pos) as u64).min(len) as usize;
        let range = self.pos..self.pos + n;
        self.pos += n;
        if self.pos == self.end {
            (self.pos, self.end) = (0, 0);
        }
        range
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
                if self.end > self.pos {
                    // The start of the payload came with the header: copy it out of the
                    // read-ahead buffer, then receive the rest (if any) under the same check.
                    let range = self.take_ahead(len - done);
                    // SAFETY: the registration table checked offset + len <= region length and
                    // the range holds at most len - done bytes, so the copy stays inside the
                    // region; the live guard keeps revocation from happening during it, and
                    // `ahead` is a separate allocation.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            self.ahead[range.clone()].as_ptr(),
                            live.as_ptr().add((offset + done) as usize),
                            range.len(),
                        );
                    }
                    done += range.len() as u64;
                    if done == len {
                        break;
                    }
                }
                let want = ((len - done) as usize).min(RECV_CHUNK);
                // SAFETY: the registration table checked offset + len <= region length, and
                // done < len, so [offset + done, offset + done + want) lies inside the region.
                // The live guard keeps revocation (and so the end of the backend's right to the
                // memory) from happening during the call; the memory itself outlives the guard
                // (Arc). The read-ahead buffer is exclusively borrowed and empty (what it held
                // of this payload was taken first, and done < len means it held less).
                unsafe {
                    let dst = live.as_ptr().add((offset + done) as usize);
                    if done + want as u64 == len {
                        let ahead = self.ahead.len();
                        self.sock
                            .recv_two_raw((dst, want), (self.ahead.as_mut_ptr(), ahead))
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
                        (self.pos, self.end) = (0, n - rest as usize);
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

    /// Lands a run of PULL frames into `memory`, each checked against the registration by the
    /// caller, copied from where its bytes lie in the writer's memory. One `process_vm_readv`
    /// per [`PULL_CHUNK`] bytes, [`PULL_RUN`] frames and [`PULL_IOVS`] source ranges at most,
    /// each under the region's revocation guard and after checking that the writer has not
    /// reset the lane (its source pins may be gone once it has). If the region is revoked
    /// part-way, stops at once and returns `Revoked` for the run; nothing is on the wire to
    /// drain.
    pub fn pull(
        &mut self,
        memory: &RegisteredMemory,
        frames: &[PullRange],
        writer: &mut PullSource,
    ) -> Result<Landing, IoFail> {
        // Landing tickets only where the owner keeps a landing log (no allocation otherwise).
        let _logged: Vec<_> = frames
            .iter()
            .filter_map(|f| memory.landing(f.offset, f.len))
            .collect();
        // Frame `at` has `done` of its bytes landed; every frame before it is whole.
        let (mut at, mut done) = (0usize, 0u64);
        let mut local: Vec<(*mut u8, usize)> = Vec::with_capacity(frames.len().min(PULL_RUN));
        let mut remote: Vec<(u64, usize)> = Vec::with_capacity(frames.len().min(PULL_RUN));
        loop {
            skip_whole(frames, &mut at, &mut done, 0);
            if at == frames.len() {
                return Ok(Landing::Landed);
            }
            if self.sock.reset_by_peer() {
                return Err(IoFail::PeerReset);
            }
            let Some(live) = memory.live() else {
                return Ok(Landing::Revoked);
            };
            local.clear();
            remote.clear();
            let mut budget = PULL_CHUNK as u64;
            let (mut i, mut d) = (at, done);
            while i < frames.len() && local.len() < PULL_RUN && budget > 0 {
                let f = frames[i];
                let mut want = (f.len - d).min(budget);
                match f.stride {
                    None => remote.push((f.source + d, want as usize)),
                    Some(s) => {
                        let (from, s) = s.advance(f.source, d);
                        let room = (PULL_IOVS - remote.len()) as u64;
                        want = want.min(s.bytes_in(room));
                        remote.extend(s.segments(from, want).map(|(a, n)| (a, n as usize)));
                    }
                }
                if want == 0 {
                    break; // no source range left in this call
                }
                // SAFETY: the registration table checked offset + len <= region length and
                // d + want <= len, so the range lies inside the region; the live guard keeps
                // revocation from happening during the call below, and the memory outlives
                // the guard (Arc).
                let dst = unsafe { live.as_ptr().add((f.offset + d) as usize) };
                local.push((dst, want as usize));
                budget -= want;
                (i, d) = if d + want == f.len {
                    (i + 1, 0)
                } else {
                    (i, d + want)
                };
                if remote.len() == PULL_IOVS {
                    break;
                }
            }
            // SAFETY: each local range lies inside the live region (above) and no Rust
            // reference to region memory exists; two frames aimed at the same bytes only mean
            // that the later one's bytes win, as with two payloads. Only the writer's memory is
            // read.
            let got = unsafe { writer.pull_run(&local, &remote) };
            drop(live);
            self.shared.stats.pull_calls.fetch_add(1, Ordering::Relaxed);
            match got {
                Ok(n) => skip_whole(frames, &mut at, &mut done, n as u64),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(IoFail::Os(e)),
            }
        }
    }

    /// Reads and discards `len` bytes (the payload of a refused frame, or the rest of one whose
    /// region was revoked).
    pub fn drain(&mut self, len: u64) -> Result<(), IoFail> {
        let mut left = len - self.take_ahead(len).len() as u64;
        if left > 0 && self.scratch.is_empty() {
            self.scratch.resize(64 << 10, 0);
        }
        let (timeout, stop) = (self.timeout(), self.stop());
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

    /// Queues a completion without sending anything: the caller flushes after the frame, or
    /// after a run of pulls, whose completions go out together
    /// ([`flush_if_due`](Self::flush_if_due)).
    pub fn queue_completion(&mut self, completion: Completion) {
        self.acks.extend_from_slice(&completion.encode());
    }

    /// Sends the queued completions if enough have piled up.
    pub fn flush_if_due(&mut self) -> Result<(), IoFail> {
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

/// Moves the cursor (`at`, `done`: frame `at` has `done` bytes landed) `n` bytes further
/// through `frames`, past every frame that is then whole.
fn skip_whole(frames: &[PullRange], at: &mut usize, done: &mut u64, mut n: u64) {
    while *at < frames.len() {
        let left = frames[*at].len - *done;
        if left > n {
            *done += n;
            return;
        }
        n -= left;
        (*at, *done) = (*at + 1, 0);
    }
}
