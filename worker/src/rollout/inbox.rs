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
//! The apply hashes each run it rewrites in the pass that patches it (one read of the run; see
//! [`patch_hashed`]), and `verify` compares that hash with the trainer's checksum on the same
//! terms as a hash the round's early check took while the run landed: only if the landing log
//! shows that no frame touched the run since the apply read it; otherwise (or with no log) the
//! run is read and hashed again. An early hash taken of such a run before the apply is never
//! used (it follows the fabric's frames, and an apply writes none). Either way every byte of
//! every run is compared with the trainer's prepared bytes.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::time::Instant;

use rayon::prelude::*;
use weightsync_common::fabric::{Access, FabricBackend, RegionDescriptor};
use weightsync_common::protocol::{DeltaFigures, DeltaRecord};

use super::RolloutWorker;
use super::early_check::RunKey;
use crate::checksum::HASH_CHUNK;
use crate::delta::codec::Changes;
use crate::error::{Result, WorkerError};
use weightsync_common::fabric::{FabricError, Region};
use xxhash_rust::xxh3::Xxh3;

/// What the receiver knows of the versions it holds and this round's deltas.
#[derive(Debug, Default)]
pub(super) struct DeltaState {
    /// The version the destination holds whole (see the module docs).
    pub held: Option<u64>,
    /// What it held when the armed version was armed: the only base a delta may have.
    pub base: Option<u64>,
    /// The version armed (or landed, until applied and verified).
    pub round: Option<u64>,
    /// Runs rewritten by this round's apply (their early hashes are stale): the hash the apply
    /// took of each, and the landing log's sequence number read before it read the run (`None`:
    /// no log, the run is hashed again when verified).
    pub applied: BTreeMap<RunKey, (u64, Option<u64>)>,
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

    /// Whether `run` was rewritten by this round's apply: then the hash the apply took of it
    /// and the landing log's sequence number it was taken after.
    pub(super) fn delta_applied(&self, run: &RunKey) -> Option<(u64, Option<u64>)> {
        self.delta.lock().applied.get(run).copied()
    }

