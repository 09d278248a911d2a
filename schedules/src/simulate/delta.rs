//! The bytes and memory traffic of a delta sync, per run, from the fraction of elements that
//! changed: what `weightsync simulate --changed F` predicts a delta sync with.
//!
//! Why a model of the encoding rather than a flat `F x bytes`: what a delta sync puts on the
//! wire is not the changed bytes but their encoding (`weightsync_worker::delta::codec`), chosen
//! per run, and a run whose encoding is too large goes dense. At 2% changed an fp8 run (one-byte
//! elements) costs about 4.2% of its bytes as gaps, a bf16 run about 3.1%; at 20% a bf16 run's
//! smaller encoding, its bitmap, is over the quarter of its bytes its inbox slot holds, and it
//! goes dense. And its time is not only the wire: the
//! trainer compares every byte it prepared with its base, and each engine applies the changes
//! into its weights before it verifies. This module computes, for one run of `len` bytes of
//! `elem`-byte elements at changed fraction `F` (changes independent and uniform, the expected
//! value of each size), exactly what the codec and the trainer's choice would do:
//!
//! - **gaps**: per change a LEB128 varint of the unchanged elements before it, then its `elem`
//!   bytes: `F n (elem + E[varint])`, where a gap is geometric, so `E[varint] = 1 + sum_k
//!   (1 - F)^(128^k)` (a varint takes `k + 1` bytes from a gap of `128^k` on);
//! - **bitmap**: `ceil(n / 8) + F n elem`;
//! - the smaller of the two goes if it is at most its capacity, the smaller of
//!   [`DeltaModel::max_fraction`] of the run's bytes (the trainer's threshold, 0.5) and the run's
//!   slot of the engine's inbox ([`DeltaModel::inbox_fraction`] of its bytes, 0.25 by default);
//!   an empty encoding still travels as one byte. Otherwise the run goes dense.
//!
//! Memory traffic, in bytes, at [`DeltaModel::scan_bytes_per_s`] per GPU (the simulator charges
//! the encode in the trainer's prepare stage and the apply on each engine after its last write
//! landed, before the barrier):
//! - **encode** (trainer, once per run however many replicas take it): read the new bytes and the
//!   base (`2 len`), copy the changed 64-byte blocks into the base (`t len`, with `t = 1 - (1 -
//!   F)^(64 / elem)` the fraction of blocks with a change), write the encoding. A run that goes
//!   dense is not scanned again (the worker remembers its fraction): its base takes the new bytes
//!   (`2 len`) and one block in 16 is compared (`2 len / 16`).
//! - **apply** (engine, per replica): read the encoding and rewrite every 64-byte line with a
//!   change (`2 t len`: read and write).
//!
//! Tasks that are plain copies (same dtype on both sides) keep no base and always go dense: the
//! worker writes them straight from the registered source and keeps no base for them unless told
//! to (`DeltaConfig::keep_direct`). Casts (f32 master weights to bf16) and fp8 quantisation keep
//! bases. fp8 tasks encode values and scales alike at a byte grain, as the codec does.

use serde::{Deserialize, Serialize};
use weightsync_common::protocol::DeltaKind;

use crate::simulate::SimError;
use crate::table::Transform;

/// Bytes compared at once by the codec, and the granule the memory traffic is counted in.
const BLOCK_BYTES: f64 = 64.0;

/// Of the blocks of a run that goes dense, one in this many is still compared (as the worker).
const SAMPLE_STRIDE: f64 = 16.0;

/// What a delta sync is simulated with.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DeltaModel {
    /// Fraction of elements that changed since the version the engines hold, in `[0, 1]`.
    pub changed: f64,
    /// Memory bandwidth of the encode and the apply, bytes per second per GPU.
    pub scan_bytes_per_s: f64,
    /// A run goes as a delta only if its encoding is at most this fraction of its bytes.
    pub max_fraction: f64,
    /// Each engine's inbox, as a fraction of its weights' bytes (a run's slot is its share).
    pub inbox_fraction: f64,
}

impl DeltaModel {
    /// The worker's defaults (threshold 0.5, inbox a quarter of the weights) at `changed`, the
    /// scan at `scan_bytes_per_s`.
    pub fn new(changed: f64, scan_bytes_per_s: f64) -> DeltaModel {
        DeltaModel {
            changed,
            scan_bytes_per_s,
            max_fraction: 0.5,
            inbox_fraction: 0.25,
        }
    }

