//! The writing half of the emulated NIC: one lane = one TCP connection = one "queue pair".
//!
//! Each lane has a sender thread that takes jobs (a list of frames; the last is signalled) from
//! an unbounded channel and streams header and payload with `sendmsg` straight from the source
//! region, and a completion thread that reads the receiver's completions and resolves the jobs in
//! order. Many jobs are in flight per lane (pipelining); only the last frame of each job asks for
//! a completion, and since a lane is one ordered byte stream that one completion covers every
//! frame before it (selective signalling).
//!
//! On a lane whose handshake agreed on same-host pulls (`same_host`), frames of at least
//! [`PULL_MIN_BYTES`](super::same_host::PULL_MIN_BYTES) (on a shared-memory lane, `shared_pulls`: every frame from shared memory)
//! go as PULL frames: the header alone, naming where the bytes are in this
//! process, and the receiver copies them out itself. The job then holds a [`SourcePin`] on each
//! source it pulls from until its completion arrives, or until the lane has been aborted when it
//! fails, so that no source is revoked while the receiver may still be reading it.
//!
//! Failure is per lane, as with a queue pair going to the error state: a send error, a peer that
//! stops reading for `io_timeout`, a closed connection or a malformed completion fails every job
//! in flight on the lane (with that error), marks the lane broken, and the pool opens a fresh
//! lane (new connection, new handshake) on next use.

use std::collections::VecDeque;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Instant;

use parking_lot::Mutex;
use tokio::sync::{oneshot, watch};

use super::Shared;
use super::addresses::{LaneRoute, peer_address};
use super::frame::{COMPLETION_LEN, Completion, FrameHeader};
use super::handshake::client_handshake_same_host;
use super::shared_pulls::PullMode;
use super::socket::{IoFail, LaneSocket, Readiness};
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::{FabricError, Result};
use crate::fabric::region::{Region, SourcePin};
use crate::fabric::stride::Stride;

/// Bytes a job adds to its lane's queue until it is answered or dropped (whichever way).
///
/// The counter is the peer's slot's (see `peer.rs`), so that it outlives a lane that broke; the
/// guard lives here because every job of a lane carries one.
#[derive(Debug)]
pub(super) struct QueuedBytes {
    counter: Arc<AtomicU64>,
    bytes: u64,
}

impl QueuedBytes {
    /// Adds `bytes` to `counter` until the returned guard drops.
    pub(super) fn count(counter: &Arc<AtomicU64>, bytes: u64) -> QueuedBytes {
        counter.fetch_add(bytes, Ordering::Relaxed);
        QueuedBytes {
            counter: counter.clone(),
            bytes,
        }
    }
}

