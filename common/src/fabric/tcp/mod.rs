//! The TCP backend: a user-space emulation of an RDMA NIC, the default fabric.
//!
//! Each process listens on its [`Endpoint`]. A writer keeps `lanes_per_peer` TCP connections
//! ("lanes", standing in for queue pairs) to each peer it writes to, opened lazily and
//! authenticated with a challenge on the job token ([`handshake`]). A write travels as a frame
//! (op, rkey, remote address, length, immediate, payload: [`frame`]); the receiving thread checks
//! it against the registration table and reads the payload straight into the registered region
//! (`receiver`), counting the immediate only once every byte is in memory. The writer streams
//! many frames per lane without waiting and asks for a completion only at the end of each job
//! (`lane`), like selective signalling on a send queue.
//!
//! Which lane carries what: every lane slot counts the bytes posted on it and not yet
//! acknowledged, and each write goes where it lands soonest ([`place`]): whole to
//! the least-loaded lane when the lanes are busy (a 1 MiB write split four ways behind 8 MiB of
//! queue lands no sooner, and costs four frames, four completions and four wake-ups), spread
//! over the idle lanes when they are not (a lone 64 MiB write still uses every lane).
//!
//! Resetting ([`FabricBackend::reset_connections`]) aborts every outbound lane with an RST, which
//! makes the kernel discard its send queue; lanes also close with `SO_LINGER` {on, 0}, so even a
//! dying process never leaves frames for the kernel to deliver later. A receiver drops the frames
//! of a lane its writer reset that it has not landed yet (the kernel still hands them out).
//!
//! Why threads rather than async tasks: each lane is a long-lived byte stream that is either
//! busy or idle, and a dedicated thread doing non-blocking `sendmsg`/`recv` straight from and into
//! registered memory has the shortest path (no executor hops on the data path, no copies).
//! Callers see async futures all the same (completions travel on oneshot channels).
//!
//! Several NICs: the fabric listens on every configured address, its endpoint lists them all,
//! and its lanes to a peer are spread over the pairs of addresses (`addresses`).
//!
//! Same host: where writer and receiver share a machine (and [`FabricConfig::same_host`]), a
//! lane's handshake agrees that the receiver copies the bytes of large frames out of the
//! writer's memory itself, once ([`same_host`]): the writer sends a PULL frame (header only,
//! naming its source address) and keeps the source pinned until the completion; the receiver
//! checks the frame exactly as a payload frame and lands it with `process_vm_readv` instead of
//! `recv`. One copy instead of the two of a loopback socket. Where the kernel refuses this
//! receiver ptrace access to the writer (containers, Yama, a non-dumpable writer), the writer's
//! sources, which this backend allocates as sealed `memfd`s, are handed over by descriptor on a
//! UNIX socket and the receiver copies out of its own mapping of them (`shared_pulls`): still one
//! copy, no ptrace. [`TcpStats::bytes_shared`] counts those bytes.
//!
//! Layout: [`frame`] (wire format), [`handshake`] (authentication), `registry` (rkey table),
//! `receiver` (inbound lanes), `inbound` (reading one inbound lane), `peer` (the lanes to one
//! peer and their queues), `lane` (one outbound lane), `addresses` (local addresses and
//! multi-address endpoints), `socket` (the raw socket calls), [`same_host`] (pull offers and
//! the cross-process copy), `shared_pulls` (pulls from memory shared by descriptor).

mod addresses;
#[cfg(test)]
mod addresses_tests;
pub mod frame;
pub mod handshake;
mod inbound;
mod lane;
mod peer;
mod receiver;
mod registry;
pub mod same_host;
mod shared_pulls;
mod socket;

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use self::addresses::{LocalAddress, endpoint_of};
use self::frame::{FrameHeader, MAX_FRAME_PAYLOAD, MAX_PARTS, Part};
use self::lane::{LaneJob, OutFrame};
use self::peer::PeerLanes;
use super::{
    Access, Endpoint, FabricBackend, FabricConfig, FabricError, ImmCounter, Memory, MemoryLocation,
    Region, RegionDescriptor, RegisteredMemory, Result, TransferPaths, WriteOp, merge_contiguous,
    place,
};
pub use addresses::AddressBytes;
pub use registry::{Registration, RegistrationTable, WriteWindow};

/// Alignment of the pieces a large write is split into.
const STRIPE_ALIGN: u64 = 4096;

