//! A lane: one connected RC queue pair to a peer, with its send-queue bookkeeping.
//!
//! Lanes are directional, like the TCP backend's: the process that writes connects its own queue
//! pairs to the peer's bootstrap endpoint, and the peer's matching queue pairs only receive. A
//! lane that fails (any error completion moves an RC queue pair to the error state and flushes
//! everything queued behind it) is marked broken; the writes on it fail, and the next write to that
//! peer replaces it with a fresh queue pair, like a queue-pair reset.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use super::super::descriptor::Endpoint;
use super::super::error::FabricError;
use super::verbs_completion::WrId;
use super::verbs_qp::VerbsQp;
use super::verbs_send_queue::SendQueue;
use super::verbs_wr::{doorbell_groups, SendChain, WritePiece};

/// One writer lane.
#[derive(Debug)]
pub struct Lane {
    /// The peer.
    pub peer: Endpoint,
    /// Index among the peer's lanes.
    pub index: usize,
    /// The queue pair.
    pub qp: Arc<VerbsQp>,
    /// Send-queue slots.
    pub sq: Mutex<SendQueue>,
    /// Set once the queue pair failed: the root cause.
    pub broken: Mutex<Option<FabricError>>,
    /// Signalled when slots free up or the lane breaks.
    pub slots: Notify,
    /// The bootstrap connection; closing it tells the peer to destroy its queue pair.
    pub bootstrap: Mutex<Option<tokio::net::TcpStream>>,
}

impl Lane {
    /// The error of a broken lane.
    pub fn broken(&self) -> Option<FabricError> {
        self.broken.lock().clone()
    }

    /// Marks the lane broken with `root` (first cause wins): no more posting on it, and the
    /// peer is told (by closing the bootstrap connection) to destroy its end. WRs still queued
    /// complete with flush errors, which resolve the batches waiting on them.
    pub fn mark_broken(&self, root: FabricError) {
        {
            let mut b = self.broken.lock();
            if b.is_none() {
                *b = Some(root);
            }
        }
        drop(self.bootstrap.lock().take());
        self.slots.notify_waiters();
    }

    /// Whether the lane is broken and every signalled WR on it has completed (so nobody waits
    /// on its CQ any more and it can stop being polled).
    pub fn drained(&self) -> bool {
        self.broken.lock().is_some() && self.sq.lock().signalled_outstanding() == 0
    }

    /// Posts as many of `pieces` as the send queue has room for, in doorbell groups of
    /// `per_doorbell`, signalling as [`SendQueue`] decides; the last piece is the lane's final WR
    /// of `token` when `ends_share`. Returns how many were posted (0 means: wait for slots).
    ///
    /// `first_piece` is the batch index of `pieces[0]` (pieces are consecutive in the batch).
    pub fn post_some(
        &self,
        token: u64,
        pieces: &[(u32, WritePiece)],
        ends_share: bool,
        per_doorbell: usize,
    ) -> Result<usize, FabricError> {
        if let Some(e) = self.broken() {
            return Err(e);
        }
        let wr_id = |i: usize| {
            WrId {
                token,
                piece: pieces[i].0,
                is_final: ends_share && i + 1 == pieces.len(),
            }
            .encode()
        };
        let mut sq = self.sq.lock();
        let grants = sq.reserve(pieces.len(), ends_share, wr_id);
        let n = grants.len();
        for group in doorbell_groups(n, per_doorbell) {
            let items: Vec<(WritePiece, u64, bool)> = group
                .clone()
                .map(|i| (pieces[i].1, wr_id(i), grants[i].signalled))
                .collect();
            let mut chain = SendChain::new(&items);
            // SAFETY: every piece was resolved against a live registration of this fabric's
            // protection domain (lkey and bounds checked in `resolve`); that registration keeps
            // its memory allocated until it is deregistered, after which the NIC no longer
            // touches it.
            let posted = unsafe { self.qp.post_send(&mut chain) };
            if let Err(e) = posted {
                drop(sq);
                let err = FabricError::Disconnected {
                    peer: self.peer.clone(),
                    lane: self.index,
                    detail: e.to_string(),
                };
                self.mark_broken(err.clone());
                return Err(err);
            }
        }
        Ok(n)
    }
}

/// What the progress thread does with a queue pair's completions.
#[derive(Debug, Clone)]
pub enum Role {
    /// Our writer lane: send completions.
    Writer(Arc<Lane>),
    /// A peer's lane into us: WRITE_WITH_IMM receive completions.
    Receiver,
}

/// A queue pair the progress thread polls.
#[derive(Debug, Clone)]
pub struct Polled {
    /// The queue pair (its CQ is polled).
    pub qp: Arc<VerbsQp>,
    /// What it is.
    pub role: Role,
}

/// The set of polled queue pairs, with a generation so the progress thread re-reads it only when
/// it changed.
#[derive(Debug, Default)]
pub struct PolledSet {
    inner: RwLock<(u64, Vec<Polled>)>,
}

impl PolledSet {
    /// Adds a queue pair.
    pub fn add(&self, p: Polled) {
        let mut g = self.inner.write();
        g.0 += 1;
        g.1.push(p);
    }

    /// Removes the queue pair with number `qp_num`.
    pub fn remove(&self, qp_num: u32) {
        let mut g = self.inner.write();
        g.0 += 1;
        g.1.retain(|p| p.qp.qp_num() != qp_num);
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.inner.read().0
    }

    /// A snapshot and its generation.
    pub fn snapshot(&self) -> (u64, Vec<Polled>) {
        let g = self.inner.read();
        (g.0, g.1.clone())
    }
}
