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

/// Calls `f(index)` for every element of `elem` bytes where `a` and `b` differ, in order, until
/// `f` returns `false`. Compares eight bytes at a time and skips equal words whole.
fn for_each_change(a: &[u8], b: &[u8], elem: usize, mut f: impl FnMut(u64) -> bool) {
    debug_assert_eq!(a.len(), b.len());
    let words = a.len() / 8;
    let per_word = 8 / elem;
    let (aw, bw) = (a.chunks_exact(8), b.chunks_exact(8));
    for (w, (x, y)) in aw.zip(bw).enumerate() {
        let x = u64::from_le_bytes(x.try_into().expect("chunks of 8"));
        let y = u64::from_le_bytes(y.try_into().expect("chunks of 8"));
        let diff = x ^ y;
        if diff == 0 {
            continue;
        }
        let mask = if elem == 8 {
            u64::MAX
        } else {
            (1u64 << (elem * 8)) - 1
        };
        for e in 0..per_word {
            if (diff >> (e * elem * 8)) & mask != 0 && !f((w * per_word + e) as u64) {
                return;
            }
        }
    }
    let tail = words * 8;
    for e in (tail / elem)..(a.len() / elem) {
        let r = e * elem..(e + 1) * elem;
        if a[r.clone()] != b[r] && !f(e as u64) {
            return;
        }
    }
}

/// Encodes the changes of `new` against `base` into `out` (its length is the capacity), or
/// says how far it looked when neither encoding fits (the run goes dense). Reads only; the caller updates its
/// base once every destination of the run was served (see `super::bases`).
///
/// # Panics
/// If `new` and `base` differ in length or `elem` does not divide it (callers pass runs of
/// whole elements, see [`element_size`](super::element_size)).
pub fn encode(base: &[u8], new: &[u8], elem: usize, out: &mut [u8]) -> Result<Encoded, Overflow> {
    assert_eq!(base.len(), new.len(), "a delta compares runs of one length");
    check_elem(new.len(), elem).expect("runs of whole elements");
    let elems = (new.len() / elem) as u64;
    let cap = out.len();
    let bitmap_bytes = elems.div_ceil(8) as usize;
    // Pass 1: the size of each encoding, stopping once both exceed the capacity.
    let (mut changed, mut gaps_len, mut prev) = (0u64, 0usize, 0u64);
    let mut bitmap_fits = true;
    let mut gaps_fit = true;
    let mut scanned = elems;
    for_each_change(base, new, elem, |i| {
        scanned = i + 1;
        gaps_len += varint_len(i - prev) + elem;
        prev = i + 1;
        changed += 1;
        gaps_fit = gaps_len <= cap;
        bitmap_fits = bitmap_bytes + changed as usize * elem <= cap;
        gaps_fit || bitmap_fits
    });
    if !gaps_fit && !bitmap_fits {
        return Err(Overflow { scanned, changed });
    }
    let bitmap_len = bitmap_bytes + changed as usize * elem;
    let kind = if gaps_len <= bitmap_len {
        DeltaKind::Gaps
    } else {
        DeltaKind::Bitmap
    };
    let len = gaps_len.min(bitmap_len);
    if len > cap {
        return Err(Overflow { scanned, changed });
    }
    // Pass 2: write it.
    match kind {
        DeltaKind::Gaps => {
            let (mut at, mut prev) = (0usize, 0u64);
            for_each_change(base, new, elem, |i| {
                at = put_varint(out, at, i - prev);
                let from = i as usize * elem;
                out[at..at + elem].copy_from_slice(&new[from..from + elem]);
                at += elem;
                prev = i + 1;
                true
            });
            debug_assert_eq!(at, len);
        }
        DeltaKind::Bitmap => {
            out[..bitmap_bytes].fill(0);
            let mut at = bitmap_bytes;
            for_each_change(base, new, elem, |i| {
                out[(i / 8) as usize] |= 1 << (i % 8);
                let from = i as usize * elem;
                out[at..at + elem].copy_from_slice(&new[from..from + elem]);
                at += elem;
                true
            });
            debug_assert_eq!(at, len);
        }
    }
    Ok(Encoded { kind, len, changed })
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
        ) {
            let elems = (new.len() / elem) as u64;
            let cap = (new.len() as f64 * cap_frac) as usize + 1;
            let mut out = vec![0xAAu8; cap];
            let changed = (0..elems as usize)
                .filter(|&e| base[e * elem..(e + 1) * elem] != new[e * elem..(e + 1) * elem])
                .count() as u64;
            match encode(&base, &new, elem, &mut out) {
                Ok(enc) => {
                    prop_assert_eq!(enc.changed, changed);
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
            let enc = encode(&base, &new, elem, &mut out).unwrap();
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
        let enc = encode(&base, &sparse, 2, &mut out).unwrap();
        assert_eq!((enc.kind, enc.changed), (DeltaKind::Gaps, 2));
        // gap 100 (1 byte) + 2, gap 2899 (2 bytes) + 2.
        assert_eq!(enc.len, 7);
        let mut dense = base.clone();
        for e in (0..4096).step_by(3) {
            dense[2 * e] = 9;
        }
        let enc = encode(&base, &dense, 2, &mut out).unwrap();
        assert_eq!(enc.kind, DeltaKind::Bitmap);
        assert_eq!(enc.len, 512 + 2 * 1366);
        // Everything changed: over half the dense bytes, refused.
        assert!(encode(&base, &vec![1u8; base.len()], 2, &mut out).is_err());
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
