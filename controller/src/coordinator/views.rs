//! What the HTTP API and the dashboard read from the coordinator: the workers (never an
//! endpoint or an rkey), the history of syncs, and the membership log.

use serde::Serialize;
use weightsync_common::protocol::WorkerRole;

use super::{Coordinator, Now};
use crate::sync_record::{lane_gbps, SyncView};

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
