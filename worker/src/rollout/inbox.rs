//! The receiver's half of a delta sync: its inbox, the version it holds, and applying deltas.
//!
//! The inbox is one more registered region, a fraction of the destination's size
//! ([`RolloutWorker::enable_delta_inbox`]); trainers write encodings there instead of dense
//! bytes into the destination (see [`crate::delta`]). Once every write of the version landed,
//! [`RolloutWorker::apply_deltas`] applies the version's records (the trainers' list, forwarded
//! like checksums) into the destination, and only then may [`RolloutWorker::verify`] compare
//! the whole destination with the trainers' checksums, exactly as for a full sync: every byte
//! of every run is hashed where it lies, whether it arrived dense or as a delta.
//!
//! The chain rule, the receiver's own guard: an engine holds version N once N landed and was
//! applied (or verified) without error; arming the next version drops it (the destination is
//! being rewritten), and a delta is applied only if its base is what the engine held when the
//! version was armed. A refused or failed apply, a failed verification or an abort leaves the
//! engine holding nothing, so only a full sync can follow. The controller decides the same
//! from its side; this guard makes a mistake there a failed sync, never silently wrong weights.
//!
//! Runs rewritten by an apply are hashed again by `verify` even if the round's early check
//! hashed them (it follows the fabric's frames, and an apply writes none).

use std::collections::BTreeSet;
use std::time::Instant;

use rayon::prelude::*;
use weightsync_common::fabric::{Access, FabricBackend, RegionDescriptor};
use weightsync_common::protocol::{DeltaFigures, DeltaRecord};

use super::RolloutWorker;
use super::early_check::RunKey;
use crate::delta::codec::decode;
use crate::error::{Result, WorkerError};

/// What the receiver knows of the versions it holds and this round's deltas.
#[derive(Debug, Default)]
pub(super) struct DeltaState {
    /// The version the destination holds whole (see the module docs).
    pub held: Option<u64>,
    /// What it held when the armed version was armed: the only base a delta may have.
    pub base: Option<u64>,
    /// The version armed (or landed, until applied and verified).
    pub round: Option<u64>,
    /// Runs rewritten by this round's apply (their early hashes are stale).
    pub applied: BTreeSet<RunKey>,
}

impl<F: FabricBackend> RolloutWorker<F> {
    /// Whether deltas can be applied here: not when landed bytes go on to device memory (they
    /// were copied there before an apply could run).
    pub fn can_apply_deltas(&self) -> bool {
        self.device.is_none()
    }

    /// Registers a delta inbox of `bytes` (at least one), so trainers may write deltas here
    /// (see the module docs). A fraction of the destination's bytes: runs whose encoding does
    /// not fit their share of it go dense.
    pub fn enable_delta_inbox(&mut self, bytes: u64) -> Result<()> {
        let inbox = self
            .fabric
            .alloc(bytes.max(1) as usize, Access::RECEIVE)
            .map_err(|e| {
                WorkerError::fabric(format!("{}: registering the delta inbox", self.name), e)
            })?;
        self.inbox = Some(inbox);
        Ok(())
    }

    /// The inbox's descriptor, for the trainers (`None`: this receiver takes no deltas).
    pub fn inbox_descriptor(&self) -> Option<RegionDescriptor> {
        self.inbox.as_ref().map(|r| r.descriptor().clone())
    }

    /// The version this receiver's destination holds whole, if any (see the module docs).
    pub fn held_version(&self) -> Option<u64> {
        self.delta.lock().held
    }

    /// A new round is armed for `version`: the destination is about to change.
    pub(super) fn delta_armed(&self, version: u64) {
        let mut d = self.delta.lock();
        d.base = d.held.take();
        d.round = Some(version);
        d.applied.clear();
    }

    /// The round failed or was aborted: the destination holds nothing certain.
    pub(super) fn delta_lost(&self) {
        let mut d = self.delta.lock();
        d.held = None;
        d.round = None;
    }

    /// An abort: a round not yet whole leaves the destination holding nothing certain; after
    /// one that was (verified), or with no round at all (the agent aborts whatever may be
    /// armed before each `Prepare`), what is held stays held.
    pub(super) fn delta_aborted(&self) {
        let mut d = self.delta.lock();
        if d.round.is_some() && d.held != d.round {
            d.held = None;
            d.round = None;
        }
    }

