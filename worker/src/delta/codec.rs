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
//! [`encode`] makes two passes. The scan compares 64-byte blocks with their base a word at a
//! time ([`super::lanes`]: equal blocks skipped whole, a changed block's per-element mask
//! found without a branch per element), writes each block's mask into a bitmap (the bitmap
//! encoding's, bit for bit), copies changed blocks into the base, and counts the changes, which
//! gives the bitmap encoding's exact size; the scan stops as soon as both encodings are known
//! too big. Then the set bits are walked (`trailing_zeros`, a few nanoseconds a change) to size
//! the gaps encoding where it could be the smaller, and to write the chosen one.
//!
//! [`apply`] is the receiver's half. It trusts nothing: an encoding that runs past its end,
//! names an element past the run or leaves trailing bytes is an error naming what was wrong,
//! and nothing is written until the whole encoding was checked.

use std::cell::RefCell;

use thiserror::Error;
use weightsync_common::protocol::DeltaKind;
use xxhash_rust::xxh3::Xxh3;

use super::lanes::{BLOCK, changed_mask};

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

thread_local! {
    /// The scan's bitmap, kept per thread between runs (one bit per element of the largest run
    /// encoded on the thread).
    static CHANGED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Encodes the changes of `new` against `base` into `out` (its length is the capacity) and
/// brings `base` up to `new` on the way (only changed blocks are copied). Of the two encodings
/// the smaller is written (the gaps on a tie); when neither fits, the scan stops as soon as
/// that is certain and the rest of the base is copied (the run goes dense), and the error says
/// how far it looked.
///
/// # Panics
/// If `new` and `base` differ in length or `elem` does not divide it (callers pass runs of
/// whole elements, see [`element_size`](super::element_size)).
pub fn encode(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    out: &mut [u8],
) -> Result<Encoded, Overflow> {
    encode_into(base, new, elem, out, None)
}

/// [`encode`] and the [`xxh3`](crate::checksum::xxh3) of `new` in one pass: each
/// [`HASH_SPAN`] of `new` is hashed right after it was compared (or copied into the base),
/// while it is still in the core's cache, instead of in a second pass over the whole run.
/// Gives exactly what [`encode`] gives, and the hash `xxh3(new)` gives.
///
/// # Panics
/// As [`encode`].
pub fn encode_hashed(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    out: &mut [u8],
) -> (Result<Encoded, Overflow>, u64) {
    let mut hasher = Xxh3::new();
    let got = encode_into(base, new, elem, out, Some(&mut hasher));
    (got, hasher.digest())
}

/// Brings `base` up to `new` (copying only the 64-byte blocks that differ: a base mostly equal
/// to `new` is read, not rewritten) and returns `xxh3(new)`, in one pass of [`HASH_SPAN`]s.
pub fn refresh_hashed(base: &mut [u8], new: &[u8]) -> u64 {
    assert_eq!(
        base.len(),
        new.len(),
        "a base is refreshed from a run of its length"
    );
    let mut hasher = Xxh3::new();
    for (b, n) in base.chunks_mut(HASH_SPAN).zip(new.chunks(HASH_SPAN)) {
        copy_changed_blocks(b, n);
        hasher.update(n);
    }
    hasher.digest()
}

/// Copies the blocks of `new` that differ from `base` into it (the tail past the last whole
/// block too, when it differs).
fn copy_changed_blocks(base: &mut [u8], new: &[u8]) {
    let mut bs = base.chunks_exact_mut(BLOCK);
    let mut ns = new.chunks_exact(BLOCK);
    for (b, n) in (&mut bs).zip(&mut ns) {
        if b != n {
            b.copy_from_slice(n);
        }
    }
    let (b, n) = (bs.into_remainder(), ns.remainder());
    if b != n {
        b.copy_from_slice(n);
    }
}

/// Bytes of a run compared (or copied) before they are hashed in [`encode_hashed`]: with the
/// base's span, a core's L1 cache.
pub const HASH_SPAN: usize = 16 << 10;

fn encode_into(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    out: &mut [u8],
    hasher: Option<&mut Xxh3>,
) -> Result<Encoded, Overflow> {
    assert_eq!(base.len(), new.len(), "a delta compares runs of one length");
    check_elem(new.len(), elem).expect("runs of whole elements");
    CHANGED.with_borrow_mut(|bits| match elem {
        1 => encode_as::<1>(base, new, out, bits, hasher),
        2 => encode_as::<2>(base, new, out, bits, hasher),
        4 => encode_as::<4>(base, new, out, bits, hasher),
        _ => encode_as::<8>(base, new, out, bits, hasher),
    })
}

fn encode_as<const E: usize>(
    base: &mut [u8],
    new: &[u8],
    out: &mut [u8],
    bits: &mut Vec<u8>,
    hasher: Option<&mut Xxh3>,
) -> Result<Encoded, Overflow> {
    let elems = new.len() / E;
    bits.clear();
    bits.resize(elems.div_ceil(8), 0);
    let changed = scan::<E>(base, new, bits, out.len(), hasher)?;
    let bitmap_len = bits.len() + changed as usize * E;
    // A change costs the gaps encoding at least 1 + E bytes: past the bitmap's size, or the
    // capacity when the bitmap does not fit, the gaps need not be counted.
    let gaps_floor = changed as usize * (1 + E);
    let gaps_len = if gaps_floor <= bitmap_len.max(out.len()) {
        gaps_len::<E>(bits)
    } else {
        usize::MAX
    };
    let (kind, len) = if gaps_len <= bitmap_len {
        (DeltaKind::Gaps, gaps_len)
    } else {
        (DeltaKind::Bitmap, bitmap_len)
    };
    if len > out.len() {
        return Err(Overflow {
            scanned: elems as u64,
            changed,
        });
    }
    let out = &mut out[..len];
    match kind {
        DeltaKind::Gaps => write_gaps::<E>(bits, new, out),
        DeltaKind::Bitmap => {
            let (map, values) = out.split_at_mut(bits.len());
            map.copy_from_slice(bits);
            write_values::<E>(bits, new, values);
        }
    }
    Ok(Encoded { kind, len, changed })
}

/// The scan (see the module docs): fills `bits`, brings `base` up to date, and returns the
/// number of changes, or stops once neither encoding can fit in `cap` bytes (the rest of the
/// base copied). With a `hasher`, every [`HASH_SPAN`] of `new` is fed to it once compared or
/// copied, so it ends holding all of `new` whichever way the scan ends.
fn scan<const E: usize>(
    base: &mut [u8],
    new: &[u8],
    bits: &mut [u8],
    cap: usize,
    mut hasher: Option<&mut Xxh3>,
) -> Result<u64, Overflow> {
    let bitmap_bytes = bits.len();
    // Bitmap bytes per block.
    let per_block = BLOCK / E / 8;
    let too_big = |changed: u64| {
        let c = changed as usize;
        (bitmap_bytes + c * E).min(c * (1 + E)) > cap
    };
    let blocks = new.len() / BLOCK;
    let span_blocks = HASH_SPAN / BLOCK;
    let mut changed = 0u64;
    let mut overflow = None;
    let mut span_start = 0usize;
    while span_start < blocks && overflow.is_none() {
        let span_end = (span_start + span_blocks).min(blocks);
        for b in span_start..span_end {
            let r = b * BLOCK..(b + 1) * BLOCK;
            let x: &mut [u8; BLOCK] = (&mut base[r.clone()]).try_into().expect("a block");
            let y: &[u8; BLOCK] = new[r].try_into().expect("a block");
            let mask = changed_mask::<E>(x, y);
            if mask == 0 {
                continue;
            }
            bits[b * per_block..(b + 1) * per_block]
                .copy_from_slice(&mask.to_le_bytes()[..per_block]);
            *x = *y;
            changed += u64::from(mask.count_ones());
            if too_big(changed) {
                let end = (b + 1) * BLOCK;
                overflow = Some(Overflow {
                    scanned: (end / E) as u64,
                    changed,
                });
                break;
            }
        }
        if let Some(h) = hasher.as_deref_mut() {
            h.update(&new[span_start * BLOCK..span_end * BLOCK]);
        }
        span_start = span_end;
    }
    if let Some(over) = overflow {
        // The rest goes dense: the base takes it (and the hash, a span at a time).
        let end = over.scanned as usize * E;
        let hashed = span_start * BLOCK;
        base[end..hashed].copy_from_slice(&new[end..hashed]);
        match hasher {
            Some(h) => {
                for (b, n) in base[hashed..]
                    .chunks_mut(HASH_SPAN)
                    .zip(new[hashed..].chunks(HASH_SPAN))
                {
                    b.copy_from_slice(n);
                    h.update(n);
                }
            }
            None => base[hashed..].copy_from_slice(&new[hashed..]),
        }
        return Err(over);
    }
    for i in blocks * BLOCK / E..new.len() / E {
        let r = i * E..(i + 1) * E;
        if base[r.clone()] != new[r.clone()] {
            bits[i / 8] |= 1 << (i % 8);
            changed += 1;
            base[r.clone()].copy_from_slice(&new[r]);
        }
    }
    if let Some(h) = hasher {
        h.update(&new[blocks * BLOCK..]);
    }
    if too_big(changed) {
        return Err(Overflow {
            scanned: (new.len() / E) as u64,
            changed,
        });
    }
    Ok(changed)
}

/// Calls `f` with the index of every bit set in `bits` (little-endian: bit `i % 8` of byte
/// `i / 8`), in order.
#[inline(always)]
fn for_each_set(bits: &[u8], mut f: impl FnMut(usize)) {
    let words = bits.chunks_exact(8);
    let tail = words.remainder();
    let mut visit = |w: usize, mut word: u64| {
        while word != 0 {
            f(w * 64 + word.trailing_zeros() as usize);
            word &= word - 1;
        }
    };
    for (w, chunk) in words.enumerate() {
        visit(w, u64::from_le_bytes(chunk.try_into().expect("8 bytes")));
    }
    if !tail.is_empty() {
        let mut last = [0u8; 8];
        last[..tail.len()].copy_from_slice(tail);
        visit(bits.len() / 8, u64::from_le_bytes(last));
    }
}

/// Bytes of the gaps encoding of the changes in `bits`.
fn gaps_len<const E: usize>(bits: &[u8]) -> usize {
    let (mut len, mut next) = (0usize, 0usize);
    for_each_set(bits, |i| {
        len += varint_len((i - next) as u64) + E;
        next = i + 1;
    });
    len
}

/// Writes the gaps encoding of the changes in `bits`, their bytes from `new`, into `out`
/// (exactly its size).
fn write_gaps<const E: usize>(bits: &[u8], new: &[u8], out: &mut [u8]) {
    let (mut at, mut next) = (0usize, 0usize);
    for_each_set(bits, |i| {
        let gap = (i - next) as u64;
        at = if gap < 0x80 {
            out[at] = gap as u8;
            at + 1
        } else {
            put_varint(out, at, gap)
        };
        out[at..at + E].copy_from_slice(&new[i * E..(i + 1) * E]);
        at += E;
        next = i + 1;
    });
    debug_assert_eq!(at, out.len());
}

/// Writes the bytes from `new` of the changes in `bits`, in order, into `out` (exactly their
/// size).
fn write_values<const E: usize>(bits: &[u8], new: &[u8], out: &mut [u8]) {
    let mut at = 0usize;
    for_each_set(bits, |i| {
        out[at..at + E].copy_from_slice(&new[i * E..(i + 1) * E]);
        at += E;
    });
    debug_assert_eq!(at, out.len());
}

/// Counts the changed elements of every `stride`-th 64-byte block of `new` against `base`:
/// `(elements compared, changed)`, an estimate of a run's changed fraction at `1 / stride` of
/// a full compare's cost (a run that went dense still tells the next sync what to expect).
pub fn sample_changes(base: &[u8], new: &[u8], elem: usize, stride: usize) -> (u64, u64) {
    let count = match elem {
        1 => sample_as::<1>,
        2 => sample_as::<2>,
        4 => sample_as::<4>,
        _ => sample_as::<8>,
    };
    count(base, new, stride.max(1))
}

fn sample_as<const E: usize>(base: &[u8], new: &[u8], stride: usize) -> (u64, u64) {
    let (mut scanned, mut changed) = (0u64, 0u64);
    for b in (0..new.len() / BLOCK).step_by(stride) {
        let r = b * BLOCK..(b + 1) * BLOCK;
        let x: &[u8; BLOCK] = base[r.clone()].try_into().expect("a block");
        let y: &[u8; BLOCK] = new[r].try_into().expect("a block");
        scanned += (BLOCK / E) as u64;
        changed += u64::from(changed_mask::<E>(x, y).count_ones());
    }
    (scanned, changed)
}

/// An encoding made by [`encode`], checked against the run it applies to: every change names
/// an element of the run and carries its bytes, and nothing trails.
#[derive(Debug, Clone, Copy)]
pub struct Changes<'a> {
    enc: &'a [u8],
    kind: DeltaKind,
    elem: usize,
    count: u64,
}