    /// Applies this round's deltas (records for other ranks are ignored) into the destination,
    /// after every write landed and before verifying. Refuses, naming the run, a record whose
    /// base is not the version held when the round was armed, one outside the regions or the
    /// inbox, or a malformed encoding; the engine then holds nothing (the next sync is full).
    pub fn apply_deltas(&self, records: &[DeltaRecord]) -> Result<DeltaFigures> {
        let rank = self.plan.rank;
        let start = Instant::now();
        let mine: Vec<&DeltaRecord> = records.iter().filter(|r| r.rollout == rank).collect();
        // Read before any run is: a frame that ended by now is wholly in memory.
        let seq = self.landing.as_ref().map(|l| l.seq());
        let res = self.apply_mine(&mine);
        match res {
            Ok((mut figures, hashes)) => {
                let mut d = self.delta.lock();
                d.applied = mine
                    .iter()
                    .zip(hashes)
                    .map(|(r, h)| ((r.mr, r.offset, r.len), (h, seq)))
                    .collect();
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

    /// Checks and applies `mine`: the figures, and per record the hash of its run after the
    /// apply.
    fn apply_mine(&self, mine: &[&DeltaRecord]) -> Result<(DeltaFigures, Vec<u64>)> {
        let rank = self.plan.rank;
        let base = self.delta.lock().base;
        if mine.is_empty() {
            return Ok((DeltaFigures::default(), Vec::new()));
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
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let applied = mine.par_iter().map(|r| -> Result<(u64, u64, u64)> {
            let enc = inbox
                .copy_to_vec(r.inbox_offset, r.enc_len as usize)
                .map_err(|e| WorkerError::fabric("reading the delta inbox", e))?;
            let elem = usize::from(r.elem);
            let changes =
                Changes::check(&enc, r.kind, elem, r.len).map_err(|e| refuse(r, e.to_string()))?;
            let region = &self.regions[r.mr as usize];
            let hash = SCRATCH
                .with_borrow_mut(|scratch| {
                    patch_hashed(region, r.offset, r.len, elem, &changes, scratch)
                })
                .map_err(|e| WorkerError::fabric("applying a delta", e))?;
            Ok((changes.len(), r.len / elem as u64, hash))
        });
        let counts: Vec<(u64, u64, u64)> = applied.collect::<Result<_>>()?;
        let mut figures = DeltaFigures::default();
        let mut hashes = Vec::with_capacity(counts.len());
        for (r, (changed, elements, hash)) in mine.iter().zip(counts) {
            figures.delta_bytes += r.enc_len;
            figures.delta_run_bytes += r.len;
            figures.changed += changed;
            figures.elements += elements;
            hashes.push(hash);
        }
        Ok((figures, hashes))
    }
}

/// Where [`patch`] reads and writes a run's bytes: a registered region (a plain buffer in tests).
trait RunBytes {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> std::result::Result<(), FabricError>;
    fn write_at(&self, offset: u64, data: &[u8]) -> std::result::Result<(), FabricError>;
}

impl RunBytes for Region {
    fn read_at(&self, offset: u64, out: &mut [u8]) -> std::result::Result<(), FabricError> {
        Region::read_at(self, offset, out)
    }
    fn write_at(&self, offset: u64, data: &[u8]) -> std::result::Result<(), FabricError> {
        Region::write_at(self, offset, data)
    }
}

/// Writes `changes` into the run of `len` bytes at `offset` of `region` and returns the
/// [`xxh3`](crate::checksum::xxh3) of the whole run as it then is, in one pass: the run is read
/// a window of `scratch` ([`HASH_CHUNK`] bytes) at a time, the window's changes are written into
/// the copy, the 64-byte blocks they touched are written back (neighbours coalesced), and the
/// copy, still in the cache, is hashed. The apply and the verification's hash of a delta run
/// thus cost one read of it instead of a read and write (the apply) and another read (verify).
fn patch_hashed(
    region: &impl RunBytes,
    offset: u64,
    len: u64,
    elem: usize,
    changes: &Changes<'_>,
    scratch: &mut Vec<u8>,
) -> std::result::Result<u64, FabricError> {
    if scratch.len() < HASH_CHUNK {
        scratch.resize(HASH_CHUNK, 0);
    }
    let chunk = HASH_CHUNK as u64;
    let mut window = Window {
        lo: 0,
        n: 0,
        dirty: [0u64; HASH_CHUNK / BLOCK / 64],
    };
    let mut hasher = Xxh3::new();
    let mut failed = None;
    // Hashes and writes back the loaded window, then loads the next one.
    let mut next_window = |w: &mut Window, scratch: &mut [u8]| {
        let buf = &scratch[..w.n];
        hasher.update(buf);
        w.flush(region, offset, buf)?;
        w.lo += w.n as u64;
        w.n = chunk.min(len - w.lo) as usize;
        region.read_at(offset + w.lo, &mut scratch[..w.n])
    };
    if len > 0 {
        window.n = chunk.min(len) as usize;
        region.read_at(offset, &mut scratch[..window.n])?;
    }
    changes.for_each(|index, v| {
        if failed.is_some() {
            return;
        }
        let at = index * elem as u64;
        // Elements never straddle a window: `elem` divides the chunk.
        while at >= window.lo + window.n as u64 {
            if let Err(e) = next_window(&mut window, scratch) {
                failed = Some(e);
                return;
            }
        }
        let from = (at - window.lo) as usize;
        scratch[from..from + elem].copy_from_slice(v);
        let block = from / BLOCK;
        window.dirty[block / 64] |= 1 << (block % 64);
    });
    if let Some(e) = failed {
        return Err(e);
    }
    while window.n > 0 {
        next_window(&mut window, scratch)?;
    }
    Ok(hasher.digest())
}

/// Bytes compared as one unit by [`Window::flush`]: a cache line.
const BLOCK: usize = 64;

/// The window of a run [`patch_hashed`] holds: its start in the run, its length, and which of its
/// 64-byte blocks were patched.
struct Window {
    lo: u64,
    n: usize,
    dirty: [u64; HASH_CHUNK / BLOCK / 64],
}

impl Window {
    /// Writes the patched blocks of `buf` (the window) back to the run at `offset` of `region`,
    /// each stretch of adjacent patched blocks in one write, and clears the marks.
    fn flush(
        &mut self,
        region: &impl RunBytes,
        offset: u64,
        buf: &[u8],
    ) -> std::result::Result<(), FabricError> {
        let blocks = buf.len().div_ceil(BLOCK);
        let mut b = 0usize;
        while b < blocks {
            if self.dirty[b / 64] & (1 << (b % 64)) == 0 {
                b += 1;
                continue;
            }
            let first = b;
            while b < blocks && self.dirty[b / 64] & (1 << (b % 64)) != 0 {
                b += 1;
            }
            let range = first * BLOCK..(b * BLOCK).min(buf.len());
            region.write_at(offset + self.lo + range.start as u64, &buf[range])?;
        }
        self.dirty = [0u64; HASH_CHUNK / BLOCK / 64];
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::delta::codec::encode;

    impl RunBytes for RefCell<Vec<u8>> {
        fn read_at(&self, offset: u64, out: &mut [u8]) -> std::result::Result<(), FabricError> {
            let o = offset as usize;
            out.copy_from_slice(&self.borrow()[o..o + out.len()]);
            Ok(())
        }
        fn write_at(&self, offset: u64, data: &[u8]) -> std::result::Result<(), FabricError> {
            let o = offset as usize;
            self.borrow_mut()[o..o + data.len()].copy_from_slice(data);
            Ok(())
        }
    }

    /// Runs patched at any density (over several windows, the last one partial) end as the new
    /// run, the hash taken on the way is the new run's, and around the run nothing moves.
    #[test]
    fn patching_a_run_at_any_density_gives_the_new_run() {
        let elem = 2;
        let len = 3 * HASH_CHUNK + 2 * 1000;
        let base: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        for every in [1usize, 3, 40, 300, 5000] {
            let mut new = base.clone();
            for e in (every / 2..len / elem).step_by(every) {
                new[e * elem + e % 2] ^= 0x5a;
            }
            let mut out = vec![0u8; len * 2];
            let enc = encode(&mut base.clone(), &new, elem, &mut out).unwrap();
            let changes = Changes::check(&out[..enc.len], enc.kind, elem, len as u64).unwrap();
            // The run at byte 6 of a larger region: the bytes around it stay as they were.
            let mut region = vec![9u8; len + 12];
            region[6..6 + len].copy_from_slice(&base);
            let region = RefCell::new(region);
            let mut scratch = Vec::new();
            let hash = patch_hashed(&region, 6, len as u64, elem, &changes, &mut scratch).unwrap();
            assert_eq!(
                hash,
                crate::checksum::xxh3(&new),
                "a change every {every} elements"
            );
            let got = region.into_inner();
            assert_eq!(
                &got[6..6 + len],
                &new[..],
                "a change every {every} elements"
            );
            assert_eq!((&got[..6], &got[6 + len..]), (&[9u8; 6][..], &[9u8; 6][..]));
        }
    }
}
