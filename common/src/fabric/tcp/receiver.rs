//! The receiving half of the emulated NIC: accept lanes, check frames, land payloads.
//!
//! One thread per inbound lane (blocking-style I/O on a non-blocking socket): for each frame it
//! checks rkey, bounds and permission in the [`RegistrationTable`](super::RegistrationTable) before
//! touching memory, then `recv`s the payload directly into the registered region, holding the
//! region's revocation guard only for each non-blocking `recv` so that deregistration takes
//! effect at once. Only after the last payload byte is in memory does it count the immediate
//! (for a split write: after the last of its parts). Refused frames are drained into a small
//! scratch buffer and reported in the next completion; malformed frames drop the lane.
//!
//! A writer that abandons its writes resets its lane (RST). The kernel still hands out the bytes
//! that arrived before the RST, so before landing each chunk of payload, and again before
//! counting an immediate, the thread checks whether the connection was reset, and if so stops:
//! frames a writer abandoned never land late, over the bytes of a later sync.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::frame::{Completion, FrameHeader, COMPLETION_LEN, HEADER_LEN};
use super::handshake::server_handshake;
use super::socket::{wait_fd, IoFail, LaneSocket, Readiness};
use super::Shared;
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::RemoteAccessKind;
use crate::fabric::region::RegisteredMemory;

/// Largest single `recv` while holding a region's guard.
const RECV_CHUNK: usize = 8 << 20;

/// Most payload bytes a receive thread waits to have queued before it wakes (`SO_RCVLOWAT`).
/// Without it, loopback wakes the thread for every 64 KiB segment: a `poll`, a `recv` and a
/// context switch each. 256 KiB keeps the copy within the L2 cache of this class of machine.
const WAKE_BYTES: usize = 256 << 10;

/// The lane socket's current `SO_RCVLOWAT`, changed only when it must be.
struct WakeThreshold {
    bytes: usize,
}

impl WakeThreshold {
    fn set(&mut self, sock: &LaneSocket, bytes: usize) -> Result<(), IoFail> {
        let bytes = bytes.max(1);
        if bytes != self.bytes {
            sock.set_rcvlowat(bytes).map_err(IoFail::Os)?;
            self.bytes = bytes;
        }
        Ok(())
    }
}

/// Runs the accept loop of the listener on local address number `local` until the fabric stops.
pub(super) fn accept_loop(listener: TcpListener, local: usize, shared: Arc<Shared>) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "fabric listener cannot be made non-blocking");
        return;
    }
    loop {
        match wait_fd(
            std::os::fd::AsRawFd::as_raw_fd(&listener),
            Readiness::Read,
            None,
            &shared.stop,
        ) {
            Err(IoFail::Shutdown) => return,
            Err(e) => {
                tracing::error!(error = %e, "fabric listener failed");
                return;
            }
            Ok(()) => {}
        }
        match listener.accept() {
            Ok((stream, addr)) => {
                let shared = shared.clone();
                let spawned = std::thread::Builder::new()
                    .name("ws-fabric-rx".into())
                    .spawn(move || serve_lane(stream, addr.into(), local, shared));
                if let Err(e) = spawned {
                    tracing::error!(error = %e, "cannot spawn a fabric receive thread");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!(error = %e, "accepting a fabric lane failed"),
        }
    }
}

fn serve_lane(stream: TcpStream, peer: Endpoint, local: usize, shared: Arc<Shared>) {
    let setup = (|| {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        super::socket::set_buffer_sizes(&stream, shared.config.socket_buffer_bytes)?;
        stream.set_read_timeout(Some(shared.config.connect_timeout()))?;
        stream.set_write_timeout(Some(shared.config.connect_timeout()))?;
        Ok::<_, std::io::Error>(())
    })();
    if let Err(e) = setup {
        tracing::warn!(%peer, error = %e, "setting up an inbound lane failed");
        return;
    }
    let mut stream = stream;
    let instance = match server_handshake(&mut stream, &shared.key, &peer) {
        Ok(i) => i,
        Err(e) => {
            shared.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "inbound lane refused");
            return;
        }
    };
    let sock = match LaneSocket::new(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "inbound lane setup failed");
            return;
        }
    };
    tracing::debug!(%peer, "inbound lane up");
    match receive_frames(&sock, instance, local, &shared) {
        Ok(()) | Err(IoFail::Shutdown) => tracing::debug!(%peer, "inbound lane closed"),
        Err(IoFail::PeerReset) => {
            tracing::debug!(%peer, "inbound lane reset by the writer; its queued frames dropped")
        }
        Err(e) => {
            shared.stats.lane_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "inbound lane failed");
        }
    }
    sock.shutdown();
}

