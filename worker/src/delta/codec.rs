//! The delta encoding of one run of prepared bytes against the bytes its destination holds.
//!
//! A run is a sequence of elements of `elem` bytes (2 for bf16 / f16, 4 for f32, 1 for fp8
//! values and, in an fp8 task, its scales too). An element either equals its base or changed;
//! only changed elements travel. Two encodings, chosen per run by which is smaller:
//! - [`DeltaKind::Gaps`]: per changed element a LEB128 varint of the number of unchanged
//!   elements before it (since the previous changed one), then its `elem` new bytes. About
//!   `1 + elem` bytes per change while changes are denser than one in 128 elements, `2 + elem`
//!   to one in 16384: the encoding of sparse runs (fp8 at RL learning rates: ~3 bytes per change).
//! - [`DeltaKind::Bitmap`]: one bit per element (set: changed), then the changed elements' new
//!   bytes in order. `n / 8 + changes * elem` bytes: the encoding of dense runs.
//!
//! A run whose smaller encoding does not fit its capacity (the caller's threshold: at most half
//! the dense bytes, and what the receiver's inbox has for it) is not encoded: it goes dense, as
//! every run did before deltas. The scan stops as soon as both encodings are known too big, so
//! a run that changed a lot costs a partial compare, not a full one.
//!
//! [`encode`] is one pass: it compares 64-byte blocks as eight words and skips equal ones whole
//! (at RL learning rates most blocks of a bf16 run are equal to their base), writes the changes
//! straight into the encoding it expects to be the smaller (the caller's guess from the
//! previous sync), rewrites what it wrote as the other one if that turns out smaller or the
//! guess outgrows the capacity, and brings the caller's base up to date as it goes (only the
//! changed blocks are copied).
//!
//! [`apply`] is the receiver's half. It trusts nothing: an encoding that runs past its end,
//! names an element past the run or leaves trailing bytes is an error naming what was wrong,
//! and nothing is written until the whole encoding was checked.

use thiserror::Error;
use weightsync_common::protocol::DeltaKind;

/// What [`encode`] made of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoded {
    /// The encoding chosen.
    pub kind: DeltaKind,
    /// Bytes of the encoding written at the start of the output buffer.
    pub len: usize,
    /// Elements that differ from the base.
    pub changed: u64,
}

/// A run [`encode`] refused: neither encoding fits its capacity (the run goes dense).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overflow {
    /// Elements compared before the scan stopped.
    pub scanned: u64,
    /// Of those, the ones that changed.
    pub changed: u64,
}

/// Why an encoding cannot be applied (the receiver's checks; see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DeltaError {
    /// The run is not a whole number of elements.
    #[error("a run of {len} bytes is not a whole number of {elem}-byte elements")]
    Misaligned {
        /// Bytes of the run.
        len: usize,
        /// Element size.
        elem: usize,
    },
    /// The element size is not 1, 2, 4 or 8.
    #[error("element size {0} is not 1, 2, 4 or 8")]
    ElementSize(usize),
    /// The encoding ends inside a varint or an element's bytes.
    #[error("the encoding ends at byte {at} inside a change ({len} bytes in all)")]
    Truncated {
        /// Where it ended.
        at: usize,
        /// Its length.
        len: usize,
    },
    /// A change names an element past the end of the run.
    #[error("a change names element {index} of a run of {elems} elements")]
    OutOfRange {
        /// The element named.
        index: u64,
        /// Elements in the run.
        elems: u64,
    },
    /// A bitmap encoding's length disagrees with the number of bits set.
    #[error("a bitmap of {set} set bits needs {need} bytes, the encoding has {len}")]
    BitmapLength {
        /// Bits set.
        set: u64,
        /// Bytes that many changes need.
        need: usize,
        /// Bytes of the encoding.
        len: usize,
    },
}

fn check_elem(len: usize, elem: usize) -> Result<(), DeltaError> {
    if !matches!(elem, 1 | 2 | 4 | 8) {
        return Err(DeltaError::ElementSize(elem));
    }
    if !len.is_multiple_of(elem) {
        return Err(DeltaError::Misaligned { len, elem });
    }
    Ok(())
}

/// Bytes of the LEB128 varint of `v`.
fn varint_len(v: u64) -> usize {
    (64 - v.max(1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(out: &mut [u8], mut at: usize, mut v: u64) -> usize {
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out[at] = byte;
            return at + 1;
        }
        out[at] = byte | 0x80;
        at += 1;
    }
}

fn get_varint(enc: &[u8], mut at: usize) -> Result<(u64, usize), DeltaError> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *enc
            .get(at)
            .ok_or(DeltaError::Truncated { at, len: enc.len() })?;
        at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok((v, at));
        }
    }
    Err(DeltaError::Truncated { at, len: enc.len() })
}

