//! Lanes to a peer: found, or connected (bootstrap over TCP, queue pairs brought up, the
//! largest message agreed) when missing or broken. Split from the fabric so the write path and
//! the connection path read apart; it sees the fabric's private state as a child module.

use super::*;

impl Inner {
    pub(super) fn peer_lanes(&self, peer: &Endpoint) -> Arc<PeerLanes> {
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
    pub(super) async fn lane(&self, peer: &Endpoint, index: usize) -> Result<Arc<Lane>> {
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
        let qp = VerbsQp::new(&self.pd, s.send_depth, 1, self.port.limits.send_sge())?;
        qp.modify(&to_init(self.port.port, RemoteWrite::On), "RESET->INIT")?;
        let ours = self.port.endpoint(qp.qp_num(), 1);
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
                    )));
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
                });
            }
            Ok(Err(e)) => return Err(bootstrap_error(peer, index, e)),
            Err(_) => {
                return Err(FabricError::Timeout {
                    what: format!("queue-pair bootstrap with {peer} (lane {index})"),
                    after: timeout,
                });
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
                if let Some(lane) = weak.upgrade()
                    && lane.broken().is_none()
                {
                    lane.mark_broken(FabricError::Disconnected {
                        peer: lane.peer.clone(),
                        lane: lane.index,
                        detail: "the peer closed the lane (its queue pair is gone)".into(),
                    });
                    let _ = lane.qp.modify(&to_error(), "->ERR (peer gone)");
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
}
