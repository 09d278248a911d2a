//! The write path: a batch resolved into pieces, posted on the lanes of each peer, waited on,
//! re-posted on fresh queue pairs where that is safe, and a refusal diagnosed by asking the peer.

use super::*;

impl Inner {
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
            // Nothing wrong with the rkey, the range or the region's permission: the NIC
            // refused the write because the queue pair had no remote write, i.e. the peer's
            // write window was closed (`verbs_window`).
            Ok(Some(Reply::Diagnosis { kind: None })) => RemoteAccessKind::OutsideWindow,
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
            WrLimits {
                max_msg,
                max_sge: self.port.limits.send_sge(),
            },
            first,
        );
        self.deliver(peer, ops, &resolved, plan.now, generation)
            .await?;
        // A striped write's immediate goes only after its body landed on every lane.
        self.deliver(peer, ops, &resolved, plan.deferred, generation)
            .await
    }

    pub(super) async fn write_batch(
        self: Arc<Self>,
        ops: Vec<WriteOp>,
        generation: u64,
    ) -> Result<()> {
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
