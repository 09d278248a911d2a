//! What a controller must remember across its own crash, and nothing more: the job's run, the
//! newest committed `(run, version)`, the next sync id and the incarnation that saved it.
//!
//! Why these four: sync ids double as the immediates' epochs, and a rollout that survived the
//! controller refuses an epoch it already retired, so ids must never repeat; engines must never
//! be told of a version older than one they committed, so the newest committed version must
//! outlive the process; the run says which versions compare. Everything else (membership, the
//! plan, pushes) is rebuilt from what the workers tell a new controller when they reconnect.
//!
//! The coordinator only produces and consumes [`Durable`]; the service writes it to a file
//! (`crate::state_file`) whenever an effect says it changed, before any message that depends on
//! it goes out.

use serde::{Deserialize, Serialize};

/// The durable state (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Durable {
    /// The incarnation that saved it (a random id per controller start).
    pub incarnation: u64,
    /// The job's current run.
    pub run: u64,
    /// The newest committed `(run, version)`.
    pub committed: Option<(u64, u64)>,
    /// The next sync id to hand out: every id below it may have been used.
    pub next_sync_id: u64,
}

impl Default for Durable {
    fn default() -> Self {
        Durable {
            incarnation: 0,
            run: 0,
            committed: None,
            next_sync_id: 1,
        }
    }
}
