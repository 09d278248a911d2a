//! The vocabulary of a delta sync that both halves and the control channel share.
//!
//! A trainer that writes a run as a delta writes its encoding into the destination engine's
//! delta inbox, not into the destination; the receiver needs to know where each encoding lies
//! and which bytes of which region it rewrites. That is a [`DeltaRecord`] per run, carried
//! beside the run checksums (the trainer's report, then the controller's `Verify`), so the
//! inbox itself holds nothing but encodings and a stale one from an earlier sync can never be
//! mistaken for this sync's: only the records of this sync are applied.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// How a run's changed elements are encoded (the codec is `weightsync_worker`'s `delta::codec`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeltaKind {
    /// Per changed element: a LEB128 varint of the unchanged elements before it, then its bytes.
    Gaps,
    /// A bitmap of the run's elements (set: changed), then the changed elements' bytes in order.
    Bitmap,
}

/// One run of a destination written as a delta: the receiver applies the encoding found at
/// `inbox_offset` of its inbox to `len` bytes at `offset` of region `mr`, if what it holds is
/// version `base_version`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeltaRecord {
    /// Destination rollout rank.
    pub rollout: u32,
    /// Memory region on that rank.
    pub mr: u16,
    /// Byte offset of the run in the region.
    pub offset: u64,
    /// Bytes of the run (dense).
    pub len: u64,
    /// Where the encoding starts in the rank's inbox.
    pub inbox_offset: u64,
    /// Bytes of the encoding.
    pub enc_len: u64,
    /// The encoding.
    pub kind: DeltaKind,
    /// Bytes per element (1, 2, 4 or 8).
    pub elem: u8,
    /// The version the encoding applies on top of.
    pub base_version: u64,
}

/// What a sync's deltas came to, per worker (a trainer's writes, a rollout's applies) and summed
/// per sync by the controller.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct DeltaFigures {
    /// Bytes a full sync would have written to rollouts.
    pub dense_bytes: u64,
    /// Bytes written as encodings into inboxes.
    pub delta_bytes: u64,
    /// Bytes of runs written as deltas (their dense size).
    pub delta_run_bytes: u64,
    /// Elements compared (of the runs kept as bases).
    pub elements: u64,
    /// Of `elements`: those that changed (counted only in runs that went as deltas or were
    /// scanned to the end).
    pub changed: u64,
    /// Nanoseconds spent encoding (trainer) or applying (rollout).
    pub codec_ns: u64,
}

impl DeltaFigures {
    /// Adds `other` to these.
    pub fn add(&mut self, other: &DeltaFigures) {
        self.dense_bytes += other.dense_bytes;
        self.delta_bytes += other.delta_bytes;
        self.delta_run_bytes += other.delta_run_bytes;
        self.elements += other.elements;
        self.changed += other.changed;
        self.codec_ns += other.codec_ns;
    }

    /// Bytes on the wire for the rollouts' runs: encodings plus the runs that went dense.
    pub fn wire_bytes(&self) -> u64 {
        self.dense_bytes - self.delta_run_bytes + self.delta_bytes
    }
}

/// What the controller tells trainers in `Start`: the engines that take deltas this sync, all
/// of them holding `base_version`, committed by this controller's run of the job (every other
/// engine gets dense writes: it restarted, missed a version, or a failed sync left it invalid).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaBase {
    /// The version every engine in `rollouts` holds.
    pub base_version: u64,
    /// Rollout ranks taking deltas.
    pub rollouts: BTreeSet<u32>,
}