    /// Checks every field, naming the one out of range.
    pub fn validate(&self) -> Result<(), SimError> {
        let fractions = [
            ("changed", self.changed),
            ("max_fraction", self.max_fraction),
            ("inbox_fraction", self.inbox_fraction),
        ];
        for (name, v) in fractions {
            if !(0.0..=1.0).contains(&v) {
                return Err(SimError::BadCluster(format!(
                    "delta.{name} must be a fraction in [0, 1], got {v}"
                )));
            }
        }
        if !(self.scan_bytes_per_s.is_finite() && self.scan_bytes_per_s > 0.0) {
            return Err(SimError::BadCluster(format!(
                "delta.scan_bytes_per_s must be a positive rate, got {}",
                self.scan_bytes_per_s
            )));
        }
        Ok(())
    }

    /// Expected bytes of the gaps encoding of `elems` elements of `elem` bytes.
    pub fn gaps_bytes(&self, elems: f64, elem: u64) -> f64 {
        let f = self.changed;
        if f <= 0.0 {
            return 0.0;
        }
        let keep = 1.0 - f;
        // P(gap >= 128^k) = (1 - F)^(128^k); gaps are below 2^64 (k <= 9).
        let longer: f64 = (1..=9)
            .map(|k| keep.powf(128f64.powi(k)))
            .take_while(|&p| p > 0.0)
            .sum();
        f * elems * (elem as f64 + 1.0 + longer)
    }

    /// Expected bytes of the bitmap encoding of `elems` elements of `elem` bytes.
    pub fn bitmap_bytes(&self, elems: f64, elem: u64) -> f64 {
        (elems / 8.0).ceil() + self.changed * elems * elem as f64
    }

    /// Fraction of a run's 64-byte blocks that hold at least one change.
    pub fn touched(&self, elem: u64) -> f64 {
        let per_block = (BLOCK_BYTES / elem as f64).max(1.0);
        1.0 - (1.0 - self.changed).powf(per_block)
    }

    /// The most bytes a run of `len` bytes may encode into: the trainer's threshold and the
    /// run's slot of its engine's inbox.
    pub fn capacity(&self, len: u64) -> f64 {
        let len = len as f64;
        (len * self.max_fraction)
            .floor()
            .min((len * self.inbox_fraction).floor())
    }

    /// What a run of `len` bytes of `elem`-byte elements comes to (see the module docs).
    pub fn run(&self, len: u64, elem: u64) -> RunDelta {
        let elem = elem.max(1);
        let bytes = len as f64;
        let elems = (len / elem) as f64;
        let gaps = self.gaps_bytes(elems, elem);
        let bitmap = self.bitmap_bytes(elems, elem);
        let (kind, enc) = if bitmap < gaps {
            (DeltaKind::Bitmap, bitmap)
        } else {
            (DeltaKind::Gaps, gaps)
        };
        // An empty encoding still travels as one byte (the write carries the immediate).
        let wire = enc.max(1.0);
        if wire <= self.capacity(len) {
            let t = self.touched(elem);
            RunDelta {
                kind: Some(kind),
                wire_bytes: wire,
                encode_bytes: 2.0 * bytes + t * bytes + enc,
                apply_bytes: enc + 2.0 * t * bytes,
            }
        } else {
            RunDelta {
                kind: None,
                wire_bytes: bytes,
                encode_bytes: 2.0 * bytes + 2.0 * bytes / SAMPLE_STRIDE,
                apply_bytes: 0.0,
            }
        }
    }
}

/// What one run of a delta sync costs (expected values).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RunDelta {
    /// The encoding that goes (`None`: the run goes dense).
    pub kind: Option<DeltaKind>,
    /// Bytes on the wire: the encoding, or the run's bytes when it goes dense.
    pub wire_bytes: f64,
    /// Memory traffic of the trainer's compare, base update and encoding, bytes.
    pub encode_bytes: f64,
    /// Memory traffic of the engine's apply, bytes (0 for a dense run).
    pub apply_bytes: f64,
}

/// Bytes per element of a task's runs, as the codec sees them: 1 for fp8 (values and scales
/// alike), else the output dtype's size.
pub fn element_size(transform: &Transform) -> u64 {
    match transform {
        Transform::Fp8Block { .. } => 1,
        t => (t.output_dtype().size() as u64).clamp(1, 8),
    }
}