/// Bytes compared at once: a block equal to its base is skipped whole.
const BLOCK: usize = 64;

/// The encoding being written, switched on the fly (see [`encode`]).
struct Writer<'a> {
    out: &'a mut [u8],
    elem: usize,
    kind: DeltaKind,
    /// Bytes of the encoding written (gaps), or the end of the values (bitmap).
    at: usize,
    bitmap_bytes: usize,
    /// The exact sizes both encodings would have so far.
    gaps_len: usize,
    changed: u64,
    /// Index after the last change (gaps are counted from it).
    next: u64,
}

impl Writer<'_> {
    fn bitmap_len(&self) -> usize {
        self.bitmap_bytes + self.changed as usize * self.elem
    }

    fn start(&mut self, kind: DeltaKind) {
        self.kind = kind;
        self.at = 0;
        if kind == DeltaKind::Bitmap {
            self.out[..self.bitmap_bytes].fill(0);
            self.at = self.bitmap_bytes;
        }
    }

    /// Rewrites what was written so far as `kind` (both encodings list the same changes).
    fn convert(&mut self, kind: DeltaKind, run_len: u64) {
        let len = self.at;
        let old: Vec<u8> = self.out[..len].to_vec();
        let changes = decode(&old, self.kind, self.elem, run_len).expect("our own encoding");
        self.start(kind);
        let mut next = 0u64;
        for (i, from) in changes {
            self.put(i, &old[from..from + self.elem], &mut next);
        }
    }

    /// Writes change `i` with its new bytes `v` (no size checks; `next` is the gaps cursor).
    fn put(&mut self, i: u64, v: &[u8], next: &mut u64) {
        match self.kind {
            DeltaKind::Gaps => self.at = put_varint(self.out, self.at, i - *next),
            DeltaKind::Bitmap => self.out[(i / 8) as usize] |= 1 << (i % 8),
        }
        self.out[self.at..self.at + self.elem].copy_from_slice(v);
        self.at += self.elem;
        *next = i + 1;
    }

    /// Records change `i`; `false` when neither encoding fits the capacity any more.
    fn change(&mut self, i: u64, v: &[u8], run_len: u64) -> bool {
        self.gaps_len += varint_len(i - self.next) + self.elem;
        self.changed += 1;
        let cap = self.out.len();
        let fits = match self.kind {
            DeltaKind::Gaps if self.gaps_len > cap => {
                if self.bitmap_len() > cap {
                    return false;
                }
                // The gaps outgrew the capacity: the bitmap still fits, carry on as one.
                self.convert(DeltaKind::Bitmap, run_len);
                true
            }
            DeltaKind::Gaps => true,
            DeltaKind::Bitmap if self.bitmap_len() > cap => {
                if self.gaps_len > cap {
                    return false;
                }
                // Started as a bitmap on a guess, but the changes are sparse: gaps fit.
                self.convert(DeltaKind::Gaps, run_len);
                true
            }
            DeltaKind::Bitmap => true,
        };
        if !fits {
            return false;
        }
        let mut next = self.next;
        self.put(i, v, &mut next);
        self.next = next;
        true
    }
}

