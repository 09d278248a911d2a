//! The write window of a verbs receiver, enforced by the NIC: a receiving queue pair grants
//! remote write only while a sync is armed.
//!
//! # Why in the queue pair
//! A one-sided RDMA WRITE never reaches the receiver's CPU: the NIC checks the rkey, the bounds
//! and the region's access and places the bytes. So the TCP backend's per-frame check
//! ([`WriteWindow`] in `tcp::registry`) has no place to run here. What the NIC does check on
//! every request is the *queue pair's* own access flags: an RC responder whose queue pair lacks
//! `IBV_ACCESS_REMOTE_WRITE` refuses an RDMA WRITE with a NAK before placing a byte, whatever
//! rkey it names. A receiver therefore closes its window by modifying every inbound queue pair
//! (those peers write through into this process's regions) RTS → RTS with only
//! `IBV_QP_ACCESS_FLAGS` in the mask, dropping remote write, and arms it by restoring it
//! ([`set_remote_write`]; the kernel's transition table allows exactly this, see
//! `verbs_qp_attr`). A queue pair connected while the window is closed comes up without remote
//! write from INIT on ([`InboundWindow::admit`]). The memory regions keep their access (their
//! rkeys stay valid; re-registering per sync would cost a pin and a translation-table rewrite).
//!
//! # What a refusal looks like, and how it is counted
//! The refused write's queue pair goes to the error state on both sides. The writer sees a NAK
//! completion: providers that follow the IBA's rule for an opcode the queue pair does not enable
//! answer *Invalid Request* (rdmavt's `nack_inv`, Soft-RoCE's `RESPST_ERR_UNSUPPORTED_OPCODE` →
//! `AETH_NAK_INVALID_REQ`: `IBV_WC_REM_INV_REQ_ERR`), others *Remote Access Error*
//! (`IBV_WC_REM_ACCESS_ERR`, whose diagnosis then finds nothing wrong with the rkey and names
//! the window). The receiver gets the matching affiliated async event on its queue pair:
//! `IBV_EVENT_QP_REQ_ERR` ("invalid request local work queue error": the responder saw an
//! opcode the queue pair does not allow; NVIDIA's *RDMA Aware Programming User Manual*,
//! "Events") or `IBV_EVENT_QP_ACCESS_ERR` (the responder saw an access violation; same page,
//! and what a Soft-RoCE patch raises for rkey violations). Both are counted
//! ([`counts_as_outside_window`]) into `outside_window`, the name the TCP backend's counter
//! has, when they concern a listed inbound queue pair while the window is closed; while it is
//! armed they are ordinary refusals (a wrong rkey, a range outside the region) and only break
//! the lane. Either way the errored queue pair leaves the list (nothing passes it any more),
//! its lane is torn down as on every other queue-pair error (`verbs_async_events`), and the
//! writer's next write connects a fresh one, which again comes up with the window's access. A
//! device that raises neither event still refuses the write (nothing lands) but does not count
//! it: which event a given NIC raises is not documented per model, and the ignored device test
//! in `tests/tests/fabric_verbs.rs` checks refusal, count and bytes on hardware.
//!
//! # Ordering: no legitimate write meets a closed queue pair
//! The rollout driver (`agent/src/rollout.rs`) arms in its `Prepare` handler, and
//! [`InboundWindow::set`] returns only once every modify returned (or failed and its queue pair
//! was fenced), before the driver answers `Prepared`; the controller starts the trainers' writes
//! only when every rollout answered (`controller/src/coordinator/messages.rs`, `on_prepared`).
//! It closes once every immediate it expects was counted, i.e. after the last byte of every
//! write of the sync landed (immediates are counted only after their bytes), and `Verify` waits
//! for the close, so the verified bytes can no longer change. The calls are the ones the TCP
//! receiver already enforces frame by frame in every end-to-end test. A queue pair being
//! connected while the window changes is serialized with it: [`InboundWindow::admit`] holds the
//! window's read lock from choosing the INIT access until the queue pair is in RTS and listed,
//! and [`InboundWindow::set`] holds its write lock while it modifies the listed ones. What the
//! NIC cannot check is the epoch: within an armed window any peer holding a queue pair and an
//! rkey may write; a stale sync's write is still never *counted* (its immediate carries the old
//! epoch), as before.
//!
//! # Cost
//! One firmware command (`ibv_modify_qp`) per inbound queue pair per arm and per close: a
//! receiver has `lanes_per_peer` queue pairs per writer that writes to it in the plan (a
//! rollout fed by 8 trainer ranks over 4 lanes: 32 queue pairs, 64 commands per sync). A
//! modify is a system call into the driver and a command to the NIC's firmware: tens to a few
//! hundred microseconds each (an estimate, not measured here). The queue pairs are modified
//! from up to [`MAX_PARALLEL_MODIFIES`] threads at once (drivers keep several firmware
//! commands in flight), so 32 cost about as much as 4 in a row, roughly 0.1-1 ms per arm on the
//! sync's critical path (before `Prepared`); the close runs on the blocking pool while the
//! landing report travels to the controller, off the critical path unless `Verify` arrives
//! first. A window changed between two armed syncs (Armed → Armed) modifies nothing. None of
//! this has run on an RDMA device here: `tracing` logs each change's queue pairs and duration
//! at debug level, which is where a device run reads the real figure.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ibverbs_sys as ffi;
use parking_lot::{Mutex, RwLock};

