//! [`VerbsFabric`]: the [`FabricBackend`] over ibverbs RC queue pairs.

mod connect;
mod deliver;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::super::{
    Access, Endpoint, FabricBackend, FabricConfig, FabricError, ImmCounter, Memory, PageSize,
    Region, RegionDescriptor, RegisteredMemory, RemoteAccessKind, Result, WriteOp, WriteWindow,
    merge_contiguous,
};
use super::verbs_async_events;
use super::verbs_batch::{BatchTable, LaneFailure, plan_repost};
use super::verbs_bootstrap::{
    BootstrapError, HandshakeKey, LaneMsg, Reply, Request, send_frame, writer_exchange,
};
use super::verbs_completion::{MAX_PIECES_PER_TOKEN, PieceTarget};
use super::verbs_device::{PortInfo, VerbsContext, VerbsPd};
use super::verbs_endpoint::agreed_max_msg;
use super::verbs_lane::{Lane, Polled, PolledSet, Role};
use super::verbs_lane_session::{ReaderEnd, read_writer_lane};
use super::verbs_lane_state::{Blocked, LaneState};
use super::verbs_listener::{Listener, set_keepalive};
use super::verbs_mr::VerbsMr;
use super::verbs_progress::Progress;
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::{RemoteWrite, to_error, to_init, to_rtr, to_rts};
use super::verbs_registry::{RegistrationKey, Registry};
use super::verbs_settings::VerbsSettings;
use super::verbs_window::InboundWindow;
use super::verbs_wr::{ResolvedOp, WrLimits, WritePiece, plan_pieces};

/// The verbs fabric of one process (cheap to clone).
#[derive(Debug, Clone)]
pub struct VerbsFabric {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct PeerLanes {
    lanes: Vec<tokio::sync::Mutex<Option<Arc<Lane>>>>,
    /// The largest message both sides carry (0 until a lane connected).
    max_msg: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    endpoint: Endpoint,
    config: FabricConfig,
    settings: VerbsSettings,
    key: HandshakeKey,
    pd: Arc<VerbsPd>,
    port: PortInfo,
    imm: ImmCounter,
    registry: Arc<Mutex<Registry>>,
    /// When peers may write into this process's regions, enforced on the inbound queue pairs.
    window: Arc<InboundWindow>,
    peers: Mutex<HashMap<Endpoint, Arc<PeerLanes>>>,
    polled: Arc<PolledSet>,
    batches: Arc<BatchTable>,
    next_token: AtomicU64,
    next_lane: AtomicUsize,
    /// Bumped by every `reset_connections`: a write started under an older value posts nothing
    /// more (no new pieces, no re-posts of flushed ones) and fails with `ConnectionsReset`.
    generation: AtomicU64,
    shutdown: Arc<AtomicBool>,
    /// Fault hook of the progress thread (see [`VerbsFabric::stall_progress`]).
    stalled_until_ms: Arc<AtomicU64>,
    epoch: Instant,
    listener_task: tokio::task::AbortHandle,
    /// Dropped with the fabric: tells the receiving queue pairs' tasks to tear them down.
    _closed: tokio::sync::watch::Sender<()>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        self.listener_task.abort();
    }
}

/// A snapshot of a verbs fabric's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerbsStats {
    /// Writes the NIC refused because this receiver's write window was closed (counted from
    /// the refusal's async event on the inbound queue pair; see `verbs_window`). The TCP
    /// backend's counter of the same name also counts frames of another sync's epoch, which
    /// a NIC cannot tell apart.
    pub outside_window: u64,
    /// Inbound queue pairs the window gates now.
    pub inbound_queue_pairs: u64,
}

/// How many times pieces flushed by a failing queue pair are re-posted on a fresh one.
const REPOST_ROUNDS: usize = 2;

/// Forgets a token if its write future is dropped before it resolved.
struct TokenGuard<'a> {
    batches: &'a BatchTable,
    token: u64,
}

impl Drop for TokenGuard<'_> {
    fn drop(&mut self) {
        self.batches.forget(self.token);
    }
}

