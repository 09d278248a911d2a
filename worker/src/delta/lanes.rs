//! Which elements of a 64-byte block changed, as a bit mask, without a branch per element.
//!
//! The encoder's inner loop (`super::codec`) compares every block of a run with its base. A
//! branch per element costs tens of nanoseconds per change once changes are dense enough to
//! defeat the branch predictor (10% of bf16 elements: almost every block has some), so the
//! compare is done on 64-bit words instead: XOR the words, fold each `E`-byte lane of the
//! difference to its top bit (a lane is nonzero iff adding `0x7f..` to its low bits, or its top
//! bit, carries into the top bit; no carry crosses a lane), and gather the lanes' top bits into
//! consecutive bits with one multiply (every partial product lands on its own bit, so nothing
//! carries). Bit `i` of a block's mask is element `i` of the block, so masks laid end to end in
//! little-endian byte order are the bitmap encoding's bitmap.

/// Bytes compared at once: a block equal to its base is skipped whole.
pub(crate) const BLOCK: usize = 64;

/// The top bit of every `e`-byte lane of a word.
const fn lane_tops(e: usize) -> u64 {
    match e {
        1 => 0x8080_8080_8080_8080,
        2 => 0x8000_8000_8000_8000,
        4 => 0x8000_0000_8000_0000,
        _ => 0x8000_0000_0000_0000,
    }
}

/// One bit per `E`-byte lane of `d` (bit `j`: lane `j`, the bytes `j * E..` in little-endian
/// order), set when the lane is not zero.
#[inline(always)]
fn nonzero_lanes<const E: usize>(d: u64) -> u64 {
    if E == 8 {
        return u64::from(d != 0);
    }
    let tops = lane_tops(E);
    let low = !tops;
    let t = ((d & low).wrapping_add(low) | d) & tops;
    // Lane j's top bit sits at 8E(j + 1) - 1; the multiplier's bit for lane j moves it to
    // 64 - 8/E + j (the products' positions are all distinct, so nothing carries).
    match E {
        1 => t.wrapping_mul(0x0002_0408_1020_4081) >> 56,
        2 => t.wrapping_mul((1 << 45) | (1 << 30) | (1 << 15) | 1) >> 60,
        _ => t.wrapping_mul((1 << 31) | 1) >> 62,
    }
}

#[inline(always)]
fn word(s: &[u8; BLOCK], k: usize) -> u64 {
    u64::from_le_bytes(s[k * 8..k * 8 + 8].try_into().expect("8 bytes"))
}

/// The changed elements of block `y` against `x`: bit `i` set when element `i` (of `E` bytes,
/// `64 / E` of them) differs. Zero when the blocks are equal (checked first, cheaply).
#[inline(always)]
pub(crate) fn changed_mask<const E: usize>(x: &[u8; BLOCK], y: &[u8; BLOCK]) -> u64 {
    let mut any = 0u64;
    for k in 0..BLOCK / 8 {
        any |= word(x, k) ^ word(y, k);
    }
    if any == 0 {
        return 0;
    }
    let mut mask = 0u64;
    for k in 0..BLOCK / 8 {
        mask |= nonzero_lanes::<E>(word(x, k) ^ word(y, k)) << (k * (8 / E));
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn naive(x: &[u8; BLOCK], y: &[u8; BLOCK], e: usize) -> u64 {
        (0..BLOCK / e)
            .filter(|&i| x[i * e..(i + 1) * e] != y[i * e..(i + 1) * e])
            .fold(0u64, |m, i| m | 1 << i)
    }

    fn masks(x: &[u8; BLOCK], y: &[u8; BLOCK]) -> [u64; 4] {
        [
            changed_mask::<1>(x, y),
            changed_mask::<2>(x, y),
            changed_mask::<4>(x, y),
            changed_mask::<8>(x, y),
        ]
    }

    proptest! {
        /// The mask equals the element-by-element compare, for every element size, whichever
        /// bytes (top, bottom, several) of which elements changed.
        #[test]
        fn the_mask_names_exactly_the_changed_elements(
            x in prop::array::uniform32(any::<u8>()),
            x2 in prop::array::uniform32(any::<u8>()),
            flips in prop::collection::vec((0usize..BLOCK, 1u8..=255), 0..12),
        ) {
            let mut a = [0u8; BLOCK];
            a[..32].copy_from_slice(&x);
            a[32..].copy_from_slice(&x2);
            let mut b = a;
            for (at, by) in flips {
                b[at] ^= by;
            }
            let got = masks(&a, &b);
            for (i, e) in [1usize, 2, 4, 8].into_iter().enumerate() {
                prop_assert_eq!(got[i], naive(&a, &b, e), "element size {}", e);
            }
        }
    }

    #[test]
    fn single_bytes_at_every_position_and_full_blocks() {
        let a = [0x7fu8; BLOCK];
        for at in 0..BLOCK {
            for by in [0x01u8, 0x80, 0xff] {
                let mut b = a;
                b[at] ^= by;
                let got = masks(&a, &b);
                for (i, e) in [1usize, 2, 4, 8].into_iter().enumerate() {
                    assert_eq!(got[i], 1 << (at / e), "byte {at} element size {e}");
                }
            }
        }
        let all = masks(&[0u8; BLOCK], &[0xffu8; BLOCK]);
        assert_eq!(all, [u64::MAX, u32::MAX as u64, 0xffff, 0xff]);
    }
}
