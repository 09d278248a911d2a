//! Checksums of write runs: how a rollout proves that what landed is what a trainer prepared.
//!
//! A trainer prepares only pieces of a destination tensor (its shard's rows, possibly split by
//! the watermark), so it cannot hash a whole tensor. What both sides can see is the *run*: the
//! bytes of one posted write, `[offset, offset + len)` of a destination MR. The trainer hashes
//! each run's prepared bytes with xxh3 right after preparing them; the rollout hashes the same
//! range of its memory after the sync landed and compares. A mismatch names the destination
//! tensor(s) the run lies in. Because every destination byte is written exactly once per sync,
//! the runs of all trainers tile the destination tensors exactly, so the rollout also checks that
//! the records cover every tensor byte once: verification can never pass vacuously.

use serde::{Deserialize, Serialize};

/// The xxh3 of one write run as prepared by a trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RunChecksum {
    /// Rollout rank the run was written to.
    pub rank: u32,
    /// Memory region on that rank.
    pub mr: u16,
    /// Byte offset in the MR.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// xxh3-64 of the bytes.
    pub xxh3: u64,
}

/// xxh3-64 of bytes (the one hash both sides use).
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