impl<'a> Changes<'a> {
    /// Checks `enc` (of `kind`) for a run of `run_len` bytes of `elem`-byte elements.
    pub fn check(
        enc: &'a [u8],
        kind: DeltaKind,
        elem: usize,
        run_len: u64,
    ) -> Result<Changes<'a>, DeltaError> {
        check_elem(run_len as usize, elem)?;
        let elems = run_len / elem as u64;
        let count = match kind {
            DeltaKind::Gaps => {
                let (mut at, mut next, mut count) = (0usize, 0u64, 0u64);
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
                    at = after + elem;
                    next = index + 1;
                    count += 1;
                }
                count
            }
            DeltaKind::Bitmap => {
                let bitmap_bytes = elems.div_ceil(8) as usize;
                if enc.len() < bitmap_bytes {
                    return Err(DeltaError::Truncated {
                        at: enc.len(),
                        len: enc.len(),
                    });
                }
                let map = &enc[..bitmap_bytes];
                let set: u64 = map.iter().map(|b| u64::from(b.count_ones())).sum();
                let need = bitmap_bytes + set as usize * elem;
                if need != enc.len() {
                    return Err(DeltaError::BitmapLength {
                        set,
                        need,
                        len: enc.len(),
                    });
                }
                // Bits past the run's last element (in the last byte's padding).
                let pad = map.last().map_or(0, |&b| {
                    let used = elems - (bitmap_bytes as u64 - 1) * 8;
                    u64::from(b) >> used
                });
                if pad != 0 {
                    let index = elems + u64::from(pad.trailing_zeros());
                    return Err(DeltaError::OutOfRange { index, elems });
                }
                set
            }
        };
        Ok(Changes {
            enc,
            kind,
            elem,
            count,
        })
    }

    /// The number of changed elements.
    pub fn len(&self) -> u64 {
        self.count
    }

    /// Whether nothing changed.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Calls `f` with every change's element index and new bytes, in order.
    pub fn for_each(&self, mut f: impl FnMut(u64, &'a [u8])) {
        let (enc, elem) = (self.enc, self.elem);
        match self.kind {
            DeltaKind::Gaps => {
                let (mut at, mut next) = (0usize, 0u64);
                while at < enc.len() {
                    let (gap, after) = if enc[at] < 0x80 {
                        (u64::from(enc[at]), at + 1)
                    } else {
                        get_varint(enc, at).expect("checked")
                    };
                    let index = next + gap;
                    f(index, &enc[after..after + elem]);
                    at = after + elem;
                    next = index + 1;
                }
            }
            DeltaKind::Bitmap => {
                let map_len = self.enc.len() - self.count as usize * elem;
                let (map, values) = enc.split_at(map_len);
                let mut at = 0usize;
                for_each_set(map, |i| {
                    f(i as u64, &values[at..at + elem]);
                    at += elem;
                });
            }
        }
    }

    /// Writes every change into `dst` (the run).
    ///
    /// # Panics
    /// If `dst` is shorter than the run the encoding was checked against.
    pub fn apply_to(&self, dst: &mut [u8]) {
        match self.elem {
            1 => self.apply_as::<1>(dst),
            2 => self.apply_as::<2>(dst),
            4 => self.apply_as::<4>(dst),
            _ => self.apply_as::<8>(dst),
        }
    }

    fn apply_as<const E: usize>(&self, dst: &mut [u8]) {
        self.for_each(|index, v| {
            let to = index as usize * E;
            dst[to..to + E].copy_from_slice(&v[..E]);
        });
    }
}

