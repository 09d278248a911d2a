//! Scalar element conversions between bf16, fp16, fp32 and float8 e4m3fn.
//!
//! Why hand-written rather than `half`: the kernels need conversions that the compiler can
//! vectorise (no branches, no tables, no calls), and the NVRTC kernels in `gpu` mirror these
//! exact integer/float steps so the CPU and GPU outputs are bit-identical. The results are
//! checked against `half` (casts) and against ml_dtypes' float8_e4m3fn (committed vectors).
//!
//! Conventions:
//! - every narrowing conversion rounds to nearest, ties to even;
//! - a NaN stays a NaN with its sign; narrowing to bf16/fp16 keeps the top payload bits and
//!   sets the quiet bit (what `half`, F16C and torch do); widening bf16/fp16 NaNs keep their
//!   payload and also get the quiet bit (as `half` does);
//! - fp32 -> bf16/fp16 overflow rounds to ±inf (IEEE);
//! - fp32 -> e4m3fn *saturates*: finite values beyond ±448 and ±inf become ±448 (0x7e/0xfe),
//!   NaN becomes 0x7f / 0xff (sign kept). e4m3fn has no infinity; ml_dtypes and torch map
//!   overflow and inf to NaN in a plain cast, so this function equals ml_dtypes applied to
//!   `clip(x, -448, 448)` (NaN passes through `clip`).

/// Largest finite float8 e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;

/// bf16 bits to f32 (exact; a NaN gets the quiet bit, as `half` does).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    let quiet = if h & 0x7fff > 0x7f80 { 0x40 } else { 0 };
    f32::from_bits(((h | quiet) as u32) << 16)
}

/// f32 to bf16 bits, round to nearest even; NaN keeps sign and top payload, quiet bit set.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    // Signed 32-bit arithmetic throughout: vector ISAs have signed compares and min, not
    // unsigned ones, and every compared quantity here is below 2^31.
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    let is_nan = ((b & 0x7fff_ffff) as i32) > 0x7f80_0000;
    (if is_nan { nan } else { rounded }) as u16
}

/// fp16 bits to f32 (exact; NaN gets the quiet bit).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let h = h as i32;
    let sign = (h & 0x8000) << 16;
    let em = h & 0x7fff;
    // Normal: rebias the exponent (15 -> 127) by adding (127 - 15) << 23 to the shifted pattern.
    let normal = (em << 13) + ((127 - 15) << 23);
    // Subnormal (and zero): the value is em * 2^-24, exact in f32 and never an f32 denormal.
    let subnormal = (em as f32 * f32::from_bits(0x3380_0000)).to_bits() as i32; // 2^-24
    // Inf / NaN: all-ones exponent; a NaN gets the quiet bit.
    let quiet = if em > 0x7c00 { 0x0040_0000 } else { 0 };
    let special = (em << 13) | 0x7f80_0000 | quiet;
    let mag = if em < 0x0400 {
        subnormal
    } else if em >= 0x7c00 {
        special
    } else {
        normal
    };
    f32::from_bits((sign | mag) as u32)
}

/// f32 to fp16 bits, round to nearest even; overflow to ±inf; NaN keeps sign and top payload,
/// quiet bit set.
#[inline(always)]
pub fn f32_to_f16(x: f32) -> u16 {
    let b = x.to_bits() as i32;
    let sign = (b >> 16) & 0x8000;
    let a = b & 0x7fff_ffff;
    let nan = 0x7e00 | ((a >> 13) & 0x03ff);
    // Results below 2^-14 are fp16 subnormals (units of 2^-24). Adding 0.5 (whose ulp is 2^-24)
    // makes the FPU round to that grid, ties to even; the low bits are then the count of units
    // (1024 = the smallest normal, which is also its encoding).
    let subnormal = ((f32::from_bits(a as u32) + 0.5).to_bits() as i32).wrapping_sub(0x3f00_0000);
    // Normal: round the 23-bit mantissa to 10 bits (ties to even), then rebias 127 -> 15.
    // (Only selected for a < 65520, so the addition cannot overflow.)
    let normal = (a.wrapping_add(0x0fff + ((a >> 13) & 1)) >> 13).wrapping_sub((127 - 15) << 10);
    let mag = if a > 0x7f80_0000 {
        nan
    } else if a >= 0x477f_f000 {
        // 65520 and above (and inf) round to inf.
        0x7c00
    } else if a < 0x3880_0000 {
        subnormal
    } else {
        normal
    };
    (sign | mag) as u16
}

/// f32 to float8 e4m3fn, saturating (see the module doc), round to nearest even.
#[inline(always)]
pub fn f32_to_e4m3_saturating(x: f32) -> u8 {
    let b = x.to_bits() as i32;
    let abs = b & 0x7fff_ffff;
    let is_nan = abs > 0x7f80_0000;
    // Saturate in the integer domain: for non-negative floats the bit order is the value
    // order, so this maps everything above 448 (inf and NaN included) to 448.
    let a = abs.min(0x43e0_0000);
    // Below 2^-6 the result is an e4m3 subnormal (units of 2^-9): adding 2^14, whose ulp is
    // 2^-9, rounds to that grid with ties to even; 8 units is the smallest normal's encoding.
    let subnormal = (f32::from_bits(a as u32) + 16384.0).to_bits() as i32 - 0x4680_0000;
    // Normal: round 23 mantissa bits to 3 (ties to even), then rebias the exponent 127 -> 7.
    let normal = ((a + 0x7_ffff + ((a >> 20) & 1)) >> 20) - (120 << 3);
    let mag = if a < 0x3c80_0000 { subnormal } else { normal };
    // A NaN went through the saturation as 448 (0x7e); setting the low bit makes it 0x7f.
    let v = mag | is_nan as i32;
    (((b >> 24) & 0x80) | v) as u8
}

