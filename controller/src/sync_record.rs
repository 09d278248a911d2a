//! One sync's record: its state, who it still waits for, the reports it collected, and the
//! views the HTTP API and the dashboard draw from it.
//!
//! Times are kept as nanoseconds since the sync was created, on the controller's monotonic clock.
//! Workers report spans relative to the instant they received `Prepare` / `Start`; the record
//! places them on its own axis at the instant the controller sent that message, which on a LAN is
//! within the one-way control latency (tens of microseconds), far below a span's length.

use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

use crate::coordinator::delta_policy::DecisionKind;

use weightsync_common::protocol::{
    DeltaBase, DeltaFigures, DeltaRecord, Failure, FailureKind, RunChecksum, Stage, TimeSplit,
    TimeSplitSeconds, TimelineEvent, WorkerId, WorkerReport,
};

/// Where a sync is in the version protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SyncState {
    /// Rollouts are arming / trainers refreshing their source; nothing written yet.
    Pending,
    /// Trainers are writing; waiting for every rollout's "landed".
    Running,
    /// Every rollout reported the version landed (and verified); rollouts were told to use it.
    Committed,
    /// Failed with a cause; rollouts were told the version is not valid.
    Failed,
}

impl SyncState {
    /// Whether the sync has ended.
    pub fn is_terminal(self) -> bool {
        matches!(self, SyncState::Committed | SyncState::Failed)
    }
}

/// A span on a worker's lane, on the sync's time axis.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Span {
    /// Stage name.
    pub stage: Stage,
    /// Task index on the worker.
    pub task: u32,
    /// Start, ns since the sync was created.
    pub start_ns: u64,
    /// End, ns since the sync was created.
    pub end_ns: u64,
    /// Bytes.
    pub bytes: u64,
}

impl Span {
    /// A worker's event (timed from its own origin) on the sync's axis, `origin_ns` later; an
    /// end before the start is drawn as an instant.
    fn shifted(origin_ns: u64, e: &TimelineEvent) -> Self {
        Span {
            stage: e.stage,
            task: e.task,
            start_ns: origin_ns.saturating_add(e.start_ns),
            end_ns: origin_ns.saturating_add(e.end_ns.max(e.start_ns)),
            bytes: e.bytes,
        }
    }
}

/// One worker's lane in a sync.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Lane {
    /// Spans in start order.
    pub spans: Vec<Span>,
    /// Bytes written or landed.
    pub bytes: u64,
    /// Writes posted or counted.
    pub writes: u64,
    /// Peak staging bytes (trainers).
    pub peak_staging_bytes: u64,
    /// Source bytes copied into staging (trainers).
    pub staged_bytes: u64,
    /// Bytes written straight from registered source memory (trainers).
    pub direct_bytes: u64,
    /// Where the trainer's sync wall went: wire, idle, overhead (trainers, once written).
    pub split: Option<TimeSplit>,
    /// When this worker's last report arrived, ns since creation.
    pub done_ns: Option<u64>,
    /// When it reported its main part done (trainer: written; rollout: landed).
    pub part_done_ns: Option<u64>,
    /// Whether this lane is on the critical path (it finished last in its role).
    pub critical: bool,
}

/// Per-stage durations of a sync, as the controller saw them.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct StageDurations {
    /// Creation to every worker prepared (rollouts armed, trainers' sources ready).
    pub prepare_ms: Option<f64>,
    /// Start to the last trainer's "written".
    pub write_ms: Option<f64>,
    /// Start to the last rollout's "landed".
    pub land_ms: Option<f64>,
    /// Verification (trainers' checksums against what landed), when on.
    pub verify_ms: Option<f64>,
    /// Creation to the end (commit or failure).
    pub total_ms: Option<f64>,
    /// The last rollout's "landed" to the end: what committing costs once every byte is in
    /// place (verification, the control round trips). Kept small against `land_ms`.
    pub after_landing_ms: Option<f64>,
    /// Of `after_landing_ms`: the last rollout's "landed" to `Verify` going out (the trainers'
    /// last "written" still to come), when verification is on.
    pub after_landing_wait_ms: Option<f64>,
    /// Of `after_landing_ms`: the longest rollout's pass over what landed (its verify span).
    pub after_landing_check_ms: Option<f64>,
    /// Of `after_landing_ms`: the rest, the control messages around the check and the commit.
    pub after_landing_control_ms: Option<f64>,
}