/// Encodes the changes of `new` against `base` into `out` (its length is the capacity), starting
/// as `start` (the encoding the caller expects to be the smaller: [`DeltaKind::Gaps`] for sparse
/// runs), and brings `base` up to `new` on the way: one pass over both, 64-byte blocks equal to
/// their base skipped whole, only changed blocks copied into the base. Of the two encodings the
/// smaller is returned; when neither fits, the scan stops there and the rest of the base is
/// copied (the run goes dense), and the error says how far it looked.
///
/// # Panics
/// If `new` and `base` differ in length or `elem` does not divide it (callers pass runs of
/// whole elements, see [`element_size`](super::element_size)).
pub fn encode(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    out: &mut [u8],
    start: DeltaKind,
) -> Result<Encoded, Overflow> {
    assert_eq!(base.len(), new.len(), "a delta compares runs of one length");
    check_elem(new.len(), elem).expect("runs of whole elements");
    let run_len = new.len() as u64;
    let elems = run_len / elem as u64;
    let bitmap_bytes = elems.div_ceil(8) as usize;
    let mut w = Writer {
        out,
        elem,
        kind: DeltaKind::Gaps,
        at: 0,
        bitmap_bytes,
        gaps_len: 0,
        changed: 0,
        next: 0,
    };
    let start = if start == DeltaKind::Bitmap && bitmap_bytes <= w.out.len() {
        DeltaKind::Bitmap
    } else {
        DeltaKind::Gaps
    };
    w.start(start);
    let per_word = 8 / elem;
    let mask = if elem == 8 {
        u64::MAX
    } else {
        (1u64 << (elem * 8)) - 1
    };
    let word = |s: &[u8], k: usize| u64::from_le_bytes(s[k * 8..k * 8 + 8].try_into().expect("8"));
    let blocks = new.len() / BLOCK;
    for b in 0..blocks {
        let r = b * BLOCK..(b + 1) * BLOCK;
        let (x, y) = (&base[r.clone()], &new[r.clone()]);
        let mut any = 0u64;
        for k in 0..BLOCK / 8 {
            any |= word(x, k) ^ word(y, k);
        }
        if any == 0 {
            continue;
        }
        for k in 0..BLOCK / 8 {
            let diff = word(x, k) ^ word(y, k);
            if diff == 0 {
                continue;
            }
            for e in 0..per_word {
                if (diff >> (e * elem * 8)) & mask == 0 {
                    continue;
                }
                let at = r.start + k * 8 + e * elem;
                if !w.change((at / elem) as u64, &new[at..at + elem], run_len) {
                    let scanned = (at / elem) as u64 + 1;
                    base[r.start..].copy_from_slice(&new[r.start..]);
                    return Err(Overflow {
                        scanned,
                        changed: w.changed,
                    });
                }
            }
        }
        base[r.clone()].copy_from_slice(&new[r]);
    }
    let tail = blocks * BLOCK;
    for at in (tail..new.len()).step_by(elem) {
        if base[at..at + elem] != new[at..at + elem]
            && !w.change((at / elem) as u64, &new[at..at + elem], run_len)
        {
            let scanned = (at / elem) as u64 + 1;
            base[tail..].copy_from_slice(&new[tail..]);
            return Err(Overflow {
                scanned,
                changed: w.changed,
            });
        }
    }
    base[tail..].copy_from_slice(&new[tail..]);
    // The smaller of the two (both sizes are exact): switch if the other one is.
    let cap = w.out.len();
    let bitmap_len = w.bitmap_len();
    match w.kind {
        DeltaKind::Gaps if bitmap_len < w.gaps_len && bitmap_len <= cap => {
            w.convert(DeltaKind::Bitmap, run_len);
        }
        DeltaKind::Bitmap if w.gaps_len <= bitmap_len => w.convert(DeltaKind::Gaps, run_len),
        _ => {}
    }
    debug_assert_eq!(w.at, w.gaps_len.min(bitmap_len));
    Ok(Encoded {
        kind: w.kind,
        len: w.at,
        changed: w.changed,
    })
}

/// Counts the changed elements of every `stride`-th 64-byte block of `new` against `base`:
/// `(elements compared, changed)`, an estimate of a run's changed fraction at `1 / stride` of
/// a full compare's cost (a run that went dense still tells the next sync what to expect).
pub fn sample_changes(base: &[u8], new: &[u8], elem: usize, stride: usize) -> (u64, u64) {
    let (mut scanned, mut changed) = (0u64, 0u64);
    for b in (0..new.len() / BLOCK).step_by(stride.max(1)) {
        let r = b * BLOCK..(b + 1) * BLOCK;
        scanned += (BLOCK / elem) as u64;
        if base[r.clone()] == new[r.clone()] {
            continue;
        }
        changed += base[r.clone()]
            .chunks_exact(elem)
            .zip(new[r].chunks_exact(elem))
            .filter(|(a, b)| a != b)
            .count() as u64;
    }
    (scanned, changed)
}

