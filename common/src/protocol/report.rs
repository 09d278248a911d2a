//! What a worker says about a sync it ran: its stages as timeline spans ([`Stage`],
//! [`TimelineEvent`]), the checksums of its write runs ([`RunChecksum`]), its totals
//! ([`WorkerReport`]) and where a trainer's wall went ([`TimeSplit`]).
//!
//! Why apart from the wire messages (`messages.rs`): this is a vocabulary, not a message. The
//! worker builds it, the controller stores and draws it, the CLI and benches print it, and the
//! messages carry it ([`FromWorker::Written`], `Landed`, ...); it is defined once so that no two
//! crates hold different things under one name.

use serde::{Deserialize, Serialize};
use std::fmt;

#[cfg(doc)]
use super::FromWorker;

/// A stage of a sync on one worker, drawn as a span on the dashboard's timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Source to staging copy.
    H2d,
    /// Gather / cast / fp8 quantisation into registered staging.
    Prepare,
    /// One-sided writes to rollouts.
    Write,
    /// Waiting until every destination confirmed its count.
    Barrier,
    /// Rollout: arming counters for the version.
    Arm,
    /// Rollout: waiting until every expected write landed.
    Land,
    /// Rollout: checksumming what landed.
    Verify,
    /// Trainer: refreshing its source for the version, where a source needs it before a sync
    /// (none of today's sources does: the demo rewrites its weights outside the sync).
    Source,
    /// Trainer: sending rows of a straddling fp8 block to the trainer that owns the block.
    GatherSend,
    /// Trainer: waiting for rows of a straddling fp8 block from other trainers.
    GatherWait,
    /// Engine: held (serving no requests) for a version. Reported by the engine itself with
    /// [`FromWorker::EngineStages`].
    Pause,
    /// Engine: loading the version through its own loading path (post-processing, repacking).
    /// Reported by the engine itself.
    Load,
    /// Engine: resuming after a version (finishing the update, resetting the prefix cache).
    /// Reported by the engine itself.
    Resume,
}

impl Stage {
    /// Lower-case name used in JSON and traces.
    pub const fn name(self) -> &'static str {
        match self {
            Stage::H2d => "h2d",
            Stage::Prepare => "prepare",
            Stage::Write => "write",
            Stage::Barrier => "barrier",
            Stage::Arm => "arm",
            Stage::Land => "land",
            Stage::Verify => "verify",
            Stage::Source => "source",
            Stage::GatherSend => "gather_send",
            Stage::GatherWait => "gather_wait",
            Stage::Pause => "pause",
            Stage::Load => "load",
            Stage::Resume => "resume",
        }
    }

    /// Every stage, in the order a sync meets them.
    pub const ALL: [Stage; 13] = [
        Stage::Source,
        Stage::Arm,
        Stage::H2d,
        Stage::Prepare,
        Stage::GatherSend,
        Stage::GatherWait,
        Stage::Write,
        Stage::Barrier,
        Stage::Land,
        Stage::Verify,
        Stage::Pause,
        Stage::Load,
        Stage::Resume,
    ];

    /// Whether an engine reports this stage itself ([`FromWorker::EngineStages`]) rather than
    /// the worker library recording it.
    pub const fn is_engine(self) -> bool {
        matches!(self, Stage::Pause | Stage::Load | Stage::Resume)
    }
}

impl std::str::FromStr for Stage {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Stage::ALL
            .into_iter()
            .find(|st| st.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Stage::ALL.iter().map(|st| st.name()).collect();
                format!("unknown stage {s:?} (expected one of {})", names.join(", "))
            })
    }
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One span of work (one stage of one task, or of one piece of a split task) on one worker
/// during a sync: what the worker library records and what a report carries. Times are
/// nanoseconds since a reference instant of the worker (the start of its sync in the worker
/// library; the instant it received `Prepare` in a report, which the controller places on its
/// own clock).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimelineEvent {
    /// Task index within the worker's slice ([`WHOLE_SYNC`] for whole-sync stages).
    pub task: u32,
    /// The piece of the task when the watermark split it (0 when it was not split).
    pub piece: u32,
    /// Which stage.
    pub stage: Stage,
    /// Start, ns since the worker's reference instant.
    pub start_ns: u64,
    /// End, ns since the worker's reference instant.
    pub end_ns: u64,
    /// Bytes the span moved or produced.
    pub bytes: u64,
}

impl TimelineEvent {
    /// Duration in nanoseconds.
    pub fn duration_ns(&self) -> u64 {
        self.end_ns.saturating_sub(self.start_ns)
    }
}

/// Task index of whole-sync events (the barrier, arming, verification, a source refresh, an
/// engine's pause, load and resume).
pub const WHOLE_SYNC: u32 = u32::MAX;