/// Counters of one TCP fabric (for metrics and tests).
#[derive(Debug, Default)]
pub(super) struct Counters {
    lanes_opened: AtomicU64,
    lane_failures: AtomicU64,
    auth_failures: AtomicU64,
    preauth_dropped: AtomicU64,
    frames_sent: AtomicU64,
    bytes_sent: AtomicU64,
    frames_received: AtomicU64,
    bytes_received: AtomicU64,
    bytes_pulled: AtomicU64,
    bytes_shared: AtomicU64,
    pull_calls: AtomicU64,
    /// Written by this process, by path (`transfer_paths`).
    sent_payload_bytes: AtomicU64,
    sent_ptrace_bytes: AtomicU64,
    sent_shared_bytes: AtomicU64,
    refused: AtomicU64,
    outside_window: AtomicU64,
}

/// A snapshot of a TCP fabric's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Outbound lanes connected and authenticated.
    pub lanes_opened: u64,
    /// Lanes (either direction) that failed.
    pub lane_failures: u64,
    /// Inbound connections refused by the handshake.
    pub auth_failures: u64,
    /// Inbound connections closed before their handshake because too many unauthenticated ones
    /// were waiting (in all, or from their address).
    pub preauth_dropped: u64,
    /// Frames sent.
    pub frames_sent: u64,
    /// Bytes sent (headers included).
    pub bytes_sent: u64,
    /// Frames whose payload landed here.
    pub frames_received: u64,
    /// Payload bytes that landed here.
    pub bytes_received: u64,
    /// Of `bytes_received`, those this process copied out of a same-host writer's memory
    /// itself (PULL frames, see [`same_host`]) rather than read from a socket.
    pub bytes_pulled: u64,
    /// Of `bytes_pulled`, those copied out of a writer's memory shared by file descriptor
    /// (lanes whose receiver the kernel refused ptrace access to the writer, or
    /// [`SameHostPath::Shared`](super::SameHostPath)); the rest were `process_vm_readv` copies.
    pub bytes_shared: u64,
    /// Copies out of same-host writers (`process_vm_readv` calls) that landed them: fewer than
    /// the PULL frames landed when runs of them arrive together and land at once.
    pub pull_calls: u64,
    /// Frames refused here (rkey, bounds, permission, deregistered, outside the window).
    pub refused: u64,
    /// Of `refused`, frames that arrived while the receiver's [`WriteWindow`] was closed.
    pub outside_window: u64,
}

/// State shared by the fabric handle and its lane threads.
#[derive(Debug)]
pub(super) struct Shared {
    config: FabricConfig,
    key: [u8; 32],
    /// Random id of this process's writer side (scopes split-write ids at receivers).
    instance: u64,
    table: Arc<RegistrationTable>,
    imm: ImmCounter,
    stop: AtomicBool,
    /// (writer instance, write id) -> parts still to land, for split writes with an immediate.
    assembly: Mutex<HashMap<(u64, u64), u16>>,
    stats: Counters,
    /// The addresses listened on and written from (`listen` first), with their counters.
    local: Vec<LocalAddress>,
    /// How many peers this process said it writes to ([`FabricBackend::expect_peers`]; 0:
    /// not said), which bounds the lanes opened to each peer met afterwards.
    expected_peers: std::sync::atomic::AtomicUsize,
}

/// The frames of one batch bound for one peer, per lane.
struct PeerPlan {
    lanes: Arc<PeerLanes>,
    frames: Vec<Vec<OutFrame>>,
    /// Bytes each lane has queued, counting this batch's frames planned so far.
    loads: Vec<u64>,
    /// The lane that wins the next tie.
    first: usize,
}

#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    endpoint: Endpoint,
    peers: Mutex<HashMap<Endpoint, Arc<PeerLanes>>>,
    next_write_id: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
    }
}

/// The TCP fabric of one process (cheap to clone; the last clone stops its threads).
#[derive(Debug, Clone)]
pub struct TcpFabric {
    inner: Arc<Inner>,
}