/// Applies an encoding made by [`encode`] to `dst` (the run as the destination holds it),
/// checking all of it before writing anything; returns the number of elements changed.
pub fn apply(dst: &mut [u8], enc: &[u8], kind: DeltaKind, elem: usize) -> Result<u64, DeltaError> {
    let changes = Changes::check(enc, kind, elem, dst.len() as u64)?;
    changes.apply_to(dst);
    Ok(changes.len())
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
            let mut kept = base.clone();
            let got = encode(&mut kept, &new, elem, &mut out);
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
            let enc = encode(&mut base.clone(), &new, elem, &mut out).unwrap();
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

    /// Runs longer than several hash spans (with a partial last span and block), element sizes
    /// 1, 2 and 4, changes from none to every element, clustered or spread.
    fn long_runs() -> impl Strategy<Value = (Vec<u8>, Vec<u8>, usize)> {
        (
            prop::sample::select(vec![1usize, 2, 4]),
            0usize..(3 * HASH_SPAN + 3 * BLOCK + 5),
            any::<u64>(),
            prop::sample::select(vec![0.0f64, 0.001, 0.01, 0.1, 0.6, 1.0]),
            0usize..4,
        )
            .prop_map(|(elem, bytes, seed, p, clustered)| {
                let elems = bytes / elem;
                let mut s = seed | 1;
                let mut next = move || {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    s
                };
                let base: Vec<u8> = (0..elems * elem).map(|_| next() as u8).collect();
                let mut new = base.clone();
                // Clustered: changes only in one stretch of the run (a span's worth).
                let (lo, hi) = if clustered == 0 && elems > 0 {
                    let lo = next() as usize % elems;
                    (lo, (lo + HASH_SPAN / elem).min(elems))
                } else {
                    (0, elems)
                };
                for e in lo..hi {
                    let r = next();
                    if (r % 10_000) as f64 / 10_000.0 < p {
                        let b = e * elem + (r >> 32) as usize % elem;
                        new[b] = new[b].wrapping_add(1 + (r >> 40) as u8 % 255);
                    }
                }
                (base, new, elem)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        /// The fused pass (compare, encode, base update and hash at once) gives byte for byte
        /// what the separate passes give: the same encoding or the same refusal, the same base,
        /// and the hash of the whole new run, whatever the capacity.
        #[test]
        fn the_fused_pass_equals_encoding_then_hashing(
            (base, new, elem) in long_runs(),
            cap_frac in prop::sample::select(vec![0.0f64, 0.01, 0.1, 0.5]),
        ) {
            let cap = (new.len() as f64 * cap_frac) as usize + 1;
            let (mut out_ref, mut out_fused) = (vec![0x55u8; cap], vec![0x55u8; cap]);
            let (mut base_ref, mut base_fused) = (base.clone(), base.clone());
            let want = encode(&mut base_ref, &new, elem, &mut out_ref);
            let want_hash = crate::checksum::xxh3(&new);
            let (got, hash) = encode_hashed(&mut base_fused, &new, elem, &mut out_fused);
            prop_assert_eq!(got, want);
            prop_assert_eq!(hash, want_hash);
            prop_assert_eq!(&base_fused, &base_ref);
            prop_assert_eq!(&base_fused, &new);
            if let Ok(enc) = got {
                prop_assert_eq!(&out_fused[..enc.len], &out_ref[..enc.len]);
            }
            // A refresh (no encoding) leaves the same base and the same hash.
            let mut refreshed = base.clone();
            prop_assert_eq!(refresh_hashed(&mut refreshed, &new), want_hash);
            prop_assert_eq!(&refreshed, &new);
        }
    }

    #[test]
    fn sparse_runs_take_gaps_and_dense_ones_a_bitmap() {
        let base = vec![0u8; 2 * 4096];
        let mut sparse = base.clone();
        sparse[2 * 100] = 1;
        sparse[2 * 3000 + 1] = 7;
        let mut out = vec![0u8; base.len() / 2];
        let enc = encode(&mut base.clone(), &sparse, 2, &mut out).unwrap();
        assert_eq!((enc.kind, enc.changed), (DeltaKind::Gaps, 2));
        // gap 100 (1 byte) + 2, gap 2899 (2 bytes) + 2.
        assert_eq!(enc.len, 7);
        let mut dense = base.clone();
        for e in (0..4096).step_by(3) {
            dense[2 * e] = 9;
        }
        let enc = encode(&mut base.clone(), &dense, 2, &mut out).unwrap();
        assert_eq!(enc.kind, DeltaKind::Bitmap);
        assert_eq!(enc.len, 512 + 2 * 1366);
        // Everything changed: over half the dense bytes, refused.
        let mut kept = base.clone();
        let all = vec![1u8; base.len()];
        assert!(encode(&mut kept, &all, 2, &mut out).is_err());
        assert_eq!(kept, all, "a refused run still brings the base up to date");
    }

    #[test]
    fn a_bitmap_naming_elements_past_the_run_is_refused() {
        // 10 elements: two bitmap bytes, the second using 2 bits; bit 12 lies past the run.
        let mut enc = vec![0u8, 1 << 4];
        enc.extend_from_slice(&[7, 7]);
        let mut dst = vec![0u8; 20];
        assert_eq!(
            apply(&mut dst, &enc, DeltaKind::Bitmap, 2),
            Err(DeltaError::OutOfRange {
                index: 12,
                elems: 10
            })
        );
        assert_eq!(dst, vec![0u8; 20]);
        // The same change on the run's last element applies.
        enc[1] = 1 << 1;
        assert_eq!(apply(&mut dst, &enc, DeltaKind::Bitmap, 2), Ok(1));
        assert_eq!(&dst[18..], &[7, 7]);
    }

    #[test]
    fn long_gaps_take_multi_byte_varints_both_ways() {
        // Changes 200_000 elements apart (3-byte varints) in a run with a partial last block.
        let elems = 600_001usize;
        let base = vec![3u8; elems];
        let mut new = base.clone();
        for i in [0, 200_000, 400_000, 600_000] {
            new[i] = 4;
        }
        let mut out = vec![0u8; 64];
        let mut kept = base.clone();
        let enc = encode(&mut kept, &new, 1, &mut out).unwrap();
        assert_eq!(kept, new);
        assert_eq!((enc.kind, enc.changed), (DeltaKind::Gaps, 4));
        assert_eq!(enc.len, 2 + 3 * (3 + 1));
        let mut dst = base.clone();
        assert_eq!(apply(&mut dst, &out[..enc.len], enc.kind, 1), Ok(4));
        assert_eq!(dst, new);
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
