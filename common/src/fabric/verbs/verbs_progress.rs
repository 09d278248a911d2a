//! The progress thread: polls every queue pair's CQ, completes write futures, counts immediates.
//!
//! RDMA completes work without the CPU, but somebody has to read the completion queues: send
//! completions tell writers that their bytes are acknowledged (and free send-queue slots), and
//! receive completions of WRITE_WITH_IMM carry the immediates the [`ImmCounter`] counts. One
//! dedicated thread polls all CQs of the fabric, so neither the async runtime nor the caller
//! spins. It busy-polls while completions flow and backs off to short sleeps when idle, trading
//! a few tens of microseconds of first-completion latency for not burning a core between syncs.
//!
//! Every receive completion re-posts a receive on the same queue pair right away (batched per
//! poll), so the receive queue never runs dry while the peer keeps writing: no RNR NAKs in steady
//! state, and `rnr_retry` only has to cover a peer that stopped polling.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::super::imm_counter::ImmCounter;
use super::verbs_batch::BatchTable;
use super::verbs_completion::{is_flush, status_error, status_name, PieceTarget, WrId};
use super::verbs_lane::{Lane, PolledSet, Role};
use super::verbs_qp::VerbsQp;

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
}

impl Progress {
    /// Starts the thread.
    pub fn spawn(self) -> std::io::Result<std::thread::JoinHandle<()>> {
        std::thread::Builder::new()
            .name("weightsync-verbs-progress".into())
            .spawn(move || self.run())
    }

    fn run(self) {
        let mut wcs = vec![ffi::ibv_wc::default(); 64];
        let (mut generation, mut set) = self.polled.snapshot();
        let mut idle: u32 = 0;
        while !self.shutdown.load(Ordering::Acquire) {
            if self.polled.generation() != generation {
                (generation, set) = self.polled.snapshot();
            }
            let mut progressed = false;
            for p in &set {
                loop {
                    let n = match p.qp.cq().poll(&mut wcs) {
                        Ok(n) => n,
                        Err(e) => {
                            tracing::warn!(qp = p.qp.qp_num(), error = %e, "polling a CQ failed");
                            0
                        }
                    };
                    if n == 0 {
                        break;
                    }
                    progressed = true;
                    match &p.role {
                        Role::Writer(lane) => self.on_send_completions(lane, &wcs[..n]),
                        Role::Receiver => self.on_recv_completions(&p.qp, &wcs[..n]),
                    }
                    if n < wcs.len() {
                        break;
                    }
                }
            }
            if progressed {
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
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
                    let recorded = lane.sq.lock().complete_oldest_signalled();
                    if recorded != Some(wc.wr_id()) {
                        tracing::debug!(
                            ?recorded,
                            got = wc.wr_id(),
                            "send completion out of the recorded order"
                        );
                    }
                    if id.is_final {
                        self.batches.lane_done(id.token);
                    }
                }
                Some((status, vendor_err)) => {
                    {
                        // Error completions come for unsignalled WRs too; retire the
                        // bookkeeping entry only if this one was signalled.
                        let mut sq = lane.sq.lock();
                        if sq.oldest_signalled() == Some(wc.wr_id()) {
                            sq.complete_oldest_signalled();
                        }
                    }
                    let flushed = is_flush(status);
                    let error = if flushed {
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
                        .piece_failed(id.token, id.piece, id.is_final, error, flushed);
                }
            }
        }
        if lane.drained() {
            // Every waiter on this broken lane has its answer; its replacement is polled
            // instead.
            self.polled.remove(lane.qp.qp_num());
        }
        lane.slots.notify_waiters();
    }

    fn on_recv_completions(&self, qp: &Arc<VerbsQp>, wcs: &[ffi::ibv_wc]) {
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
            if let Err(e) = qp.post_recvs(consumed) {
                tracing::warn!(qp = qp.qp_num(), error = %e, "re-posting receives failed");
            }
        }
    }
}