impl TcpFabric {
    /// Binds a listener on every configured address (`listen`, then `extra_listen`) and starts
    /// accepting lanes.
    pub async fn start(config: &FabricConfig) -> Result<TcpFabric> {
        config.validate()?;
        let mut listeners = Vec::new();
        for address in config.listen_addresses() {
            let listener = std::net::TcpListener::bind(address)
                .map_err(|e| FabricError::io(format!("binding fabric listener {address}"), e))?;
            let addr = listener.local_addr().map_err(|e| {
                FabricError::io(format!("reading the address of listener {address}"), e)
            })?;
            listeners.push((listener, addr));
        }
        let addrs: Vec<std::net::SocketAddr> = listeners.iter().map(|l| l.1).collect();
        let endpoint = endpoint_of(&addrs);
        let shared = Arc::new(Shared {
            config: config.clone(),
            key: config.job_token.handshake_key(),
            instance: rand::random(),
            table: Arc::default(),
            imm: ImmCounter::new(),
            stop: AtomicBool::new(false),
            assembly: Mutex::default(),
            stats: Counters::default(),
            local: addrs.iter().map(|&a| LocalAddress::new(a)).collect(),
            expected_peers: std::sync::atomic::AtomicUsize::new(0),
        });
        // From here on the handle owns the threads: dropping it (also on an error below) stops
        // every accept thread already started.
        let fabric = TcpFabric {
            inner: Arc::new(Inner {
                shared: shared.clone(),
                endpoint,
                peers: Mutex::default(),
                next_write_id: AtomicU64::new(1),
            }),
        };
        for (index, (listener, _)) in listeners.into_iter().enumerate() {
            let acceptor_shared = shared.clone();
            std::thread::Builder::new()
                .name("ws-fabric-accept".into())
                .spawn(move || receiver::accept_loop(listener, index, acceptor_shared))
                .map_err(|e| FabricError::io("spawning the fabric accept thread", e))?;
        }
        tracing::debug!(endpoint = %fabric.inner.endpoint, "tcp fabric listening");
        Ok(fabric)
    }

