//! [`PendingCopies`]: the events of asynchronous copies queued on memory that must not be
//! reused (rewritten, unmapped, freed, handed back) until they have completed.
//!
//! Why not cudarc's own tracking: it keeps one read and one write event per *allocation* and
//! only while the context tracks events in multi-stream mode, and it cannot see copies queued
//! through raw driver calls on a range (a mapped IPC arena, a borrowed tensor, part of a pinned
//! buffer). The owners of such memory record an event here after each copy and wait on them
//! before reuse, whatever mode the context is in.
//!
//! Waits that guard a release never skip waiting on an error (device review N3): cudarc binds
//! the context first on every call and returns, and clears, any error an earlier `Drop`
//! recorded (a failed `free_async` or `cuEventDestroy`), *without* doing the call; so a wait
//! may return `Err` having waited for nothing, and a mapping closed or a lease reused after it
//! could still be read or written by a queued copy. [`synchronize_surely`] and [`wait_queued`]
//! retry until a call really ran, and report the first error.

use std::sync::Mutex;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};

use super::GpuError;

/// One event per stream (a later copy on a stream supersedes the earlier one there).
#[derive(Debug, Default)]
pub(crate) struct PendingCopies {
    events: Mutex<Vec<(usize, CudaEvent)>>,
}

impl PendingCopies {
    /// Records that a copy was just queued on `stream`.
    pub(crate) fn record(&self, stream: &CudaStream) -> Result<(), GpuError> {
        let event = stream.record_event(Some(WAIT_EVENT))?;
        let key = stream.cu_stream() as usize;
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        events.retain(|(k, _)| *k != key);
        events.push((key, event));
        Ok(())
    }

    /// Waits for every recorded copy; the first error, after waiting for all.
    pub(crate) fn wait(&self) -> Result<(), GpuError> {
        let events = std::mem::take(&mut *self.events.lock().unwrap_or_else(|p| p.into_inner()));
        let mut first = Ok(());
        for (_, e) in events {
            if let Err(err) = synchronize_surely(&e)
                && first.is_ok()
            {
                first = Err(err);
            }
        }
        first
    }
}

/// Events that something waits on block the waiting thread instead of spinning a core for the
/// whole copy (`cuEventSynchronize` otherwise follows the context's scheduling, and a torch
/// process's primary context usually spins: device review N11). cudarc takes one flag, so
/// these also keep timing, which costs nothing measurable per copy.
const WAIT_EVENT: CUevent_flags = CUevent_flags::CU_EVENT_BLOCKING_SYNC;

/// Calls before giving up on a wait that keeps failing (a stale error is cleared by the first
/// failing call; a sticky error fails every call, and then nothing runs on the context anyway).
const WAIT_TRIES: usize = 4;

/// Waits for `event`, again when a call failed (it may not have waited); the first error.
pub(crate) fn synchronize_surely(event: &CudaEvent) -> Result<(), GpuError> {
    let mut first: Option<GpuError> = None;
    for _ in 0..WAIT_TRIES {
        match event.synchronize() {
            Ok(()) => return first.map_or(Ok(()), Err),
            Err(e) => {
                first.get_or_insert(e.into());
            }
        }
    }
    Err(first.expect("at least one try"))
}

/// Waits for everything queued on `stream` so far (an event recorded now), recording again
/// when recording failed (it may not have recorded); the first error.
pub(crate) fn wait_queued(stream: &CudaStream) -> Result<(), GpuError> {
    let mut first: Option<GpuError> = None;
    for _ in 0..WAIT_TRIES {
        match stream.record_event(Some(WAIT_EVENT)) {
            Ok(event) => {
                let waited = synchronize_surely(&event);
                return match (first, waited) {
                    (Some(e), _) | (None, Err(e)) => Err(e),
                    (None, Ok(())) => Ok(()),
                };
            }
            Err(e) => {
                first.get_or_insert(e.into());
            }
        }
    }
    Err(first.expect("at least one try"))
}
