//! Where a sync spent its time: one event ([`TimelineEvent`], the protocol's own) per stage of
//! every task, per worker.
//!
//! The controller's dashboard draws one lane per worker with spans for H2D, prepare, WRITE and
//! barrier, and marks the critical path; for that it needs, for every stage of every task, when
//! it started, when it ended and how many bytes it moved. Times are nanoseconds since the start
//! of the sync on this worker ([`Timeline::started_unix_ns`] anchors them to the wall clock so the
//! controller can line workers up). Recording is a mutex-protected push (a few per task), far
//! below the cost of the stages themselves.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weightsync_common::protocol::{Stage, TimelineEvent};

/// The events of one sync on one worker.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timeline {
    /// The worker.
    pub worker: String,
    /// Wall-clock time of the sync's start on this worker, nanoseconds since the Unix epoch.
    pub started_unix_ns: u64,
    /// Events ordered by start time.
    pub events: Vec<TimelineEvent>,
}

impl Timeline {
    /// Wall time from the first start to the last end, in nanoseconds.
    pub fn span_ns(&self) -> u64 {
        let start = self.events.iter().map(|e| e.start_ns).min().unwrap_or(0);
        let end = self.events.iter().map(|e| e.end_ns).max().unwrap_or(0);
        end.saturating_sub(start)
    }

    /// Sum of the durations of every event of `stage` (time spent in it, overlaps counted twice).
    pub fn busy_ns(&self, stage: Stage) -> u64 {
        self.events
            .iter()
            .filter(|e| e.stage == stage)
            .map(TimelineEvent::duration_ns)
            .sum()
    }

    /// The events on another time axis of this worker: relative to the wall-clock instant
    /// `reference_unix_ns` (e.g. when its agent received `Prepare`), which must not be after the
    /// sync's start here (an earlier start would clamp to it).
    pub fn relative_to(&self, reference_unix_ns: u64) -> Vec<TimelineEvent> {
        let shift = self.started_unix_ns.saturating_sub(reference_unix_ns);
        self.events
            .iter()
            .map(|e| TimelineEvent {
                start_ns: shift + e.start_ns,
                end_ns: shift + e.end_ns,
                ..e.clone()
            })
            .collect()
    }

    /// Sum of the bytes of every event of `stage`.
    pub fn bytes(&self, stage: Stage) -> u64 {
        self.events
            .iter()
            .filter(|e| e.stage == stage)
            .map(|e| e.bytes)
            .sum()
    }
}

/// Records events of one sync; cheap to clone (clones share the events).
#[derive(Debug, Clone)]
pub struct TimelineRecorder {
    worker: Arc<str>,
    origin: Instant,
    started_unix_ns: u64,
    events: Arc<Mutex<Vec<TimelineEvent>>>,
}

impl TimelineRecorder {
    /// Starts the clock for a sync on `worker`.
    pub fn start(worker: &str) -> TimelineRecorder {
        let started_unix_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        TimelineRecorder {
            worker: worker.into(),
            origin: Instant::now(),
            started_unix_ns,
            events: Arc::default(),
        }
    }

    /// Nanoseconds since the sync started.
    pub fn now_ns(&self) -> u64 {
        self.origin.elapsed().as_nanos() as u64
    }

    /// Records a finished stage that started at `start_ns` (from [`now_ns`](Self::now_ns)) and
    /// ends now.
    pub fn record(&self, task: u32, piece: u32, stage: Stage, start_ns: u64, bytes: u64) {
        let end_ns = self.now_ns();
        self.events.lock().push(TimelineEvent {
            task,
            piece,
            stage,
            start_ns,
            end_ns,
            bytes,
        });
    }

    /// The events so far, ordered by start time.
    pub fn finish(&self) -> Timeline {
        let mut events = self.events.lock().clone();
        events.sort_by_key(|e| (e.start_ns, e.end_ns, e.task, e.piece, e.stage));
        Timeline {
            worker: self.worker.to_string(),
            started_unix_ns: self.started_unix_ns,
            events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_in_start_order_and_serialises() {
        let rec = TimelineRecorder::start("trainer-0");
        let t0 = rec.now_ns();
        let clone = rec.clone();
        clone.record(1, 0, Stage::Prepare, t0 + 5, 100);
        rec.record(0, 0, Stage::H2d, t0, 200);
        let tl = rec.finish();
        assert_eq!(tl.events.len(), 2);
        assert_eq!(tl.events[0].stage, Stage::H2d);
        assert!(tl.events.iter().all(|e| e.end_ns >= e.start_ns));
        assert_eq!(tl.bytes(Stage::H2d), 200);
        let json = serde_json::to_string(&tl).unwrap();
        assert!(json.contains("\"h2d\""), "{json}");
        let back: Timeline = serde_json::from_str(&json).unwrap();
        assert_eq!(back, tl);
    }
}