impl Drop for QueuedBytes {
    fn drop(&mut self) {
        self.counter.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// Frames sent per `sendmsg` at most (two segments each).
const FRAMES_PER_SEND: usize = 32;

/// One frame to send: header plus a payload range of a local region.
#[derive(Debug)]
pub(super) struct OutFrame {
    pub header: FrameHeader,
    pub src: Region,
    pub src_offset: u64,
    /// How the payload lies in the source when it is not one range from `src_offset`.
    pub src_stride: Option<Stride>,
    /// The destination region's base, to turn a refused address back into an offset.
    pub dst_base: u64,
}

/// Frames that complete together (the last one is sent signalled).
#[derive(Debug)]
pub(super) struct LaneJob {
    pub frames: Vec<OutFrame>,
    pub done: oneshot::Sender<Result<()>>,
    /// The job's bytes on its lane's queue, until it is answered.
    pub queued: QueuedBytes,
}

/// What a pending job needs to report its completion.
#[derive(Debug)]
struct Pending {
    done: oneshot::Sender<Result<()>>,
    frames: u32,
    /// (rkey, addr, dst_base, len) per frame, to name a refused frame.
    ctx: Vec<(u64, u64, u64, u64)>,
    /// The sources the receiver pulls this job's PULL frames from.
    pins: Vec<SourcePin>,
    _queued: QueuedBytes,
}

#[derive(Debug, Default)]
struct PendingQueue {
    items: VecDeque<Pending>,
    closed: Option<FabricError>,
}

impl PendingQueue {
    /// Fails every pending job with `err` and refuses later ones. Returns the jobs' source
    /// pins, which the caller drops only once the lane is aborted (the receiver may be pulling
    /// from those sources until it sees the reset).
    #[must_use = "drop the pins after aborting the lane"]
    fn close(&mut self, err: FabricError) -> Vec<SourcePin> {
        if self.closed.is_none() {
            self.closed = Some(err.clone());
        }
        let mut pins = Vec::new();
        for p in self.items.drain(..) {
            pins.extend(p.pins);
            let _ = p.done.send(Err(err.clone()));
        }
        pins
    }
}

#[derive(Debug)]
struct LaneState {
    peer: Endpoint,
    index: usize,
    route: LaneRoute,
    broken: AtomicBool,
    /// Set by [`Lane::reset`]: nothing more may be sent on this lane.
    reset: AtomicBool,
    socket: Mutex<Option<Arc<LaneSocket>>>,
    /// Jobs sent and not yet completed (closed once the lane fails or is reset).
    pending: Mutex<PendingQueue>,
    ready: watch::Sender<Option<Result<()>>>,
    born: Instant,
    /// Milliseconds since `born` of the last byte sent or completion received.
    last_progress_ms: AtomicU64,
}

impl LaneState {
    fn touch(&self) {
        self.last_progress_ms
            .store(self.born.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
}

/// A handle to one lane (cheap to clone).
#[derive(Debug, Clone)]
pub(super) struct Lane {
    tx: mpsc::Sender<LaneJob>,
    state: Arc<LaneState>,
}

impl Lane {
    /// Starts lane `index` to `peer` over `route`; it connects in the background and takes jobs
    /// at once.
    pub fn open(peer: Endpoint, index: usize, route: LaneRoute, shared: Arc<Shared>) -> Lane {
        let (tx, rx) = mpsc::channel();
        let (ready, _) = watch::channel(None);
        let state = Arc::new(LaneState {
            peer: peer.clone(),
            index,
            route,
            broken: AtomicBool::new(false),
            reset: AtomicBool::new(false),
            socket: Mutex::new(None),
            pending: Mutex::default(),
            ready,
            born: Instant::now(),
            last_progress_ms: AtomicU64::new(0),
        });
        let thread_state = state.clone();
        let spawned = std::thread::Builder::new()
            .name("ws-fabric-tx".into())
            .spawn(move || run_sender(peer, rx, thread_state, shared));
        if let Err(e) = spawned {
            state.broken.store(true, Ordering::SeqCst);
            state
                .ready
                .send_replace(Some(Err(FabricError::io("spawning a lane thread", e))));
        }
        Lane { tx, state }
    }

    /// Queues a job; gives it back if the lane's thread has exited.
    pub fn submit(&self, job: LaneJob) -> std::result::Result<(), LaneJob> {
        self.tx.send(job).map_err(|e| e.0)
    }

    /// Whether the lane failed (the pool replaces it on next use).
    pub fn is_broken(&self) -> bool {
        self.state.broken.load(Ordering::SeqCst)
    }

    /// Resolves once the lane is connected and authenticated (or failed to be).
    pub fn ready(&self) -> impl std::future::Future<Output = Result<()>> + Send + 'static + use<> {
        let mut rx = self.state.ready.subscribe();
        async move {
            loop {
                if let Some(r) = rx.borrow_and_update().clone() {
                    return r;
                }
                if rx.changed().await.is_err() {
                    return Err(FabricError::Shutdown);
                }
            }
        }
    }

    /// Resets the lane: every job sent and not yet completed fails with
    /// [`FabricError::ConnectionsReset`], jobs still queued are refused, and the connection is
    /// aborted (RST; the kernel discards its send queue), so none of their frames is delivered
    /// later, even once a partition heals. The pool opens a fresh lane on next use.
    pub fn reset(&self) {
        let err = FabricError::ConnectionsReset {
            peer: self.state.peer.clone(),
            lane: self.state.index,
        };
        self.state.reset.store(true, Ordering::SeqCst);
        self.state.broken.store(true, Ordering::SeqCst);
        // Closing the queue first: the sender thread checks it before it sends a job's frames.
        let pins = self.state.pending.lock().close(err.clone());
        self.state.ready.send_if_modified(|r| {
            if r.is_some() {
                return false;
            }
            *r = Some(Err(err));
            true
        });
        // If the sender is still connecting, it finds `reset` set once it has a socket and
        // aborts it itself (both sides look under the socket lock).
        if let Some(s) = self.state.socket.lock().as_ref() {
            s.abort();
        }
        drop(pins);
    }

    /// Fault injection: shuts the connection down as if the cable were pulled.
    pub fn cut(&self) {
        if let Some(s) = self.state.socket.lock().as_ref() {
            s.shutdown();
        }
    }
}

/// Connects and authenticates a lane; also says how the receiver reads its PULL frames.
fn connect(
    peer: &Endpoint,
    index: usize,
    route: LaneRoute,
    shared: &Shared,
) -> Result<(LaneSocket, PullMode)> {
    let addr = peer_address(peer, route.remote)?;
    let timeout = shared.config.connect_timeout();
    let connected = match route.bind {
        None => TcpStream::connect_timeout(&addr, timeout),
        Some(local) => super::socket::connect_from(local, addr, timeout),
    };
    let mut stream = connected.map_err(|e| FabricError::PeerUnreachable {
        peer: peer.clone(),
        source: Arc::new(match route.bind {
            // Name the pair, so that the NIC (or the peer's address) at fault is plain.
            Some(local) => std::io::Error::new(
                e.kind(),
                format!("lane {index} from {local} to address {addr}: {e}"),
            ),
            None if addr.to_string() != peer.as_str() => {
                std::io::Error::new(e.kind(), format!("lane {index} to address {addr}: {e}"))
            }
            None => e,
        }),
    })?;
    let setup = (|| {
        stream.set_nodelay(true)?;
        let (send, receive) = shared.config.socket_buffers();
        super::socket::set_buffer_sizes(&stream, send, receive)?;
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))
    })();
    setup.map_err(|e| FabricError::io(format!("setting up a lane to {peer}"), e))?;
    // A lane closed for any reason (a failure, a reset, this process dying) must never have its
    // queued frames delivered later: close with RST. Nothing graceful is lost, since a write
    // counts as done only once the peer acknowledged it.
    super::socket::set_linger_abort(&stream)
        .map_err(|e| FabricError::io(format!("setting up a lane to {peer}"), e))?;
    let pulls = client_handshake_same_host(
        &mut stream,
        &shared.key,
        shared.instance,
        peer,
        shared
            .config
            .same_host
            .then_some(shared.config.same_host_path),
    )?;
    let sock = LaneSocket::new(stream)
        .map_err(|e| FabricError::io(format!("setting up a lane to {peer}"), e))?;
    Ok((sock, pulls))
}

fn run_sender(
    peer: Endpoint,
    rx: mpsc::Receiver<LaneJob>,
    state: Arc<LaneState>,
    shared: Arc<Shared>,
) {
    let (sock, mut pulls) = match connect(&peer, state.index, state.route, &shared) {
        Ok((s, pulls)) => (Arc::new(s), pulls),
        Err(e) => {
            tracing::warn!(%peer, lane = state.index, error = %e, "lane connect failed");
            state.broken.store(true, Ordering::SeqCst);
            state.ready.send_replace(Some(Err(e.clone())));
            while let Ok(job) = rx.try_recv() {
                let _ = job.done.send(Err(e.clone()));
            }
            return;
        }
    };
    shared.stats.lanes_opened.fetch_add(1, Ordering::Relaxed);
    {
        let mut slot = state.socket.lock();
        *slot = Some(sock.clone());
        if state.reset.load(Ordering::SeqCst) {
            // Reset while connecting: nothing may be sent on this lane.
            drop(slot);
            let e = FabricError::ConnectionsReset {
                peer: peer.clone(),
                lane: state.index,
            };
            state_fail(&sock, &state.pending, &e);
            while let Ok(job) = rx.try_recv() {
                let _ = job.done.send(Err(e.clone()));
            }
            return;
        }
    }
    state.touch();
    let cq = {
        let (s, st, sh, pe) = (sock.clone(), state.clone(), shared.clone(), peer.clone());
        std::thread::Builder::new()
            .name("ws-fabric-cq".into())
            .spawn(move || run_completions(&pe, &s, &st.pending, &st, &sh))
    };
    if let Err(e) = cq {
        let e = FabricError::io("spawning a lane completion thread", e);
        state.broken.store(true, Ordering::SeqCst);
        state.ready.send_replace(Some(Err(e.clone())));
        state_fail(&sock, &state.pending, &e);
        while let Ok(job) = rx.try_recv() {
            let _ = job.done.send(Err(e.clone()));
        }
        return;
    }
    state.ready.send_if_modified(|r| {
        if r.is_some() {
            return false;
        }
        *r = Some(Ok(()));
        true
    });
    tracing::debug!(%peer, lane = state.index, pulls = pulls.name(), "lane up");
    let mut failure = None;
    while let Ok(job) = rx.recv() {
        // Take whatever else is queued (up to one sendmsg's worth of frames) along.
        let mut frames = job.frames.len();
        let mut jobs = vec![job];
        while frames < FRAMES_PER_SEND {
            match rx.try_recv() {
                Ok(j) => {
                    frames += j.frames.len();
                    jobs.push(j);
                }
                Err(_) => break,
            }
        }
        if let Err(e) = send_jobs(&peer, &sock, jobs, &mut pulls, &state, &shared) {
            failure = Some(e);
            break;
        }
    }
    let err = match failure {
        // The send failed because this endpoint reset the lane (the abort broke the socket
        // under it): what it had not sent fails as reset, whatever error the socket gave.
        Some(_) if state.reset.load(Ordering::SeqCst) => FabricError::ConnectionsReset {
            peer: peer.clone(),
            lane: state.index,
        },
        Some(e) => {
            // Count the failure once per lane, whichever of its threads saw it first.
            if !state.broken.swap(true, Ordering::SeqCst) {
                shared.stats.lane_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, lane = state.index, error = %e, "lane failed");
            }
            e
        }
        None => FabricError::Shutdown,
    };
    state.broken.store(true, Ordering::SeqCst);
    state_fail(&sock, &state.pending, &err);
    while let Ok(job) = rx.try_recv() {
        let _ = job.done.send(Err(err.clone()));
    }
}

