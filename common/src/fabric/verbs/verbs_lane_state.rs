//! The state of one writer lane under one lock: send-queue slots, receive credits, and whether
//! the lane is broken.
//!
//! Why one lock: the progress thread stops polling a lane once it is broken and has no signalled
//! WR outstanding ([`LaneState::drained`]). If "broken" and "reserved" lived under separate locks,
//! a writer could pass the broken check, the progress thread could then mark the lane broken and
//! find it drained, and the writer would reserve and post WRs that flush into a CQ nobody polls:
//! its write would hang until the acknowledgement timeout. Here [`LaneState::reserve`] refuses a
//! broken lane and [`LaneState::mark_broken`] runs under the same lock, so once `drained()` is
//! true it stays true.

use super::super::error::FabricError;
use super::verbs_credits::ImmCredits;
use super::verbs_send_queue::{SendQueue, SlotGrant};

/// Why a reservation granted fewer WRs than asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// The send queue is full: wait for a signalled completion.
    Slots,
    /// The next WR carries an immediate and the peer has no receive left for it: wait for the
    /// peer's credit report.
    Credits,
}

/// Slots, credits and the broken flag of one lane.
#[derive(Debug, Clone)]
pub struct LaneState {
    sq: SendQueue,
    credits: ImmCredits,
    broken: Option<FabricError>,
    /// Set by the first error completion: whether it was a NAK (see `verbs_completion::classify`).
    first_failure_was_nak: Option<bool>,
}

impl LaneState {
    /// A lane with `send_depth` slots signalling every `signal_interval` WRs, towards a peer that
    /// posted `peer_recv_depth` receives.
    pub fn new(send_depth: u32, signal_interval: u32, peer_recv_depth: u32) -> LaneState {
        LaneState {
            sq: SendQueue::new(send_depth, signal_interval),
            credits: ImmCredits::new(peer_recv_depth),
            broken: None,
            first_failure_was_nak: None,
        }
    }