use super::super::error::FabricError;
use super::super::tcp::WriteWindow;
use super::verbs_qp::VerbsQp;
use super::verbs_qp_attr::{RemoteWrite, set_remote_write, to_error};

/// At most this many threads modify queue pairs at once when a window opens or closes.
pub const MAX_PARALLEL_MODIFIES: usize = 8;

/// What the window needs of an inbound queue pair (a [`VerbsQp`]; the tests use a recording
/// stand-in).
pub trait InboundGate: Send + Sync {
    /// Its queue pair number.
    fn qp_num(&self) -> u32;
    /// Grants or withdraws remote write (RTS → RTS, access flags only).
    fn set_remote_write(&self, remote_write: RemoteWrite) -> Result<(), FabricError>;
    /// Moves it to the error state: nothing lands through it any more.
    fn fence(&self);
}

impl InboundGate for VerbsQp {
    fn qp_num(&self) -> u32 {
        VerbsQp::qp_num(self)
    }

    fn set_remote_write(&self, remote_write: RemoteWrite) -> Result<(), FabricError> {
        let what = match remote_write {
            RemoteWrite::On => "RTS->RTS +REMOTE_WRITE (arm)",
            RemoteWrite::Off => "RTS->RTS -REMOTE_WRITE (close)",
        };
        self.modify(&set_remote_write(remote_write), what)
    }

    fn fence(&self) {
        if let Err(e) = self.modify(&to_error(), "->ERR (write window not applied)") {
            tracing::warn!(qp = self.qp_num(), error = %e, "fencing a receiving queue pair");
        }
    }
}

/// The queue-pair access a window grants: remote write unless it is closed.
pub fn remote_write_of(window: WriteWindow) -> RemoteWrite {
    match window {
        WriteWindow::Closed => RemoteWrite::Off,
        WriteWindow::Always | WriteWindow::Armed { .. } => RemoteWrite::On,
    }
}

/// Whether an async event of `event_type` on a queue pair counts as a write refused outside the
/// window: a responder error (invalid request or access violation) on an inbound queue pair
/// while the window is closed.
pub fn counts_as_outside_window(
    event_type: ffi::ibv_event_type,
    inbound: bool,
    window: WriteWindow,
) -> bool {
    let responder_refusal = matches!(
        event_type,
        ffi::IBV_EVENT_QP_REQ_ERR | ffi::IBV_EVENT_QP_ACCESS_ERR
    );
    responder_refusal && inbound && remote_write_of(window) == RemoteWrite::Off
}

/// What one [`InboundWindow::set`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WindowChange {
    /// Queue pairs modified.
    pub modified: usize,
    /// Of them, those whose modify failed and that were moved to the error state instead (a
    /// queue pair already in error, or a device fault): their writers reconnect, and the fresh
    /// queue pair comes up with the window's access.
    pub fenced: usize,
}

/// The window and the inbound queue pairs it gates (one per verbs fabric).
pub struct InboundWindow<G: InboundGate = VerbsQp> {
    /// The window in force; read-locked while a queue pair is brought up, write-locked while
    /// the listed ones are modified.
    window: RwLock<WriteWindow>,
    inbound: Mutex<Vec<Arc<G>>>,
    outside_window: AtomicU64,
}

impl<G: InboundGate> std::fmt::Debug for InboundWindow<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboundWindow")
            .field("window", &*self.window.read())
            .field("inbound", &self.inbound.lock().len())
            .field("outside_window", &self.outside_window())
            .finish()
    }
}