enum Landing {
    Landed,
    Revoked,
}

fn receive_frames(
    sock: &LaneSocket,
    instance: u64,
    local: usize,
    shared: &Shared,
) -> Result<(), IoFail> {
    let timeout = shared.config.io_timeout();
    let stop = &shared.stop;
    let mut since_signal: u32 = 0;
    let mut first_error: Option<(RemoteAccessKind, u64, u64)> = None;
    let mut scratch = Vec::new();
    let mut acks = AckBuffer::default();
    let mut wake = WakeThreshold { bytes: 1 };
    loop {
        let mut hdr = [0u8; HEADER_LEN];
        if !read_header(sock, &mut hdr, &mut acks, shared)? {
            // A clean close between frames is the normal end of a lane.
            return Ok(());
        }
        let header = match FrameHeader::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                return Err(IoFail::Os(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("malformed frame: {e}"),
                )))
            }
        };
        since_signal = since_signal.wrapping_add(1);
        match shared
            .table
            .check_write(header.rkey, header.addr, header.len)
        {
            Ok((reg, offset)) => {
                let landing =
                    land_payload(sock, &reg.memory, offset, header.len, &mut wake, shared);
                match landing {
                    Ok(Landing::Landed) => {
                        shared.stats.frames_received.fetch_add(1, Ordering::Relaxed);
                        shared
                            .stats
                            .bytes_received
                            .fetch_add(header.len, Ordering::Relaxed);
                        shared.local[local]
                            .bytes_received
                            .fetch_add(header.len, Ordering::Relaxed);
                        if header.imm.is_some() && sock.reset_by_peer() {
                            // The writer abandoned this write; do not count it.
                            if let Some(imm) = header.imm {
                                shared.imm.record_torn(imm);
                            }
                            return Err(IoFail::PeerReset);
                        }
                        count_immediate(&header, instance, shared);
                    }
                    Ok(Landing::Revoked) => {
                        if let Some(imm) = header.imm {
                            shared.imm.record_torn(imm);
                        }
                        shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                        first_error.get_or_insert((
                            RemoteAccessKind::Deregistered,
                            header.rkey,
                            header.addr,
                        ));
                    }
                    Err(e) => {
                        if let Some(imm) = header.imm {
                            shared.imm.record_torn(imm);
                        }
                        return Err(e);
                    }
                }
            }
            Err(kind) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                first_error.get_or_insert((kind, header.rkey, header.addr));
                drain(sock, header.len, &mut scratch, shared)?;
            }
        }
        acks.landed += header.len;
        if header.signalled {
            let c = Completion {
                frames: since_signal,
                error: first_error.take(),
            };
            since_signal = 0;
            acks.bytes.extend_from_slice(&c.encode());
            if acks.bytes.len() >= ACK_BATCH * COMPLETION_LEN || acks.landed >= ACK_BATCH_BYTES {
                acks.flush(sock, timeout, stop)?;
            }
        }
    }
}

/// Completions are coalesced: sent when the lane has no more input for the moment, or when
/// enough have piled up (by count or by bytes landed) that the writer should hear now.
const ACK_BATCH: usize = 16;
const ACK_BATCH_BYTES: u64 = 256 << 10;

#[derive(Default)]
struct AckBuffer {
    bytes: Vec<u8>,
    /// Payload bytes landed since the last flush.
    landed: u64,
}

impl AckBuffer {
    fn flush(
        &mut self,
        sock: &LaneSocket,
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        if !self.bytes.is_empty() {
            sock.write_all(&self.bytes, timeout, stop)?;
            self.bytes.clear();
        }
        self.landed = 0;
        Ok(())
    }
}