fn state_fail(sock: &LaneSocket, pending: &Mutex<PendingQueue>, err: &FabricError) {
    let pins = pending.lock().close(err.clone());
    sock.abort();
    drop(pins);
}

/// Registers the jobs' completions, then streams all their frames (several jobs per `sendmsg`
/// when they are small: the doorbell batching of a real NIC). With `pulls`, large frames (on a
/// shared-memory lane: every frame from shared memory) become PULL frames and their jobs pin
/// the sources.
fn send_jobs(
    peer: &Endpoint,
    sock: &LaneSocket,
    jobs: Vec<LaneJob>,
    pulls: &mut PullMode,
    state: &LaneState,
    shared: &Shared,
) -> Result<()> {
    let mut all: Vec<OutFrame> = Vec::new();
    {
        let mut q = state.pending.lock();
        for LaneJob {
            mut frames,
            done,
            queued,
        } in jobs
        {
            let Some(last) = frames.last_mut() else {
                let _ = done.send(Ok(()));
                continue;
            };
            if let Some(err) = &q.closed {
                let _ = done.send(Err(err.clone()));
                continue;
            }
            last.header.signalled = true;
            let pins = if pulls.pulls() {
                mark_pulls(&mut frames, pulls)
            } else {
                Vec::new()
            };
            let ctx = frames
                .iter()
                .map(|f| (f.header.rkey, f.header.addr, f.dst_base, f.header.len))
                .collect();
            q.items.push_back(Pending {
                done,
                frames: frames.len() as u32,
                ctx,
                pins,
                _queued: queued,
            });
            all.append(&mut frames);
        }
        if let Some(err) = &q.closed {
            return Err(err.clone());
        }
    }
    for window in all.chunk_by(|a, b| a.src.same_registration(&b.src)) {
        for chunk in window.chunks(FRAMES_PER_SEND) {
            send_window(peer, sock, chunk, state, shared)?;
        }
    }
    shared
        .stats
        .frames_sent
        .fetch_add(all.len() as u64, Ordering::Relaxed);
    count_paths(&all, pulls, shared);
    Ok(())
}

