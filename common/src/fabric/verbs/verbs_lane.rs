//! A lane: one connected RC queue pair to a peer, with its send-queue slots, receive credits and
//! broken flag under one lock (`verbs_lane_state`), and the set of queue pairs the progress
//! thread polls.
//!
//! Lanes are directional, like the TCP backend's: the process that writes connects its own queue
//! pairs to the peer's bootstrap endpoint, and the peer's matching queue pairs only receive. A
//! lane that fails (any error completion moves an RC queue pair to the error state and flushes
//! everything queued behind it) is marked broken; the writes on it fail (or re-post what may go
//! again, see `verbs_batch`), and the next write to that peer replaces it with a fresh queue pair,
//! like a queue-pair reset. A broken lane leaves the polled set once drained: when its last
//! signalled WR completed, or in a sweep for lanes broken with nothing outstanding.

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;

use super::super::descriptor::Endpoint;
use super::super::error::FabricError;
use super::verbs_completion::WrId;
use super::verbs_credits::ReceiveCredits;
use super::verbs_lane_state::{Blocked, LaneState};
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::to_error;
use super::verbs_wr::{SendChain, WritePiece, doorbell_groups};

/// One writer lane.
#[derive(Debug)]
pub struct Lane {
    /// The peer.
    pub peer: Endpoint,
    /// Index among the peer's lanes.
    pub index: usize,
    /// The queue pair.
    pub qp: Arc<VerbsQp>,
    /// Slots, credits and the broken flag, under one lock (see `verbs_lane_state`).
    pub state: Mutex<LaneState>,
    /// The receives the peer posted before answering (the base of its credit reports).
    pub peer_recv_depth: u32,
    /// Signalled when slots or credits free up, or the lane breaks.
    pub slots: Notify,
    /// The bootstrap connection's sending half; closing it tells the peer to destroy its queue
    /// pair, and a reset sends the teardown on it.
    pub bootstrap: Mutex<Option<tokio::net::tcp::OwnedWriteHalf>>,
    /// The task reading the peer's credit reports (and its teardown answer).
    pub reader: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Lane {
    /// The error of a broken lane.
    pub fn broken(&self) -> Option<FabricError> {
        self.state.lock().broken().cloned()
    }

    /// Marks the lane broken with `root` (first cause wins): no more posting on it, and the
    /// peer is told (by closing the bootstrap connection) to destroy its end. WRs still queued
    /// complete with flush errors, which resolve the batches waiting on them.
    pub fn mark_broken(&self, root: FabricError) {
        self.state.lock().mark_broken(root);
        drop(self.bootstrap.lock().take());
        self.slots.notify_waiters();
    }

    /// Whether the lane is broken and every signalled WR on it has completed (so nobody waits
    /// on its CQ any more and it can stop being polled). Final once true.
    pub fn drained(&self) -> bool {
        self.state.lock().drained()
    }

    /// The peer reports `reposted` receives re-posted in all.
    pub fn grant_credits(&self, reposted: u64) {
        self.state
            .lock()
            .grant_credits(u64::from(self.peer_recv_depth) + reposted);
        self.slots.notify_waiters();
    }

    /// Posts as many of `pieces` as the send queue and the receive credits allow, in doorbell
    /// groups of `per_doorbell`; the last posted piece is signalled and marked final (it ends
    /// the caller's chunk). Returns how many were posted, and why not more (0 posted means:
    /// wait for slots or credits).
    ///
    /// A failed `ibv_post_send` moves the queue pair to the error state, so that what was posted
    /// flushes and the lane drains, and forgets the WRs the NIC never got.
    pub fn post_some(
        &self,
        token: u64,
        pieces: &[(u32, WritePiece)],
        per_doorbell: usize,
    ) -> Result<(usize, Option<Blocked>), FabricError> {
        let has_imm: Vec<bool> = pieces.iter().map(|(_, p)| p.imm.is_some()).collect();
        let mut state = self.state.lock();
        // Broken check and reservation under one lock: see `verbs_lane_state` (V5).
        let wr_id = |i: usize, is_final: bool| {
            WrId {
                token,
                piece: pieces[i].0,
                is_final,
            }
            .encode()
        };
        let (grants, blocked) = state.reserve(&has_imm, wr_id)?;
        let n = grants.len();
        for group in doorbell_groups(n, per_doorbell) {
            let items: Vec<(WritePiece, u64, bool)> = group
                .clone()
                .map(|i| (pieces[i].1, wr_id(i, i + 1 == n), grants[i].signalled))
                .collect();
            let mut chain = SendChain::new(&items);
            // SAFETY: every piece was resolved against a live registration of this fabric's
            // protection domain (lkey and bounds checked in `resolve`); the write's batch entry
            // keeps that registration alive until the WR completed (`verbs_batch`), and after a
            // deregistration the NIC no longer touches the memory.
            let posted = unsafe { self.qp.post_send(&mut chain) };
            if let Err(failure) = posted {
                let sent = group.start + failure.posted;
                let unposted_imms = has_imm[sent..n].iter().filter(|&&i| i).count() as u64;
                state.unreserve(n - sent, unposted_imms);
                let err = FabricError::Disconnected {
                    peer: self.peer.clone(),
                    lane: self.index,
                    detail: format!("{} ({sent} of {n} WRs were posted)", failure.error),
                };
                state.mark_broken(err.clone());
                drop(state);
                if let Err(e) = self.qp.modify(&to_error(), "->ERR after a failed post") {
                    tracing::warn!(peer = %self.peer, lane = self.index, error = %e,
                        "moving a lane to the error state failed");
                }
                drop(self.bootstrap.lock().take());
                self.slots.notify_waiters();
                return Err(err);
            }
        }
        Ok((n, blocked))
    }
}

/// What the progress thread does with a queue pair's completions.
#[derive(Debug, Clone)]
pub enum Role {
    /// Our writer lane: send completions.
    Writer(Arc<Lane>),
    /// A peer's lane into us: WRITE_WITH_IMM receive completions, and the credits to report.
    Receiver(Arc<ReceiveCredits>),
}

/// A queue pair the progress thread polls.
#[derive(Debug, Clone)]
pub struct Polled {
    /// The queue pair (its CQ is polled).
    pub qp: Arc<VerbsQp>,
    /// What it is.
    pub role: Role,
}

/// What the polled set needs of an entry (a [`Polled`]; tests use plain data).
pub trait PolledEntry: Clone {
    /// Its queue pair number.
    fn qp_num(&self) -> u32;
    /// Whether it is a writer lane that is drained (nothing will complete on it any more).
    fn drained(&self) -> bool;
}

impl PolledEntry for Polled {
    fn qp_num(&self) -> u32 {
        self.qp.qp_num()
    }