/// Checks an encoding made by [`encode`] for a run of `run_len` bytes, returning each change
/// as `(element index, where its bytes start in enc)`, in order.
pub fn decode(
    enc: &[u8],
    kind: DeltaKind,
    elem: usize,
    run_len: u64,
) -> Result<Vec<(u64, usize)>, DeltaError> {
    check_elem(run_len as usize, elem)?;
    let elems = run_len / elem as u64;
    let mut changes: Vec<(u64, usize)> = Vec::new();
    match kind {
        DeltaKind::Gaps => {
            let (mut at, mut next) = (0usize, 0u64);
            while at < enc.len() {
                let (gap, after) = get_varint(enc, at)?;
                let index = next.saturating_add(gap);
                if index >= elems {
                    return Err(DeltaError::OutOfRange { index, elems });
                }
                if after + elem > enc.len() {
                    return Err(DeltaError::Truncated {
                        at: enc.len(),
                        len: enc.len(),
                    });
                }
                changes.push((index, after));
                at = after + elem;
                next = index + 1;
            }
        }
        DeltaKind::Bitmap => {
            let bitmap_bytes = elems.div_ceil(8) as usize;
            if enc.len() < bitmap_bytes {
                return Err(DeltaError::Truncated {
                    at: enc.len(),
                    len: enc.len(),
                });
            }
            let set: u64 = enc[..bitmap_bytes]
                .iter()
                .map(|b| u64::from(b.count_ones()))
                .sum();
            let need = bitmap_bytes + set as usize * elem;
            if need != enc.len() {
                return Err(DeltaError::BitmapLength {
                    set,
                    need,
                    len: enc.len(),
                });
            }
            let mut at = bitmap_bytes;
            for (byte_at, &byte) in enc[..bitmap_bytes].iter().enumerate() {
                let mut bits = byte;
                while bits != 0 {
                    let bit = u64::from(bits.trailing_zeros());
                    bits &= bits - 1;
                    let index = byte_at as u64 * 8 + bit;
                    if index >= elems {
                        return Err(DeltaError::OutOfRange { index, elems });
                    }
                    changes.push((index, at));
                    at += elem;
                }
            }
        }
    }
    Ok(changes)
}

