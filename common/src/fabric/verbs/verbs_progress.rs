//! The progress thread: polls every queue pair's CQ, completes write futures, counts immediates.
//!
//! RDMA completes work without the CPU, but somebody has to read the completion queues: send
//! completions tell writers that their bytes are acknowledged (and free send-queue slots), and
//! receive completions of WRITE_WITH_IMM carry the immediates the [`ImmCounter`] counts. One
//! dedicated thread polls all CQs of the fabric, so neither the async runtime nor the caller
//! spins.
//!
//! # Polling
//! Each round visits every CQ once and takes at most [`BATCHES_PER_ROUND`] batches of
//! [`BATCH`] completions from it before moving on ([`poll_round`]), so a CQ that keeps returning
//! full batches (a receiver under a stream of small WRITE_WITH_IMMs) cannot starve the others:
//! their receives are re-posted and their writers' slots freed within one round. While
//! completions flow the thread busy-polls; when a round finds nothing it yields 256 times, then
//! sleeps 20 µs per round, and after 4096 idle rounds 200 µs: a few tens (at worst hundreds) of
//! microseconds of first-completion latency after an idle spell, for not burning a core between
//! syncs. Idle rounds also sweep drained writer lanes out of the polled set.
//!
//! # Receives and credits
//! Every receive completion re-posts a receive on the same queue pair (batched per poll) and adds
//! to the queue pair's [`ReceiveCredits`], which its lane task reports to the writer. The writer
//! never has more WRITE_WITH_IMMs outstanding than receives were posted (`verbs_credits`), so a
//! late re-post (this thread asleep, or descheduled for milliseconds) only makes the writer wait
//! for credits; it never meets an RNR NAK. The wait is bounded by the write's acknowledgement
//! timeout, after which the write fails naming "receive credits".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::super::imm_counter::ImmCounter;
use super::verbs_batch::BatchTable;
use super::verbs_completion::{
    PieceTarget, WrId, classify, is_flush, is_nak, status_error, status_name,
};
use super::verbs_credits::ReceiveCredits;
use super::verbs_lane::{Lane, PolledSet, Role};
use super::verbs_qp::VerbsQp;

/// Completions taken from a CQ per poll.
pub const BATCH: usize = 64;
/// Polls of one CQ per round at most, before the next CQ's turn.
pub const BATCHES_PER_ROUND: usize = 4;

/// One round over `set`: polls each entry's CQ with `poll` (which fills the buffer and returns
/// how many completions it got) until it comes back short or [`BATCHES_PER_ROUND`] full batches
/// were taken, hands each batch to `handle`, and moves on. Returns whether anything completed.
pub fn poll_round<T>(
    set: &[T],
    wcs: &mut [ffi::ibv_wc],
    mut poll: impl FnMut(&T, &mut [ffi::ibv_wc]) -> usize,
    mut handle: impl FnMut(&T, &[ffi::ibv_wc]),
) -> bool {
    let mut progressed = false;
    for entry in set {
        for _ in 0..BATCHES_PER_ROUND {
            let n = poll(entry, wcs).min(wcs.len());
            if n == 0 {
                break;
            }
            progressed = true;
            handle(entry, &wcs[..n]);
            if n < wcs.len() {
                break;
            }
        }
    }
    progressed
}

/// What the progress thread works on.
#[derive(Debug, Clone)]
pub struct Progress {
    /// Queue pairs to poll.
    pub polled: Arc<PolledSet>,
    /// Write futures to complete.
    pub batches: Arc<BatchTable>,
    /// Immediates to count.
    pub imm: ImmCounter,
    /// Set to stop the thread.
    pub shutdown: Arc<AtomicBool>,
    /// Fault hook: while the clock (ms since `epoch`) is below this, the thread polls nothing
    /// (a descheduled receiver). 0: never.
    pub stalled_until_ms: Arc<AtomicU64>,
    /// The clock's origin for `stalled_until_ms`.
    pub epoch: Instant,
}

