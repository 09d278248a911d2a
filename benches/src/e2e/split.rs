//! Where each trainer's sync went: the worker's [`TimeSplit`] (wire, idle, overhead) per trainer
//! and summed, for the median weightsync sync of a run.
//!
//! Why beside `ratio_vs_fabric`: that ratio says how much of the fabric's rate a sync keeps, the
//! split says where the rest went. `wire_gbps` (a trainer's bytes over its wire time) set against
//! the fabric limit's rate tells a wire that is busy but under-used (small writes, few in flight:
//! see `mean_writes_in_flight`) from one that is simply not busy (idle, overhead).

use serde::Serialize;
use weightsync_common::protocol::{Stage, TimeSplit, TimeSplitSeconds};
use weightsync_worker::SyncReport;

/// One trainer's part of one sync.
#[derive(Debug, Clone, Serialize)]
pub struct TrainerSplit {
    /// Training rank.
    pub trainer: u32,
    /// The trainer's sync wall time, seconds (`wire_s + idle_s + overhead_s`).
    pub wall_s: f64,
    /// Some write of this trainer on the fabric, seconds.
    pub wire_s: f64,
    /// Waiting (a watermark lease, gathered rows) with nothing in flight, seconds.
    pub idle_s: f64,
    /// The trainer's own work (staging, preparing, checksums, scheduling) with nothing in
    /// flight, seconds.
    pub overhead_s: f64,
    /// Bytes written.
    pub bytes: u64,
    /// Writes posted.
    pub writes: u64,
    /// Pieces run.
    pub pieces: u64,
    /// Writes in flight on average during `wire_s`.
    pub mean_writes_in_flight: f64,
    /// `bytes` over `wire_s`, GB/s: the rate while the wire was busy with this trainer.
    pub wire_gbps: f64,
    /// Time spent copying into staging (H2D), summed over pieces, seconds (overlaps the wire
    /// or falls in `overhead_s`).
    pub h2d_busy_s: f64,
    /// Time spent preparing (casts, fp8) and checksumming, summed over pieces, seconds.
    pub prepare_busy_s: f64,
    /// Source bytes that went through staging (copied into it and prepared there).
    pub staged_bytes: u64,
    /// Source bytes written straight from registered source memory (zero copy).
    pub direct_bytes: u64,
}

impl TrainerSplit {
    /// From a trainer's report.
    pub fn of(trainer: u32, r: &SyncReport) -> TrainerSplit {
        let TimeSplitSeconds {
            wall_s,
            wire_s,
            idle_s,
            overhead_s,
        } = r.split.seconds();
        TrainerSplit {
            trainer,
            wall_s,
            wire_s,
            idle_s,
            overhead_s,
            bytes: r.bytes_written,
            writes: r.writes_posted,
            pieces: r.pieces,
            mean_writes_in_flight: r.mean_writes_in_flight,
            wire_gbps: if wire_s > 0.0 {
                r.bytes_written as f64 / wire_s / 1e9
            } else {
                0.0
            },
            h2d_busy_s: r.timeline.busy_ns(Stage::H2d) as f64 / 1e9,
            prepare_busy_s: r.timeline.busy_ns(Stage::Prepare) as f64 / 1e9,
            staged_bytes: r.staged_bytes,
            direct_bytes: r.direct_bytes,
        }
    }

    fn time_split(&self) -> TimeSplit {
        let ns = |s: f64| (s * 1e9).round() as u64;
        TimeSplit {
            wall_ns: ns(self.wall_s),
            wire_ns: ns(self.wire_s),
            idle_ns: ns(self.idle_s),
            overhead_ns: ns(self.overhead_s),
        }
    }
}

/// The split of one sync: per trainer and summed over trainers.
#[derive(Debug, Clone, Serialize)]
pub struct SplitReport {
    /// The sync's seconds (the driver's: trainers started to the last rollout landed).
    pub sync_seconds: f64,
    /// Per trainer.
    pub per_trainer: Vec<TrainerSplit>,
    /// Summed over trainers, seconds.
    pub sum: TimeSplitSeconds,
}

impl SplitReport {
    /// From one sync's seconds and its trainers' splits.
    pub fn of(sync_seconds: f64, per_trainer: Vec<TrainerSplit>) -> SplitReport {
        let total = per_trainer
            .iter()
            .fold(TimeSplit::default(), |a, t| a.plus(t.time_split()));
        SplitReport {
            sync_seconds,
            per_trainer,
            sum: total.seconds(),
        }
    }

    /// Text lines, one per trainer and the sum.
    pub fn human(&self) -> String {
        let mut s = format!(
            "  split of the median sync ({:.3} s), per trainer: wall = wire + idle + overhead\n",
            self.sync_seconds
        );
        for t in &self.per_trainer {
            s += &format!(
                "    trainer-{:<3} {:>7.3} = {:>7.3} + {:>7.3} + {:>7.3} s  {:>6} writes  {:>5} pieces  {:>4.1} in flight  {:>5.2} GB/s on the wire  (h2d {:.3} s, prepare {:.3} s busy; {:.0} MB staged, {:.0} MB direct)\n",
                t.trainer,
                t.wall_s,
                t.wire_s,
                t.idle_s,
                t.overhead_s,
                t.writes,
                t.pieces,
                t.mean_writes_in_flight,
                t.wire_gbps,
                t.h2d_busy_s,
                t.prepare_busy_s,
                t.staged_bytes as f64 / 1e6,
                t.direct_bytes as f64 / 1e6
            );
        }
        s += &format!(
            "    sum         {:>7.3} = {:>7.3} + {:>7.3} + {:>7.3} s\n",
            self.sum.wall_s, self.sum.wire_s, self.sum.idle_s, self.sum.overhead_s
        );
        s
    }
}