fn config_error(e: impl std::fmt::Display) -> FabricError {
    FabricError::Config(e.to_string())
}

impl VerbsFabric {
    /// Opens the device, binds the bootstrap listener on `config.listen` and starts the progress
    /// thread.
    pub async fn start(config: &FabricConfig) -> Result<VerbsFabric> {
        config.validate()?;
        let settings = VerbsSettings::from_config_and_env(&config.verbs).map_err(config_error)?;
        let ctx = VerbsContext::open(&settings)?;
        let pd = VerbsPd::new(&ctx)?;
        let port = ctx.port().clone();
        let listener = TcpListener::bind(&config.listen)
            .await
            .map_err(|e| FabricError::io(format!("binding {}", config.listen), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| FabricError::io("reading the listener address", e))?;
        let key = HandshakeKey(config.job_token.handshake_key());
        let polled = Arc::new(PolledSet::default());
        let batches = Arc::new(BatchTable::default());
        let imm = ImmCounter::new();
        let shutdown = Arc::new(AtomicBool::new(false));
        let registry: Arc<Mutex<Registry>> = Arc::default();
        let window: Arc<InboundWindow> = Arc::default();
        let (closed_tx, closed_rx) = tokio::sync::watch::channel(());
        let stalled_until_ms = Arc::new(AtomicU64::new(0));
        let epoch = Instant::now();
        Progress {
            polled: polled.clone(),
            batches: batches.clone(),
            imm: imm.clone(),
            shutdown: shutdown.clone(),
            stalled_until_ms: stalled_until_ms.clone(),
            epoch,
        }
        .spawn()
        .map_err(|e| FabricError::io("spawning the verbs progress thread", e))?;
        verbs_async_events::spawn(
            ctx.clone(),
            polled.clone(),
            window.clone(),
            shutdown.clone(),
        )
        .map_err(|e| FabricError::io("spawning the verbs async-event thread", e))?;
        let accept = Listener {
            pd: pd.clone(),
            port: port.clone(),
            settings: settings.clone(),
            key,
            polled: polled.clone(),
            registry: registry.clone(),
            closed: closed_rx,
            handshake_timeout: config.connect_timeout(),
            window: window.clone(),
        };
        let listener_task = tokio::spawn(accept.run(listener)).abort_handle();
        Ok(VerbsFabric {
            inner: Arc::new(Inner {
                endpoint: addr.into(),
                config: config.clone(),
                settings,
                key,
                pd,
                port,
                imm,
                registry,
                window,
                _closed: closed_tx,
                peers: Mutex::default(),
                polled,
                batches,
                next_token: AtomicU64::new(1),
                next_lane: AtomicUsize::new(0),
                generation: AtomicU64::new(0),
                shutdown,
                stalled_until_ms,
                epoch,
                listener_task,
            }),
        })
    }

    /// The device port in use.
    pub fn port(&self) -> &PortInfo {
        &self.inner.port
    }

    /// The resolved settings.
    pub fn settings(&self) -> &VerbsSettings {
        &self.inner.settings
    }

    /// Sets when peers may write into this process's regions ([`WriteWindow`]): closing
    /// withdraws remote write from every inbound queue pair, arming restores it (see
    /// `verbs_window`). Blocks until every queue pair was modified (one firmware command each,
    /// several at once), so a caller that reports "armed" afterwards is telling the truth; call
    /// it off the async executor where queue pairs are many.
    pub fn set_write_window(&self, window: WriteWindow) {
        let start = Instant::now();
        let change = self.inner.window.set(window);
        if change.modified > 0 {
            tracing::debug!(?window, queue_pairs = change.modified, took = ?start.elapsed(),
                "write window changed on the inbound queue pairs");
        }
        if change.fenced > 0 {
            tracing::warn!(
                ?window,
                fenced = change.fenced,
                "inbound queue pairs that could not take the window's access were fenced; \
                 their writers reconnect"
            );
        }
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> VerbsStats {
        VerbsStats {
            outside_window: self.inner.window.outside_window(),
            inbound_queue_pairs: self.inner.window.inbound() as u64,
        }
    }

    /// Moves every queue pair of our lanes to `peer` into the error state, as a pulled cable or
    /// a NIC reset would: writes in flight on them fail (imm-less pieces are re-posted; a piece
    /// with an immediate is not, see `verbs_batch`), and the next write re-establishes the lanes.
    /// For fault tests.
    pub fn cut_lanes(&self, peer: &Endpoint) {
        let Some(lanes) = self.inner.peers.lock().get(peer).cloned() else {
            return;
        };
        for slot in &lanes.lanes {
            if let Ok(slot) = slot.try_lock()
                && let Some(lane) = slot.as_ref()
            {
                // Broken first, then ERR: a flush seen in between reports the cut.
                lane.mark_broken(FabricError::Disconnected {
                    peer: peer.clone(),
                    lane: lane.index,
                    detail: "lane cut (queue pair moved to the error state)".into(),
                });
                if let Err(e) = lane.qp.modify(&to_error(), "->ERR") {
                    tracing::warn!(%peer, lane = lane.index, error = %e, "cutting a lane failed");
                }
            }
        }
        self.inner.polled.remove_drained();
    }

    /// Fault hook: the progress thread polls nothing for `how_long`, as a descheduled or
    /// CPU-throttled process would (receives are not re-posted, completions not seen).
    pub fn stall_progress(&self, how_long: Duration) {
        let until = self.inner.epoch.elapsed() + how_long;
        self.inner
            .stalled_until_ms
            .store(until.as_millis() as u64 + 1, Ordering::Relaxed);
    }

    /// Resets every writer lane: it is marked broken with `ConnectionsReset` (before its queue
    /// pair moves to the error state, so writes on it report the reset, not the flush), its queue
    /// pair goes to the error state (the NIC flushes every WR it has not executed), and writes
    /// started before stop posting: no new pieces and no re-posts. Then the peer is asked over
    /// each lane's bootstrap connection to fence its end (move its queue pair to the error state)
    /// and the reset waits for the answers, at most the connect timeout, so that nothing posted
    /// before the reset can land once it returned, not even packets still on the wire. Drained
    /// lanes are dropped from their slots and from polling. The next write connects fresh queue
    /// pairs.
    async fn reset_lanes(inner: Arc<Inner>) {
        inner.generation.fetch_add(1, Ordering::SeqCst);
        let peers: Vec<(Endpoint, Arc<PeerLanes>)> = inner
            .peers
            .lock()
            .iter()
            .map(|(e, l)| (e.clone(), l.clone()))
            .collect();
        let mut fences = Vec::new();
        for (peer, lanes) in &peers {
            for slot in &lanes.lanes {
                // Waits for a connect in progress; a lane connected meanwhile is reset too.
                let mut slot = slot.lock().await;
                let Some(lane) = slot.as_ref() else { continue };
                // Keep the connection for the fence (marking broken would close it).
                let stream = lane.bootstrap.lock().take();
                let reader = lane.reader.lock().take();
                lane.mark_broken(FabricError::ConnectionsReset {
                    peer: peer.clone(),
                    lane: lane.index,
                });
                // Also for a lane already broken: any state may move to ERR, and a lane broken
                // by a failed post may still have WRs the NIC has not executed.
                if let Err(e) = lane.qp.modify(&to_error(), "->ERR") {
                    tracing::warn!(%peer, lane = lane.index, error = %e, "resetting a lane failed");
                }
                if let (Some(mut stream), Some(reader)) = (stream, reader) {
                    fences.push(async move {
                        if send_frame(&mut stream, &LaneMsg::Teardown).await.is_ok() {
                            let _ = reader.await;
                        }
                        drop(stream);
                    });
                }
                if lane.drained() {
                    *slot = None;
                }
            }
        }
        let wait = inner.config.connect_timeout();
        if tokio::time::timeout(wait, futures::future::join_all(fences))
            .await
            .is_err()
        {
            tracing::warn!(after = ?wait, "a peer did not confirm a lane teardown");
        }
        inner.polled.remove_drained();
        // Peers without any lane left are forgotten.
        let mut map = inner.peers.lock();
        map.retain(|_, lanes| {
            lanes
                .lanes
                .iter()
                .any(|slot| slot.try_lock().map_or(true, |s| s.is_some()))
        });
    }

    /// Bytes of host memory this fabric has pinned.
    pub fn pinned_bytes(&self) -> u64 {
        self.inner.registry.lock().pinned()
    }
}

impl Inner {
    fn resolve(&self, op: &WriteOp) -> Result<ResolvedOp> {
        let key = RegistrationKey::of(op.src.memory());
        let found = self.registry.lock().lookup(key);
        let Some((base, region_len, lkey)) = found else {
            if op.src.is_registered() {
                return Err(FabricError::Unsupported(
                    "write source region belongs to another fabric".into(),
                ));
            }
            return Err(FabricError::LocalDeregistered {
                what: "write source (not registered with this verbs fabric)",
                rkey: op.src.rkey(),
            });
        };
        let in_bounds = op.source_end().is_some_and(|end| end <= region_len);
        if !in_bounds {
            return Err(FabricError::LocalOutOfBounds {
                what: "write source",
                offset: op.src_offset,
                len: op.len,
                region_len,
            });
        }
        let local_addr = base + op.src_offset;
        let refused = |kind| FabricError::RemoteAccess {
            kind,
            peer: op.dst.endpoint.clone(),
            rkey: op.dst.rkey,
            offset: op.dst_offset,
            len: op.len,
        };
        let rkey = u32::try_from(op.dst.rkey).map_err(|_| refused(RemoteAccessKind::WrongRkey))?;
        let remote_addr = op
            .dst
            .base
            .checked_add(op.dst_offset)
            .ok_or_else(|| refused(RemoteAccessKind::OutOfBounds))?;
        Ok(ResolvedOp {
            local_addr,
            lkey,
            remote_addr,
            rkey,
            len: op.len,
            imm: op.imm,
            stride: op.src_stride,
        })
    }
}

/// A write that overlapped a `reset_connections` reports the reset, not the transport error the
/// reset caused (a flush, a closed lane, a timeout): the contract says writes not acknowledged
/// before a reset fail with `ConnectionsReset`. Refusals and local errors stay as they are.
fn reset_wins(result: Result<()>, reset_since: bool, peer: &Endpoint) -> Result<()> {
    match result {
        Err(
            FabricError::Disconnected { lane, .. } | FabricError::ConnectionsReset { lane, .. },
        ) if reset_since => Err(FabricError::ConnectionsReset {
            peer: peer.clone(),
            lane,
        }),
        Err(FabricError::Timeout { .. } | FabricError::PeerUnreachable { .. }) if reset_since => {
            Err(FabricError::ConnectionsReset {
                peer: peer.clone(),
                lane: 0,
            })
        }
        other => other,
    }
}

fn bootstrap_error(peer: &Endpoint, lane: usize, e: BootstrapError) -> FabricError {
    match e {
        BootstrapError::Auth(detail) => FabricError::Auth {
            peer: peer.clone(),
            detail,
        },
        BootstrapError::Refused(reason) if reason.contains("authentication") => FabricError::Auth {
            peer: peer.clone(),
            detail: reason,
        },
        BootstrapError::Protocol(detail) => FabricError::Protocol {
            peer: peer.clone(),
            detail,
        },
        other => FabricError::Disconnected {
            peer: peer.clone(),
            lane,
            detail: format!("queue-pair bootstrap failed: {other}"),
        },
    }
}

impl FabricBackend for VerbsFabric {
    fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    fn lanes_per_peer(&self) -> usize {
        self.inner.config.lanes_per_peer
    }

    /// Huge pages for every region: the NIC translates each page a WRITE reads or lands in
    /// (fewer translation entries to cache), and no CPU copies between two such regions.
    fn page_size(&self, _access: Access) -> PageSize {
        PageSize::Huge
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Region> {
        let memory = RegisteredMemory::new(memory);
        let pinned = self.inner.registry.lock().pinned();
        let mr = Arc::new(VerbsMr::register(
            &self.inner.pd,
            memory.clone(),
            access,
            pinned,
        )?);
        let descriptor = RegionDescriptor {
            endpoint: self.inner.endpoint.clone(),
            base: mr.addr(),
            len: mr.len(),
            rkey: u64::from(mr.rkey()),
        };
        let key = RegistrationKey::of(&memory);
        if self.inner.registry.lock().insert(key, mr, access).is_some() {
            // Cannot happen: `memory` is a fresh allocation held by the new MR.
            return Err(FabricError::Unsupported(
                "a registration with this memory already exists".into(),
            ));
        }
        let registry = self.inner.registry.clone();
        let deregister = move || {
            let mr = registry.lock().remove(key);
            // Dropping the last Arc calls ibv_dereg_mr: from here the NIC refuses the rkey.
            drop(mr);
        };
        Ok(Region::new(
            memory,
            access,
            descriptor,
            Box::new(deregister),
        ))
    }

    fn write(&self, op: WriteOp) -> impl Future<Output = Result<()>> + Send + 'static {
        self.write_batch(vec![op])
    }

    fn write_batch(&self, ops: Vec<WriteOp>) -> impl Future<Output = Result<()>> + Send + 'static {
        // Posted at once, like work handed to a NIC: the write makes progress whether or not the
        // returned future is polled, and dropping the future does not cancel it.
        let generation = self.inner.generation.load(Ordering::SeqCst);
        let work = self.inner.clone().write_batch(ops, generation);
        let spawned = tokio::runtime::Handle::try_current().map(|rt| rt.spawn(work));
        async move {
            match spawned {
                Ok(handle) => handle.await.unwrap_or_else(|e| {
                    Err(FabricError::io(
                        "verbs write task",
                        std::io::Error::other(e),
                    ))
                }),
                Err(_) => Err(FabricError::Unsupported(
                    "verbs writes must be started inside a tokio runtime".into(),
                )),
            }
        }
    }

    fn connect(&self, peer: &Endpoint) -> impl Future<Output = Result<()>> + Send + 'static {
        let inner = self.inner.clone();
        let peer = peer.clone();
        async move {
            for index in 0..inner.config.lanes_per_peer {
                inner.lane(&peer, index).await?;
            }
            Ok(())
        }
    }

