//! Hand-written AVX-512 row loops of the fp8 quantiser (the [`RowOps`] of the [`Avx512`] token).
//!
//! Why: the plain-Rust loops leave the quantiser at about 0.4x memcpy; LLVM keeps the
//! per-element select between the subnormal and the normal rounding path, and the narrowing
//! store, in slow shapes. Here each step takes 16 elements (bf16: 32): widen to f32 (bf16: a
//! 16-bit shift or mask; f16: `vcvtph2ps`, exact; f32: as is), multiply by `448 / amax` (the
//! same single f32 multiply as the scalar code), then exactly the integer and f32 steps of
//! [`f32_to_e4m3_saturating`](super::f32_to_e4m3_saturating) lane-wise, the select done with
//! a mask, and one truncating narrowing store (`vpmovdb`, or `vpmovdw` of paired codes). The
//! amax pass keeps one vector of running maxima per column block (32 keys of 16 bits, or 16
//! of 32 bits) and reduces it once per block. Partial segments use masked loads and stores,
//! so nothing outside the slices is touched. Bit-exactness is tested against an independent
//! scalar reference on random data of every class and on every 16-bit pattern.
//!
//! Every `unsafe` here is either a call to a `#[target_feature]` function, sound because the
//! [`Avx512`] token only exists on a CPU that has those features, or a load/store through a
//! pointer whose range is checked against the slice right beside it.

use super::row_loops::portable_stand_in;
use super::{F16, F32, RowOps};
use crate::prepare::isa::Avx512;