    /// The round's destination is whole and right (applied, or verified).
    pub(super) fn delta_held(&self) {
        let mut d = self.delta.lock();
        d.held = d.round;
    }

    /// Whether `run` was rewritten by this round's apply.
    pub(super) fn delta_applied(&self, run: &RunKey) -> bool {
        self.delta.lock().applied.contains(run)
    }

    /// Applies this round's deltas (records for other ranks are ignored) into the destination,
    /// after every write landed and before verifying. Refuses, naming the run, a record whose
    /// base is not the version held when the round was armed, one outside the regions or the
    /// inbox, or a malformed encoding; the engine then holds nothing (the next sync is full).
    pub fn apply_deltas(&self, records: &[DeltaRecord]) -> Result<DeltaFigures> {
        let rank = self.plan.rank;
        let start = Instant::now();
        let mine: Vec<&DeltaRecord> = records.iter().filter(|r| r.rollout == rank).collect();
        let res = self.apply_mine(&mine);
        match res {
            Ok(mut figures) => {
                let mut d = self.delta.lock();
                d.applied = mine.iter().map(|r| (r.mr, r.offset, r.len)).collect();
                d.held = d.round;
                figures.codec_ns = start.elapsed().as_nanos() as u64;
                Ok(figures)
            }
            Err(e) => {
                self.delta_lost();
                Err(e)
            }
        }
    }

    fn apply_mine(&self, mine: &[&DeltaRecord]) -> Result<DeltaFigures> {
        let rank = self.plan.rank;
        let base = self.delta.lock().base;
        if mine.is_empty() {
            return Ok(DeltaFigures::default());
        }
        let refuse = |r: &DeltaRecord, detail: String| WorkerError::Delta {
            rank,
            mr: r.mr,
            offset: r.offset,
            detail,
        };
        let inbox = self
            .inbox
            .as_ref()
            .ok_or_else(|| refuse(mine[0], "this receiver has no delta inbox".into()))?;
        if self.device.is_some() {
            // The landed bytes were already copied to the device: an apply here would not be.
            return Err(refuse(
                mine[0],
                "deltas into device memory are not supported (register no inbox)".into(),
            ));
        }
        // Check every record before touching the destination.
        for r in mine {
            if base != Some(r.base_version) {
                return Err(refuse(
                    r,
                    format!(
                        "it applies on top of version {}, this engine holds {}",
                        r.base_version,
                        base.map_or("none".to_string(), |v| v.to_string())
                    ),
                ));
            }
            let region = self
                .regions
                .get(r.mr as usize)
                .ok_or_else(|| refuse(r, format!("MR {} does not exist", r.mr)))?;
            if !region.descriptor().contains(r.offset, r.len) {
                return Err(refuse(r, format!("the run ends past MR {}", r.mr)));
            }
            if !inbox.descriptor().contains(r.inbox_offset, r.enc_len) {
                return Err(refuse(
                    r,
                    format!(
                        "its encoding ({} bytes at {}) ends past the inbox of {} bytes",
                        r.enc_len,
                        r.inbox_offset,
                        inbox.len()
                    ),
                ));
            }
        }
        let applied = mine.par_iter().map(|r| -> Result<(u64, u64)> {
            let enc = inbox
                .copy_to_vec(r.inbox_offset, r.enc_len as usize)
                .map_err(|e| WorkerError::fabric("reading the delta inbox", e))?;
            let elem = usize::from(r.elem);
            let changes =
                decode(&enc, r.kind, elem, r.len).map_err(|e| refuse(r, e.to_string()))?;
            let region = &self.regions[r.mr as usize];
            for &(index, at) in &changes {
                region
                    .write_at(r.offset + index * elem as u64, &enc[at..at + elem])
                    .map_err(|e| WorkerError::fabric("applying a delta", e))?;
            }
            Ok((changes.len() as u64, r.len / elem as u64))
        });
        let counts: Vec<(u64, u64)> = applied.collect::<Result<_>>()?;
        let mut figures = DeltaFigures::default();
        for (r, (changed, elements)) in mine.iter().zip(counts) {
            figures.delta_bytes += r.enc_len;
            figures.delta_run_bytes += r.len;
            figures.changed += changed;
            figures.elements += elements;
        }
        Ok(figures)
    }
}
