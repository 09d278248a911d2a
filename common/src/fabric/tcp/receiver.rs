//! The receiving half of the emulated NIC: accept lanes, check frames, land payloads.
//!
//! One thread per inbound lane (blocking-style I/O on a non-blocking socket): for each frame it
//! checks rkey, bounds and permission in the [`RegistrationTable`](super::RegistrationTable) before
//! touching memory, then `recv`s the payload directly into the registered region (`inbound`),
//! holding the region's revocation guard only for each non-blocking `recv` so that
//! deregistration takes effect at once. Only after the last payload byte is in memory does it count the immediate
//! (for a split write: after the last of its parts). Refused frames are drained into a small
//! scratch buffer and reported in the next completion; malformed frames drop the lane.
//!
//! A PULL frame (agreed same-host pulls only) is checked the same way and landed by copying the
//! bytes out of the writer's memory (`same_host`), under the same guard, in bounded chunks, with
//! the same reset checks; a PULL on a lane that did not agree to pulls drops the lane.
//!
//! A writer that abandons its writes resets its lane (RST). The kernel still hands out the bytes
//! that arrived before the RST, so before landing each chunk of payload, and again before
//! counting an immediate, the thread checks whether the connection was reset, and if so stops:
//! frames a writer abandoned never land late, over the bytes of a later sync.

use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::frame::{Completion, FrameHeader};
use super::handshake::{server_handshake, Accepted};
use super::inbound::{InboundLane, Landing};
use super::socket::{wait_fd, IoFail, LaneSocket, Readiness};
use super::Shared;
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::RemoteAccessKind;

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
        let (send, receive) = shared.config.socket_buffers();
        super::socket::set_buffer_sizes(&stream, send, receive)?;
        stream.set_read_timeout(Some(shared.config.connect_timeout()))?;
        stream.set_write_timeout(Some(shared.config.connect_timeout()))?;
        Ok::<_, std::io::Error>(())
    })();
    if let Err(e) = setup {
        tracing::warn!(%peer, error = %e, "setting up an inbound lane failed");
        return;
    }
    let mut stream = stream;
    let accepted = match server_handshake(&mut stream, &shared.key, &peer, shared.config.same_host)
    {
        Ok(a) => a,
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
    tracing::debug!(%peer, pulls = accepted.writer.is_some(), "inbound lane up");
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
    let instance = accepted.instance;
    let mut lane = InboundLane::new(sock, shared);
    let mut since_signal: u32 = 0;
    let mut first_error: Option<(RemoteAccessKind, u64, u64)> = None;
    loop {
        let Some(hdr) = lane.read_header()? else {
            // A clean close between frames is the normal end of a lane.
            return Ok(());
        };
        let header = match FrameHeader::decode(&hdr) {
            Ok(h) => h,
            Err(e) => {
                return Err(IoFail::Os(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("malformed frame: {e}"),
                )))
            }
        };
        let pull_from = match (header.source, accepted.writer) {
            (None, _) => None,
            (Some(source), Some(writer)) => Some((writer, source)),
            (Some(_), None) => {
                return Err(IoFail::Os(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a PULL frame on a lane that did not agree to same-host pulls",
                )))
            }
        };
        since_signal = since_signal.wrapping_add(1);
        let checked = shared
            .table
            .check_write(header.rkey, header.addr, header.len);
        let landing = match checked {
            Err(kind) => {
                shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                first_error.get_or_insert((kind, header.rkey, header.addr));
                lane.drain(header.wire_payload())?;
                None
            }
            Ok((reg, offset)) => Some(match pull_from {
                None => lane.land(&reg.memory, offset, header.len),
                Some((writer, source)) => {
                    lane.pull(&reg.memory, offset, header.len, writer, source)
                }
            }),
        };
        match landing {
            None => {}
            Some(Ok(Landing::Landed)) => {
                shared.stats.frames_received.fetch_add(1, Ordering::Relaxed);
                shared
                    .stats
                    .bytes_received
                    .fetch_add(header.len, Ordering::Relaxed);
                if pull_from.is_some() {
                    shared
                        .stats
                        .bytes_pulled
                        .fetch_add(header.len, Ordering::Relaxed);
                }
                // What crossed this address: a pulled frame's bytes did not.
                shared.local[local]
                    .bytes_received
                    .fetch_add(header.wire_payload(), Ordering::Relaxed);
                if header.imm.is_some() && sock.reset_by_peer() {
                    // The writer abandoned this write; do not count it.
                    if let Some(imm) = header.imm {
                        shared.imm.record_torn(imm);
                    }
                    return Err(IoFail::PeerReset);
                }
                count_immediate(&header, instance, shared);
            }
            Some(Ok(Landing::Revoked)) => {
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
            Some(Err(e)) => {
                if let Some(imm) = header.imm {
                    shared.imm.record_torn(imm);
                }
                return Err(e);
            }
        }
        lane.count_landed(header.len);
        if header.signalled {
            lane.complete(Completion {
                frames: since_signal,
                error: first_error.take(),
            })?;
            since_signal = 0;
        }
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