    fn imm_counter(&self) -> &ImmCounter {
        &self.inner.imm
    }

    fn reset_connections(&self) -> impl Future<Output = ()> + Send + 'static {
        VerbsFabric::reset_lanes(self.inner.clone())
    }
}

/// How long a writer waits at most for acknowledgements of `bytes`: the I/O timeout, once more
/// per GiB (RC retries detect a dead peer long before; this only bounds a wedged device).
fn ack_wait(io_timeout: Duration, bytes: u64) -> Duration {
    io_timeout * (1 + (bytes >> 30) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V10: a write that overlapped a reset fails with `ConnectionsReset` even when the
    /// progress thread saw the flush first (a `Disconnected` "work request flushed").
    #[test]
    fn a_reset_wins_over_the_flush_it_caused() {
        let peer = Endpoint("p:1".into());
        let flushed = Err(FabricError::Disconnected {
            peer: peer.clone(),
            lane: 1,
            detail: "queue pair failed: work request flushed".into(),
        });
        assert!(matches!(
            reset_wins(flushed.clone(), true, &peer),
            Err(FabricError::ConnectionsReset { lane: 1, .. })
        ));
        assert!(matches!(
            reset_wins(flushed, false, &peer),
            Err(FabricError::Disconnected { .. })
        ));
        let refused = Err(FabricError::RemoteAccess {
            kind: RemoteAccessKind::WrongRkey,
            peer: peer.clone(),
            rkey: 1,
            offset: 0,
            len: 1,
        });
        assert!(
            reset_wins(refused, true, &peer)
                .unwrap_err()
                .remote_access_kind()
                .is_some()
        );
        assert!(reset_wins(Ok(()), true, &peer).is_ok());
    }
}