/// Most spans one [`FromWorker::EngineStages`] may carry, and most engine spans one worker's
/// lane of one sync may hold: an engine reports a handful per version, so more is a bug the
/// controller refuses rather than stores.
pub const MAX_ENGINE_STAGE_EVENTS: usize = 64;

/// The xxh3 of one write run: the bytes of one posted write, `[offset, offset + len)` of a
/// rollout's memory region. A trainer hashes what it prepared, a rollout what landed; both
/// sides, the report and the controller's `Verify` carry this one type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunChecksum {
    /// Destination rollout rank.
    pub rollout: u32,
    /// Memory region on that rank.
    pub mr: u16,
    /// Byte offset in the region.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// xxh3-64 of the bytes.
    pub xxh3: u64,
}

/// What a worker did during one sync.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct WorkerReport {
    /// Bytes written (trainer) or landed (rollout).
    pub bytes: u64,
    /// Writes posted (trainer) or counted (rollout).
    pub writes: u64,
    /// Peak staging bytes held at once (trainers).
    pub peak_staging_bytes: u64,
    /// Source bytes copied into staging before being written (trainers).
    pub staged_bytes: u64,
    /// Bytes written straight from registered source memory, copied by nobody but the fabric
    /// (trainers).
    pub direct_bytes: u64,
    /// Spans, in any order.
    pub events: Vec<TimelineEvent>,
    /// Checksums of prepared (trainer) or landed (rollout) units, when verification is on.
    pub checksums: Vec<RunChecksum>,
    /// Where the trainer's sync wall time went (zero for rollouts).
    pub split: TimeSplit,
    /// A trainer's runs written as deltas this sync, which the receivers apply (forwarded with
    /// `Verify`); empty in a full sync and for rollouts.
    pub deltas: Vec<super::DeltaRecord>,
    /// What the deltas came to: a trainer's encodings, a rollout's applies.
    pub delta: super::DeltaFigures,
}

/// Where one trainer's sync wall time went, measured inside its pipeline; the three parts add
/// up to `wall_ns` exactly.
///
/// The wall is the trainer's own run of the sync: from the pipeline starting its first piece to
/// its last write acknowledged (this worker's half of the barrier). Every instant of it is
/// charged to exactly one part, in this order of precedence:
/// - `wire_ns`: at least one of this trainer's writes is on the fabric (posted, not yet
///   acknowledged by its destination), whatever else happens meanwhile: the fabric is busy with
///   this trainer's bytes. Preparation hidden behind writes is counted here.
/// - `overhead_ns`: no write in flight and the trainer itself is working or between steps:
///   copying into staging (H2D), preparing (casts, fp8 quantisation), checksumming, splitting
///   pieces, spawning and scheduling piece jobs, building write lists: the per-piece and
///   per-task costs of getting bytes to the wire.
/// - `idle_ns`: no write in flight, no work running, and the trainer waits for something outside
///   itself: a watermark lease, the straddling fp8 rows other trainers gather into it.
///
/// Arming the rollouts and the control messages before and after a sync lie outside the wall;
/// the controller's stage durations and `after_landing_ms` cover them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TimeSplit {
    /// The trainer's sync wall time, ns.
    pub wall_ns: u64,
    /// Of the wall: some write on the fabric, ns.
    pub wire_ns: u64,
    /// Of the wall: waiting with nothing in flight and nothing to do, ns.
    pub idle_ns: u64,
    /// Of the wall: the trainer's own work with nothing in flight, ns.
    pub overhead_ns: u64,
}

impl TimeSplit {
    /// The sum of two splits (e.g. over trainers).
    pub fn plus(self, o: TimeSplit) -> TimeSplit {
        TimeSplit {
            wall_ns: self.wall_ns + o.wall_ns,
            wire_ns: self.wire_ns + o.wire_ns,
            idle_ns: self.idle_ns + o.idle_ns,
            overhead_ns: self.overhead_ns + o.overhead_ns,
        }
    }

    /// The four figures in seconds.
    pub fn seconds(&self) -> TimeSplitSeconds {
        let s = |ns: u64| ns as f64 / 1e9;
        TimeSplitSeconds {
            wall_s: s(self.wall_ns),
            wire_s: s(self.wire_ns),
            idle_s: s(self.idle_ns),
            overhead_s: s(self.overhead_ns),
        }
    }
}

/// A [`TimeSplit`] in seconds, as JSON reports show it.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TimeSplitSeconds {
    /// The trainer's sync wall time (`wire_s + idle_s + overhead_s`).
    pub wall_s: f64,
    /// Some write on the fabric.
    pub wire_s: f64,
    /// Waiting with nothing in flight and nothing to do.
    pub idle_s: f64,
    /// The trainer's own work with nothing in flight.
    pub overhead_s: f64,
}
