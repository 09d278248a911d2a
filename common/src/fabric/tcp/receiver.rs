//! The receiving half of the emulated NIC: accept lanes, check frames, land payloads.
//!
//! Before a writer has proved the job token it gets no thread of its own: a few handshake
//! threads per listener serve a bounded queue, with caps per address and one deadline per
//! handshake (see [`accept_loop`]). After it, one thread per inbound lane (blocking-style I/O on a non-blocking socket): for each frame it
//! checks rkey, bounds and permission in the [`RegistrationTable`](super::RegistrationTable) before
//! touching memory, then `recv`s the payload directly into the registered region (`inbound`),
//! holding the region's revocation guard only for each non-blocking `recv` so that
//! deregistration takes effect at once. Only after the last payload byte is in memory does it count the immediate
//! (for a split write: after the last of its parts). Refused frames are drained into a small
//! scratch buffer and reported in the next completion; malformed frames drop the lane.
//!
//! A PULL frame (agreed same-host pulls only) is checked the same way and landed by copying the
//! bytes out of the writer's memory (`same_host`), under the same guard, in bounded chunks, with
//! the same reset checks; a PULL on a lane that did not agree to pulls drops the lane. The PULL
//! frames whose headers arrived together land as one run (one copy call, one reset check, their
//! completions sent together), each frame checked on its own first: a run ends at the first
//! frame that is not a PULL, is refused, or aims at another registration, and that frame is
//! handled on its own as before.
//!
//! A writer that abandons its writes resets its lane (RST). The kernel still hands out the bytes
//! that arrived before the RST, so before landing each chunk of payload, and again before
//! counting an immediate, the thread checks whether the connection was reset, and if so stops:
//! frames a writer abandoned never land late, over the bytes of a later sync.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::TrySendError;
use std::time::Duration;

use parking_lot::Mutex;

use super::Shared;
use super::frame::HEADER_LEN;
use super::frame::{Completion, FrameHeader};
use super::handshake::{Accepted, server_handshake_within};
use super::inbound::{AHEAD, InboundLane, Landing, PullRange};
use super::same_host::{PULL_RUN, PULL_RUN_BYTES};
use super::shared_pulls::PullSource;
use super::socket::{IoFail, LaneSocket, Readiness, wait_fd};
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::RemoteAccessKind;

/// Handshakes running or queued at once, per listener, before anyone proved the job token.
const PENDING_HANDSHAKES: usize = 64;
/// Of those, from one IP address.
const PENDING_PER_IP: u32 = 8;
/// Threads that run handshakes, per listener (a lane gets a thread of its own only once its
/// writer proved the job token).
const HANDSHAKE_THREADS: usize = 4;
/// The longest a peer may take over the whole handshake.
const HANDSHAKE_LIMIT: Duration = Duration::from_secs(3);

/// Unauthenticated connections per IP address, queued or in a handshake.
#[derive(Debug, Default)]
struct PendingByIp(Mutex<HashMap<IpAddr, u32>>);

impl PendingByIp {
    /// Counts one more from `ip` unless it already has [`PENDING_PER_IP`].
    fn admit(&self, ip: IpAddr) -> bool {
        let mut m = self.0.lock();
        let n = m.entry(ip).or_insert(0);
        if *n >= PENDING_PER_IP {
            return false;
        }
        *n += 1;
        true
    }

    fn release(&self, ip: IpAddr) {
        let mut m = self.0.lock();
        if let Some(n) = m.get_mut(&ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&ip);
            }
        }
    }
}

