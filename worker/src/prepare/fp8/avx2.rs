//! Hand-written AVX2 row loops of the fp8 quantiser (the [`RowOps`] of the [`Avx2`] token): the
//! same steps as [`super::avx512`], eight f32 lanes wide, for the many x86 CPUs without AVX-512
//! (AMD before Zen 4, Intel client cores).
//!
//! Why: there the plain-Rust loops, even compiled for AVX2, leave the quantiser at about 0.4x
//! memcpy (LLVM keeps the per-lane select between the two rounding paths and the narrowing
//! stores in slow shapes), and on a sidecar or CPU host the quantiser is most of a fp8 sync's
//! CPU time. Each step widens 8 elements to f32 (bf16: a shift or a mask of 16 packed
//! elements; f16: `vcvtph2ps`, exact; f32: as is), multiplies by `448 / amax` (the same single
//! f32 multiply as the scalar code), then runs exactly the integer and f32 steps of
//! [`f32_to_e4m3_saturating`] lane-wise, the selects done with `vpblendvb`; codes are narrowed
//! with unsigned packs and a lane permute. AVX2 has no byte-masked loads or stores, so the
//! last elements of a segment that fill no whole step run through the scalar conversion, which
//! gives the same bytes. The amax pass keeps one vector of running maxima per column block (16
//! keys of 16 bits, or 8 of 32 bits). Bit-exactness is tested against an independent scalar
//! reference on random data of every class and on every 16-bit pattern (`Path::Avx2`).
//!
//! Every `unsafe` here is either a call to a `#[target_feature]` function, sound because the
//! [`Avx2`] token only exists on a CPU that has AVX2 and F16C, or a load/store through a pointer
//! whose range is checked against the slice right beside it.

use super::row_loops::portable_stand_in;
use super::{F16, F32, RowOps};
use crate::prepare::isa::Avx2;