impl<G: InboundGate> Default for InboundWindow<G> {
    fn default() -> Self {
        InboundWindow {
            window: RwLock::new(WriteWindow::Always),
            inbound: Mutex::new(Vec::new()),
            outside_window: AtomicU64::new(0),
        }
    }
}

impl<G: InboundGate> InboundWindow<G> {
    /// The window in force.
    pub fn window(&self) -> WriteWindow {
        *self.window.read()
    }

    /// Brings up an inbound queue pair: `connect` gets the access its INIT transition must
    /// grant and returns the queue pair once it is in RTS (plus whatever else the caller
    /// needs); the queue pair is then listed, so every later [`InboundWindow::set`] modifies
    /// it. The window cannot change in between.
    pub fn admit<T, E>(
        &self,
        connect: impl FnOnce(RemoteWrite) -> Result<(Arc<G>, T), E>,
    ) -> Result<(Arc<G>, T), E> {
        let window = self.window.read();
        let (gate, extra) = connect(remote_write_of(*window))?;
        self.inbound.lock().push(gate.clone());
        drop(window);
        Ok((gate, extra))
    }

    /// Forgets the inbound queue pair `qp_num` (its lane ended).
    pub fn remove(&self, qp_num: u32) {
        self.inbound.lock().retain(|g| g.qp_num() != qp_num);
    }

    /// Number of inbound queue pairs listed.
    pub fn inbound(&self) -> usize {
        self.inbound.lock().len()
    }

    /// Sets the window. When the access it grants changes, every listed queue pair is modified
    /// (from up to [`MAX_PARALLEL_MODIFIES`] threads) before this returns; one whose modify
    /// fails is fenced, so no queue pair is left granting more than the window says.
    pub fn set(&self, window: WriteWindow) -> WindowChange {
        let mut current = self.window.write();
        let before = remote_write_of(*current);
        *current = window;
        let access = remote_write_of(window);
        if access == before {
            return WindowChange::default();
        }
        let gates: Vec<Arc<G>> = self.inbound.lock().clone();
        let fenced = apply_parallel(&gates, access);
        drop(current);
        WindowChange {
            modified: gates.len(),
            fenced,
        }
    }

    /// Notes an async error event of `event_type` (one that moved a queue pair to the error
    /// state) on the queue pair `is_it` picks out; returns whether it was counted as a write
    /// refused outside the window. That needs it to be one of the listed inbound queue pairs
    /// (the list, not the progress thread's polled set, which drops a queue pair at its first
    /// flushed receive, maybe before the event is read). An errored queue pair carries no
    /// write again, so it is no longer gated: later window changes do not try to modify it.
    pub fn on_queue_pair_error(
        &self,
        event_type: ffi::ibv_event_type,
        is_it: impl Fn(&G) -> bool,
    ) -> bool {
        let window = self.window.read();
        let mut inbound = self.inbound.lock();
        let listed = inbound.len();
        inbound.retain(|g| !is_it(g));
        let counted = counts_as_outside_window(event_type, inbound.len() < listed, *window);
        drop(inbound);
        drop(window);
        if counted {
            self.outside_window.fetch_add(1, Ordering::Relaxed);
        }
        counted
    }

    /// Writes refused because the window was closed (one per refused queue pair: the first
    /// refused write errors it, and its writer reconnects before writing again).
    pub fn outside_window(&self) -> u64 {
        self.outside_window.load(Ordering::Relaxed)
    }
}