portable_stand_in!(Avx512);

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::super::Bf16;
    use super::super::row_loops::{Widen, row_ops};
    use super::{Avx512, F16, F32, RowOps};
    use crate::prepare::fp8::Elem;

    row_ops!(Avx512, __m512i, Bf16, Widen::Bf16, max16, 0x7f80, reduce16);
    row_ops!(Avx512, __m512i, F16, Widen::F16, max16, 0x7c00, reduce16);
    row_ops!(
        Avx512,
        __m512i,
        F32,
        Widen::F32,
        max32,
        0x7f80_0000,
        reduce32
    );

    #[inline]
    #[target_feature(enable = "avx512f")]
    fn zero() -> __m512i {
        _mm512_setzero_si512()
    }

    /// Folds the finite-|x| keys of 16-bit elements (`|x| < limit`, inf and NaN count as 0)
    /// into `acc`, 32 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn max16(acc: __m512i, seg: &[u8], limit: i16) -> __m512i {
        let n = seg.len() / 2;
        let p = seg.as_ptr();
        let abs = _mm512_set1_epi16(0x7fff);
        let lim = _mm512_set1_epi16(limit);
        let mut m = acc;
        let mut i = 0;
        while i + 32 <= n {
            // SAFETY: elements i .. i + 32 lie inside `seg` (checked by the loop condition).
            m = step16(
                m,
                unsafe { _mm512_loadu_si512(p.add(2 * i).cast()) },
                abs,
                lim,
            );
            i += 32;
        }
        if i < n {
            let k: __mmask32 = (1u32 << (n - i)) - 1;
            // SAFETY: only the lanes below n - i are read, and those lie inside `seg`.
            m = step16(
                m,
                unsafe { _mm512_maskz_loadu_epi16(k, p.add(2 * i).cast()) },
                abs,
                lim,
            );
        }
        m
    }

    /// [`max16`] for 32-bit elements, 16 lanes at a time.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn max32(acc: __m512i, seg: &[u8], limit: i32) -> __m512i {
        let n = seg.len() / 4;
        let p = seg.as_ptr();
        let abs = _mm512_set1_epi32(0x7fff_ffff);
        let lim = _mm512_set1_epi32(limit);
        let mut m = acc;
        let mut i = 0;
        while i + 16 <= n {
            // SAFETY: elements i .. i + 16 lie inside `seg` (checked by the loop condition).
            m = step32(
                m,
                unsafe { _mm512_loadu_si512(p.add(4 * i).cast()) },
                abs,
                lim,
            );
            i += 16;
        }
        if i < n {
            let k: __mmask16 = (1u16 << (n - i)) - 1;
            // SAFETY: only the lanes below n - i are read, and those lie inside `seg`.
            m = step32(
                m,
                unsafe { _mm512_maskz_loadu_epi32(k, p.add(4 * i).cast()) },
                abs,
                lim,
            );
        }
        m
    }

    /// `max(m, |v|)` in the lanes where `|v| < lim` (16-bit lanes).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn step16(m: __m512i, v: __m512i, abs: __m512i, lim: __m512i) -> __m512i {
        let a = _mm512_and_si512(v, abs);
        _mm512_mask_max_epi16(m, _mm512_cmplt_epi16_mask(a, lim), m, a)
    }

    /// `max(m, |v|)` in the lanes where `|v| < lim` (32-bit lanes).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn step32(m: __m512i, v: __m512i, abs: __m512i, lim: __m512i) -> __m512i {
        let a = _mm512_and_si512(v, abs);
        _mm512_mask_max_epi32(m, _mm512_cmplt_epi32_mask(a, lim), m, a)
    }

    /// Max of 32 non-negative 16-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn reduce16(m: __m512i) -> i16 {
        let lo = _mm512_cvtepi16_epi32(_mm512_castsi512_si256(m));
        let hi = _mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64::<1>(m));
        // Every lane is a key in 0 ..= 0x7fff, so the narrowing is exact.
        _mm512_reduce_max_epi32(_mm512_max_epi32(lo, hi)) as i16
    }

    /// Max of 16 32-bit lanes.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn reduce32(m: __m512i) -> i32 {
        _mm512_reduce_max_epi32(m)
    }

    /// Loads `lanes` (1..=16) elements at `p` as f32 lanes (the rest zero).
    ///
    /// # Safety
    /// `p .. p + lanes * element size` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load<const W: u8>(p: *const u8, lanes: usize) -> __m512 {
        let k: __mmask16 = if lanes >= 16 { !0 } else { (1u16 << lanes) - 1 };
        if W == Widen::F32 as u8 {
            // SAFETY: the caller guarantees the unmasked lanes are readable.
            unsafe { _mm512_maskz_loadu_ps(k, p.cast()) }
        } else {
            // SAFETY: the caller guarantees the unmasked lanes are readable.
            let h = unsafe { _mm256_maskz_loadu_epi16(k, p.cast()) };
            if W == Widen::F16 as u8 {
                _mm512_cvtph_ps(h)
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    /// Loads 16 whole elements at `p` as f32 lanes.
    ///
    /// # Safety
    /// `p .. p + 16 * element size` must be readable.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load16<const W: u8>(p: *const u8) -> __m512 {
        if W == Widen::F32 as u8 {
            // SAFETY: the caller guarantees 64 readable bytes.
            unsafe { _mm512_loadu_ps(p.cast()) }
        } else {
            // SAFETY: the caller guarantees 32 readable bytes.
            let h = unsafe { _mm256_loadu_si256(p.cast()) };
            if W == Widen::F16 as u8 {
                _mm512_cvtph_ps(h)
            } else {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
            }
        }
    }

    /// `f32_to_e4m3_saturating(x * inv)` in every lane; the code is the low byte of each
    /// 32-bit lane, and byte 1 is always zero (bytes 2 and 3 are not cleared: the narrowing
    /// store drops them).
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn e4m3(x: __m512, inv: __m512) -> __m512i {
        let b = _mm512_castps_si512(_mm512_mul_ps(x, inv));
        let abs = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let not_nan = _mm512_cmple_epi32_mask(abs, _mm512_set1_epi32(0x7f80_0000));
        // Saturate: above 448 (inf included) becomes 448. A NaN becomes the pattern one
        // e4m3 step above 448 (0x43f0_0000, which is what the scalar code's `0x7e | 1` gives:
        // the normal path below turns it into 0x7f), folded into the same masked min.
        let a = _mm512_mask_min_epi32(
            _mm512_set1_epi32(0x43f0_0000),
            not_nan,
            abs,
            _mm512_set1_epi32(0x43e0_0000),
        );
        // Subnormal: a + 2^14 rounds a to units of 2^-9; its bits are 0x4680_00uu, uu the
        // count of units (at most 8), so the low byte is already the code.
        let sub = _mm512_castps_si512(_mm512_add_ps(
            _mm512_castsi512_ps(a),
            _mm512_set1_ps(16384.0),
        ));
        // Normal: round 23 mantissa bits to 3 (ties to even) and rebias 127 -> 7; the rebias
        // (-120 << 3 after the shift) is folded into the addend before it.
        let lsb = _mm512_and_si512(_mm512_srli_epi32::<20>(a), _mm512_set1_epi32(1));
        let biased = _mm512_add_epi32(a, _mm512_set1_epi32(0x7_ffff - (960 << 20)));
        let normal = _mm512_srli_epi32::<20>(_mm512_add_epi32(biased, lsb));
        let small = _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x3c80_0000));
        let mag = _mm512_mask_blend_epi32(small, normal, sub);
        // (sign byte & 0x80) | mag, in one ternary-logic op: A & B | C is 0xEA.
        _mm512_ternarylogic_epi32::<0xEA>(_mm512_srli_epi32::<24>(b), _mm512_set1_epi32(0x80), mag)
    }

    /// Quantises one row segment of `W` elements into `out` (one byte per element).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn quantise_row<const W: u8>(seg: &[u8], inv: f32, out: &mut [u8]) {
        let size = if W == Widen::F32 as u8 { 4 } else { 2 };
        let n = out.len().min(seg.len() / size);
        let (p, q) = (seg.as_ptr(), out.as_mut_ptr());
        let inv = _mm512_set1_ps(inv);
        let mut i = 0;
        if W == Widen::Bf16 as u8 {
            // 32 bf16 per step from one 64-byte load: each 32-bit lane holds elements 2j (low
            // half) and 2j+1 (high half), so a shift and a mask give both as f32 without any
            // widening shuffle. Byte 1 of every `e4m3` lane is zero (see there), so the odd
            // codes or-ed in at bit 8 pair up with the even ones in 16-bit lanes, in memory
            // order, and one 32-to-16-bit narrowing stores all 32.
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            while i + 32 <= n {
                // SAFETY: elements i .. i + 32 lie inside `seg` (loop condition, n <= seg len).
                let v = unsafe { _mm512_loadu_si512(p.add(2 * i).cast()) };
                let even = e4m3(_mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)), inv);
                let odd = e4m3(_mm512_castsi512_ps(_mm512_and_si512(v, high)), inv);
                let pairs = _mm512_or_si512(even, _mm512_slli_epi32::<8>(odd));
                let codes = _mm512_cvtepi32_epi16(pairs);
                // SAFETY: bytes i .. i + 32 lie inside `out` (loop condition, n <= out len).
                unsafe { _mm256_storeu_si256(q.add(i).cast(), codes) };
                i += 32;
            }
        }
        while i + 16 <= n {
            // SAFETY: elements i .. i + 16 lie inside `seg` (loop condition, n <= seg len).
            let x = unsafe { load16::<W>(p.add(size * i)) };
            let v = _mm512_cvtepi32_epi8(e4m3(x, inv));
            // SAFETY: bytes i .. i + 16 lie inside `out` (loop condition, n <= out len).
            unsafe { _mm_storeu_si128(q.add(i).cast(), v) };
            i += 16;
        }
        if i < n {
            let lanes = n - i;
            // SAFETY: elements i .. n lie inside `seg`; the load reads only those lanes.
            let x = unsafe { load::<W>(p.add(size * i), lanes) };
            let v = _mm512_cvtepi32_epi8(e4m3(x, inv));
            // SAFETY: the masked store writes only bytes i .. n, inside `out`.
            unsafe { _mm_mask_storeu_epi8(q.add(i).cast(), (1u16 << lanes) - 1, v) };
        }
    }
}