portable_stand_in!(Avx2);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::Bf16;
    use super::super::row_loops::{Widen, row_ops};
    use super::{Avx2, F16, F32, RowOps};
    use crate::prepare::convert::f32_to_e4m3_saturating;
    use crate::prepare::fp8::Elem;

    row_ops!(Avx2, __m256i, Bf16, Widen::Bf16, max16, 0x7f80, reduce16);
    row_ops!(Avx2, __m256i, F16, Widen::F16, max16, 0x7c00, reduce16);
    row_ops!(Avx2, __m256i, F32, Widen::F32, max32, 0x7f80_0000, reduce32);

    #[inline]
    #[target_feature(enable = "avx2")]
    fn zero() -> __m256i {
        _mm256_setzero_si256()
    }

    /// The bytes of `seg` from `from` on (fewer than one vector), zero-padded to 32 bytes: key
    /// 0 is the max of nothing, so the padding never raises a block's amax.
    #[inline(always)]
    fn padded(seg: &[u8], from: usize) -> [u8; 32] {
        let mut t = [0u8; 32];
        let rest = &seg[from..];
        t[..rest.len()].copy_from_slice(rest);
        t
    }

    /// Folds the finite-|x| keys of 16-bit elements (`|x| < limit`, inf and NaN count as 0)
    /// into `acc`, 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn max16(acc: __m256i, seg: &[u8], limit: i16) -> __m256i {
        let n = seg.len() / 2;
        let p = seg.as_ptr();
        let abs = _mm256_set1_epi16(0x7fff);
        let lim = _mm256_set1_epi16(limit);
        let mut m = acc;
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: elements i .. i + 16 lie inside `seg` (checked by the loop condition).
            let v = unsafe { _mm256_loadu_si256(p.add(2 * i).cast()) };
            m = step16(m, v, abs, lim);
            i += 16;
        }
        if i < n {
            let t = padded(&seg[..2 * n], 2 * i);
            // SAFETY: `t` is 32 readable bytes.
            let v = unsafe { _mm256_loadu_si256(t.as_ptr().cast()) };
            m = step16(m, v, abs, lim);
        }
        m
    }

    /// [`max16`] for 32-bit elements, 8 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn max32(acc: __m256i, seg: &[u8], limit: i32) -> __m256i {
        let n = seg.len() / 4;
        let p = seg.as_ptr();
        let abs = _mm256_set1_epi32(0x7fff_ffff);
        let lim = _mm256_set1_epi32(limit);
        let mut m = acc;
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: elements i .. i + 8 lie inside `seg` (checked by the loop condition).
            let v = unsafe { _mm256_loadu_si256(p.add(4 * i).cast()) };
            m = step32(m, v, abs, lim);
            i += 8;
        }
        if i < n {
            let t = padded(&seg[..4 * n], 4 * i);
            // SAFETY: `t` is 32 readable bytes.
            let v = unsafe { _mm256_loadu_si256(t.as_ptr().cast()) };
            m = step32(m, v, abs, lim);
        }
        m
    }

    /// `max(m, |v|)` in the lanes where `|v| < lim`, 0 elsewhere (16-bit lanes; keys are
    /// non-negative, so the signed compare and max are the unsigned ones).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn step16(m: __m256i, v: __m256i, abs: __m256i, lim: __m256i) -> __m256i {
        let a = _mm256_and_si256(v, abs);
        let finite = _mm256_cmpgt_epi16(lim, a);
        _mm256_max_epi16(m, _mm256_and_si256(a, finite))
    }

    /// [`step16`] on 32-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn step32(m: __m256i, v: __m256i, abs: __m256i, lim: __m256i) -> __m256i {
        let a = _mm256_and_si256(v, abs);
        let finite = _mm256_cmpgt_epi32(lim, a);
        _mm256_max_epi32(m, _mm256_and_si256(a, finite))
    }

    /// Max of 16 non-negative 16-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce16(m: __m256i) -> i16 {
        let x = _mm_max_epi16(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let x = _mm_max_epi16(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
        let x = _mm_max_epi16(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
        // The high half of each 32-bit lane onto the low one (zeros shifted in: keys are >= 0).
        let x = _mm_max_epi16(x, _mm_srli_epi32::<16>(x));
        (_mm_cvtsi128_si32(x) & 0xffff) as i16
    }

    /// Max of 8 32-bit lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn reduce32(m: __m256i) -> i32 {
        let x = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
        let x = _mm_max_epi32(x, _mm_shuffle_epi32::<0b01_00_11_10>(x));
        let x = _mm_max_epi32(x, _mm_shuffle_epi32::<0b10_11_00_01>(x));
        _mm_cvtsi128_si32(x)
    }

    /// Loads 8 whole elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p .. p + 8 * element size` must be readable.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8<const W: u8>(p: *const u8) -> __m256 {
        if W == Widen::F32 as u8 {
            // SAFETY: the caller guarantees 32 readable bytes.
            unsafe { _mm256_loadu_ps(p.cast()) }
        } else {
            // SAFETY: the caller guarantees 16 readable bytes.
            let h = unsafe { _mm_loadu_si128(p.cast()) };
            if W == Widen::F16 as u8 {
                _mm256_cvtph_ps(h)
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }

    /// `f32_to_e4m3_saturating(x * inv)` in every lane; the code is the low byte of each
    /// 32-bit lane, and byte 1 is always zero (bytes 2 and 3 are not: callers mask them off).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn e4m3(x: __m256, inv: __m256) -> __m256i {
        let b = _mm256_castps_si256(_mm256_mul_ps(x, inv));
        let abs = _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff));
        let nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f80_0000));
        // Saturate: above 448 (inf included) becomes 448. A NaN becomes the pattern one e4m3
        // step above 448 (0x43f0_0000, what the scalar code's `0x7e | 1` gives: the normal
        // path below turns it into 0x7f).
        let a = _mm256_blendv_epi8(
            _mm256_min_epi32(abs, _mm256_set1_epi32(0x43e0_0000)),
            _mm256_set1_epi32(0x43f0_0000),
            nan,
        );
        // Subnormal: a + 2^14 rounds a to units of 2^-9; its bits are 0x4680_00uu, uu the
        // count of units (at most 8), so the low byte is already the code.
        let sub = _mm256_castps_si256(_mm256_add_ps(
            _mm256_castsi256_ps(a),
            _mm256_set1_ps(16384.0),
        ));
        // Normal: round 23 mantissa bits to 3 (ties to even) and rebias 127 -> 7; the rebias
        // (-120 << 3 after the shift) is folded into the addend before it.
        let lsb = _mm256_and_si256(_mm256_srli_epi32::<20>(a), _mm256_set1_epi32(1));
        let biased = _mm256_add_epi32(a, _mm256_set1_epi32(0x7_ffff - (960 << 20)));
        let normal = _mm256_srli_epi32::<20>(_mm256_add_epi32(biased, lsb));
        let small = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c80_0000), a);
        let mag = _mm256_blendv_epi8(normal, sub, small);
        let sign = _mm256_and_si256(_mm256_srli_epi32::<24>(b), _mm256_set1_epi32(0x80));
        _mm256_or_si256(sign, mag)
    }

    /// Packs the low 16 bits of the lanes of `a` then `b` (each value < 2^16) into 16 u16 in
    /// lane order.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn pack_u16(a: __m256i, b: __m256i) -> __m256i {
        // packus works per 128-bit half: [a0..4, b0..4 | a4..8, b4..8]; the permute puts the
        // quarters back in order.
        _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi32(a, b))
    }

    /// Quantises one row segment of `W` elements into `out` (one byte per element).
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn quantise_row<const W: u8>(seg: &[u8], inv: f32, out: &mut [u8]) {
        let size = if W == Widen::F32 as u8 { 4 } else { 2 };
        let n = out.len().min(seg.len() / size);
        let (p, q) = (seg.as_ptr(), out.as_mut_ptr());
        let invv = _mm256_set1_ps(inv);
        let low16 = _mm256_set1_epi32(0xffff);
        let low8 = _mm256_set1_epi32(0xff);
        let mut i = 0;
        if W == Widen::Bf16 as u8 {
            // 32 bf16 per step from two 32-byte loads: each 32-bit lane holds elements 2j (low
            // half) and 2j+1 (high half), so a shift and a mask give both as f32 without any
            // widening shuffle. Byte 1 of every `e4m3` lane is zero, so the odd codes or-ed in
            // at bit 8 pair up with the even ones in the low 16 bits, in memory order.
            let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
            let pairs = |v: __m256i| {
                let even = e4m3(_mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)), invv);
                let odd = e4m3(_mm256_castsi256_ps(_mm256_and_si256(v, high)), invv);
                _mm256_and_si256(_mm256_or_si256(even, _mm256_slli_epi32::<8>(odd)), low16)
            };
            while i + 32 <= n {
                // SAFETY: elements i .. i + 32 lie inside `seg` (loop condition, n <= seg len).
                let (v0, v1) = unsafe {
                    (
                        _mm256_loadu_si256(p.add(2 * i).cast()),
                        _mm256_loadu_si256(p.add(2 * i + 32).cast()),
                    )
                };
                let codes = pack_u16(pairs(v0), pairs(v1));
                // SAFETY: bytes i .. i + 32 lie inside `out` (loop condition, n <= out len).
                unsafe { _mm256_storeu_si256(q.add(i).cast(), codes) };
                i += 32;
            }
        }
        while i + 16 <= n {
            // SAFETY: elements i .. i + 16 lie inside `seg` (loop condition, n <= seg len).
            let (x0, x1) = unsafe {
                (
                    load8::<W>(p.add(size * i)),
                    load8::<W>(p.add(size * (i + 8))),
                )
            };
            let c0 = _mm256_and_si256(e4m3(x0, invv), low8);
            let c1 = _mm256_and_si256(e4m3(x1, invv), low8);
            // 16 u16 in order, then bytes: packus_epi16 per half gives [c0 | c0 | c1 | c1]
            // as quadwords; quadwords 0 and 2 are the 16 codes.
            let w = pack_u16(c0, c1);
            let b = _mm256_packus_epi16(w, w);
            let codes = _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b00_00_10_00>(b));
            // SAFETY: bytes i .. i + 16 lie inside `out` (loop condition, n <= out len).
            unsafe { _mm_storeu_si128(q.add(i).cast(), codes) };
            i += 16;
        }
        // Fewer than 16 left: the scalar conversion, which the vector steps mirror exactly.
        let elem_f32 = |e: &[u8]| match W {
            w if w == Widen::F32 as u8 => <F32 as Elem>::to_f32(e),
            w if w == Widen::F16 as u8 => <F16 as Elem>::to_f32(e),
            _ => <Bf16 as Elem>::to_f32(e),
        };
        for (e, o) in seg[size * i..size * n]
            .chunks_exact(size)
            .zip(&mut out[i..n])
        {
            *o = f32_to_e4m3_saturating(elem_f32(e) * inv);
        }
    }
}