/// Runs the accept loop of the listener on local address number `local` until the fabric stops.
///
/// Accepted sockets wait in a bounded queue for one of [`HANDSHAKE_THREADS`] threads, which
/// run the handshake under one overall deadline ([`HANDSHAKE_LIMIT`]); only an authenticated
/// lane gets a receive thread of its own. A socket that finds the queue full, or its address
/// over [`PENDING_PER_IP`], is closed at once and counted (`TcpStats::preauth_dropped`), so a
/// flood of idle or trickling connections costs a few threads and no memory to speak of.
pub(super) fn accept_loop(listener: TcpListener, local: usize, shared: Arc<Shared>) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!(error = %e, "fabric listener cannot be made non-blocking");
        return;
    }
    let (queue, waiting) = std::sync::mpsc::sync_channel::<(TcpStream, SocketAddr)>(
        PENDING_HANDSHAKES.saturating_sub(HANDSHAKE_THREADS),
    );
    let waiting = Arc::new(Mutex::new(waiting));
    let pending = Arc::new(PendingByIp::default());
    for _ in 0..HANDSHAKE_THREADS {
        let (waiting, pending, shared) = (waiting.clone(), pending.clone(), shared.clone());
        let spawned = std::thread::Builder::new()
            .name("ws-fabric-hs".into())
            .spawn(move || {
                loop {
                    // The lock is held only while waiting for the next socket.
                    let next = waiting.lock().recv();
                    let Ok((stream, addr)) = next else { return };
                    let lane = authenticate(stream, addr.into(), &shared);
                    pending.release(addr.ip());
                    if let Some((stream, peer, accepted)) = lane {
                        let shared = shared.clone();
                        let spawned = std::thread::Builder::new()
                            .name("ws-fabric-rx".into())
                            .spawn(move || serve_lane(stream, peer, accepted, local, shared));
                        if let Err(e) = spawned {
                            tracing::error!(error = %e, "cannot spawn a fabric receive thread");
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot spawn a fabric handshake thread");
            return;
        }
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
                let ip = addr.ip();
                if !pending.admit(ip) {
                    shared.stats.preauth_dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(%addr, "too many unauthenticated fabric lanes from this address");
                    continue;
                }
                if let Err(e) = queue.try_send((stream, addr)) {
                    pending.release(ip);
                    shared.stats.preauth_dropped.fetch_add(1, Ordering::Relaxed);
                    if matches!(e, TrySendError::Full(_)) {
                        tracing::debug!(%addr, "fabric handshake queue full; connection closed");
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => tracing::warn!(error = %e, "accepting a fabric lane failed"),
        }
    }
}

/// Sets up an accepted socket and runs the server handshake under [`HANDSHAKE_LIMIT`].
fn authenticate(
    stream: TcpStream,
    peer: Endpoint,
    shared: &Shared,
) -> Option<(TcpStream, Endpoint, Accepted)> {
    let setup = (|| {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        let (send, receive) = shared.config.socket_buffers();
        super::socket::set_buffer_sizes(&stream, send, receive)?;
        Ok::<_, std::io::Error>(())
    })();
    if let Err(e) = setup {
        tracing::warn!(%peer, error = %e, "setting up an inbound lane failed");
        return None;
    }
    let limit = HANDSHAKE_LIMIT.min(shared.config.connect_timeout());
    let path = shared
        .config
        .same_host
        .then_some(shared.config.same_host_path);
    match server_handshake_within(&stream, &shared.key, &peer, path, limit) {
        Ok(a) => Some((stream, peer, a)),
        Err(e) => {
            shared.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "inbound lane refused");
            None
        }
    }
}

fn serve_lane(
    stream: TcpStream,
    peer: Endpoint,
    accepted: Accepted,
    local: usize,
    shared: Arc<Shared>,
) {
    let timeouts = stream
        .set_read_timeout(Some(shared.config.connect_timeout()))
        .and_then(|()| stream.set_write_timeout(Some(shared.config.connect_timeout())));
    if let Err(e) = timeouts {
        tracing::warn!(%peer, error = %e, "setting up an inbound lane failed");
        return;
    }
    let sock = match LaneSocket::new(stream) {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "inbound lane setup failed");
            return;
        }
    };
    let path = match (&accepted.writer, &accepted.shared) {
        (Some(_), _) => "ptrace",
        (None, Some(_)) => "shared_memory",
        (None, None) => "payloads",
    };
    tracing::debug!(%peer, path, "inbound lane up");
    match receive_frames(&sock, accepted, local, &shared) {
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

fn receive_frames(
    sock: &LaneSocket,
    accepted: Accepted,
    local: usize,
    shared: &Shared,
) -> Result<(), IoFail> {
    let mut source = match (accepted.writer, accepted.shared) {
        (Some(w), _) => Some(PullSource::Process(w)),
        (None, Some(s)) => Some(PullSource::Shared(s)),
        (None, None) => None,
    };
    let read_ahead = if source.is_some() { AHEAD } else { HEADER_LEN };
    let mut lane = InboundLane::new(sock, shared, read_ahead);
    let mut ledger = Ledger {
        instance: accepted.instance,
        local,
        since_signal: 0,
        first_error: None,
        shared_memory: source.as_ref().is_some_and(PullSource::is_shared),
    };
    // The PULL frames of one run: their headers, and where each lands and comes from.
    let mut run: Vec<FrameHeader> = Vec::with_capacity(PULL_RUN);
    let mut ranges: Vec<PullRange> = Vec::with_capacity(PULL_RUN);
    loop {
        let Some(hdr) = lane.read_header()? else {
            // A clean close between frames is the normal end of a lane.
            return Ok(());
        };
        let header = decode(&hdr)?;
        let pull_from = match (header.source, source.is_some()) {
            (None, _) => None,
            (Some(from), true) => Some(from),
            (Some(_), false) => {
                return Err(IoFail::Os(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a PULL frame on a lane that did not agree to same-host pulls",
                )));
            }
        };
        let checked = shared
            .table
            .check_write(header.rkey, header.addr, header.len);
        let (reg, offset) = match checked {
            Err(kind) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                if kind == RemoteAccessKind::OutsideWindow {
                    shared.stats.outside_window.fetch_add(1, Ordering::Relaxed);
                }
                ledger
                    .first_error
                    .get_or_insert((kind, header.rkey, header.addr));
                lane.drain(header.wire_payload())?;
                if ledger.settle(&mut lane, &header, None, shared) {
                    lane.flush_if_due()?;
                }
                continue;
            }
            Ok(checked) => checked,
        };
        let (Some(from), Some(writer)) = (pull_from, source.as_mut()) else {
            let landing = lane.land(&reg.memory, offset, header.len);
            let landing = landed_or_torn(landing, std::slice::from_ref(&header), sock, shared)?;
            if ledger.settle(&mut lane, &header, Some(landing), shared) {
                lane.flush_if_due()?;
            }
            continue;
        };
        // A run: the PULL frames into the same registration whose headers are already here.
        run.clear();
        ranges.clear();
        run.push(header);
        ranges.push(PullRange {
            offset,
            len: header.len,
            source: from,
            stride: header.stride,
        });
        let mut bytes = header.len;
        while run.len() < PULL_RUN {
            let Some(next) = lane
                .peek_header()
                .and_then(|h| FrameHeader::decode(&h).ok())
            else {
                break;
            };
            let Some(source) = next.source else { break };
            let Ok((r, offset)) = shared.table.check_write(next.rkey, next.addr, next.len) else {
                break;
            };
            if !Arc::ptr_eq(&r.memory, &reg.memory) || bytes + next.len > PULL_RUN_BYTES {
                break;
            }
            lane.skip_header();
            bytes += next.len;
            run.push(next);
            ranges.push(PullRange {
                offset,
                len: next.len,
                source,
                stride: next.stride,
            });
        }
        let landing = lane.pull(&reg.memory, &ranges, writer);
        let landing = landed_or_torn(landing, &run, sock, shared)?;
        let mut signalled = false;
        for h in &run {
            signalled |= ledger.settle(&mut lane, h, Some(landing), shared);
        }
        if signalled {
            lane.flush_if_due()?;
        }
    }
}

fn decode(raw: &[u8; HEADER_LEN]) -> Result<FrameHeader, IoFail> {
    FrameHeader::decode(raw).map_err(|e| {
        IoFail::Os(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("malformed frame: {e}"),
        ))
    })
}