    /// Reserves slots for as many of the next WRs as fit, in order: `has_imm[i]` says whether WR
    /// `i` carries an immediate (and needs a receive credit). The last granted WR is signalled
    /// (it ends the caller's chunk). `wr_ids(i, is_last)` gives the wr_id of WR `i` (recorded
    /// for signalled ones). Refuses a broken lane with its error. An empty grant comes with the
    /// reason.
    pub fn reserve(
        &mut self,
        has_imm: &[bool],
        wr_ids: impl Fn(usize, bool) -> u64,
    ) -> Result<(Vec<SlotGrant>, Option<Blocked>), FabricError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let room = self.sq.free();
        let mut credits = self.credits.available();
        let mut n = 0;
        let mut blocked = None;
        for &imm in has_imm {
            if n == room {
                blocked = Some(Blocked::Slots);
                break;
            }
            if imm {
                if credits == 0 {
                    blocked = Some(Blocked::Credits);
                    break;
                }
                credits -= 1;
            }
            n += 1;
        }
        let imms = has_imm[..n].iter().filter(|&&i| i).count() as u64;
        self.credits.take(imms);
        Ok((self.sq.reserve(n, true, |i| wr_ids(i, i + 1 == n)), blocked))
    }

    /// The last `unposted` WRs of the latest reservation (`unposted_imms` of them with an
    /// immediate) were never handed to the NIC: forget their slots, signals and credits.
    pub fn unreserve(&mut self, unposted: usize, unposted_imms: u64) {
        self.sq.unreserve(unposted);
        self.credits.give_back(unposted_imms);
    }

    /// Marks the lane broken with `root` (first cause wins). Returns whether this call broke it.
    pub fn mark_broken(&mut self, root: FabricError) -> bool {
        if self.broken.is_some() {
            return false;
        }
        self.broken = Some(root);
        true
    }

    /// The error of a broken lane.
    pub fn broken(&self) -> Option<&FabricError> {
        self.broken.as_ref()
    }

    /// Broken, and every signalled WR completed: nobody waits on this lane's CQ any more, and no
    /// WR can be posted on it again.
    pub fn drained(&self) -> bool {
        self.broken.is_some() && self.sq.signalled_outstanding() == 0
    }

    /// The peer has posted `total` receives in all.
    pub fn grant_credits(&mut self, total: u64) {
        self.credits.grant_total(total);
    }

    /// Records an error completion; returns whether the queue pair's *first* failure was a NAK.
    pub fn record_failure(&mut self, is_nak: bool) -> bool {
        *self.first_failure_was_nak.get_or_insert(is_nak)
    }

    /// The send queue (completion bookkeeping).
    pub fn sq(&mut self) -> &mut SendQueue {
        &mut self.sq
    }

    /// Credits available now.
    pub fn credits_available(&self) -> u64 {
        self.credits.available()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::Endpoint;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::VecDeque;

    fn cut() -> FabricError {
        FabricError::Disconnected {
            peer: Endpoint("peer:1".into()),
            lane: 0,
            detail: "cut".into(),
        }
    }

    /// V5, the interleaving of the lost-completion race: a writer looked at the lane (not
    /// broken), then the progress thread marked it broken and found it drained (it stops polling
    /// the CQ), then the writer reserves. The reservation must be refused; WRs granted here would
    /// flush into a CQ nobody polls.
    #[test]
    fn a_lane_drained_by_the_progress_thread_takes_no_more_work_requests() {
        let mut lane = LaneState::new(16, 4, 16);
        // The writer's look: not broken.
        assert!(lane.broken().is_none());
        // The progress thread: the last error completion breaks the lane, nothing is outstanding.
        assert!(lane.mark_broken(cut()));
        assert!(
            lane.drained(),
            "nothing outstanding: the CQ stops being polled"
        );
        // The writer's reservation comes after that.
        let r = lane.reserve(&[false, true], |i, _| i as u64);
        assert!(r.is_err(), "a drained lane granted slots: {r:?}");
        assert!(lane.drained(), "drained must stay final");
    }

    /// V5: while a reservation's signalled WR is outstanding the lane is not drained, so the
    /// progress thread keeps polling until its completion arrives.
    #[test]
    fn a_reservation_keeps_the_lane_polled_until_its_completion() {
        let mut lane = LaneState::new(16, 4, 16);
        let (grants, blocked) = lane
            .reserve(&[false, false, true], |i, _| 10 + i as u64)
            .unwrap();
        assert_eq!((grants.len(), blocked), (3, None));
        assert!(grants[2].signalled, "the chunk's last WR is signalled");
        lane.mark_broken(cut());
        assert!(!lane.drained());
        assert_eq!(lane.sq().oldest_signalled(), Some(12));
        lane.sq().complete_oldest_signalled();
        assert!(lane.drained());
    }

    /// V8: a post that failed after `posted` WRs leaves no signalled entry of the WRs the NIC
    /// never got, so the lane drains once the posted ones flushed.
    #[test]
    fn unposted_work_requests_leave_no_bookkeeping() {
        let mut lane = LaneState::new(16, 2, 4);
        let (grants, _) = lane
            .reserve(&[false, true, false, true, true], |i, _| i as u64)
            .unwrap();
        assert_eq!(grants.len(), 5);
        assert_eq!(lane.credits_available(), 1);
        // ibv_post_send failed at WR 2: WRs 2..5 (two with immediates) never reached the NIC.
        lane.unreserve(3, 2);
        assert_eq!(lane.credits_available(), 3);
        lane.mark_broken(cut());
        // WR 1 was signalled (interval 2) and posted: its flush completes it.
        assert_eq!(lane.sq().signalled_outstanding(), 1);
        lane.sq().complete_oldest_signalled();
        assert!(
            lane.drained(),
            "entries of unposted WRs kept the lane from draining"
        );
        assert_eq!(lane.sq().outstanding(), 0);
    }

    #[test]
    fn first_failure_decides_what_later_flushes_mean() {
        let mut lane = LaneState::new(16, 4, 16);
        assert!(lane.record_failure(true));
        assert!(
            lane.record_failure(false),
            "the first failure (a NAK) decides"
        );
        let mut other = LaneState::new(16, 4, 16);
        assert!(!other.record_failure(false));
        assert!(!other.record_failure(true));
    }

    /// V4: a writer streaming WRITE_WITH_IMMs at a peer with 8 receives, whose progress thread
    /// re-posts late and whose credit reports arrive later still, never finds the peer's receive
    /// queue empty (no RNR), and still delivers everything. Seeded random interleavings of the
    /// writer, the NIC, the peer's progress thread and the credit channel.
    #[test]
    fn a_writer_within_its_credits_never_meets_rnr() {
        const RECV_DEPTH: u32 = 8;
        const WRITES: usize = 3_000;
        for seed in 0..20u64 {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut lane = LaneState::new(512, 128, RECV_DEPTH);
            let mut rq_posted = u64::from(RECV_DEPTH); // receives waiting in the peer's RQ
            let mut consumed = 0u64; // taken by a WRITE_WITH_IMM, not yet re-posted
            let mut reposted_total = 0u64;
            let mut reported: VecDeque<u64> = VecDeque::new(); // credit reports on the wire
            let mut wire: VecDeque<bool> = VecDeque::new(); // posted WRs (signalled?) not yet run
            let (mut posted, mut delivered) = (0usize, 0usize);
            let mut steps = 0;
            while delivered < WRITES {
                steps += 1;
                assert!(steps < 1_000_000, "seed {seed}: no progress (deadlock)");
                match rng.random_range(0..10) {
                    // The writer posts as much as it may (every WR carries an immediate).
                    0..=3 if posted < WRITES => {
                        let want = vec![true; (WRITES - posted).min(64)];
                        let (grants, _) = lane.reserve(&want, |i, _| i as u64).unwrap();
                        posted += grants.len();
                        wire.extend(grants.iter().map(|g| g.signalled));
                    }
                    // The NIC runs the oldest WR: it consumes a receive, or meets RNR.
                    4..=6 => {
                        if let Some(signalled) = wire.pop_front() {
                            assert!(
                                rq_posted > 0,
                                "seed {seed}: RNR after {delivered} writes: the writer had more \
                                 WRITE_WITH_IMMs out than the peer had receives"
                            );
                            rq_posted -= 1;
                            consumed += 1;
                            delivered += 1;
                            if signalled {
                                lane.sq().complete_oldest_signalled();
                            }
                        }
                    }
                    // The peer's progress thread wakes up (rarely) and re-posts what was consumed.
                    7 if rng.random_bool(0.3) => {
                        rq_posted += consumed;
                        reposted_total += consumed;
                        consumed = 0;
                        reported.push_back(reposted_total);
                    }
                    // A credit report arrives at the writer.
                    8 => {
                        if let Some(total) = reported.pop_front() {
                            lane.grant_credits(u64::from(RECV_DEPTH) + total);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}