/// Everything about one sync.
#[derive(Debug, Clone)]
pub struct SyncRecord {
    /// Controller-assigned id.
    pub id: u64,
    /// Weight version.
    pub version: u64,
    /// The job's run the version belongs to.
    pub run: u64,
    /// Plan it ran under.
    pub plan_id: u64,
    /// State.
    pub state: SyncState,
    /// Wall-clock creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Monotonic creation instant.
    pub created: std::time::Instant,
    /// Workers taking part.
    pub members: BTreeSet<WorkerId>,
    /// Workers whose `Prepared` is still missing.
    pub awaiting_prepared: BTreeSet<WorkerId>,
    /// Trainers whose `Written` is still missing (only meaningful once running).
    pub awaiting_written: BTreeSet<WorkerId>,
    /// Rollouts whose `Landed` is still missing.
    pub awaiting_landed: BTreeSet<WorkerId>,
    /// Rollouts whose `Verified` is still missing (after `Verify` went out).
    pub awaiting_verified: BTreeSet<WorkerId>,
    /// When `Verify` went out, ns since creation.
    pub verify_sent_ns: Option<u64>,
    /// When `Prepare` went out to each worker, ns since creation (always 0 today).
    pub prepare_sent_ns: u64,
    /// When `Start` went out, ns since creation.
    pub start_sent_ns: Option<u64>,
    /// When it ended, ns since creation.
    pub ended_ns: Option<u64>,
    /// Lanes.
    pub lanes: BTreeMap<WorkerId, Lane>,
    /// Trainers' checksums of what they prepared, when verification is on.
    pub sent_checksums: Vec<RunChecksum>,
    /// The engines offered deltas in `Start`, and their base (`None`: a full sync).
    pub delta_base: Option<DeltaBase>,
    /// Trainers' runs written as deltas, forwarded to their engines with `Verify`.
    pub sent_deltas: Vec<DeltaRecord>,
    /// What the trainers' deltas came to, summed (encode time summed too).
    pub delta: DeltaFigures,
    /// The slowest engine's apply of its deltas, ns.
    pub delta_apply_ns: u64,
    /// Whether the sync offered deltas, and why (decided at `Start`; see `coordinator`'s
    /// `delta_policy`).
    pub delta_policy: Option<(DecisionKind, String)>,
    /// Whether verification ran and passed (`None`: off or not yet).
    pub verified: Option<bool>,
    /// Why it failed.
    pub failure: Option<Failure>,
    /// A worker's failure report held for the grace period, and when it came.
    pub reported: Option<(Failure, std::time::Instant)>,
    /// Set while the sync is queued: the id of the failed sync whose trainers must confirm they
    /// drained it (nothing of it can still land) before this one's `Prepare` goes out.
    pub queued_behind: Option<u64>,
    /// Trainers still draining while queued.
    pub awaiting_drain: BTreeSet<WorkerId>,
    /// How long it was queued behind a drain, ms (its creation time is reset when it starts).
    pub drain_wait_ms: Option<f64>,
}