/// Reads the next frame header, flushing pending completions whenever the lane runs dry.
/// Returns `false` on a clean close before the first byte.
fn read_header(
    sock: &LaneSocket,
    hdr: &mut [u8; HEADER_LEN],
    acks: &mut AckBuffer,
    shared: &Shared,
) -> Result<bool, IoFail> {
    let timeout = shared.config.io_timeout();
    let mut got = 0;
    loop {
        // SAFETY: hdr[got..] is a valid, exclusively borrowed byte range.
        let rc = unsafe { sock.recv_raw(hdr[got..].as_mut_ptr(), HEADER_LEN - got) };
        match rc {
            Ok(0) if got == 0 => {
                let _ = acks.flush(sock, timeout, &shared.stop);
                return Ok(false);
            }
            Ok(0) => return Err(IoFail::Eof),
            Ok(n) => {
                got += n;
                if got == HEADER_LEN {
                    return Ok(true);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if !acks.bytes.is_empty() {
                    acks.flush(sock, timeout, &shared.stop)?;
                    continue;
                }
                let limit = if got == 0 { None } else { Some(timeout) };
                sock.wait(Readiness::Read, limit, &shared.stop)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(IoFail::Os(e)),
        }
    }
}

/// Receives `len` payload bytes into `memory` at `offset`. If the region is revoked part-way,
/// stops writing to it at once, drains the rest and returns `Revoked`. While it waits for more
/// of the payload it raises the socket's wake threshold to what is still to come (capped), and
/// lowers it again before returning, so that waits for the next header wake at its first byte.
fn land_payload(
    sock: &LaneSocket,
    memory: &RegisteredMemory,
    offset: u64,
    len: u64,
    wake: &mut WakeThreshold,
    shared: &Shared,
) -> Result<Landing, IoFail> {
    let landing = land_payload_bytes(sock, memory, offset, len, wake, shared);
    wake.set(sock, 1)?;
    landing
}

fn land_payload_bytes(
    sock: &LaneSocket,
    memory: &RegisteredMemory,
    offset: u64,
    len: u64,
    wake: &mut WakeThreshold,
    shared: &Shared,
) -> Result<Landing, IoFail> {
    let timeout = shared.config.io_timeout();
    let mut done: u64 = 0;
    while done < len {
        if sock.reset_by_peer() {
            return Err(IoFail::PeerReset);
        }
        let rc = {
            let Some(live) = memory.live() else {
                wake.set(sock, 1)?;
                let mut scratch = Vec::new();
                drain(sock, len - done, &mut scratch, shared)?;
                return Ok(Landing::Revoked);
            };
            let want = ((len - done) as usize).min(RECV_CHUNK);
            // SAFETY: the registration table checked offset + len <= region length, and done <
            // len, so [offset + done, offset + done + want) lies inside the region. The live guard
            // keeps revocation (and so the end of the backend's right to the memory) from
            // happening during the call; the memory itself outlives the guard (Arc).
            unsafe {
                let dst = live.as_ptr().add((offset + done) as usize);
                sock.recv_raw(dst, want)
            }
        };
        match rc {
            Ok(0) => return Err(IoFail::Eof),
            Ok(n) => done += n as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                wake.set(sock, ((len - done) as usize).min(WAKE_BYTES))?;
                sock.wait(Readiness::Read, Some(timeout), &shared.stop)?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(IoFail::Os(e)),
        }
    }
    Ok(Landing::Landed)
}

/// Reads and discards `len` bytes (the payload of a refused frame).
fn drain(
    sock: &LaneSocket,
    len: u64,
    scratch: &mut Vec<u8>,
    shared: &Shared,
) -> Result<(), IoFail> {
    if scratch.is_empty() {
        scratch.resize(64 << 10, 0);
    }
    let mut left = len;
    while left > 0 {
        let n = (left as usize).min(scratch.len());
        sock.read_exact(
            &mut scratch[..n],
            Some(shared.config.io_timeout()),
            shared.config.io_timeout(),
            &shared.stop,
        )?;
        left -= n as u64;
    }
    Ok(())
}

/// Counts the frame's immediate: at once for a whole write, after the last part for a split one.
fn count_immediate(header: &FrameHeader, instance: u64, shared: &Shared) {
    let Some(imm) = header.imm else { return };
    match header.part {
        None => shared.imm.record_arrival(imm),
        Some(part) => {
            let complete = {
                let mut parts = shared.assembly.lock();
                let key = (instance, part.write_id);
                let left = parts.entry(key).or_insert(part.parts);
                *left = left.saturating_sub(1);
                if *left == 0 {
                    parts.remove(&key);
                    true
                } else {
                    false
                }
            };
            if complete {
                shared.imm.record_arrival(imm);
            }
        }
    }
}
