//! [`PendingCopies`]: the events of asynchronous copies queued on memory that must not be
//! reused (rewritten, unmapped, freed, handed back) until they have completed.
//!
//! Why not cudarc's own tracking: it keeps one read and one write event per *allocation* and
//! only while the context tracks events in multi-stream mode, and it cannot see copies queued
//! through raw driver calls on a range (a mapped IPC arena, a borrowed tensor, part of a pinned
//! buffer). The owners of such memory record an event here after each copy and wait on them
//! before reuse, whatever mode the context is in.

use std::sync::Mutex;

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
        let event = stream.record_event(None)?;
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
            if let Err(err) = e.synchronize()
                && first.is_ok()
            {
                first = Err(err.into());
            }
        }
        first
    }
}
