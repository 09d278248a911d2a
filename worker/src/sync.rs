//! The name of one sync, shared by both halves of it.
//!
//! Why a file of its own: a trainer stamps every write with the sync's epoch and a rollout arms
//! its counters for it, so both `trainer/` and `rollout/` speak of a [`SyncId`]; kept at the
//! bottom of the crate, neither has to import the other for it.

use serde::{Deserialize, Serialize};

/// Identifies one sync: the weights' version and the attempt's epoch (distinct for every
/// attempt, also when a failed version is retried; it goes into the immediates).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SyncId {
    /// Weights version (the training step).
    pub version: u64,
    /// Attempt number, strictly increasing over the job.
    pub epoch: u64,
}
