//! Send-queue slots and selective signalling of one queue pair, as pure bookkeeping.
//!
//! A send queue holds `depth` outstanding WRs; a slot is free again only once the WR completed,
//! and the application learns that only through a completion. Asking for a completion on every
//! WR costs the NIC a CQE write and the CPU a poll per WR, so we signal selectively: the last WR
//! of each chunk a write posts on the lane (its caller waits for it), plus one every `interval`
//! WRs so that long batches free slots as they go. A successful signalled completion retires every
//! earlier WR of the queue, because an RC queue completes in order.
//!
//! Invariant that keeps posting live: `interval <= depth / 2`, so whenever the queue is full at
//! least one signalled WR is outstanding and its completion will free slots.

use std::collections::VecDeque;

/// Slot accounting of one send queue.
#[derive(Debug, Clone)]
pub struct SendQueue {
    depth: u32,
    interval: u32,
    posted: u64,
    retired: u64,
    since_signal: u32,
    /// Sequence numbers (1-based count of WRs posted) of outstanding signalled WRs, oldest first,
    /// with the wr_id each carries.
    signalled: VecDeque<(u64, u64)>,
}

/// The signalling decision for one WR about to be posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotGrant {
    /// Ask for a completion on this WR.
    pub signalled: bool,
}

impl SendQueue {
    /// A queue of `depth` slots signalling at least every `interval` WRs.
    pub fn new(depth: u32, interval: u32) -> SendQueue {
        let depth = depth.max(2);
        SendQueue {
            depth,
            interval: interval.clamp(1, depth / 2),
            posted: 0,
            retired: 0,
            since_signal: 0,
            signalled: VecDeque::new(),
        }
    }

    /// Free slots now.
    pub fn free(&self) -> usize {
        (u64::from(self.depth) - (self.posted - self.retired)) as usize
    }

    /// WRs posted and not yet known complete.
    pub fn outstanding(&self) -> u64 {
        self.posted - self.retired
    }

    /// Reserves slots for up to `want` WRs (as many as are free) and decides which are signalled.
    /// `final_in_want` says whether the last of the `want` WRs ends the caller's share and must be
    /// signalled; it is signalled only if it fits in this reservation. `wr_ids(i)` gives the
    /// wr_id of the i-th reserved WR (recorded for signalled ones).
    pub fn reserve(
        &mut self,
        want: usize,
        final_in_want: bool,
        wr_ids: impl Fn(usize) -> u64,
    ) -> Vec<SlotGrant> {
        let n = want.min(self.free());
        let mut grants = Vec::with_capacity(n);
        for i in 0..n {
            self.since_signal += 1;
            let is_last_of_share = final_in_want && i + 1 == want;
            let signalled = is_last_of_share || self.since_signal >= self.interval;
            let seq = self.posted + i as u64 + 1;
            if signalled {
                self.since_signal = 0;
                self.signalled.push_back((seq, wr_ids(i)));
            }
            grants.push(SlotGrant { signalled });
        }
        self.posted += n as u64;
        grants
    }

    /// A signalled WR completed successfully: it and every WR before it are retired. Returns
    /// its wr_id as recorded (completions of one queue arrive in order, so it is the oldest).
    pub fn complete_oldest_signalled(&mut self) -> Option<u64> {
        let (seq, wr_id) = self.signalled.pop_front()?;
        self.retired = self.retired.max(seq);
        Some(wr_id)
    }

    /// The wr_id of the oldest outstanding signalled WR.
    pub fn oldest_signalled(&self) -> Option<u64> {
        self.signalled.front().map(|(_, id)| *id)
    }

    /// Signalled WRs not yet completed.
    pub fn signalled_outstanding(&self) -> usize {
        self.signalled.len()
    }

    /// The last `n` WRs reserved were never posted (the post failed before them): forget their
    /// slots and the signalled entries among them.
    pub fn unreserve(&mut self, n: usize) {
        let n = (n as u64).min(self.posted - self.retired);
        self.posted -= n;
        let posted = self.posted;
        self.signalled.retain(|(seq, _)| *seq <= posted);
    }

    /// The queue pair failed: forget everything outstanding and return the wr_ids of the
    /// signalled WRs that will never complete successfully (their batches must fail).
    pub fn fail_all(&mut self) -> Vec<u64> {
        self.retired = self.posted;
        self.since_signal = 0;
        self.signalled.drain(..).map(|(_, id)| id).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_of_share_and_every_interval_are_signalled() {
        let mut q = SendQueue::new(16, 4);
        let g = q.reserve(10, true, |i| i as u64);
        let flags: Vec<bool> = g.iter().map(|g| g.signalled).collect();
        assert_eq!(
            flags,
            vec![
                false, false, false, true, false, false, false, true, false, true
            ]
        );
        assert_eq!(q.outstanding(), 10);
        assert_eq!(q.free(), 6);
        // Completions arrive in order and retire everything before them.
        assert_eq!(q.signalled_outstanding(), 3);
        assert_eq!(q.oldest_signalled(), Some(3));
        assert_eq!(q.complete_oldest_signalled(), Some(3));
        assert_eq!(q.outstanding(), 6);
        assert_eq!(q.complete_oldest_signalled(), Some(7));
        assert_eq!(q.complete_oldest_signalled(), Some(9));
        assert_eq!(q.outstanding(), 0);
        assert_eq!(q.complete_oldest_signalled(), None);
    }

    #[test]
    fn a_full_queue_grants_only_free_slots_and_always_has_a_signal_outstanding() {
        let mut q = SendQueue::new(8, 100); // interval is clamped to depth/2 = 4
        let g = q.reserve(20, true, |_| 0);
        assert_eq!(g.len(), 8);
        // The final WR did not fit, so the last granted one is not "final"; but signals every 4
        // guarantee a completion will free slots.
        assert!(g[3].signalled && g[7].signalled);
        assert_eq!(q.free(), 0);
        assert!(q.reserve(1, true, |_| 0).is_empty());
        q.complete_oldest_signalled();
        assert_eq!(q.free(), 4);
        let g = q.reserve(1, true, |_| 0);
        assert!(g[0].signalled);
    }

    #[test]
    fn failure_returns_outstanding_signalled_ids_and_frees_the_queue() {
        let mut q = SendQueue::new(16, 8);
        q.reserve(3, true, |i| 100 + i as u64);
        q.reserve(2, true, |i| 200 + i as u64);
        assert_eq!(q.fail_all(), vec![102, 201]);
        assert_eq!(q.free(), 16);
        assert_eq!(q.outstanding(), 0);
    }

    #[test]
    fn signals_never_fall_behind_the_interval() {
        // Property: in any sequence of reservations, no run of unsignalled WRs reaches the
        // interval, so a full queue always has a signalled WR outstanding.
        let mut q = SendQueue::new(64, 8);
        let mut run = 0;
        for want in [1usize, 7, 3, 30, 2, 9, 5] {
            for g in q.reserve(want, want % 2 == 0, |_| 0) {
                if g.signalled {
                    run = 0;
                } else {
                    run += 1;
                    assert!(run < 8);
                }
            }
            while q.free() < 16 {
                q.complete_oldest_signalled().unwrap();
            }
        }
    }
}