    fn drained(&self) -> bool {
        match &self.role {
            Role::Writer(lane) => lane.drained(),
            Role::Receiver(_) => false,
        }
    }
}

/// The set of polled queue pairs, with a generation so the progress thread re-reads it only when
/// it changed.
#[derive(Debug)]
pub struct PolledSet<P = Polled> {
    inner: RwLock<(u64, Vec<P>)>,
}

impl<P> Default for PolledSet<P> {
    fn default() -> Self {
        PolledSet {
            inner: RwLock::new((0, Vec::new())),
        }
    }
}

impl<P: PolledEntry> PolledSet<P> {
    /// Removes every drained writer lane (a lane broken by a reset or a cut with nothing
    /// outstanding produces no completion that would remove it). Returns how many.
    pub fn remove_drained(&self) -> usize {
        let mut g = self.inner.write();
        let before = g.1.len();
        g.1.retain(|p| !p.drained());
        let removed = before - g.1.len();
        if removed > 0 {
            g.0 += 1;
        }
        removed
    }

    /// Number of polled queue pairs.
    pub fn len(&self) -> usize {
        self.inner.read().1.len()
    }

    /// Whether nothing is polled.
    pub fn is_empty(&self) -> bool {
        self.inner.read().1.is_empty()
    }

    /// Adds a queue pair.
    pub fn add(&self, p: P) {
        let mut g = self.inner.write();
        g.0 += 1;
        g.1.push(p);
    }

    /// Removes the queue pair with number `qp_num`.
    pub fn remove(&self, qp_num: u32) {
        let mut g = self.inner.write();
        g.0 += 1;
        g.1.retain(|p| p.qp_num() != qp_num);
    }

    /// The current generation.
    pub fn generation(&self) -> u64 {
        self.inner.read().0
    }

    /// A snapshot and its generation.
    pub fn snapshot(&self) -> (u64, Vec<P>) {
        let g = self.inner.read();
        (g.0, g.1.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone)]
    struct Entry {
        qp: u32,
        drained: bool,
    }

    impl PolledEntry for Entry {
        fn qp_num(&self) -> u32 {
            self.qp
        }
        fn drained(&self) -> bool {
            self.drained
        }
    }

    /// V18: lanes broken by a reset or a cut with nothing outstanding never produce a
    /// completion; a sweep must still stop polling them.
    #[test]
    fn drained_lanes_leave_the_polled_set_without_a_completion() {
        let set: PolledSet<Entry> = PolledSet::default();
        set.add(Entry {
            qp: 1,
            drained: false,
        });
        set.add(Entry {
            qp: 2,
            drained: true,
        });
        set.add(Entry {
            qp: 3,
            drained: true,
        });
        let g = set.generation();
        assert_eq!(set.remove_drained(), 2);
        assert_eq!(set.len(), 1);
        assert_ne!(
            set.generation(),
            g,
            "the progress thread must re-read the set"
        );
        assert_eq!(set.snapshot().1[0].qp, 1);
        assert_eq!(set.remove_drained(), 0);
    }
}
