//! What kind of failure ended a sync, and a worker's own report of its failure.
//!
//! Why a kind beside the text: a caller decides what to do by the kind (retry after a timeout or
//! a lost peer, stop on a checksum mismatch or a layout the job cannot use) and should not parse
//! a message to find it. The kind travels with the failure from the worker that found it,
//! through the controller (the sync record, `GET /v1/syncs/{id}`), to every worker of the sync
//! and to Python's `SyncFailedError.kind`.
//!
//! A worker sends a [`Fault`]: it cannot name itself on the wire (the controller knows which
//! connection the report came on and blames that worker, making it a
//! [`Failure`](super::Failure)).

use serde::{Deserialize, Serialize};
use std::fmt;

/// What kind of failure it was. Its name (`checksum`, `timeout`, `peer_lost`...) is what JSON
/// and Python say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum FailureKind {
    /// What landed differs from what the trainer prepared (a checksum, or the demo's
    /// recomputation of every byte).
    Checksum,
    /// Something did not happen in time: writes that did not land, a worker that did not
    /// answer.
    Timeout,
    /// A fabric operation failed: a refused write, a lane that broke, a peer not reachable.
    Fabric,
    /// The plan, the job or the registered tensors disagree with the layout (a malformed plan,
    /// a destination nobody described, a watermark below a piece, a model that cannot be laid
    /// out).
    Layout,
    /// The source does not hold what the plan reads (a missing tensor, a file too short, a
    /// dtype or shape other than the plan's).
    Source,
    /// The sync was cancelled (its controller aborted it) before this part finished.
    Cancelled,
    /// A worker of the sync left or fell silent (disconnected, stopped heartbeating).
    PeerLost,
    /// An engine's own hook (`before_landing`, `after_commit`) raised.
    Hook,
    /// Not a failure of anything: a newer version (or a newer run) was pushed before this one
    /// started, so this one never syncs. Non-fatal: an embedded `wait()` returns an outcome that
    /// says so instead of raising.
    Superseded,
    /// The version is not newer than the last one committed in the job's run (a trainer restarted
    /// from an older checkpoint): declare a new run (`Trainer.begin_run`, `POST /v1/runs`).
    Stale,
    /// A registered tensor was written while its sync read it (an optimizer step during a sync):
    /// what was sent is a mix of two versions. The tensor is named.
    Modified,
    /// Anything else (an internal error, a message out of protocol order).
    #[default]
    Other,
}

impl FailureKind {
    /// Every kind, in declaration order.
    pub const ALL: [FailureKind; 12] = [
        FailureKind::Checksum,
        FailureKind::Timeout,
        FailureKind::Fabric,
        FailureKind::Layout,
        FailureKind::Source,
        FailureKind::Cancelled,
        FailureKind::PeerLost,
        FailureKind::Hook,
        FailureKind::Superseded,
        FailureKind::Stale,
        FailureKind::Modified,
        FailureKind::Other,
    ];

    /// Its name, as JSON and Python say it (`peer_lost`).
    pub fn name(self) -> &'static str {
        match self {
            FailureKind::Checksum => "checksum",
            FailureKind::Timeout => "timeout",
            FailureKind::Fabric => "fabric",
            FailureKind::Layout => "layout",
            FailureKind::Source => "source",
            FailureKind::Cancelled => "cancelled",
            FailureKind::PeerLost => "peer_lost",
            FailureKind::Hook => "hook",
            FailureKind::Superseded => "superseded",
            FailureKind::Stale => "stale",
            FailureKind::Modified => "modified",
            FailureKind::Other => "other",
        }
    }
}

impl fmt::Display for FailureKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FailureKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FailureKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = FailureKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown failure kind {s:?} (one of {})", names.join(", "))
            })
    }
}

/// A worker's report of its own failure, as it sends it in `Failed`: the controller adds who
/// sent it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    /// What kind of failure.
    pub kind: FailureKind,
    /// The tensor involved, when known.
    pub tensor: Option<String>,
    /// Human-readable cause.
    pub cause: String,
}

impl Fault {
    /// The failure of `worker` (the connection it came on).
    pub fn blame(self, worker: super::WorkerId) -> super::Failure {
        super::Failure {
            worker,
            kind: self.kind,
            tensor: self.tensor,
            cause: self.cause,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::FailureKind;

    #[test]
    fn every_kind_is_listed_once_and_json_says_its_name() {
        // Adding a variant must list it in `ALL`: this match stops compiling until it is.
        let listed = |k: FailureKind| match k {
            FailureKind::Checksum
            | FailureKind::Timeout
            | FailureKind::Fabric
            | FailureKind::Layout
            | FailureKind::Source
            | FailureKind::Cancelled
            | FailureKind::PeerLost
            | FailureKind::Hook
            | FailureKind::Superseded
            | FailureKind::Stale
            | FailureKind::Modified
            | FailureKind::Other => FailureKind::ALL.contains(&k),
        };
        for k in FailureKind::ALL {
            assert!(listed(k));
            assert_eq!(k.name().parse::<FailureKind>(), Ok(k));
            assert_eq!(
                serde_json::to_string(&k).unwrap(),
                format!("\"{}\"", k.name())
            );
        }
        let mut names: Vec<&str> = FailureKind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(
            names.len(),
            FailureKind::ALL.len(),
            "two kinds share a name"
        );
        let err = "corrupt".parse::<FailureKind>().unwrap_err();
        assert!(
            err.contains("checksum") && err.contains("peer_lost"),
            "{err}"
        );
    }
}
