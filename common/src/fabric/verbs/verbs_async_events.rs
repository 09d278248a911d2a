//! Asynchronous events of the device: port errors, fatal queue-pair and CQ errors, GID changes.
//!
//! The NIC reports some failures only here, not in any completion: a port that goes down shows up
//! per lane only as `RETRY_EXC_ERR` after the transport retries (about half a second per lane),
//! and a CQ overrun or a fatal QP error may leave waiters with nothing to poll. A small thread
//! reads the context's async events (its `async_fd` set non-blocking and polled with a timeout,
//! so the thread notices the fabric's shutdown), logs each, breaks the lanes it concerns
//! ([`event_effect`]) and acknowledges every event it read: `ibv_destroy_qp` / `ibv_destroy_cq`
//! wait until all events reported for that object are acknowledged. A responder error on a
//! receiving queue pair while the write window is closed is a write the NIC refused outside the
//! window: it is counted there (`verbs_window`) before the lane breaks as for any other error.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::verbs_device::VerbsContext;
use super::verbs_lane::{PolledSet, Role};
use super::verbs_qp_attr::to_error;
use super::verbs_window::InboundWindow;

/// What an async event means for the lanes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventEffect {
    /// The queue pair named by the event failed: break its lane.
    BreakQp,
    /// The CQ named by the event failed: break the lane of its queue pair.
    BreakCq,
    /// The port or the device failed: break every lane.
    BreakAll,
    /// Addressing changed (GID, LID, P_Key, subnet manager): warn; the cached GID is stale until
    /// the process restarts.
    Warn,
    /// Informational.
    Note,
}

/// The effect of an event of type `event_type`.
pub fn event_effect(event_type: ffi::ibv_event_type) -> EventEffect {
    match event_type {
        ffi::IBV_EVENT_QP_FATAL
        | ffi::IBV_EVENT_QP_REQ_ERR
        | ffi::IBV_EVENT_QP_ACCESS_ERR
        | ffi::IBV_EVENT_PATH_MIG_ERR => EventEffect::BreakQp,
        ffi::IBV_EVENT_CQ_ERR => EventEffect::BreakCq,
        ffi::IBV_EVENT_PORT_ERR | ffi::IBV_EVENT_DEVICE_FATAL => EventEffect::BreakAll,
        ffi::IBV_EVENT_GID_CHANGE
        | ffi::IBV_EVENT_LID_CHANGE
        | ffi::IBV_EVENT_PKEY_CHANGE
        | ffi::IBV_EVENT_SM_CHANGE
        | ffi::IBV_EVENT_CLIENT_REREGISTER => EventEffect::Warn,
        _ => EventEffect::Note,
    }
}

/// The libibverbs name of an event type.
fn event_name(event_type: ffi::ibv_event_type) -> String {
    // SAFETY: ibv_event_type_str returns a static string for any value.
    let p = unsafe { ffi::ibv_event_type_str(event_type) };
    if p.is_null() {
        return format!("event {event_type}");
    }
    // SAFETY: non-null static C string owned by libibverbs.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// Starts the thread reading `ctx`'s async events until `shutdown` is set.
pub fn spawn(
    ctx: Arc<VerbsContext>,
    polled: Arc<PolledSet>,
    window: Arc<InboundWindow>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    // SAFETY: the context is open (we hold its Arc); async_fd is a plain int field.
    let fd = unsafe { (*ctx.raw()).async_fd };
    // SAFETY: fcntl on a descriptor owned by the open context; only adds O_NONBLOCK.
    let rc = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK)
    };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    std::thread::Builder::new()
        .name("weightsync-verbs-events".into())
        .spawn(move || {
            while !shutdown.load(Ordering::Acquire) {
                let mut pfd = libc::pollfd {
                    fd,
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: pfd is one valid pollfd; 100 ms timeout.
                let ready = unsafe { libc::poll(&mut pfd, 1, 100) };
                if ready <= 0 {
                    continue;
                }
                // SAFETY: ibv_async_event is plain data; all-zero is a valid value.
                let mut event: ffi::ibv_async_event = unsafe { std::mem::zeroed() };
                // SAFETY: the context is open; event is a valid out-pointer. Non-blocking: no
                // event means -1 (EAGAIN).
                if unsafe { ffi::ibv_get_async_event(ctx.raw(), &mut event) } != 0 {
                    continue;
                }
                // Acknowledged before anything can drop a queue pair or CQ handle: destroying
                // one waits until every event reported for it is acknowledged, so a last `Arc`
                // dropped in `handle` before the ack would wait for this thread forever
                // (device review N7). `handle` compares the element only by address.
                let seen = event;
                // SAFETY: event came from ibv_get_async_event and is acknowledged exactly once.
                unsafe { ffi::ibv_ack_async_event(&mut event) };
                handle(&seen, &polled, &window);
            }
        })
}

