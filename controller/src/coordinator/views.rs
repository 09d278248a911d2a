//! What the HTTP API and the dashboard read from the coordinator: the workers (never an
//! endpoint or an rkey), the history of syncs, and the membership log.

use serde::Serialize;
use weightsync_common::protocol::WorkerRole;

use super::{Coordinator, Now};
use crate::sync_record::{SyncView, lane_gbps};

/// A worker, for JSON (no endpoint, no rkeys).
#[derive(Debug, Clone, Serialize)]
pub struct WorkerView {
    /// e.g. `trainer-0`.
    pub id: String,
    /// Trainer or rollout.
    pub role: WorkerRole,
    /// Rank.
    pub rank: u32,
    /// Host name.
    pub host: String,
    /// Process id.
    pub pid: u32,
    /// Registration time, ms since the Unix epoch.
    pub joined_unix_ms: u64,
    /// Milliseconds since its last message.
    pub last_seen_ms_ago: u64,
    /// Tensors it holds.
    pub tensors: usize,
    /// Bytes it holds.
    pub bytes: u64,
    /// Its rate in the last sync it took part in, GB/s.
    pub last_gbps: Option<f64>,
}

/// A line in the membership log (`GET /v1/plan` shows the recent ones).
#[derive(Debug, Clone, Serialize)]
pub struct LogLine {
    /// ms since the Unix epoch.
    pub unix_ms: u64,
    /// What happened.
    pub message: String,
}

impl Coordinator {
    /// Syncs, newest first.
    pub fn history(&self) -> Vec<SyncView> {
        self.syncs.values().rev().map(|s| s.view(false)).collect()
    }

    /// The newest sync's id and state, without building any view (what `/healthz` reads).
    pub fn last_sync(&self) -> Option<(u64, crate::sync_record::SyncState)> {
        self.syncs.values().next_back().map(|s| (s.id, s.state))
    }

    /// Recent membership and planning events.
    pub fn log(&self) -> Vec<LogLine> {
        self.log.iter().cloned().collect()
    }

    /// Registered workers, for JSON.
    pub fn workers(&self, now: Now) -> Vec<WorkerView> {
        let last_sync = self.syncs.values().rev().find(|s| s.state.is_terminal());
        self.members
            .iter()
            .map(|(w, m)| WorkerView {
                id: w.to_string(),
                role: w.role,
                rank: w.rank,
                host: m.reg.host.clone(),
                pid: m.reg.pid,
                joined_unix_ms: m.joined_unix_ms,
                last_seen_ms_ago: now.at.saturating_duration_since(m.last_seen).as_millis() as u64,
                tensors: m.reg.tensors.len(),
                bytes: m.reg.tensors.iter().map(|t| t.bytes).sum(),
                last_gbps: last_sync.and_then(|s| lane_gbps(s, w)),
            })
            .collect()
    }
}

/// Where a weight version stands, as an inference engine's driver asks before it pauses the
/// engine (`GET /v1/versions/{v}`): asking the controller costs the engine nothing, where
/// polling the engine's workers holds (or wakes) them.
///
/// "A version >= v" everywhere, as an engine sees it: an engine asked for v may load a newer
/// one, and a failed sync of v or newer ends the wait (the engine's update then fails at once).
#[derive(Debug, Clone, Serialize)]
pub struct VersionView {
    /// The version asked about.
    pub version: u64,
    /// A sync of a version >= `version` exists (trainers' pushes completed or a trigger), in
    /// any state: its rollouts have been told to prepare (a direct-mode engine may pause now).
    pub started: bool,
    /// A sync of a version >= `version` committed or failed: a staged engine holds it whole in
    /// its arena (or will be told it failed).
    pub ended: bool,
    /// The newest version committed in the job's current run.
    pub latest_committed: Option<u64>,
    /// The job's current run.
    pub run: u64,
    /// The newest attempt of the smallest version >= `version` that has a sync.
    pub sync: Option<SyncView>,
}

impl Coordinator {
    /// Where `version` stands (see [`VersionView`]).
    pub fn version_view(&self, version: u64) -> VersionView {
        let committed = self.latest_in_run().filter(|&v| v >= version);
        let newer = || {
            self.by_version
                .range(version..)
                .filter_map(|(_, id)| self.syncs.get(id))
        };
        VersionView {
            version,
            started: committed.is_some() || newer().next().is_some(),
            ended: committed.is_some() || newer().any(|s| s.state.is_terminal()),
            latest_committed: self.latest_in_run(),
            run: self.run,
            sync: newer().next().map(|s| s.view(false)),
        }
    }
}
