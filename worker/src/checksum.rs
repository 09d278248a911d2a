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
//!
//! The record is the protocol's [`RunChecksum`]: what a trainer reports is what the controller
//! forwards and what a rollout checks, with no conversion on the way.

pub use weightsync_common::protocol::RunChecksum;

/// xxh3-64 of bytes (the one hash both sides use).
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}