/// Applies an encoding made by [`encode`] to `dst` (the run as the destination holds it),
/// checking all of it before writing anything; returns the number of elements changed.
pub fn apply(dst: &mut [u8], enc: &[u8], kind: DeltaKind, elem: usize) -> Result<u64, DeltaError> {
    let changes = decode(enc, kind, elem, dst.len() as u64)?;
    for &(index, at) in &changes {
        let to = index as usize * elem;
        dst[to..to + elem].copy_from_slice(&enc[at..at + elem]);
    }
    Ok(changes.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A base, a new run that differs from it at `flips` (element indices), and the element size.
    fn runs() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, usize)> {
        (
            prop::sample::select(vec![1usize, 2, 4, 8]),
            0usize..600,
            any::<u64>(),
        )
            .prop_flat_map(|(elem, elems, seed)| {
                let len = elems * elem;
                (
                    Just(elem),
                    prop::collection::vec(any::<u8>(), len),
                    // Per element: how likely it changed, from none to all.
                    prop::sample::select(vec![0.0f64, 0.001, 0.01, 0.1, 0.5, 1.0]),
                    Just(seed),
                )
            })
            .prop_map(|(elem, base, p, seed)| {
                let mut new = base.clone();
                let mut s = seed | 1;
                for e in 0..base.len() / elem {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    if (s % 10_000) as f64 / 10_000.0 < p {
                        // Change one byte of the element (any byte: the compare must see it).
                        let b = e * elem + (s >> 32) as usize % elem;
                        new[b] = new[b].wrapping_add(1 + (s >> 40) as u8 % 255);
                    }
                }
                (base, new, elem)
            })
    }

    /// The exact size of the gaps encoding, counted the slow way.
    fn gaps_len(base: &[u8], new: &[u8], elem: usize) -> usize {
        let (mut len, mut prev) = (0, 0u64);
        for e in 0..(new.len() / elem) as u64 {
            let r = e as usize * elem..(e as usize + 1) * elem;
            if base[r.clone()] != new[r] {
                len += varint_len(e - prev) + elem;
                prev = e + 1;
            }
        }
        len
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        /// Whatever fits, applied to the base, gives exactly the new run; what does not fit is
        /// refused only when both encodings are over the capacity.
        #[test]
        fn applying_an_encoding_to_the_base_gives_the_new_run(
            (base, new, elem) in runs(),
            cap_frac in prop::sample::select(vec![0.0f64, 0.05, 0.25, 0.5, 2.0]),
            bitmap_first in any::<bool>(),
        ) {
            let elems = (new.len() / elem) as u64;
            let cap = (new.len() as f64 * cap_frac) as usize + 1;
            let mut out = vec![0xAAu8; cap];
            let changed = (0..elems as usize)
                .filter(|&e| base[e * elem..(e + 1) * elem] != new[e * elem..(e + 1) * elem])
                .count() as u64;
            let mut kept = base.clone();
            // Whichever it starts as (a guess), it ends as the smaller encoding that fits.
            let start = if bitmap_first { DeltaKind::Bitmap } else { DeltaKind::Gaps };
            let got = encode(&mut kept, &new, elem, &mut out, start);
            // Either way the base now holds the new run.
            prop_assert_eq!(&kept, &new);
            match got {
                Ok(enc) => {
                    prop_assert_eq!(enc.changed, changed);
                    let bitmap = elems.div_ceil(8) as usize + changed as usize * elem;
                    prop_assert_eq!(enc.len, gaps_len(&base, &new, elem).min(bitmap));
                    prop_assert!(enc.len <= cap);
                    let mut dst = base.clone();
                    let applied = apply(&mut dst, &out[..enc.len], enc.kind, elem).unwrap();
                    prop_assert_eq!(applied, changed);
                    prop_assert_eq!(&dst, &new);
                }
                Err(over) => {
                    // Both encodings are over the capacity, and the scan saw why.
                    let bitmap = elems.div_ceil(8) as usize + changed as usize * elem;
                    prop_assert!(bitmap > cap);
                    prop_assert!(gaps_len(&base, &new, elem) > cap);
                    prop_assert!(over.changed <= changed && over.scanned <= elems);
                }
            }
        }

        /// An encoding cut short, or applied to a shorter run, is refused and writes nothing.
        #[test]
        fn a_damaged_encoding_is_refused_and_writes_nothing(
            (base, new, elem) in runs(),
            cut in 1usize..8,
        ) {
            let mut out = vec![0u8; new.len() * 2 + 16];
            let enc = encode(&mut base.clone(), &new, elem, &mut out, DeltaKind::Gaps).unwrap();
            if enc.changed == 0 {
                return Ok(());
            }
            let short = &out[..enc.len.saturating_sub(cut)];
            let mut dst = base.clone();
            if apply(&mut dst, short, enc.kind, elem).is_err() {
                prop_assert_eq!(&dst, &base);
            }
            // The last change names the last changed element: a run that ends before it must
            // refuse a gaps encoding (a bitmap's length is checked against the run's instead).
            if enc.kind != DeltaKind::Gaps {
                return Ok(());
            }
            let last = (0..new.len() / elem)
                .rev()
                .find(|&e| base[e * elem..(e + 1) * elem] != new[e * elem..(e + 1) * elem])
                .unwrap();
            let mut shorter = base[..last * elem].to_vec();
            let before = shorter.clone();
            prop_assert!(apply(&mut shorter, &out[..enc.len], enc.kind, elem).is_err());
            prop_assert_eq!(shorter, before);
        }
    }

    #[test]
    fn sparse_runs_take_gaps_and_dense_ones_a_bitmap() {
        let base = vec![0u8; 2 * 4096];
        let mut sparse = base.clone();
        sparse[2 * 100] = 1;
        sparse[2 * 3000 + 1] = 7;
        let mut out = vec![0u8; base.len() / 2];
        let enc = encode(&mut base.clone(), &sparse, 2, &mut out, DeltaKind::Bitmap).unwrap();
        assert_eq!((enc.kind, enc.changed), (DeltaKind::Gaps, 2));
        // gap 100 (1 byte) + 2, gap 2899 (2 bytes) + 2.
        assert_eq!(enc.len, 7);
        let mut dense = base.clone();
        for e in (0..4096).step_by(3) {
            dense[2 * e] = 9;
        }
        let enc = encode(&mut base.clone(), &dense, 2, &mut out, DeltaKind::Gaps).unwrap();
        assert_eq!(enc.kind, DeltaKind::Bitmap);
        assert_eq!(enc.len, 512 + 2 * 1366);
        // Everything changed: over half the dense bytes, refused.
        let mut kept = base.clone();
        let all = vec![1u8; base.len()];
        assert!(encode(&mut kept, &all, 2, &mut out, DeltaKind::Gaps).is_err());
        assert_eq!(kept, all, "a refused run still brings the base up to date");
    }

    #[test]
    fn bad_element_sizes_and_misaligned_runs_are_named() {
        let mut dst = vec![0u8; 6];
        assert_eq!(
            apply(&mut dst, &[], DeltaKind::Gaps, 3),
            Err(DeltaError::ElementSize(3))
        );
        assert_eq!(
            apply(&mut dst, &[], DeltaKind::Gaps, 4),
            Err(DeltaError::Misaligned { len: 6, elem: 4 })
        );
        assert_eq!(
            apply(&mut dst, &[5, 1, 1], DeltaKind::Gaps, 2),
            Err(DeltaError::OutOfRange { index: 5, elems: 3 })
        );
    }
}