    /// Bytes sent and received through each local address, in the endpoint's order.
    pub fn address_stats(&self) -> Vec<AddressBytes> {
        self.inner
            .shared
            .local
            .iter()
            .map(AddressBytes::of)
            .collect()
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> TcpStats {
        let c = &self.inner.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TcpStats {
            lanes_opened: get(&c.lanes_opened),
            lane_failures: get(&c.lane_failures),
            auth_failures: get(&c.auth_failures),
            preauth_dropped: get(&c.preauth_dropped),
            frames_sent: get(&c.frames_sent),
            bytes_sent: get(&c.bytes_sent),
            frames_received: get(&c.frames_received),
            bytes_received: get(&c.bytes_received),
            bytes_pulled: get(&c.bytes_pulled),
            bytes_shared: get(&c.bytes_shared),
            pull_calls: get(&c.pull_calls),
            refused: get(&c.refused),
            outside_window: get(&c.outside_window),
        }
    }

    /// Sets when this process accepts writes into its regions ([`WriteWindow`]): a receiver
    /// that guards its memory closes the window at start, arms it for each sync and closes it
    /// again once the sync landed or was abandoned.
    pub fn set_write_window(&self, window: WriteWindow) {
        self.inner.shared.table.set_window(window);
    }

    /// Fault injection: shuts down every open lane to `peer`, as if the cable were pulled.
    /// Writes in flight on them fail; the next write reconnects.
    pub fn cut_lanes(&self, peer: &Endpoint) {
        let lanes = self.inner.peers.lock().get(peer).cloned();
        if let Some(lanes) = lanes {
            for lane in lanes.open_lanes() {
                lane.cut();
            }
        }
    }

    /// Resets every outbound lane (see [`FabricBackend::reset_connections`]): each is removed
    /// from its slot and aborted, so the next write to that peer opens a fresh one.
    fn reset_lanes(&self) {
        let peers: Vec<Arc<PeerLanes>> = self.inner.peers.lock().values().cloned().collect();
        let mut reset = 0;
        for lanes in peers {
            for lane in lanes.take_lanes() {
                lane.reset();
                reset += 1;
            }
        }
        tracing::debug!(endpoint = %self.inner.endpoint, lanes = reset, "outbound lanes reset");
    }

    fn peer(&self, endpoint: &Endpoint) -> Arc<PeerLanes> {
        let mut peers = self.inner.peers.lock();
        peers
            .entry(endpoint.clone())
            .or_insert_with(|| Arc::new(PeerLanes::new(endpoint, &self.inner.shared)))
            .clone()
    }

    /// Plans `ops` into per-lane jobs, queues them, and returns the completions to await.
    fn post(&self, ops: Vec<WriteOp>) -> Result<Vec<Completion>> {
        for op in &ops {
            op.validate()?;
            if op.dst.base.checked_add(op.dst_offset + op.len).is_none() {
                return Err(FabricError::RemoteAccess {
                    kind: super::RemoteAccessKind::OutOfBounds,
                    peer: op.dst.endpoint.clone(),
                    rkey: op.dst.rkey,
                    offset: op.dst_offset,
                    len: op.len,
                });
            }
        }
        let ops = merge_contiguous(ops);
        let stripe_min = self.inner.shared.config.stripe_min_bytes;
        let mut per_peer: HashMap<Endpoint, PeerPlan> = HashMap::new();
        for op in ops {
            let PeerPlan {
                frames,
                loads,
                first,
                ..
            } = per_peer.entry(op.dst.endpoint.clone()).or_insert_with(|| {
                let lanes = self.peer(&op.dst.endpoint);
                let (loads, first) = lanes.loads();
                PeerPlan {
                    frames: (0..lanes.len()).map(|_| Vec::new()).collect(),
                    lanes,
                    loads,
                    first,
                }
            });
            // What each lane will have queued once the writes planned so far are posted.
            let mut pieces = place(op.len, loads, stripe_min, STRIPE_ALIGN, *first);
            *first = first.wrapping_add(1);
            if pieces.iter().any(|&(_, _, n)| n > MAX_FRAME_PAYLOAD) {
                pieces = pieces
                    .into_iter()
                    .flat_map(|(lane, o, n)| {
                        (0..n.div_ceil(MAX_FRAME_PAYLOAD).max(1)).map(move |k| {
                            let off = k * MAX_FRAME_PAYLOAD;
                            (lane, o + off, (n - off).min(MAX_FRAME_PAYLOAD))
                        })
                    })
                    .collect();
            }
            if pieces.len() > MAX_PARTS as usize {
                return Err(FabricError::Unsupported(format!(
                    "a write of {} bytes needs {} parts; the limit is {MAX_PARTS}",
                    op.len,
                    pieces.len()
                )));
            }
            let part = (pieces.len() > 1 && op.imm.is_some()).then(|| Part {
                write_id: self.inner.next_write_id.fetch_add(1, Ordering::Relaxed),
                parts: pieces.len() as u16,
            });
            for (lane, off, len) in pieces {
                loads[lane] += len + frame::HEADER_LEN as u64;
                let (src_offset, src_stride) = op.source_at(off);
                frames[lane].push(OutFrame {
                    header: FrameHeader {
                        signalled: false,
                        imm: op.imm,
                        part,
                        rkey: op.dst.rkey,
                        addr: op.dst.base + op.dst_offset + off,
                        len,
                        source: None,
                        stride: None,
                    },
                    src: op.src.clone(),
                    src_offset,
                    src_stride,
                    dst_base: op.dst.base,
                });
            }
        }
        let mut completions = Vec::new();
        for PeerPlan {
            lanes: peer,
            frames,
            ..
        } in per_peer.into_values()
        {
            for (i, frames) in frames.into_iter().enumerate() {
                if frames.is_empty() {
                    continue;
                }
                let (done, rx) = oneshot::channel();
                let bytes = frames
                    .iter()
                    .map(|f| f.header.len + frame::HEADER_LEN as u64)
                    .sum();
                let queued = peer.enqueue(i, bytes);
                let job = LaneJob {
                    frames,
                    done,
                    queued,
                };
                peer.submit(i, job, &self.inner.shared);
                completions.push(Completion {
                    peer: peer.endpoint.clone(),
                    lane: i,
                    rx,
                });
            }
        }
        Ok(completions)
    }
}

/// The completion of one lane job.
struct Completion {
    peer: Endpoint,
    lane: usize,
    rx: oneshot::Receiver<Result<()>>,
}

async fn await_all(completions: Result<Vec<Completion>>) -> Result<()> {
    let mut first_err = None;
    for c in completions? {
        let r = c.rx.await.unwrap_or_else(|_| {
            Err(FabricError::Disconnected {
                peer: c.peer,
                lane: c.lane,
                detail: "lane closed before the write completed".into(),
            })
        });
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    first_err.map_or(Ok(()), Err)
}

impl FabricBackend for TcpFabric {
    fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    fn lanes_per_peer(&self) -> usize {
        self.inner.shared.config.lanes_per_peer
    }

    fn min_strided_run(&self) -> u64 {
        if self.inner.shared.config.same_host {
            same_host::MIN_STRIDED_RUN
        } else {
            1
        }
    }

    fn expect_peers(&self, peers: usize) {
        self.inner
            .shared
            .expected_peers
            .store(peers, Ordering::Relaxed);
    }

    /// Sources are shared memory (a sealed `memfd`) when same-host transfers are on and
    /// [`shared_pulls::sources_shared`] says so: a receiver on this host that may not read
    /// this process with `process_vm_readv` maps them instead (`shared_pulls`). Where no memfd
    /// can be made, anonymous memory as elsewhere.
    fn alloc(&self, len: usize, access: Access) -> Result<Region> {
        let config = &self.inner.shared.config;
        if access == Access::SOURCE
            && len > 0
            && config.same_host
            && shared_pulls::sources_shared(config.same_host_path)
        {
            match Memory::alloc_shared("weightsync-source", len) {
                Ok(m) => return self.register(m, access),
                Err(e) => tracing::debug!(error = %e, "no shared memory for a source"),
            }
        }
        self.register(Memory::alloc_on(len, self.page_size(access))?, access)
    }

    /// Counted as frames are sent: a PULL frame's bytes by the lane's agreed path (the
    /// receiver copies them), every other frame's as payloads.
    fn transfer_paths(&self) -> Option<TransferPaths> {
        let c = &self.inner.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Some(TransferPaths {
            payload_bytes: get(&c.sent_payload_bytes),
            process_vm_readv_bytes: get(&c.sent_ptrace_bytes),
            shared_memory_bytes: get(&c.sent_shared_bytes),
        })
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Region> {
        if memory.location() != MemoryLocation::Host {
            return Err(FabricError::Unsupported(
                "the TCP backend registers host memory only".into(),
            ));
        }
        // The receive threads land every frame themselves, so they can report each one.
        let mem = RegisteredMemory::new_reporting_landings(memory);
        let rkey = self.inner.shared.table.insert(mem.clone(), access);
        let descriptor = RegionDescriptor {
            endpoint: self.inner.endpoint.clone(),
            base: mem.as_ptr() as u64,
            len: mem.len() as u64,
            rkey,
        };
        let table = Arc::downgrade(&self.inner.shared.table);
        Ok(Region::new(
            mem,
            access,
            descriptor,
            Box::new(move || {
                if let Some(t) = table.upgrade() {
                    t.remove(rkey);
                }
            }),
        ))
    }

    fn write(&self, op: WriteOp) -> impl Future<Output = Result<()>> + Send + 'static {
        await_all(self.post(vec![op]))
    }

    fn write_batch(&self, ops: Vec<WriteOp>) -> impl Future<Output = Result<()>> + Send + 'static {
        await_all(self.post(ops))
    }

    fn connect(&self, peer: &Endpoint) -> impl Future<Output = Result<()>> + Send + 'static {
        let lanes = self.peer(peer);
        let ready: Vec<_> = (0..lanes.len())
            .map(|i| lanes.lane(i, &self.inner.shared).ready())
            .collect();
        async move {
            for r in ready {
                r.await?;
            }
            Ok(())
        }
    }