/// Counts the bytes of sent frames by the path that carries them (`TcpFabric::transfer_paths`).
fn count_paths(frames: &[OutFrame], pulls: &PullMode, shared: &Shared) {
    let pulled: u64 = frames
        .iter()
        .filter(|f| f.header.source.is_some())
        .map(|f| f.header.len)
        .sum();
    let all: u64 = frames.iter().map(|f| f.header.len).sum();
    let s = &shared.stats;
    s.sent_payload_bytes
        .fetch_add(all - pulled, Ordering::Relaxed);
    let by = match pulls {
        PullMode::Shared(_) => &s.sent_shared_bytes,
        _ => &s.sent_ptrace_bytes,
    };
    by.fetch_add(pulled, Ordering::Relaxed);
}

/// Turns the frames worth pulling into PULL frames (the source's address in this process) and
/// returns the pins that keep their sources alive until the job is answered. A frame whose
/// source is already revoked stays a payload frame, and sending it reports the revocation. On a
/// shared-memory lane only frames from shared memory are pulled, its descriptor handed to the
/// receiver first (a failure to hand it over leaves the frame a payload).
fn mark_pulls(frames: &mut [OutFrame], mode: &mut PullMode) -> Vec<SourcePin> {
    let mut pins: Vec<SourcePin> = Vec::new();
    let min = mode.min_bytes();
    for f in frames.iter_mut() {
        if f.header.len < min {
            continue;
        }
        let memory = f.src.memory();
        if let PullMode::Shared(exporter) = mode {
            match exporter.export(memory) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(e) => {
                    tracing::warn!(error = %e, "handing a source to the receiver failed; it travels as payloads");
                    continue;
                }
            }
        }
        let pinned = pins.iter().any(|p| Arc::ptr_eq(p.memory(), memory));
        if !pinned {
            match memory.pin() {
                Some(pin) => pins.push(pin),
                None => continue,
            }
        }
        f.header.source = Some(memory.as_ptr() as u64 + f.src_offset);
        f.header.stride = f.src_stride;
    }
    pins
}