/// Gives every gate `access`, from up to [`MAX_PARALLEL_MODIFIES`] threads; fences those whose
/// modify failed and returns how many.
fn apply_parallel<G: InboundGate>(gates: &[Arc<G>], access: RemoteWrite) -> usize {
    let apply = |chunk: &[Arc<G>]| -> usize {
        let mut fenced = 0;
        for gate in chunk {
            if let Err(e) = gate.set_remote_write(access) {
                tracing::warn!(qp = gate.qp_num(), error = %e, ?access,
                    "changing a receiving queue pair's access failed; fencing it");
                gate.fence();
                fenced += 1;
            }
        }
        fenced
    };
    if gates.len() <= 1 {
        return apply(gates);
    }
    let per_thread = gates.len().div_ceil(MAX_PARALLEL_MODIFIES);
    std::thread::scope(|scope| {
        let workers: Vec<_> = gates
            .chunks(per_thread)
            .map(|chunk| scope.spawn(move || apply(chunk)))
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .sum()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inbound queue pair that records what was done to it.
    #[derive(Debug)]
    struct Recording {
        qp: u32,
        remote_write: Mutex<RemoteWrite>,
        modifies: AtomicU64,
        fenced: std::sync::atomic::AtomicBool,
        fail: bool,
    }

    impl Recording {
        fn new(qp: u32, remote_write: RemoteWrite) -> Arc<Recording> {
            Arc::new(Recording {
                qp,
                remote_write: Mutex::new(remote_write),
                modifies: AtomicU64::new(0),
                fenced: Default::default(),
                fail: false,
            })
        }
    }

    impl InboundGate for Recording {
        fn qp_num(&self) -> u32 {
            self.qp
        }
        fn set_remote_write(&self, remote_write: RemoteWrite) -> Result<(), FabricError> {
            self.modifies.fetch_add(1, Ordering::SeqCst);
            if self.fail {
                return Err(FabricError::Unsupported("modify failed".into()));
            }
            *self.remote_write.lock() = remote_write;
            Ok(())
        }
        fn fence(&self) {
            self.fenced.store(true, Ordering::SeqCst);
        }
    }

    fn admit(w: &InboundWindow<Recording>, qp: u32) -> Arc<Recording> {
        w.admit(|access| Ok::<_, ()>((Recording::new(qp, access), ())))
            .unwrap()
            .0
    }

    #[test]
    fn closing_modifies_every_inbound_queue_pair_and_arming_restores_them() {
        let w = InboundWindow::<Recording>::default();
        let qps: Vec<_> = (0..20).map(|i| admit(&w, i)).collect();
        assert!(
            qps.iter()
                .all(|q| *q.remote_write.lock() == RemoteWrite::On),
            "unguarded by default"
        );
        let change = w.set(WriteWindow::Closed);
        assert_eq!(
            change,
            WindowChange {
                modified: 20,
                fenced: 0
            }
        );
        for q in &qps {
            assert_eq!(*q.remote_write.lock(), RemoteWrite::Off, "qp {}", q.qp);
            assert_eq!(q.modifies.load(Ordering::SeqCst), 1, "one command each");
        }
        assert_eq!(w.set(WriteWindow::Armed { epoch: 3 }).modified, 20);
        assert!(
            qps.iter()
                .all(|q| *q.remote_write.lock() == RemoteWrite::On)
        );
        // Between two armed syncs, and closing twice, the access does not change: no commands.
        assert_eq!(
            w.set(WriteWindow::Armed { epoch: 4 }),
            WindowChange::default()
        );
        w.set(WriteWindow::Closed);
        assert_eq!(w.set(WriteWindow::Closed), WindowChange::default());
        assert!(qps.iter().all(|q| q.modifies.load(Ordering::SeqCst) == 3));
    }

    #[test]
    fn a_queue_pair_connected_while_closed_has_no_remote_write() {
        let w = InboundWindow::<Recording>::default();
        w.set(WriteWindow::Closed);
        let q = admit(&w, 7);
        assert_eq!(*q.remote_write.lock(), RemoteWrite::Off);
        assert_eq!(
            q.modifies.load(Ordering::SeqCst),
            0,
            "its INIT granted none"
        );
        w.set(WriteWindow::Armed { epoch: 1 });
        assert_eq!(*q.remote_write.lock(), RemoteWrite::On, "arming lists it");
        let armed = admit(&w, 8);
        assert_eq!(*armed.remote_write.lock(), RemoteWrite::On);
        w.remove(7);
        w.set(WriteWindow::Closed);
        assert_eq!(
            *q.remote_write.lock(),
            RemoteWrite::On,
            "a removed queue pair is no longer modified"
        );
        assert_eq!(*armed.remote_write.lock(), RemoteWrite::Off);
        assert_eq!(w.inbound(), 1);
    }

    #[test]
    fn a_failed_modify_fences_the_queue_pair() {
        let w = InboundWindow::<Recording>::default();
        let ok = admit(&w, 1);
        let bad = w
            .admit(|_| {
                Ok::<_, ()>((
                    Arc::new(Recording {
                        fail: true,
                        ..Arc::into_inner(Recording::new(2, RemoteWrite::On)).unwrap()
                    }),
                    (),
                ))
            })
            .unwrap()
            .0;
        let change = w.set(WriteWindow::Closed);
        assert_eq!(
            change,
            WindowChange {
                modified: 2,
                fenced: 1
            }
        );
        assert!(bad.fenced.load(Ordering::SeqCst));
        assert!(!ok.fenced.load(Ordering::SeqCst));
    }

    #[test]
    fn a_failed_connect_lists_nothing() {
        let w = InboundWindow::<Recording>::default();
        let r: Result<(Arc<Recording>, ()), &str> = w.admit(|_| Err("INIT->RTR failed"));
        assert!(r.is_err());
        assert_eq!(w.inbound(), 0);
    }

    #[test]
    fn a_responder_error_while_closed_counts_as_outside_the_window() {
        let w = InboundWindow::<Recording>::default();
        let error_on = |event, qp: u32| {
            admit(&w, qp);
            w.on_queue_pair_error(event, |g: &Recording| g.qp == qp)
        };
        // Unguarded and armed: ordinary refusals (a wrong rkey), not counted.
        assert!(!error_on(ffi::IBV_EVENT_QP_ACCESS_ERR, 1));
        w.set(WriteWindow::Armed { epoch: 2 });
        assert!(!error_on(ffi::IBV_EVENT_QP_ACCESS_ERR, 2));
        assert!(!error_on(ffi::IBV_EVENT_QP_REQ_ERR, 3));
        assert_eq!(w.outside_window(), 0);
        w.set(WriteWindow::Closed);
        assert!(error_on(ffi::IBV_EVENT_QP_ACCESS_ERR, 4));
        assert!(error_on(ffi::IBV_EVENT_QP_REQ_ERR, 5));
        // Not a refusal: not counted.
        assert!(!error_on(ffi::IBV_EVENT_QP_FATAL, 6));
        assert_eq!(w.outside_window(), 2);
        // Not an inbound queue pair (one of our writer lanes): not counted.
        assert!(
            !w.on_queue_pair_error(ffi::IBV_EVENT_QP_ACCESS_ERR, |g: &Recording| { g.qp == 99 })
        );
        assert_eq!(w.outside_window(), 2);
        // Errored queue pairs are no longer gated: the next arm modifies none of them.
        assert_eq!(w.inbound(), 0);
        let live = admit(&w, 7);
        assert_eq!(w.set(WriteWindow::Armed { epoch: 3 }).modified, 1);
        assert_eq!(*live.remote_write.lock(), RemoteWrite::On);
    }

    #[test]
    fn the_refusal_rule_needs_a_responder_error_an_inbound_queue_pair_and_a_closed_window() {
        use ffi::{IBV_EVENT_QP_ACCESS_ERR as ACCESS, IBV_EVENT_QP_REQ_ERR as REQ};
        let closed = WriteWindow::Closed;
        assert!(counts_as_outside_window(ACCESS, true, closed));
        assert!(counts_as_outside_window(REQ, true, closed));
        assert!(!counts_as_outside_window(ACCESS, false, closed));
        assert!(!counts_as_outside_window(
            ffi::IBV_EVENT_QP_FATAL,
            true,
            closed
        ));
        assert!(!counts_as_outside_window(
            ffi::IBV_EVENT_COMM_EST,
            true,
            closed
        ));
        for open in [WriteWindow::Always, WriteWindow::Armed { epoch: 9 }] {
            assert!(!counts_as_outside_window(ACCESS, true, open), "{open:?}");
            assert!(!counts_as_outside_window(REQ, true, open), "{open:?}");
        }
    }

    /// The window cannot change while a queue pair is being brought up: a `set` waits for the
    /// `admit` in progress, then modifies the new queue pair too.
    #[test]
    fn a_window_change_waits_for_a_connect_in_progress() {
        let w = Arc::new(InboundWindow::<Recording>::default());
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let connecting = {
            let w = w.clone();
            std::thread::spawn(move || {
                w.admit(|access| {
                    entered_tx.send(()).unwrap();
                    go_rx.recv().unwrap();
                    Ok::<_, ()>((Recording::new(9, access), ()))
                })
                .unwrap()
                .0
            })
        };
        entered_rx.recv().unwrap();
        let closing = {
            let w = w.clone();
            std::thread::spawn(move || w.set(WriteWindow::Closed))
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!closing.is_finished(), "set waits for the connect");
        go_tx.send(()).unwrap();
        let q = connecting.join().unwrap();
        assert_eq!(closing.join().unwrap().modified, 1);
        assert_eq!(*q.remote_write.lock(), RemoteWrite::Off);
    }
}