    fn imm_counter(&self) -> &ImmCounter {
        &self.inner.shared.imm
    }

    fn reset_connections(&self) -> impl Future<Output = ()> + Send + 'static {
        // Synchronous: when this returns, every lane that held a frame is aborted.
        self.reset_lanes();
        std::future::ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::Stride;
    use futures::FutureExt;

    #[tokio::test]
    async fn split_write_lands_and_counts_once() {
        let config = FabricConfig {
            stripe_min_bytes: 64 << 10,
            ..FabricConfig::loopback("unit", 4)
        };
        let a = TcpFabric::start(&config).await.unwrap();
        let b = TcpFabric::start(&config).await.unwrap();
        let len = 1 << 20;
        let src = a.alloc(len, Access::SOURCE).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        src.write_at(0, &data).unwrap();
        let dst = b.alloc(len, Access::RECEIVE).unwrap();
        a.write(WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64).with_imm(5))
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), data);
        b.imm_counter().expect(5, 1).await.unwrap();
        assert_eq!(b.imm_counter().unclaimed(5), 0);
        // Split over the 4 lanes: 4 frames landed, one immediate counted.
        assert_eq!(b.stats().frames_received, 4);
        assert_eq!(a.stats().lanes_opened, 4);
        assert!(b.imm_counter().expect(5, 1).now_or_never().is_none());
    }

    #[tokio::test]
    async fn same_host_lanes_pull_large_frames_and_send_small_ones() {
        if same_host::boot_id().is_none() {
            return; // no boot id here: pulls are never offered
        }
        let config = FabricConfig::loopback("unit", 2);
        let a = TcpFabric::start(&config).await.unwrap();
        let b = TcpFabric::start(&config).await.unwrap();
        let len = 3 << 20;
        let src = a.alloc(len, Access::SOURCE).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + i / 4096) as u8).collect();
        src.write_at(0, &data).unwrap();
        let dst = b.alloc(len, Access::RECEIVE).unwrap();
        let small = same_host::PULL_MIN_BYTES - 1;
        a.write_batch(vec![
            WriteOp::new(&src, 0, dst.descriptor(), 0, small).with_imm(1),
            WriteOp::new(&src, small, dst.descriptor(), small + 1, 1 << 20).with_imm(2),
            WriteOp::new(&src, 2 << 20, dst.descriptor(), 2 << 20, 1 << 20).with_imm(3),
        ])
        .await
        .unwrap();
        let got = dst.to_vec().unwrap();
        assert_eq!(got[..small as usize], data[..small as usize]);
        assert_eq!(got[small as usize], 0, "a byte no write covered");
        assert_eq!(
            got[small as usize + 1..(small + 1 + (1 << 20)) as usize],
            data[small as usize..(small + (1 << 20)) as usize]
        );
        assert_eq!(got[2 << 20..], data[2 << 20..]);
        for imm in 1..=3 {
            b.imm_counter().expect(imm, 1).await.unwrap();
        }
        let stats = b.stats();
        assert_eq!(stats.bytes_received, small + (2 << 20));
        assert_eq!(stats.bytes_pulled, 2 << 20, "the large frames were pulled");
        // Only headers and the small frame's payload went through the sockets.
        assert!(a.stats().bytes_sent < small + 4096, "{:?}", a.stats());
        // The writer counts each frame by its path (ptrace allowed here: no shared memory).
        let paths = a.transfer_paths().unwrap();
        assert_eq!(
            (
                paths.process_vm_readv_bytes,
                paths.payload_bytes,
                paths.shared_memory_bytes
            ),
            (2 << 20, small, 0)
        );
        assert_eq!(paths.name(), "mixed");
        // The pins were released with the completions: the source deregisters at once.
        src.deregister();
    }

    #[tokio::test]
    async fn strided_sources_are_pulled_gathered_with_few_calls() {
        if same_host::boot_id().is_none() {
            return; // no boot id here: pulls are never offered
        }
        let config = FabricConfig::loopback("unit", 2);
        let a = TcpFabric::start(&config).await.unwrap();
        let b = TcpFabric::start(&config).await.unwrap();
        let len = 4 << 20;
        let src = a.alloc(len, Access::SOURCE).unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 3000) as u8).collect();
        src.write_at(0, &data).unwrap();
        let dst = b.alloc(len, Access::RECEIVE).unwrap();
        // The left half of each 6000-byte row: 300 rows of 3000 bytes, 900 000 bytes.
        let layout = Stride::new(3000, 6000);
        let n = 300 * 3000;
        a.write(
            WriteOp::new(&src, 0, dst.descriptor(), 0, n)
                .with_stride(layout)
                .with_imm(4),
        )
        .await
        .unwrap();
        b.imm_counter().expect(4, 1).await.unwrap();
        let got = dst.to_vec().unwrap();
        let want: Vec<u8> = layout
            .segments(0, n)
            .flat_map(|(o, k)| data[o as usize..(o + k) as usize].iter().copied())
            .collect();
        assert_eq!(got[..n as usize], want[..]);
        let stats = b.stats();
        assert_eq!(stats.bytes_pulled, n, "every strided byte was pulled");
        // One call per frame and at most 1024 runs each, not one per run.
        assert!(stats.pull_calls <= 4, "{stats:?}");
        assert!(a.stats().bytes_sent < 4096, "{:?}", a.stats());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pull_headers_that_arrive_together_land_in_runs() {
        use std::io::{Read, Write};
        if same_host::boot_id().is_none() {
            return; // no boot id here: pulls are never offered
        }
        let config = FabricConfig::loopback("unit", 1);
        let b = TcpFabric::start(&config).await.unwrap();
        let (a, c) = (
            b.alloc(1 << 20, Access::RECEIVE).unwrap(),
            b.alloc(1 << 20, Access::RECEIVE).unwrap(),
        );
        let (a, c) = (a.descriptor().clone(), c.descriptor().clone());
        // The writer's memory is this process's: the receiver pulls straight out of `src`.
        let src: Vec<u8> = (0..200_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        let at = |i: usize| src.as_ptr() as u64 + i as u64;
        let peer = b.endpoint().clone();
        let mut st = std::net::TcpStream::connect(peer.as_str()).unwrap();
        st.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let agreed = handshake::client_handshake_offering(
            &mut st,
            &config.job_token.handshake_key(),
            rand::random(),
            &peer,
            true,
        )
        .unwrap();
        assert!(agreed, "this process can read itself");
        let frame = |d: &RegionDescriptor, at_dst: u64, len: u64, source, signalled| FrameHeader {
            signalled,
            imm: Some(1),
            part: None,
            rkey: d.rkey,
            addr: d.base + at_dst,
            len,
            source,
            stride: None,
        };
        // One send: two pulls into A, a pull past A's end (refused), a payload frame into A,
        // two pulls into C, one more into A.
        let mut wire = Vec::new();
        for h in [
            frame(&a, 0, 20_000, Some(at(0)), false),
            frame(&a, 20_000, 20_000, Some(at(20_000)), false),
            frame(&a, a.len - 10, 20_000, Some(at(0)), true),
            frame(&a, 40_000, 100, None, false),
        ] {
            wire.extend_from_slice(&h.encode());
        }
        wire.extend_from_slice(&src[150_000..150_100]);
        for h in [
            frame(&c, 0, 30_000, Some(at(40_000)), false),
            frame(&c, 30_000, 30_000, Some(at(70_000)), false),
            frame(&a, 50_000, 20_000, Some(at(100_000)), true),
        ] {
            wire.extend_from_slice(&h.encode());
        }
        st.write_all(&wire).unwrap();
        let mut next = || {
            let mut raw = [0u8; frame::COMPLETION_LEN];
            st.read_exact(&mut raw).unwrap();
            frame::Completion::decode(&raw).unwrap()
        };
        let (first, second) = (next(), next());
        assert_eq!(first.frames, 3);
        assert_eq!(
            first.error.map(|e| e.0),
            Some(crate::fabric::RemoteAccessKind::OutOfBounds)
        );
        assert_eq!((second.frames, second.error), (4, None));
        // Every good frame landed where it was aimed, and counted its immediate.
        b.imm_counter().expect(1, 6).await.unwrap();
        let got = |d: &RegionDescriptor, off: u64, len: usize| {
            let r = b
                .inner
                .shared
                .table
                .check_write(d.rkey, d.base, 1)
                .unwrap()
                .0;
            let live = r.memory.live().unwrap();
            // SAFETY: [off, off + len) lies inside the live region, which nothing writes now
            // (every frame has completed).
            unsafe { std::slice::from_raw_parts(live.as_ptr().add(off as usize), len) }.to_vec()
        };
        assert_eq!(got(&a, 0, 40_000), src[..40_000]);
        assert_eq!(got(&a, 40_000, 100), src[150_000..150_100]);
        assert_eq!(got(&a, 50_000, 20_000), src[100_000..120_000]);
        assert_eq!(got(&c, 0, 60_000), src[40_000..100_000]);
        let stats = b.stats();
        assert_eq!(stats.bytes_pulled, 20_000 * 3 + 60_000);
        assert_eq!(stats.refused, 1);
        // The pulls landed as three runs: A's first two, C's two, A's last (another region).
        assert_eq!(stats.pull_calls, 3, "{stats:?}");
    }

    #[tokio::test]
    async fn a_guarded_receiver_refuses_writes_outside_an_armed_window() {
        let on = FabricConfig::loopback("unit", 1);
        let off = FabricConfig {
            same_host: false,
            ..on.clone()
        };
        // Payload frames and (where the host allows) same-host pulls.
        for config in [off, on] {
            let a = TcpFabric::start(&config).await.unwrap();
            let b = TcpFabric::start(&config).await.unwrap();
            let len = 1 << 20;
            let src = a.alloc(len, Access::SOURCE).unwrap();
            let dst = b.alloc(len, Access::RECEIVE).unwrap();
            dst.write_at(0, &vec![1u8; len]).unwrap();
            b.set_write_window(WriteWindow::Closed);
            src.write_at(0, &vec![7u8; len]).unwrap();
            let op = || WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64).with_imm(3);
            let err = a.write(op()).await.unwrap_err();
            assert!(
                matches!(
                    err,
                    FabricError::RemoteAccess {
                        kind: crate::fabric::RemoteAccessKind::OutsideWindow,
                        ..
                    }
                ),
                "{err}"
            );
            assert_eq!(dst.to_vec().unwrap(), vec![1u8; len], "bytes changed");
            assert_eq!(b.stats().outside_window, 1);
            assert_eq!(
                b.imm_counter().unclaimed(3),
                0,
                "a refused write was counted"
            );
            b.set_write_window(WriteWindow::Armed);
            a.write(op()).await.unwrap();
            assert_eq!(dst.to_vec().unwrap(), vec![7u8; len]);
            b.imm_counter().expect(3, 1).await.unwrap();
            b.set_write_window(WriteWindow::Closed);
            src.write_at(0, &vec![9u8; len]).unwrap();
            assert!(a.write(op()).await.is_err());
            assert_eq!(dst.to_vec().unwrap(), vec![7u8; len], "bytes changed");
            assert_eq!(b.stats().outside_window, 2);
        }
    }

    #[tokio::test]
    async fn either_side_turning_pulls_off_keeps_payloads_on_the_wire() {
        let on = FabricConfig::loopback("unit", 1);
        let off = FabricConfig {
            same_host: false,
            ..on.clone()
        };
        for (writer, receiver) in [(&off, &on), (&on, &off)] {
            let a = TcpFabric::start(writer).await.unwrap();
            let b = TcpFabric::start(receiver).await.unwrap();
            let len = 1 << 20;
            let src = a.alloc(len, Access::SOURCE).unwrap();
            src.write_at(0, &vec![9u8; len]).unwrap();
            let dst = b.alloc(len, Access::RECEIVE).unwrap();
            a.write(WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64))
                .await
                .unwrap();
            assert_eq!(dst.to_vec().unwrap(), vec![9u8; len]);
            assert_eq!(b.stats().bytes_pulled, 0);
            assert!(a.stats().bytes_sent >= len as u64);
        }
    }

    #[tokio::test]
    async fn reset_fails_unacknowledged_writes_and_the_next_write_reconnects() {
        let a = TcpFabric::start(&FabricConfig::loopback("unit", 2))
            .await
            .unwrap();
        let b = TcpFabric::start(&FabricConfig::loopback("unit", 2))
            .await
            .unwrap();
        let src = a.alloc(4096, Access::SOURCE).unwrap();
        src.write_at(0, &[7u8; 4096]).unwrap();
        let dst = b.alloc(4096, Access::RECEIVE).unwrap();
        let op = || WriteOp::new(&src, 0, dst.descriptor(), 0, 4096);
        a.write(op()).await.unwrap();
        assert_eq!(a.stats().lanes_opened, 1);
        // A write posted on a lane that is reset before its acknowledgement came back fails
        // with the reset error (or, if the acknowledgement won the race, succeeded).
        let pending = a.write(op().with_imm(9));
        a.reset_connections().await;
        match pending.await {
            Ok(()) => {}
            Err(e) => assert!(matches!(e, FabricError::ConnectionsReset { .. }), "{e}"),
        }
        // The next write opens a fresh lane and lands.
        src.write_at(0, &[8u8; 4096]).unwrap();
        a.write(op()).await.unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![8u8; 4096]);
        assert!(a.stats().lanes_opened >= 2);
        assert_eq!(a.stats().lane_failures, 0, "a reset is not a lane failure");
    }

    #[tokio::test]
    async fn a_writer_told_its_peers_shares_its_lanes_out_over_them() {
        let config = FabricConfig::loopback("unit", 8);
        let (a, b, c) = (
            TcpFabric::start(&config).await.unwrap(),
            TcpFabric::start(&config).await.unwrap(),
            TcpFabric::start(&config).await.unwrap(),
        );
        // Not told: every peer gets the configured lanes.
        assert_eq!(a.peer(b.endpoint()).len(), 8);
        // Told of 4 peers: peers met afterwards get the machine's share, and writes to them land.
        a.expect_peers(4);
        let share = FabricConfig::lanes_for_peers(8, 1, 4);
        assert!(share < 8);
        assert_eq!(a.peer(c.endpoint()).len(), share);
        let len = 1 << 20;
        let src = a.alloc(len, Access::SOURCE).unwrap();
        src.write_at(0, &vec![3u8; len]).unwrap();
        let dst = c.alloc(len, Access::RECEIVE).unwrap();
        a.write(WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64).with_imm(1))
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), vec![3u8; len]);
        assert!(a.stats().lanes_opened as usize <= share);
    }

    #[tokio::test]
    async fn unreachable_peer_is_reported() {
        let a = TcpFabric::start(&FabricConfig::loopback("unit", 1))
            .await
            .unwrap();
        // A port that was just free: nothing listens there.
        let free = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = a.connect(&free.into()).await.unwrap_err();
        assert!(matches!(err, FabricError::PeerUnreachable { .. }), "{err}");
    }
}
