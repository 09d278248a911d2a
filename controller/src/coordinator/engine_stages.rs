//! An engine's own stages of a sync (`EngineStages`: pause, load, resume), added to its lane so
//! the views, the dashboard and the trace show them beside the landing.
//!
//! Only the engine knows when it held its requests, how long its own loader took and when it
//! resumed, and it knows some of that only after the commit (a staged engine loads once the
//! version committed). So the report comes on its own, after `Landed`, and is not part of the
//! version protocol: it is never waited for and never fails a sync. It is checked instead,
//! because it comes from outside the protocol's own bookkeeping: a report that names a sync this
//! controller does not hold (or that failed, or that never started), that comes from a worker
//! that is not one of the sync's engines, that carries a stage an engine does not report, a span
//! ending before it starts or after the report arrived, or more spans than
//! [`MAX_ENGINE_STAGE_EVENTS`], is refused whole, with a logged reason, and changes nothing. The
//! connection stays up: a wrong timeline is no reason to drop an engine that serves.

use std::time::Duration;

use weightsync_common::protocol::{
    MAX_ENGINE_STAGE_EVENTS, Stage, TimelineEvent, WorkerId, WorkerRole,
};

use super::{Coordinator, Effects, Now};
use crate::sync_record::SyncState;

/// How far past the report's arrival a span may end: the engine's clock and the controller's
/// run at slightly different rates on different hosts.
const CLOCK_SLACK: Duration = Duration::from_secs(1);

/// Why an engine's report of its stages was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineStagesRefused {
    /// A trainer sent it.
    #[error("{worker} is not an engine (only rollouts report engine stages)")]
    NotAnEngine {
        /// The sender.
        worker: WorkerId,
    },
    /// No such sync (never created, or it left the history).
    #[error("sync {sync_id} is unknown (never created, or it left the history)")]
    UnknownSync {
        /// The sync named.
        sync_id: u64,
    },
    /// The sync exists but is of another version.
    #[error("sync {sync_id} is of version {actual}, not {claimed}")]
    OtherVersion {
        /// The sync named.
        sync_id: u64,
        /// Its version.
        actual: u64,
        /// The version the report named.
        claimed: u64,
    },
    /// The sender does not take part in the sync.
    #[error("{worker} is not one of sync {sync_id}'s workers")]
    NotAMember {
        /// The sender.
        worker: WorkerId,
        /// The sync named.
        sync_id: u64,
    },
    /// The sync is queued behind a drain: nobody was told of it yet.
    #[error("sync {sync_id} has not started (nobody was told to prepare it)")]
    NotStarted {
        /// The sync named.
        sync_id: u64,
    },
    /// The sync failed: its version never reached an engine.
    #[error("sync {sync_id} failed: no engine used its version")]
    Failed {
        /// The sync named.
        sync_id: u64,
    },
    /// No spans.
    #[error("no spans")]
    Empty,
    /// More spans than one report, or one lane of one sync, may hold.
    #[error("{count} engine spans for this sync, more than {max}")]
    TooMany {
        /// Spans the lane would hold (already there plus reported).
        count: usize,
        /// The bound.
        max: usize,
    },
    /// A stage the worker library records, not the engine.
    #[error("span {index}: stage {stage} is not one an engine reports (pause, load, resume)")]
    NotAnEngineStage {
        /// Its index in the report.
        index: usize,
        /// The stage.
        stage: Stage,
    },
    /// A span whose end is before its start.
    #[error("span {index} ({stage}) ends at {end_ns} ns, before it starts at {start_ns} ns")]
    EndsBeforeStart {
        /// Its index in the report.
        index: usize,
        /// The stage.
        stage: Stage,
        /// Start, ns since the worker received `Prepare`.
        start_ns: u64,
        /// End, ns since the worker received `Prepare`.
        end_ns: u64,
    },
    /// A span that ends after the report arrived.
    #[error(
        "span {index} ({stage}) ends {:.1} ms after the report arrived",
        *ahead_ns as f64 / 1e6
    )]
    EndsInTheFuture {
        /// Its index in the report.
        index: usize,
        /// The stage.
        stage: Stage,
        /// By how much, ns.
        ahead_ns: u64,
    },
}

impl Coordinator {
    /// `EngineStages` from `id`: added to its lane, or refused with a logged reason.
    pub(super) fn on_engine_stages(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        version: u64,
        events: &[TimelineEvent],
        now: Now,
    ) -> Effects {
        match self.add_engine_stages(id, sync_id, version, events, now) {
            Ok(()) => tracing::debug!(
                "{id}: {} engine spans added to sync {sync_id} (version {version})",
                events.len()
            ),
            Err(why) => tracing::warn!(
                "{id}: engine stages of sync {sync_id} (version {version}) refused: {why}"
            ),
        }
        Effects::default()
    }

    /// Checks a report of engine stages and adds it to `id`'s lane of the sync; on a refusal
    /// nothing changes.
    pub(super) fn add_engine_stages(
        &mut self,
        id: WorkerId,
        sync_id: u64,
        version: u64,
        events: &[TimelineEvent],
        now: Now,
    ) -> Result<(), EngineStagesRefused> {
        if id.role != WorkerRole::Rollout {
            return Err(EngineStagesRefused::NotAnEngine { worker: id });
        }
        let s = self
            .syncs
            .get_mut(&sync_id)
            .ok_or(EngineStagesRefused::UnknownSync { sync_id })?;
        if s.version != version {
            return Err(EngineStagesRefused::OtherVersion {
                sync_id,
                actual: s.version,
                claimed: version,
            });
        }
        if !s.members.contains(&id) {
            return Err(EngineStagesRefused::NotAMember {
                worker: id,
                sync_id,
            });
        }
        if s.queued_behind.is_some() {
            return Err(EngineStagesRefused::NotStarted { sync_id });
        }
        if s.state == SyncState::Failed {
            return Err(EngineStagesRefused::Failed { sync_id });
        }
        if events.is_empty() {
            return Err(EngineStagesRefused::Empty);
        }
        let held = s.lanes.get(&id).map_or(0, |l| {
            l.spans.iter().filter(|x| x.stage.is_engine()).count()
        });
        let count = held + events.len();
        if count > MAX_ENGINE_STAGE_EVENTS {
            return Err(EngineStagesRefused::TooMany {
                count,
                max: MAX_ENGINE_STAGE_EVENTS,
            });
        }
        let origin = s.prepare_sent_ns;
        let arrived = s.since(now.at);
        let slack = CLOCK_SLACK.as_nanos() as u64;
        for (index, e) in events.iter().enumerate() {
            let stage = e.stage;
            if !stage.is_engine() {
                return Err(EngineStagesRefused::NotAnEngineStage { index, stage });
            }
            if e.end_ns < e.start_ns {
                return Err(EngineStagesRefused::EndsBeforeStart {
                    index,
                    stage,
                    start_ns: e.start_ns,
                    end_ns: e.end_ns,
                });
            }
            let end = origin.saturating_add(e.end_ns);
            if end > arrived.saturating_add(slack) {
                return Err(EngineStagesRefused::EndsInTheFuture {
                    index,
                    stage,
                    ahead_ns: end - arrived,
                });
            }
        }
        s.add_engine_spans(id, origin, events);
        Ok(())
    }
}
