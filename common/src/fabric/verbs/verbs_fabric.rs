//! [`VerbsFabric`]: the [`FabricBackend`] over ibverbs RC queue pairs.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;

use super::super::{
    merge_contiguous, Access, Endpoint, FabricBackend, FabricConfig, FabricError, ImmCounter,
    Memory, Region, RegionDescriptor, RegisteredMemory, RemoteAccessKind, Result, WriteOp,
};
use super::verbs_async_events;
use super::verbs_batch::{plan_repost, BatchTable, LaneFailure};
use super::verbs_bootstrap::{
    send_frame, writer_exchange, BootstrapError, HandshakeKey, LaneMsg, Reply, Request,
};
use super::verbs_completion::{PieceTarget, MAX_PIECES_PER_TOKEN};
use super::verbs_device::{PortInfo, VerbsContext, VerbsPd};
use super::verbs_endpoint::{agreed_max_msg, random_psn, QpEndpoint};
use super::verbs_lane::{Lane, Polled, PolledSet, Role};
use super::verbs_lane_session::{read_writer_lane, ReaderEnd};
use super::verbs_lane_state::{Blocked, LaneState};
use super::verbs_listener::{set_keepalive, Listener};
use super::verbs_mr::VerbsMr;
use super::verbs_progress::Progress;
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::{to_error, to_init, to_rtr, to_rts};
use super::verbs_registry::{RegistrationKey, Registry};
use super::verbs_settings::VerbsSettings;
use super::verbs_wr::{plan_pieces, ResolvedOp, WritePiece};

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
        verbs_async_events::spawn(ctx.clone(), polled.clone(), shutdown.clone())
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

    /// Moves every queue pair of our lanes to `peer` into the error state, as a pulled cable or
    /// a NIC reset would: writes in flight on them fail (imm-less pieces are re-posted; a piece
    /// with an immediate is not, see `verbs_batch`), and the next write re-establishes the lanes.
    /// For fault tests.
    pub fn cut_lanes(&self, peer: &Endpoint) {
        let Some(lanes) = self.inner.peers.lock().get(peer).cloned() else {
            return;
        };
        for slot in &lanes.lanes {
            if let Ok(slot) = slot.try_lock() {
                if let Some(lane) = slot.as_ref() {
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
        let in_bounds = op
            .src_offset
            .checked_add(op.len)
            .is_some_and(|end| end <= region_len);
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
        })
    }

    fn peer_lanes(&self, peer: &Endpoint) -> Arc<PeerLanes> {
        self.peers
            .lock()
            .entry(peer.clone())
            .or_insert_with(|| {
                Arc::new(PeerLanes {
                    lanes: (0..self.config.lanes_per_peer)
                        .map(|_| tokio::sync::Mutex::new(None))
                        .collect(),
                    max_msg: AtomicU64::new(0),
                })
            })
            .clone()
    }

    /// The lane `index` to `peer`, connecting (or replacing a broken one) first.
    async fn lane(&self, peer: &Endpoint, index: usize) -> Result<Arc<Lane>> {
        let lanes = self.peer_lanes(peer);
        let slot = lanes
            .lanes
            .get(index)
            .ok_or_else(|| FabricError::Config(format!("lane {index} does not exist")))?;
        let mut slot = slot.lock().await;
        if let Some(lane) = slot.as_ref() {
            if lane.broken().is_none() {
                return Ok(lane.clone());
            }
            tracing::info!(%peer, lane = index, "re-establishing a failed lane");
            if lane.drained() {
                // Otherwise the progress thread removes it once its last waiter is answered.
                self.polled.remove(lane.qp.qp_num());
            }
            *slot = None;
        }
        let (lane, max_msg) = self.connect_lane(peer, index).await?;
        lanes.max_msg.store(max_msg, Ordering::Relaxed);
        *slot = Some(lane.clone());
        Ok(lane)
    }

    /// Connects lane `index` to `peer`; returns it and the largest message both sides carry.
    async fn connect_lane(&self, peer: &Endpoint, index: usize) -> Result<(Arc<Lane>, u64)> {
        let s = &self.settings;
        let qp = VerbsQp::new(&self.pd, s.send_depth, 1)?;
        qp.modify(&to_init(self.port.port), "RESET->INIT")?;
        let ours = QpEndpoint {
            qp_num: qp.qp_num(),
            psn: random_psn(),
            lid: self.port.lid,
            gid: self.port.gid,
            mtu: self.port.active_mtu,
            recv_depth: 1,
            max_msg_size: self.port.max_msg_size,
            gid_type: self.port.gid_type,
        };
        let timeout = self.config.connect_timeout();
        let unreachable = |source: std::io::Error| FabricError::PeerUnreachable {
            peer: peer.clone(),
            source: Arc::new(source),
        };
        let mut stream =
            match tokio::time::timeout(timeout, TcpStream::connect(peer.as_str())).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return Err(unreachable(e)),
                Err(_) => {
                    return Err(unreachable(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("connect timed out after {timeout:?}"),
                    )))
                }
            };
        let _ = stream.set_nodelay(true);
        if let Err(e) = set_keepalive(&stream) {
            tracing::debug!(%peer, error = %e, "enabling TCP keepalive failed");
        }
        let request = Request::Lane {
            lane: index as u32,
            endpoint: ours,
        };
        let exchange = writer_exchange(&mut stream, &self.key.0, request);
        let theirs = match tokio::time::timeout(timeout, exchange).await {
            Ok(Ok(Reply::Lane { endpoint })) => endpoint,
            Ok(Ok(other)) => {
                return Err(FabricError::Protocol {
                    peer: peer.clone(),
                    detail: format!("expected a queue-pair endpoint, got {other:?}"),
                })
            }
            Ok(Err(e)) => return Err(bootstrap_error(peer, index, e)),
            Err(_) => {
                return Err(FabricError::Timeout {
                    what: format!("queue-pair bootstrap with {peer} (lane {index})"),
                    after: timeout,
                })
            }
        };
        let rtr =
            to_rtr(&ours, &theirs, self.port.addressing, self.port.port, s).map_err(|detail| {
                FabricError::Protocol {
                    peer: peer.clone(),
                    detail,
                }
            })?;
        qp.modify(&rtr, "INIT->RTR")?;
        qp.modify(&to_rts(ours.psn, s), "RTR->RTS")?;
        let (rd, wr) = stream.into_split();
        let lane = Arc::new(Lane {
            peer: peer.clone(),
            index,
            qp: qp.clone(),
            state: Mutex::new(LaneState::new(
                s.send_depth,
                s.signal_interval,
                theirs.recv_depth,
            )),
            peer_recv_depth: theirs.recv_depth,
            slots: Notify::new(),
            bootstrap: Mutex::new(Some(wr)),
            reader: Mutex::new(None),
        });
        let weak: Weak<Lane> = Arc::downgrade(&lane);
        let reader = tokio::spawn(async move {
            let credits = weak.clone();
            let end = read_writer_lane(rd, move |reposted| {
                if let Some(lane) = credits.upgrade() {
                    lane.grant_credits(reposted);
                }
            })
            .await;
            if end == ReaderEnd::Closed {
                // The peer's queue pair is gone: fail the lane now rather than after the
                // transport retries.
                if let Some(lane) = weak.upgrade() {
                    if lane.broken().is_none() {
                        lane.mark_broken(FabricError::Disconnected {
                            peer: lane.peer.clone(),
                            lane: lane.index,
                            detail: "the peer closed the lane (its queue pair is gone)".into(),
                        });
                        let _ = lane.qp.modify(&to_error(), "->ERR (peer gone)");
                    }
                }
            }
        });
        *lane.reader.lock() = Some(reader);
        self.polled.add(Polled {
            qp,
            role: Role::Writer(lane.clone()),
        });
        tracing::debug!(%peer, lane = index, qp = ours.qp_num, peer_qp = theirs.qp_num, "lane up");
        Ok((
            lane,
            agreed_max_msg(self.port.max_msg_size, theirs.max_msg_size),
        ))
    }

    /// Posts `pieces` and waits until each lane's share ended; pieces that did not run, or carry
    /// no immediate, are re-posted on fresh queue pairs up to [`REPOST_ROUNDS`] times
    /// ([`plan_repost`]). Returns the first refusal; else, when a piece with an immediate may
    /// have run and so cannot go again, the error of its lane; else the lane error if
    /// re-posting did not get through.
    async fn deliver(
        &self,
        peer: &Endpoint,
        ops: &[WriteOp],
        resolved: &[ResolvedOp],
        pieces: Vec<WritePiece>,
        generation: u64,
    ) -> Result<()> {
        let targets = |pieces: &[WritePiece]| -> Vec<PieceTarget> {
            pieces
                .iter()
                .map(|p| PieceTarget {
                    peer: peer.clone(),
                    lane: p.lane,
                    rkey: ops[p.op].dst.rkey,
                    offset: ops[p.op].dst_offset + (p.remote_addr - resolved[p.op].remote_addr),
                    len: u64::from(p.len),
                    lkey: p.lkey,
                })
                .collect()
        };
        let sources = |pieces: &[WritePiece]| -> Vec<Region> {
            let mut out: Vec<Region> = Vec::new();
            for p in pieces {
                let src = &ops[p.op].src;
                if !out.iter().any(|r| r.same_registration(src)) {
                    out.push(src.clone());
                }
            }
            out
        };
        let mut refused: Option<(FabricError, Option<WritePiece>)> = None;
        for chunk in pieces.chunks(MAX_PIECES_PER_TOKEN) {
            let mut pending = chunk.to_vec();
            let mut round = 0;
            while !pending.is_empty() {
                let failures = self
                    .post_and_wait(
                        peer,
                        &pending,
                        targets(&pending),
                        sources(&pending),
                        generation,
                    )
                    .await?;
                let repost = plan_repost(&pending, &failures);
                if refused.is_none() {
                    refused = repost.refused.map(|e| (e, repost.refused_piece));
                }
                if let Some((piece, lane_error)) = repost.lost {
                    if let Some((e, piece)) = refused {
                        return Err(self.diagnose(peer, e, piece).await);
                    }
                    tracing::debug!(%peer, lane = piece.lane, imm = ?piece.imm,
                        "a piece with an immediate was flushed and may have landed; not re-sent");
                    return Err(FabricError::Disconnected {
                        peer: peer.clone(),
                        lane: piece.lane,
                        detail: format!(
                            "a write with immediate {:#x} was flushed by a failing queue pair \
                             and may have landed; it is not re-sent, so that its immediate is \
                             never counted twice ({lane_error})",
                            piece.imm.unwrap_or(0)
                        ),
                    });
                }
                if !repost.pieces.is_empty() && round == REPOST_ROUNDS {
                    let refused = refused.map(|(e, _)| e);
                    return Err(refused.or(repost.first_error).unwrap_or(
                        FabricError::Disconnected {
                            peer: peer.clone(),
                            lane: 0,
                            detail: "writes kept being flushed".into(),
                        },
                    ));
                }
                if !repost.pieces.is_empty() {
                    tracing::debug!(%peer, pieces = repost.pieces.len(), "re-posting flushed pieces");
                }
                pending = repost.pieces;
                round += 1;
            }
        }
        match refused {
            Some((e, piece)) => Err(self.diagnose(peer, e, piece).await),
            None => Ok(()),
        }
    }

    /// Asks the peer why it refused `piece` and puts the answer into `error` (the NIC reports
    /// all remote protection failures alike). On any trouble asking, `error` stays as it is.
    async fn diagnose(
        &self,
        peer: &Endpoint,
        error: FabricError,
        piece: Option<WritePiece>,
    ) -> FabricError {
        let (
            FabricError::RemoteAccess {
                kind,
                peer: p,
                rkey,
                offset,
                len,
            },
            Some(piece),
        ) = (error.clone(), piece)
        else {
            return error;
        };
        let request = Request::Diagnose {
            rkey: piece.rkey,
            addr: piece.remote_addr,
            len: u64::from(piece.len),
        };
        let ask = async {
            let mut stream = TcpStream::connect(peer.as_str()).await.ok()?;
            let _ = stream.set_nodelay(true);
            writer_exchange(&mut stream, &self.key.0, request)
                .await
                .ok()
        };
        let kind = match tokio::time::timeout(self.config.connect_timeout(), ask).await {
            Ok(Some(Reply::Diagnosis { kind: Some(k) })) => k.into(),
            _ => kind,
        };
        FabricError::RemoteAccess {
            kind,
            peer: p,
            rkey,
            offset,
            len,
        }
    }

    /// Posts one call's `pieces` (any lanes) and waits until every chunk ended. `keep` (the
    /// sources) stays registered until then, even if this future is dropped.
    async fn post_and_wait(
        &self,
        peer: &Endpoint,
        pieces: &[WritePiece],
        targets: Vec<PieceTarget>,
        keep: Vec<Region>,
        generation: u64,
    ) -> Result<Vec<LaneFailure>> {
        if pieces.is_empty() {
            return Ok(Vec::new());
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let mut per_lane: BTreeMap<usize, Vec<(u32, WritePiece)>> = BTreeMap::new();
        for (i, p) in pieces.iter().enumerate() {
            per_lane.entry(p.lane).or_default().push((i as u32, *p));
        }
        let done = self.batches.register(token, targets, keep);
        let _guard = TokenGuard {
            batches: &self.batches,
            token,
        };
        let bytes: u64 = pieces.iter().map(|p| u64::from(p.len)).sum();
        let wait = ack_wait(self.config.io_timeout(), bytes);
        for (index, list) in per_lane {
            if self.generation.load(Ordering::SeqCst) != generation {
                // Reset since this write started: do not even connect a lane for it.
                return Err(FabricError::ConnectionsReset {
                    peer: peer.clone(),
                    lane: index,
                });
            }
            let lane = self.lane(peer, index).await?;
            let mut posted = 0;
            while posted < list.len() {
                // Checked after the lane is in its slot: a reset from here on finds the lane and
                // moves its queue pair to the error state, which flushes whatever we post.
                if self.generation.load(Ordering::SeqCst) != generation {
                    return Err(FabricError::ConnectionsReset {
                        peer: peer.clone(),
                        lane: index,
                    });
                }
                let notified = lane.slots.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                self.batches.open_chunk(token);
                let (n, blocked) =
                    match lane.post_some(token, &list[posted..], self.settings.wrs_per_doorbell) {
                        Ok(r) => r,
                        Err(e) => {
                            self.batches.chunk_not_posted(token);
                            return Err(e);
                        }
                    };
                if n == 0 {
                    self.batches.chunk_not_posted(token);
                    if let Some(e) = lane.broken() {
                        return Err(e);
                    }
                    if tokio::time::timeout(wait, notified).await.is_err() {
                        return Err(match blocked {
                            Some(Blocked::Credits) => FabricError::Disconnected {
                                peer: peer.clone(),
                                lane: index,
                                detail: format!(
                                    "receiver not ready: the peer granted no receive credit for \
                                     {wait:?} (its progress thread is stalled or gone)"
                                ),
                            },
                            _ => FabricError::Timeout {
                                what: format!("send-queue slots on lane {index} to {peer}"),
                                after: wait,
                            },
                        });
                    }
                }
                posted += n;
            }
        }
        self.batches.posting_done(token);
        match tokio::time::timeout(wait, done).await {
            Ok(Ok(failures)) => Ok(failures),
            Ok(Err(_)) => Err(FabricError::Shutdown),
            Err(_) => Err(FabricError::Timeout {
                what: format!(
                    "acknowledgement of {} write pieces ({bytes} bytes) by {peer}",
                    pieces.len()
                ),
                after: wait,
            }),
        }
    }

    async fn write_to_peer(
        &self,
        peer: Endpoint,
        ops: Vec<WriteOp>,
        generation: u64,
    ) -> Result<()> {
        let result = self.write_to_peer_once(&peer, &ops, generation).await;
        reset_wins(
            result,
            self.generation.load(Ordering::SeqCst) != generation,
            &peer,
        )
    }

    async fn write_to_peer_once(
        &self,
        peer: &Endpoint,
        ops: &[WriteOp],
        generation: u64,
    ) -> Result<()> {
        let resolved = ops
            .iter()
            .map(|op| self.resolve(op))
            .collect::<Result<Vec<_>>>()?;
        let first = self.next_lane.fetch_add(1, Ordering::Relaxed);
        let lanes = self.peer_lanes(peer);
        if self.generation.load(Ordering::SeqCst) != generation {
            return Err(FabricError::ConnectionsReset {
                peer: peer.clone(),
                lane: 0,
            });
        }
        if lanes.max_msg.load(Ordering::Relaxed) == 0 {
            // The first write to this peer: learn its message limit (the lane is needed anyway,
            // the plan's first piece goes to it).
            self.lane(peer, first % self.config.lanes_per_peer).await?;
        }
        let max_msg = match lanes.max_msg.load(Ordering::Relaxed) {
            0 => self.port.max_msg_size,
            agreed => agreed,
        };
        let plan = plan_pieces(
            &resolved,
            self.config.lanes_per_peer,
            self.config.stripe_min_bytes,
            max_msg,
            first,
        );
        self.deliver(peer, ops, &resolved, plan.now, generation)
            .await?;
        // A striped write's immediate goes only after its body landed on every lane.
        self.deliver(peer, ops, &resolved, plan.deferred, generation)
            .await
    }

    async fn write_batch(self: Arc<Self>, ops: Vec<WriteOp>, generation: u64) -> Result<()> {
        for op in &ops {
            op.validate()?;
        }
        let mut by_peer: BTreeMap<Endpoint, Vec<WriteOp>> = BTreeMap::new();
        for op in merge_contiguous(ops) {
            by_peer.entry(op.dst.endpoint.clone()).or_default().push(op);
        }
        let writes = by_peer
            .into_iter()
            .map(|(peer, ops)| self.write_to_peer(peer, ops, generation));
        futures::future::try_join_all(writes).await?;
        Ok(())
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
        assert!(reset_wins(refused, true, &peer)
            .unwrap_err()
            .remote_access_kind()
            .is_some());
        assert!(reset_wins(Ok(()), true, &peer).is_ok());
    }
}