/// Sends frames that share one source registration, in as few `sendmsg` calls as the socket allows.
fn send_window(
    peer: &Endpoint,
    sock: &LaneSocket,
    frames: &[OutFrame],
    state: &LaneState,
    shared: &Shared,
) -> Result<()> {
    let src = &frames[0].src;
    let headers: Vec<[u8; super::frame::HEADER_LEN]> =
        frames.iter().map(|f| f.header.encode()).collect();
    let base = src.memory().as_ptr() as *const u8;
    let mut segs: Vec<(*const u8, usize)> = Vec::with_capacity(frames.len() * 2);
    for (f, h) in frames.iter().zip(&headers) {
        segs.push((h.as_ptr(), h.len()));
        if f.header.wire_payload() > 0 {
            // wrapping_add: the pointer is only dereferenced by sendmsg, under the live guard,
            // and the range was validated against the source region before queueing.
            match f.src_stride {
                None => segs.push((
                    base.wrapping_add(f.src_offset as usize),
                    f.header.len as usize,
                )),
                Some(s) => segs.extend(
                    s.segments(f.src_offset, f.header.len)
                        .map(|(at, n)| (base.wrapping_add(at as usize), n as usize)),
                ),
            }
        }
    }
    // The bytes are counted before they are handed to the socket, and what a failure left
    // unsent is taken back: counted after `sendmsg`, a preempted sender thread could count them
    // after the peer's completion for them was already seen, and a caller reading the counters
    // right after its write completed would miss them.
    let total: u64 = segs.iter().map(|&(_, len)| len as u64).sum();
    shared.stats.bytes_sent.fetch_add(total, Ordering::Relaxed);
    let local = &shared.local[state.route.local].bytes_sent;
    local.fetch_add(total, Ordering::Relaxed);
    let mut sent = 0u64;
    let result = send_segments(peer, sock, &mut segs, src, state, shared, &mut sent);
    if result.is_err() {
        let unsent = total - sent;
        shared.stats.bytes_sent.fetch_sub(unsent, Ordering::Relaxed);
        local.fetch_sub(unsent, Ordering::Relaxed);
    }
    result
}