fn handle(event: &ffi::ibv_async_event, polled: &PolledSet, window: &InboundWindow) {
    let kind = event.event_type;
    let name = event_name(kind);
    let effect = event_effect(kind);
    if matches!(effect, EventEffect::Warn | EventEffect::Note) {
        if effect == EventEffect::Warn {
            tracing::warn!(event = %name, "RDMA port addressing changed; the GID in use is \
                re-read only when the process restarts");
        } else {
            tracing::debug!(event = %name, "RDMA async event");
        }
        return; // no snapshot of the polled lanes: nothing of theirs is touched or dropped
    }
    let (_, set) = polled.snapshot();
    let affected: Vec<_> = match effect {
        EventEffect::BreakQp => {
            // SAFETY: for QP events the union holds the QP pointer.
            let qp = unsafe { event.element.qp };
            set.into_iter().filter(|p| p.qp.raw_ptr() == qp).collect()
        }
        EventEffect::BreakCq => {
            // SAFETY: for CQ events the union holds the CQ pointer.
            let cq = unsafe { event.element.cq };
            set.into_iter().filter(|p| p.qp.cq().raw() == cq).collect()
        }
        EventEffect::BreakAll | EventEffect::Warn | EventEffect::Note => set,
    };
    if effect == EventEffect::BreakQp {
        // SAFETY: for QP events the union holds the QP pointer (compared, never dereferenced).
        let qp = unsafe { event.element.qp };
        if window.on_queue_pair_error(kind, |inbound| inbound.raw_ptr() == qp) {
            tracing::warn!(event = %name, "a write outside the write window was refused by the \
                NIC (no sync armed); its lane is torn down");
        }
    }
    tracing::warn!(event = %name, lanes = affected.len(), "RDMA async event breaks lanes");
    for p in affected {
        if let Role::Writer(lane) = &p.role {
            lane.mark_broken(FabricError::Disconnected {
                peer: lane.peer.clone(),
                lane: lane.index,
                detail: format!("device event: {name}"),
            });
        }
        // Flushes whatever is outstanding, so waiters are answered and the lane drains.
        if let Err(e) = p.qp.modify(&to_error(), "->ERR after an async event") {
            tracing::debug!(error = %e, "moving a queue pair to the error state failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// V15: fatal queue-pair, CQ, port and device events break lanes; addressing changes warn.
    #[test]
    fn events_map_to_their_effect_on_lanes() {
        assert_eq!(event_effect(ffi::IBV_EVENT_QP_FATAL), EventEffect::BreakQp);
        assert_eq!(
            event_effect(ffi::IBV_EVENT_QP_ACCESS_ERR),
            EventEffect::BreakQp
        );
        assert_eq!(event_effect(ffi::IBV_EVENT_CQ_ERR), EventEffect::BreakCq);
        assert_eq!(event_effect(ffi::IBV_EVENT_PORT_ERR), EventEffect::BreakAll);
        assert_eq!(
            event_effect(ffi::IBV_EVENT_DEVICE_FATAL),
            EventEffect::BreakAll
        );
        assert_eq!(event_effect(ffi::IBV_EVENT_GID_CHANGE), EventEffect::Warn);
        assert_eq!(event_effect(ffi::IBV_EVENT_PORT_ACTIVE), EventEffect::Note);
        assert_eq!(event_effect(ffi::IBV_EVENT_COMM_EST), EventEffect::Note);
        assert!(
            event_name(ffi::IBV_EVENT_PORT_ERR)
                .to_lowercase()
                .contains("port")
        );
    }
}