/// Whether a task's trainer keeps a base for it (and so can send deltas): every task but plain
/// copies, which the worker writes straight from the source (see the module docs).
pub fn keeps_base(transform: &Transform) -> bool {
    !matches!(transform, Transform::Copy { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic Bernoulli(`f`) change pattern of `n` elements (xorshift).
    fn pattern(n: usize, f: f64, seed: u64) -> Vec<bool> {
        let mut s = seed | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 11) as f64 / (1u64 << 53) as f64) < f
            })
            .collect()
    }

    /// The codec's exact sizes of a change pattern (`weightsync_worker::delta::codec`): gaps =
    /// per change a LEB128 varint of the unchanged run before it plus `elem` bytes; bitmap =
    /// `ceil(n / 8)` plus `elem` bytes per change.
    fn codec_sizes(changes: &[bool], elem: u64) -> (u64, u64) {
        let varint_len = |v: u64| (64 - v.max(1).leading_zeros() as u64).div_ceil(7);
        let (mut gaps, mut next, mut changed) = (0u64, 0u64, 0u64);
        for (i, &c) in changes.iter().enumerate() {
            if c {
                gaps += varint_len(i as u64 - next) + elem;
                next = i as u64 + 1;
                changed += 1;
            }
        }
        (gaps, (changes.len() as u64).div_ceil(8) + changed * elem)
    }

    #[test]
    fn expected_sizes_match_the_codec_on_random_changes() {
        let n = 1 << 20;
        for (f, elem) in [(0.02, 1), (0.02, 2), (0.003, 1), (0.15, 2), (0.5, 4)] {
            let m = DeltaModel::new(f, 1e12);
            let (gaps, bitmap) = codec_sizes(&pattern(n, f, 7), elem);
            let (mg, mb) = (m.gaps_bytes(n as f64, elem), m.bitmap_bytes(n as f64, elem));
            for (what, model, codec) in [("gaps", mg, gaps), ("bitmap", mb, bitmap)] {
                let err = (model - codec as f64).abs() / codec as f64;
                assert!(
                    err < 0.01,
                    "F={f} elem={elem} {what}: model {model} codec {codec}"
                );
            }
        }
    }

    #[test]
    fn sparse_runs_go_as_gaps_dense_ones_as_bitmaps_and_too_dense_ones_dense() {
        let len = 1 << 20;
        // fp8 at 2%: about 2.08 bytes per change (a 1-byte gap mostly, 2 bytes from 128 on).
        let r = DeltaModel::new(0.02, 1e12).run(len, 1);
        assert_eq!(r.kind, Some(DeltaKind::Gaps));
        let per_change = r.wire_bytes / (0.02 * len as f64);
        assert!((2.07..2.09).contains(&per_change), "{per_change}");
        // bf16 at 10%: gaps (1.5 x 0.1 of the bytes) beat the bitmap (1/16 + 0.1).
        let r = DeltaModel::new(0.10, 1e12).run(len, 2);
        assert_eq!(r.kind, Some(DeltaKind::Gaps));
        // bf16 at 15%: the bitmap (1/16 + 0.15) beats gaps (0.225) and fits the quarter.
        let r = DeltaModel::new(0.15, 1e12).run(len, 2);
        assert_eq!(r.kind, Some(DeltaKind::Bitmap));
        assert!((r.wire_bytes / len as f64 - (1.0 / 16.0 + 0.15)).abs() < 1e-6);
        // bf16 at 20%: the bitmap (1/16 + 0.2) is over the inbox's quarter: dense.
        let r = DeltaModel::new(0.20, 1e12).run(len, 2);
        assert_eq!(r.kind, None);
        assert_eq!(r.wire_bytes, len as f64);
        assert_eq!(r.apply_bytes, 0.0);
        // ... but fits a whole-size inbox: then the trainer's 0.5 threshold is the cap.
        let mut m = DeltaModel::new(0.20, 1e12);
        m.inbox_fraction = 1.0;
        assert_eq!(m.run(len, 2).kind, Some(DeltaKind::Bitmap));
        m.changed = 0.45; // 1/16 + 0.45 > 0.5
        assert_eq!(m.run(len, 2).kind, None);
    }

    #[test]
    fn nothing_changed_still_writes_a_byte_per_run_and_scans_it() {
        let r = DeltaModel::new(0.0, 1e12).run(4096, 2);
        assert_eq!(r.kind, Some(DeltaKind::Gaps));
        assert_eq!(r.wire_bytes, 1.0);
        // Read new and base; no block changed, nothing to apply.
        assert_eq!(r.encode_bytes, 2.0 * 4096.0);
        assert_eq!(r.apply_bytes, 0.0);
        // A run too short for even one byte of inbox goes dense.
        assert_eq!(DeltaModel::new(0.0, 1e12).run(2, 2).kind, None);
    }

    #[test]
    fn out_of_range_fields_are_named() {
        let e = DeltaModel::new(1.5, 1e12).validate().unwrap_err();
        assert!(e.to_string().contains("delta.changed"), "{e}");
        let e = DeltaModel::new(0.1, 0.0).validate().unwrap_err();
        assert!(e.to_string().contains("scan_bytes_per_s"), "{e}");
        assert!(DeltaModel::new(0.02, 1e12).validate().is_ok());
    }
}