/// The `sendmsg` loop of [`send_window`]: `sent` is what the socket accepted before it returned.
fn send_segments(
    peer: &Endpoint,
    sock: &LaneSocket,
    segs: &mut [(*const u8, usize)],
    src: &Region,
    state: &LaneState,
    shared: &Shared,
    sent: &mut u64,
) -> Result<()> {
    let mut cursor = 0;
    let timeout = shared.config.io_timeout();
    while cursor < segs.len() {
        let rc = {
            let Some(_live) = src.memory().live() else {
                return Err(FabricError::LocalDeregistered {
                    what: "write source (deregistered while sending)",
                    rkey: src.rkey(),
                });
            };
            // SAFETY: header segments point into `headers`, alive for this function; payload
            // segments lie inside the source region (src_offset + len <= region length was
            // checked by WriteOp::validate and the region's length never changes), and the live
            // guard keeps the registration from being revoked during the call.
            unsafe { sock.send_raw(&segs[cursor..]) }
        };
        match rc {
            Ok(mut n) => {
                *sent += n as u64;
                state.touch();
                while n > 0 {
                    let (ptr, len) = segs[cursor];
                    if n >= len {
                        n -= len;
                        cursor += 1;
                    } else {
                        segs[cursor] = (ptr.wrapping_add(n), len - n);
                        n = 0;
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match sock.wait(Readiness::Write, Some(timeout), &shared.stop) {
                    Ok(()) => {}
                    Err(IoFail::TimedOut) => {
                        return Err(FabricError::Timeout {
                            what: format!("peer {peer} stopped reading lane {}", state.index),
                            after: timeout,
                        });
                    }
                    Err(IoFail::Shutdown) => return Err(FabricError::Shutdown),
                    Err(e) => return Err(disconnected(peer, state.index, &e.to_string())),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(disconnected(peer, state.index, &e.to_string())),
        }
        // Skip zero-length segments left at the cursor.
        while cursor < segs.len() && segs[cursor].1 == 0 {
            cursor += 1;
        }
    }
    Ok(())
}

fn disconnected(peer: &Endpoint, lane: usize, detail: &str) -> FabricError {
    FabricError::Disconnected {
        peer: peer.clone(),
        lane,
        detail: detail.to_owned(),
    }
}

/// Resolves the oldest pending job with one completion; an error means the lane is unusable.
fn complete_one(
    peer: &Endpoint,
    b: &[u8; COMPLETION_LEN],
    pending: &Mutex<PendingQueue>,
    state: &LaneState,
) -> Result<()> {
    let completion = Completion::decode(b).map_err(|e| FabricError::Protocol {
        peer: peer.clone(),
        detail: format!("bad completion: {e}"),
    })?;
    state.touch();
    let Some(p) = pending.lock().items.pop_front() else {
        return Err(FabricError::Protocol {
            peer: peer.clone(),
            detail: "completion without a pending write".into(),
        });
    };
    if p.frames != completion.frames {
        let e = FabricError::Protocol {
            peer: peer.clone(),
            detail: format!(
                "completion covers {} frames, expected {}",
                completion.frames, p.frames
            ),
        };
        let _ = p.done.send(Err(e.clone()));
        return Err(e);
    }
    let result = match completion.error {
        None => Ok(()),
        Some((kind, rkey, addr)) => {
            let (base, len) = p
                .ctx
                .iter()
                .find(|c| c.0 == rkey && c.1 == addr)
                .map_or((0, 0), |c| (c.2, c.3));
            Err(FabricError::RemoteAccess {
                kind,
                peer: peer.clone(),
                rkey,
                offset: addr.wrapping_sub(base),
                len,
            })
        }
    };
    // The receiver is done with the job's sources: release them before the caller hears.
    let Pending { done, pins, .. } = p;
    drop(pins);
    let _ = done.send(result);
    Ok(())
}

fn run_completions(
    peer: &Endpoint,
    sock: &LaneSocket,
    pending: &Mutex<PendingQueue>,
    state: &LaneState,
    shared: &Shared,
) {
    let timeout = shared.config.io_timeout();
    // Completions are read in bulk: one recv often carries several.
    let mut buf = [0u8; COMPLETION_LEN * 64];
    let mut filled = 0;
    let err = 'lane: loop {
        let mut start = 0;
        while filled - start >= COMPLETION_LEN {
            let mut b = [0u8; COMPLETION_LEN];
            b.copy_from_slice(&buf[start..start + COMPLETION_LEN]);
            start += COMPLETION_LEN;
            if let Err(e) = complete_one(peer, &b, pending, state) {
                break 'lane e;
            }
        }
        buf.copy_within(start..filled, 0);
        filled -= start;
        // SAFETY: buf[filled..] is a valid, exclusively borrowed byte range.
        let rc = unsafe { sock.recv_raw(buf[filled..].as_mut_ptr(), buf.len() - filled) };
        match rc {
            Ok(0) => break disconnected(peer, state.index, "connection closed by peer"),
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                match sock.wait(Readiness::Read, Some(timeout), &shared.stop) {
                    Ok(()) => {}
                    Err(IoFail::TimedOut) => {
                        let idle_ms = (state.born.elapsed().as_millis() as u64)
                            .saturating_sub(state.last_progress_ms.load(Ordering::Relaxed));
                        if idle_ms >= timeout.as_millis() as u64 && !pending.lock().items.is_empty()
                        {
                            break FabricError::Timeout {
                                what: format!(
                                    "no completion from peer {peer} on lane {}",
                                    state.index
                                ),
                                after: timeout,
                            };
                        }
                    }
                    Err(IoFail::Shutdown) => break FabricError::Shutdown,
                    Err(e) => break disconnected(peer, state.index, &e.to_string()),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break disconnected(peer, state.index, &e.to_string()),
        }
    };
    if !matches!(err, FabricError::Shutdown) && !pending.lock().items.is_empty() {
        tracing::warn!(%peer, lane = state.index, error = %err, "lane failed with writes in flight");
    }
    if !state.broken.swap(true, Ordering::SeqCst) && !matches!(err, FabricError::Shutdown) {
        shared.stats.lane_failures.fetch_add(1, Ordering::Relaxed);
    }
    state_fail(sock, pending, &err);
}
