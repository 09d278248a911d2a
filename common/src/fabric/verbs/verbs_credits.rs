//! Receive credits: a writer never has more WRITE_WITH_IMMs outstanding than its peer has
//! receives posted.
//!
//! Every WRITE_WITH_IMM consumes one receive WR on the peer's queue pair; with none posted the
//! peer answers RNR NAK, the writer's queue pair stalls `min_rnr_timer` per retry and, once
//! `rnr_retry` is spent, fails. Send-queue slots do not prevent this: the send completion of a
//! WRITE_WITH_IMM comes with the peer's ACK, *before* the peer's progress thread has polled the
//! receive completion and re-posted the receive, so slots come back faster than receives do.
//!
//! So each writer lane counts receives explicitly. The peer announces its `recv_depth` in its
//! queue-pair endpoint (the receives it posted before answering), and its lane task reports the
//! running total of receives it re-posted since, over the lane's bootstrap connection
//! (`verbs_bootstrap::LaneMsg::Credit`). The writer may have posted at most
//! `recv_depth + reposted` WRITE_WITH_IMMs in total on that queue pair: each one that runs
//! consumes exactly one receive, and one that never ran (flushed) consumed none, so the count
//! is exact or errs on the safe side. A writer out of credits waits (like one out of send-queue
//! slots) instead of posting into an RNR. RNR therefore only happens when the peer's receives
//! vanish under a live connection; it stays a named error (`receiver not ready`).

/// The receiving side of one queue pair: how many receives its progress thread re-posted, and a
/// wake-up for the lane task that reports them to the writer.
#[derive(Debug, Default)]
pub struct ReceiveCredits {
    reposted: std::sync::atomic::AtomicU64,
    changed: tokio::sync::Notify,
}

impl ReceiveCredits {
    /// `n` more receives were posted (called by the progress thread after `ibv_post_recv`).
    pub fn reposted(&self, n: u64) {
        self.reposted
            .fetch_add(n, std::sync::atomic::Ordering::Release);
        // Stores a permit when the lane task is busy, so no report is lost; reports coalesce.
        self.changed.notify_one();
    }

    /// Receives re-posted in total since the queue pair was announced.
    pub fn total(&self) -> u64 {
        self.reposted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Resolves after the next [`reposted`](Self::reposted) (or at once if one is pending).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// The credit window of one writer lane (plain bookkeeping; the lane holds it under its lock).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImmCredits {
    /// Receives the peer has posted in total on its queue pair (initial depth + re-posted).
    granted: u64,
    /// WRITE_WITH_IMMs this lane has posted in total.
    used: u64,
}

impl ImmCredits {
    /// A window opened with the `peer_recv_depth` receives the peer posted before it answered.
    pub fn new(peer_recv_depth: u32) -> ImmCredits {
        ImmCredits {
            granted: u64::from(peer_recv_depth),
            used: 0,
        }
    }

    /// WRITE_WITH_IMMs that may be posted now.
    pub fn available(&self) -> u64 {
        self.granted.saturating_sub(self.used)
    }

    /// Records `n` WRITE_WITH_IMMs posted (the caller checked [`available`](Self::available)).
    pub fn take(&mut self, n: u64) {
        self.used += n;
    }

    /// Returns the credits of `n` WRITE_WITH_IMMs that were reserved but never posted.
    pub fn give_back(&mut self, n: u64) {
        self.used = self.used.saturating_sub(n);
    }

    /// The peer reports that it has posted `total` receives in all (reports may arrive late, or
    /// twice; the window only grows).
    pub fn grant_total(&mut self, total: u64) {
        self.granted = self.granted.max(total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_grows_with_reports_and_shrinks_with_use() {
        let mut c = ImmCredits::new(8);
        assert_eq!(c.available(), 8);
        c.take(8);
        assert_eq!(c.available(), 0);
        c.grant_total(12);
        assert_eq!(c.available(), 4);
        c.grant_total(10); // a stale report changes nothing
        assert_eq!(c.available(), 4);
        c.give_back(2);
        assert_eq!(c.available(), 6);
    }
}