impl Progress {
    /// Starts the thread.
    pub fn spawn(self) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("weightsync-verbs-progress".into())
            .spawn(move || self.run())
    }

    fn run(self) {
        let mut wcs = vec![ffi::ibv_wc::default(); BATCH];
        let (mut generation, mut set) = self.polled.snapshot();
        let mut idle: u32 = 0;
        while !self.shutdown.load(Ordering::Acquire) {
            let stalled = self.stalled_until_ms.load(Ordering::Relaxed);
            if stalled != 0 && (self.epoch.elapsed().as_millis() as u64) < stalled {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            if self.polled.generation() != generation {
                (generation, set) = self.polled.snapshot();
            }
            let progressed = poll_round(
                &set,
                &mut wcs,
                |p, out| match p.qp.cq().poll(out) {
                    Ok(n) => n,
                    Err(e) => {
                        tracing::warn!(qp = p.qp.qp_num(), error = %e, "polling a CQ failed");
                        0
                    }
                },
                |p, batch| match &p.role {
                    Role::Writer(lane) => self.on_send_completions(lane, batch),
                    Role::Receiver(credits) => self.on_recv_completions(&p.qp, credits, batch),
                },
            );
            if progressed {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if idle.is_multiple_of(1024) {
                    self.polled.remove_drained();
                }
                if idle < 256 {
                    std::thread::yield_now();
                } else if idle < 4096 {
                    std::thread::sleep(Duration::from_micros(20));
                } else {
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }

    fn on_send_completions(&self, lane: &Arc<Lane>, wcs: &[ffi::ibv_wc]) {
        for wc in wcs {
            let id = WrId::decode(wc.wr_id());
            match wc.error() {
                None => {
                    let recorded = lane.state.lock().sq().complete_oldest_signalled();
                    if recorded != Some(wc.wr_id()) {
                        tracing::debug!(
                            ?recorded,
                            got = wc.wr_id(),
                            "send completion out of the recorded order"
                        );
                    }
                    if id.is_final {
                        self.batches.chunk_done(id.token);
                    }
                }
                Some((status, vendor_err)) => {
                    let first_failure_was_nak = {
                        // Error completions come for unsignalled WRs too; retire the
                        // bookkeeping entry only if this one was signalled.
                        let mut state = lane.state.lock();
                        if state.sq().oldest_signalled() == Some(wc.wr_id()) {
                            state.sq().complete_oldest_signalled();
                        }
                        state.record_failure(is_nak(status))
                    };
                    let cause = classify(status, first_failure_was_nak);
                    let error = if is_flush(status) {
                        lane.broken().unwrap_or_else(|| FabricError::Disconnected {
                            peer: lane.peer.clone(),
                            lane: lane.index,
                            detail: "work request flushed: the queue pair is in the error state"
                                .into(),
                        })
                    } else {
                        let target =
                            self.batches
                                .target(id.token, id.piece)
                                .unwrap_or(PieceTarget {
                                    peer: lane.peer.clone(),
                                    lane: lane.index,
                                    rkey: 0,
                                    lkey: 0,
                                    offset: 0,
                                    len: 0,
                                });
                        let err = status_error(status, vendor_err, &target);
                        tracing::warn!(
                            peer = %lane.peer,
                            lane = lane.index,
                            error = %err,
                            "write failed; the queue pair is in the error state"
                        );
                        err
                    };
                    lane.mark_broken(FabricError::Disconnected {
                        peer: lane.peer.clone(),
                        lane: lane.index,
                        detail: format!("queue pair failed: {error}"),
                    });
                    self.batches
                        .piece_failed(id.token, id.piece, id.is_final, error, cause);
                }
            }
        }
        if lane.drained() {
            // Every waiter on this broken lane has its answer, and nothing can be posted on it
            // any more (drained is final); its replacement is polled instead.
            self.polled.remove(lane.qp.qp_num());
        }
        lane.slots.notify_waiters();
    }

    fn on_recv_completions(
        &self,
        qp: &Arc<VerbsQp>,
        credits: &ReceiveCredits,
        wcs: &[ffi::ibv_wc],
    ) {
        let mut consumed = 0;
        let mut dead = false;
        for wc in wcs {
            match wc.error() {
                None => {
                    consumed += 1;
                    // Only a WRITE_WITH_IMM consumes a receive on our queue pairs; its completion
                    // is generated after the whole payload was placed in memory.
                    if let Some(raw) = wc.imm_data() {
                        self.imm.record_arrival(u32::from_be(raw));
                    }
                }
                Some((status, _)) => {
                    dead = true;
                    if !is_flush(status) {
                        tracing::warn!(
                            qp = qp.qp_num(),
                            status = %status_name(status),
                            "receive completion failed; the peer's lane is gone"
                        );
                    }
                }
            }
        }
        if dead {
            // The writer will reconnect with a fresh queue pair; stop polling this one. Its
            // bootstrap task drops it when the writer's connection closes.
            self.polled.remove(qp.qp_num());
            return;
        }
        if consumed > 0 {
            match qp.post_recvs(consumed) {
                Ok(()) => credits.reposted(consumed as u64),
                Err(e) => {
                    tracing::warn!(qp = qp.qp_num(), error = %e, "re-posting receives failed")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// V7: a CQ that always returns full batches must not keep the thread: within one round
    /// every CQ is polled, and the busy one at most `BATCHES_PER_ROUND` times.
    #[test]
    fn a_busy_cq_does_not_starve_the_others() {
        // CQ 0 has a hundred full batches; CQs 1 and 2 have 3 completions each.
        let left = RefCell::new([100 * BATCH, 3, 3]);
        let polls = RefCell::new(Vec::new());
        let mut wcs = vec![ffi::ibv_wc::default(); BATCH];
        let set = [0usize, 1, 2];
        let mut handled = [0usize; 3];
        let progressed = poll_round(
            &set,
            &mut wcs,
            |&cq, out| {
                polls.borrow_mut().push(cq);
                let mut left = left.borrow_mut();
                let n = left[cq].min(out.len());
                left[cq] -= n;
                n
            },
            |&cq, batch| handled[cq] += batch.len(),
        );
        assert!(progressed);
        let polls = polls.into_inner();
        assert_eq!(
            polls.iter().filter(|&&cq| cq == 0).count(),
            BATCHES_PER_ROUND,
            "the busy CQ was polled beyond its share: {polls:?}"
        );
        assert_eq!(handled, [BATCHES_PER_ROUND * BATCH, 3, 3]);
        // An idle round reports no progress.
        let idle = poll_round(&set[1..], &mut wcs, |_, _| 0, |_, _| unreachable!());
        assert!(!idle);
    }
}