/// float8 e4m3fn to f32 (exact), for tests and dequantisation checks.
pub fn e4m3_to_f32(v: u8) -> f32 {
    let sign = if v & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((v >> 3) & 0x0f) as i32;
    let man = (v & 0x07) as f32;
    if v & 0x7f == 0x7f {
        return f32::NAN.copysign(sign);
    }
    if exp == 0 {
        sign * man * (2.0f32).powi(-9)
    } else {
        sign * (1.0 + man / 8.0) * (2.0f32).powi(exp - 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn sixteen_bit_widening_matches_half_for_every_pattern() {
        for h in 0..=u16::MAX {
            let want = bf16::from_bits(h).to_f32().to_bits();
            assert_eq!(bf16_to_f32(h).to_bits(), want, "bf16 {h:#06x}");
            let want = f16::from_bits(h).to_f32().to_bits();
            assert_eq!(f16_to_f32(h).to_bits(), want, "f16 {h:#06x}");
        }
    }

    #[test]
    fn sixteen_to_sixteen_via_f32_matches_half_for_every_pattern() {
        for h in 0..=u16::MAX {
            let want = f16::from_f32(bf16::from_bits(h).to_f32()).to_bits();
            assert_eq!(f32_to_f16(bf16_to_f32(h)), want, "bf16->f16 {h:#06x}");
            let want = bf16::from_f32(f16::from_bits(h).to_f32()).to_bits();
            assert_eq!(f32_to_bf16(f16_to_f32(h)), want, "f16->bf16 {h:#06x}");
        }
    }

    fn narrowing_case(bits: u32) {
        let x = f32::from_bits(bits);
        assert_eq!(
            f32_to_bf16(x),
            bf16::from_f32(x).to_bits(),
            "f32->bf16 {bits:#010x}"
        );
        assert_eq!(
            f32_to_f16(x),
            f16::from_f32(x).to_bits(),
            "f32->f16 {bits:#010x}"
        );
    }

    #[test]
    fn f32_narrowing_matches_half_on_edges() {
        let edges = [
            0u32,
            0x8000_0000,
            0x0000_0001, // smallest f32 denormal
            0x007f_ffff, // largest f32 denormal
            0x3380_0000, // 2^-24, smallest f16 subnormal
            0x3300_0000, // 2^-25, tie to zero
            0x3300_0001, // just above the tie
            0x33c0_0000, // 1.5 * 2^-24, tie to 2 units
            0x387f_e000, // largest f16 subnormal region
            0x387f_f000, // rounds up to the smallest normal
            0x3880_0000, // 2^-14
            0x3f80_1000, // 1 + 2^-11: tie, stays 1
            0x3f80_3000, // tie, rounds up to even
            0x477f_e000, // 65504
            0x477f_efff, // just below the overflow tie
            0x477f_f000, // 65520: tie to inf
            0x7f7f_ffff, // f32 max: bf16 rounds to inf
            0x7f80_0000, // inf
            0xff80_0000, // -inf
            0x7fc0_0000, // qNaN
            0x7f80_0001, // sNaN, low payload
            0xffa0_0000, // -sNaN with payload
            0x7fff_ffff, // NaN, all payload
            0x3f80_8000, // bf16 tie, stays 1
            0x3f81_8000, // bf16 tie, rounds up
        ];
        for bits in edges {
            narrowing_case(bits);
            narrowing_case(bits ^ 0x8000_0000);
        }
    }

    #[test]
    fn f32_narrowing_matches_half_on_a_stride_over_all_patterns() {
        // Every 4093rd bit pattern (prime stride): about a million patterns over all classes.
        let mut bits: u32 = 7;
        for _ in 0..1_049_000 {
            narrowing_case(bits);
            bits = bits.wrapping_add(4093);
        }
    }

    #[test]
    fn e4m3_round_trips_every_code() {
        for v in 0..=u8::MAX {
            let x = e4m3_to_f32(v);
            if v & 0x7f == 0x7f {
                assert!(x.is_nan());
                assert_eq!(f32_to_e4m3_saturating(x), v);
            } else {
                assert_eq!(f32_to_e4m3_saturating(x), v, "code {v:#04x} value {x}");
            }
        }
    }

    #[test]
    fn e4m3_saturates_and_keeps_nan() {
        assert_eq!(f32_to_e4m3_saturating(f32::INFINITY), 0x7e);
        assert_eq!(f32_to_e4m3_saturating(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3_saturating(1.0e30), 0x7e);
        assert_eq!(f32_to_e4m3_saturating(464.0), 0x7e);
        assert_eq!(f32_to_e4m3_saturating(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3_saturating(-f32::NAN), 0xff);
        assert_eq!(f32_to_e4m3_saturating(-0.0), 0x80);
        // 2^-10 is the tie between 0 and the smallest subnormal: even is zero.
        assert_eq!(f32_to_e4m3_saturating(2f32.powi(-10)), 0x00);
        assert_eq!(f32_to_e4m3_saturating(3.0 * 2f32.powi(-10)), 0x02);
    }
}
