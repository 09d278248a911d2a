//! What the demo's wrapped drivers did outside the syncs, one JSON line per event in a file per
//! worker (`DIR/trainer-0.jsonl`): the demo process reads them to wait for its training step and
//! its checks between two syncs, and to report them on lines of their own.
//!
//! Files, not the control channel: the protocol is weightsync's, and what the demo adds to a job
//! has no place in it.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// One thing a wrapped driver did outside a sync.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum DemoEvent {
    /// A trainer wrote its weights for `version` (the training step before that push).
    Weights {
        /// The worker, e.g. `trainer-0`.
        worker: String,
        /// The version the source now holds.
        version: u64,
        /// Bytes written.
        bytes: u64,
        /// Seconds it took.
        seconds: f64,
    },
    /// A rollout compared `version` (every byte, or a sample) with its recomputation from the
    /// seed.
    Checked {
        /// The worker, e.g. `rollout-1`.
        worker: String,
        /// The committed version checked.
        version: u64,
        /// Bytes compared.
        bytes: u64,
        /// Whether that was every byte the rollout holds (else a sample).
        every_byte: bool,
        /// Seconds it took.
        seconds: f64,
        /// Why it failed (`None`: every byte equal).
        failure: Option<String>,
    },
}

/// Appends a worker's events to its file.
#[derive(Debug, Clone)]
pub struct ProgressFile {
    path: PathBuf,
}

impl ProgressFile {
    /// The file of `worker` in `dir` (created on the first event).
    pub fn new(dir: &Path, worker: &str) -> ProgressFile {
        ProgressFile {
            path: dir.join(format!("{worker}.jsonl")),
        }
    }

    /// Appends one event (a failure to write is logged: the demo then waits and says so).
    pub fn append(&self, event: &DemoEvent) {
        let line = match serde_json::to_string(event) {
            Ok(l) => l,
            Err(e) => return tracing::warn!("demo progress: {e}"),
        };
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            tracing::warn!("demo progress: {}: {e}", self.path.display());
        }
    }
}

/// Every complete event in every progress file of `dir` (a line still being written is skipped
/// until it is whole).
pub fn read_all(dir: &Path) -> Vec<DemoEvent> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "jsonl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        for line in text.split_inclusive('\n').filter(|l| l.ends_with('\n')) {
            if let Ok(e) = serde_json::from_str(line.trim_end()) {
                out.push(e);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_written_by_workers_are_read_back_and_partial_lines_wait() {
        let dir = tempfile::tempdir().unwrap();
        let t = ProgressFile::new(dir.path(), "trainer-0");
        let w = DemoEvent::Weights {
            worker: "trainer-0".into(),
            version: 2,
            bytes: 10,
            seconds: 0.5,
        };
        t.append(&w);
        let c = DemoEvent::Checked {
            worker: "rollout-1".into(),
            version: 1,
            bytes: 7,
            every_byte: true,
            seconds: 0.25,
            failure: Some("byte 3 differs".into()),
        };
        ProgressFile::new(dir.path(), "rollout-1").append(&c);
        std::fs::write(dir.path().join("rollout-0.jsonl"), "{\"event\":\"chec").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not an event\n").unwrap();
        let mut got = read_all(dir.path());
        got.sort_by_key(|e| matches!(e, DemoEvent::Checked { .. }));
        assert_eq!(got, vec![w, c]);
    }
}