/// A landing's outcome for the frames it carried (one payload, or a run of pulls): on an
/// error, or when the writer reset the lane before their immediates were counted, every
/// immediate among them is recorded torn and the lane ends.
fn landed_or_torn(
    landing: Result<Landing, IoFail>,
    frames: &[FrameHeader],
    sock: &LaneSocket,
    shared: &Shared,
) -> Result<Landing, IoFail> {
    let torn = |e| {
        for imm in frames.iter().filter_map(|h| h.imm) {
            shared.imm.record_torn(imm);
        }
        Err(e)
    };
    match landing {
        // The writer abandoned these writes after they landed: do not count them.
        Ok(Landing::Landed) if frames.iter().any(|h| h.imm.is_some()) && sock.reset_by_peer() => {
            torn(IoFail::PeerReset)
        }
        Ok(l) => Ok(l),
        Err(e) => torn(e),
    }
}

/// What a lane owes its writer between completions.
struct Ledger {
    instance: u64,
    local: usize,
    /// Frames since the last signalled one.
    since_signal: u32,
    /// The first refused frame since the last completion.
    first_error: Option<(RemoteAccessKind, u64, u64)>,
    /// This lane's pulls copy out of the writer's shared memory (counted apart).
    shared_memory: bool,
}

impl Ledger {
    /// Accounts for one frame: its counters and immediate (`Landed`), or its refusal
    /// (`Revoked`; `None`: refused before landing, already counted), and its completion if it
    /// was signalled (queued; the caller flushes when this returns true: a completion was
    /// queued, as before every flush check).
    fn settle(
        &mut self,
        lane: &mut InboundLane<'_>,
        header: &FrameHeader,
        landing: Option<Landing>,
        shared: &Shared,
    ) -> bool {
        self.since_signal = self.since_signal.wrapping_add(1);
        match landing {
            None => {}
            Some(Landing::Landed) => {
                shared.stats.frames_received.fetch_add(1, Ordering::Relaxed);
                shared
                    .stats
                    .bytes_received
                    .fetch_add(header.len, Ordering::Relaxed);
                if header.source.is_some() {
                    shared
                        .stats
                        .bytes_pulled
                        .fetch_add(header.len, Ordering::Relaxed);
                    if self.shared_memory {
                        shared
                            .stats
                            .bytes_shared
                            .fetch_add(header.len, Ordering::Relaxed);
                    }
                }
                // What crossed this address: a pulled frame's bytes did not.
                shared.local[self.local]
                    .bytes_received
                    .fetch_add(header.wire_payload(), Ordering::Relaxed);
                count_immediate(header, self.instance, shared);
            }
            Some(Landing::Revoked) => {
                if let Some(imm) = header.imm {
                    shared.imm.record_torn(imm);
                }
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                self.first_error.get_or_insert((
                    RemoteAccessKind::Deregistered,
                    header.rkey,
                    header.addr,
                ));
            }
        }
        lane.count_landed(header.len);
        if header.signalled {
            lane.queue_completion(Completion {
                frames: self.since_signal,
                error: self.first_error.take(),
            });
            self.since_signal = 0;
        }
        header.signalled
    }
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