impl SyncRecord {
    /// Nanoseconds from creation to `now`.
    pub fn since(&self, now: std::time::Instant) -> u64 {
        u64::try_from(now.saturating_duration_since(self.created).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Adds a worker's report to its lane, shifting its spans by `origin_ns`.
    pub fn add_report(
        &mut self,
        worker: WorkerId,
        origin_ns: u64,
        report: &WorkerReport,
        done_ns: u64,
    ) {
        let lane = self.lanes.entry(worker).or_default();
        lane.spans
            .extend(report.events.iter().map(|e| Span::shifted(origin_ns, e)));
        lane.spans.sort_by_key(|s| (s.start_ns, s.end_ns));
        lane.bytes = lane.bytes.max(report.bytes);
        lane.writes = lane.writes.max(report.writes);
        lane.peak_staging_bytes = lane.peak_staging_bytes.max(report.peak_staging_bytes);
        lane.staged_bytes = lane.staged_bytes.max(report.staged_bytes);
        lane.direct_bytes = lane.direct_bytes.max(report.direct_bytes);
        if report.split.wall_ns > 0 {
            lane.split = Some(report.split);
        }
        lane.done_ns = Some(done_ns);
    }

    /// Adds an engine's own spans (pause, load, resume; checked by the coordinator) to its lane,
    /// shifting them by `origin_ns`. They leave the lane's counts and done marks alone: they
    /// are not part of the version protocol, and come after the worker's part ended.
    pub fn add_engine_spans(&mut self, worker: WorkerId, origin_ns: u64, events: &[TimelineEvent]) {
        let lane = self.lanes.entry(worker).or_default();
        lane.spans
            .extend(events.iter().map(|e| Span::shifted(origin_ns, e)));
        lane.spans.sort_by_key(|s| (s.start_ns, s.end_ns));
    }

    /// Adds the report that ends a worker's part of the sync (`Written`, `Landed`), timed from
    /// `Prepare` and received at `now`, and marks the part done.
    pub fn add_part_report(
        &mut self,
        worker: WorkerId,
        report: &WorkerReport,
        now: std::time::Instant,
    ) {
        let t = self.since(now);
        self.add_report(worker, self.prepare_sent_ns, report, t);
        if let Some(l) = self.lanes.get_mut(&worker) {
            l.part_done_ns = Some(t);
        }
    }

    /// Bytes the trainers wrote.
    pub fn bytes_written(&self) -> u64 {
        self.trainer_sum(|l| l.bytes)
    }

    /// `f` of every trainer's lane, summed.
    fn trainer_sum(&self, f: impl Fn(&Lane) -> u64) -> u64 {
        self.lanes
            .iter()
            .filter(|(w, _)| w.role == weightsync_common::protocol::WorkerRole::Trainer)
            .map(|(_, l)| f(l))
            .sum()
    }

    /// The trainers' time splits, per trainer and summed (`None` before any trainer reported
    /// one).
    pub fn time_split(&self) -> Option<TimeSplitView> {
        let per: BTreeMap<String, TimeSplit> = self
            .lanes
            .iter()
            .filter_map(|(w, l)| l.split.map(|s| (w.to_string(), s)))
            .collect();
        if per.is_empty() {
            return None;
        }
        let sum = per.values().fold(TimeSplit::default(), |a, &s| a.plus(s));
        Some(TimeSplitView {
            per_trainer: per.into_iter().map(|(w, s)| (w, s.seconds())).collect(),
            sum: sum.seconds(),
        })
    }

    /// Per-stage durations.
    pub fn durations(&self) -> StageDurations {
        let ms = |ns: u64| ns as f64 / 1e6;
        let last = |role| {
            self.lanes
                .iter()
                .filter(|(w, _)| w.role == role)
                .filter_map(|(_, l)| l.part_done_ns)
                .max()
        };
        let prepared = self.start_sent_ns;
        let start = self.start_sent_ns.unwrap_or(0);
        let all_written = self.awaiting_written.is_empty() && self.start_sent_ns.is_some();
        let all_landed = self.awaiting_landed.is_empty() && self.start_sent_ns.is_some();
        let last_landed =
            last(weightsync_common::protocol::WorkerRole::Rollout).filter(|_| all_landed);
        let after_landing = match (last_landed, self.ended_ns) {
            (Some(landed), Some(end)) => Some(end.saturating_sub(landed)),
            _ => None,
        };
        let wait = after_landing
            .and(last_landed)
            .zip(self.verify_sent_ns)
            .map(|(landed, sent)| sent.saturating_sub(landed));
        let check = after_landing
            .and(self.verify_sent_ns)
            .and_then(|_| self.longest_rollout_span(Stage::Verify));
        StageDurations {
            prepare_ms: prepared.map(ms),
            write_ms: if all_written {
                last(weightsync_common::protocol::WorkerRole::Trainer)
                    .map(|e| ms(e.saturating_sub(start)))
            } else {
                None
            },
            land_ms: if all_landed {
                last(weightsync_common::protocol::WorkerRole::Rollout)
                    .map(|e| ms(e.saturating_sub(start)))
            } else {
                None
            },
            verify_ms: match (self.verify_sent_ns, self.ended_ns) {
                (Some(a), Some(b)) if self.awaiting_verified.is_empty() => {
                    Some(ms(b.saturating_sub(a)))
                }
                _ => None,
            },
            total_ms: self.ended_ns.map(ms),
            after_landing_ms: after_landing.map(ms),
            after_landing_wait_ms: wait.map(ms),
            after_landing_check_ms: check.map(ms),
            after_landing_control_ms: after_landing
                .map(|a| ms(a.saturating_sub(wait.unwrap_or(0) + check.unwrap_or(0)))),
        }
    }

    /// The longest span of `stage` on a rollout lane, ns.
    fn longest_rollout_span(&self, stage: Stage) -> Option<u64> {
        self.lanes
            .iter()
            .filter(|(w, _)| w.role == weightsync_common::protocol::WorkerRole::Rollout)
            .flat_map(|(_, l)| l.spans.iter())
            .filter(|s| s.stage == stage)
            .map(|s| s.end_ns.saturating_sub(s.start_ns))
            .max()
    }

    /// Bytes per second from `Start` to the last rollout landing (the transfer window).
    pub fn gbps(&self) -> Option<f64> {
        let d = self.durations();
        let window_ms = d.land_ms.or(d.write_ms)?;
        if window_ms <= 0.0 {
            return None;
        }
        Some(self.bytes_written() as f64 / (window_ms / 1e3) / 1e9)
    }

    /// Shrinks an ended sync to what its history entry needs: per lane and stage, the span that
    /// starts first and the longest one (what the durations and rates read), and no checksums.
    /// A record then costs O(workers × stages) however many tasks the plan has, so the history
    /// is bounded in bytes as well as in syncs. (The full timeline is kept for the newest few.)
    pub fn summarise(&mut self) {
        self.sent_checksums = Vec::new();
        for lane in self.lanes.values_mut() {
            if lane.spans.len() <= 2 * Stage::ALL.len() {
                continue;
            }
            let mut keep: Vec<Span> = Vec::new();
            for stage in Stage::ALL {
                let of = || lane.spans.iter().filter(|x| x.stage == stage);
                let first = of().min_by_key(|x| (x.start_ns, x.end_ns));
                let longest = of().max_by_key(|x| x.end_ns.saturating_sub(x.start_ns));
                keep.extend(first.cloned());
                if let Some(l) = longest
                    && Some(l) != first
                {
                    keep.push(l.clone());
                }
            }
            keep.sort_by_key(|x| (x.start_ns, x.end_ns));
            lane.spans = keep;
            lane.spans.shrink_to_fit();
        }
    }

    /// Marks the lanes that finished last in each role as the critical path.
    pub fn mark_critical(&mut self) {
        for role in [
            weightsync_common::protocol::WorkerRole::Trainer,
            weightsync_common::protocol::WorkerRole::Rollout,
        ] {
            let last = self
                .lanes
                .iter()
                .filter(|(w, l)| w.role == role && l.part_done_ns.is_some())
                .max_by_key(|(_, l)| l.part_done_ns)
                .map(|(w, _)| *w);
            for (w, l) in self.lanes.iter_mut() {
                if w.role == role {
                    l.critical = Some(*w) == last;
                }
            }
        }
    }

    /// Workers the sync is still waiting for, in the current stage (while queued: the trainers
    /// still draining the failed sync before it).
    pub fn waiting_on(&self) -> Vec<WorkerId> {
        match self.state {
            SyncState::Pending if self.queued_behind.is_some() => {
                self.awaiting_drain.iter().copied().collect()
            }
            SyncState::Pending => self.awaiting_prepared.iter().copied().collect(),
            SyncState::Running => self
                .awaiting_written
                .iter()
                .chain(self.awaiting_landed.iter())
                .chain(self.awaiting_verified.iter())
                .copied()
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The delta figures of a sync that offered deltas.
    pub fn delta_view(&self) -> Option<DeltaView> {
        let base = self.delta_base.as_ref()?;
        let d = &self.delta;
        Some(DeltaView {
            base_version: base.base_version,
            engines: base.rollouts.len(),
            dense_bytes: d.dense_bytes,
            delta_bytes: d.delta_bytes,
            wire_bytes: d.wire_bytes(),
            wire_fraction: d.wire_bytes() as f64 / d.dense_bytes.max(1) as f64,
            changed_fraction: d.changed as f64 / d.elements.max(1) as f64,
            encode_ms: d.codec_ns as f64 / 1e6,
            apply_ms: self.delta_apply_ns as f64 / 1e6,
        })
    }

    /// The JSON view for `GET /v1/syncs/{id}` (and, without lanes, the history list).
    pub fn view(&self, with_lanes: bool) -> SyncView {
        SyncView {
            id: self.id,
            version: self.version,
            run: self.run,
            plan_id: self.plan_id,
            state: self.state,
            created_unix_ms: self.created_unix_ms,
            stages: self.durations(),
            bytes: self.bytes_written(),
            staged_bytes: self.trainer_sum(|l| l.staged_bytes),
            direct_bytes: self.trainer_sum(|l| l.direct_bytes),
            time_split: self.time_split(),
            gbps: self.gbps(),
            delta: self.delta_view(),
            delta_policy: self.delta_policy.as_ref().map(|(_, why)| why.clone()),
            verified: self.verified,
            failure: self.failure.as_ref().map(|f| FailureView {
                worker: f.worker.to_string(),
                kind: f.kind,
                tensor: f.tensor.clone(),
                cause: f.cause.clone(),
            }),
            waiting_on: self.waiting_on().iter().map(ToString::to_string).collect(),
            waiting_for_drain_of: self.queued_behind,
            drain_wait_ms: self.drain_wait_ms,
            lanes: with_lanes.then(|| {
                self.lanes
                    .iter()
                    .map(|(w, l)| LaneView {
                        worker: w.to_string(),
                        lane: l.clone(),
                    })
                    .collect()
            }),
        }
    }
}

/// The trainers' time splits, for JSON: per trainer (by worker id) and summed over trainers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimeSplitView {
    /// Per trainer, e.g. `trainer-0`.
    pub per_trainer: BTreeMap<String, TimeSplitSeconds>,
    /// Summed over trainers.
    pub sum: TimeSplitSeconds,
}

/// A delta sync's figures, for JSON and `/metrics`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeltaView {
    /// The version the engines taking deltas held.
    pub base_version: u64,
    /// How many engines were offered deltas.
    pub engines: usize,
    /// Bytes a full sync writes to engines.
    pub dense_bytes: u64,
    /// Bytes of encodings written into inboxes.
    pub delta_bytes: u64,
    /// Bytes on the wire for engines: encodings plus the runs that went dense.
    pub wire_bytes: u64,
    /// `wire_bytes / dense_bytes`.
    pub wire_fraction: f64,
    /// Of the elements the trainers compared, the fraction that changed.
    pub changed_fraction: f64,
    /// Trainers' encode time, summed, ms.
    pub encode_ms: f64,
    /// The slowest engine's apply, ms.
    pub apply_ms: f64,
}

/// A failure, for JSON.
#[derive(Debug, Clone, Serialize)]
pub struct FailureView {
    /// The worker to blame, e.g. `trainer-2`.
    pub worker: String,
    /// What kind of failure: `checksum`, `timeout`, `fabric`, `layout`, `source`, `cancelled`,
    /// `peer_lost`, `hook` or `other`.
    pub kind: FailureKind,
    /// The tensor, when known.
    pub tensor: Option<String>,
    /// Why.
    pub cause: String,
}

/// A lane, for JSON.
#[derive(Debug, Clone, Serialize)]
pub struct LaneView {
    /// Worker id, e.g. `rollout-1`.
    pub worker: String,
    /// Its spans and counts.
    #[serde(flatten)]
    pub lane: Lane,
}

/// A sync, for JSON.
#[derive(Debug, Clone, Serialize)]
pub struct SyncView {
    /// Id.
    pub id: u64,
    /// Weight version.
    pub version: u64,
    /// The job's run it belongs to.
    pub run: u64,
    /// Plan id.
    pub plan_id: u64,
    /// pending / running / committed / failed.
    pub state: SyncState,
    /// Creation time, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Per-stage durations.
    pub stages: StageDurations,
    /// Bytes written by trainers.
    pub bytes: u64,
    /// Source bytes trainers copied into staging before writing (casts, fp8, strided boxes,
    /// arenas nobody registered).
    pub staged_bytes: u64,
    /// Bytes trainers wrote straight from registered source memory (no copy but the fabric's).
    pub direct_bytes: u64,
    /// Where each trainer's sync wall went (wire, idle, overhead), once trainers reported.
    pub time_split: Option<TimeSplitView>,
    /// Transfer rate, GB/s (1e9 bytes per second).
    pub gbps: Option<f64>,
    /// What the sync's deltas came to (`None`: a full sync, no engine was offered deltas).
    pub delta: Option<DeltaView>,
    /// Whether it offered deltas and why, decided when trainers were told to start, e.g.
    /// `off`, `on`, `auto: probe (full 480.0 ms)`, `auto: delta pays (120.0 ms vs full 480.0
    /// ms)`, `auto: full pays (...)` (`None`: it never started).
    pub delta_policy: Option<String>,
    /// Verification result.
    pub verified: Option<bool>,
    /// Cause of failure.
    pub failure: Option<FailureView>,
    /// Workers still awaited.
    pub waiting_on: Vec<String>,
    /// While the sync is queued (state `pending`, nothing sent yet): the failed sync whose
    /// trainers it waits for to confirm they drained it; `waiting_on` names them.
    pub waiting_for_drain_of: Option<u64>,
    /// How long it waited for that drain before it started, ms.
    pub drain_wait_ms: Option<f64>,
    /// Timeline lanes (only on the single-sync view).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lanes: Option<Vec<LaneView>>,
}

/// A lane's rate: its bytes over its transfer window (first transfer-side span to its
/// written / landed report), leaving out source refresh, arming, verification and the engine's
/// own stages (a direct engine's pause may begin before the first write).
pub fn lane_gbps(s: &SyncRecord, w: &WorkerId) -> Option<f64> {
    let l = s.lanes.get(w)?;
    let start = l
        .spans
        .iter()
        .filter(|x| {
            !matches!(x.stage, Stage::Source | Stage::Verify | Stage::Arm) && !x.stage.is_engine()
        })
        .map(|x| x.start_ns)
        .min()?;
    let end = l.part_done_ns.or(l.done_ns)?;
    (end > start && l.bytes > 0).then(|| l.bytes as f64 / ((end - start) as f64 / 1e9) / 1e9)
}
