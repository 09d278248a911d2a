//! Which engine's arithmetic an fp8 e4m3 128x128 block quantisation follows.
//!
//! Every recipe in use stores one f32 `weight_scale_inv` per block with
//! `dequant = fp8 * weight_scale_inv`, and they all dequantise equally well; but they compute
//! the block's scale with different f32 operations, so the bytes an engine's own loader would
//! have made differ in the last bit (`shared/engines/fp8-recipes.md`). A sync that must leave
//! an engine holding bit for bit what its loader makes from the same weights names the recipe.
//! Per block, from `amax = max |x|` over its finite elements, each recipe gives the factor each
//! element is multiplied by (f32 multiply, then e4m3 round-to-nearest-even, saturating) and the
//! stored scale:
//!
//! | recipe | factor | `weight_scale_inv` | all-zero block |
//! |---|---|---|---|
//! | [`Vllm`](Fp8Recipe::Vllm) | `448 / a`, a true division, `a = max(amax, 1e-4)` | `a / 448` | `1e-4 / 448` |
//! | [`Transformers`](Fp8Recipe::Transformers) | `s = fl(1 / amax) * 448` | `1 / s` | factor 1, scale 1.0 |
//! | [`DeepGemm`](Fp8Recipe::DeepGemm) | `1 / sf`, `sf = a / 448` | `sf` | `1e-4 / 448` |
//!
//! - `vllm`: vLLM's `per_block_cast_to_fp8` (and weightsync's kernels before recipes had a
//!   name); the default of `format=fused`.
//! - `transformers`: transformers' `Fp8Quantize`, what `from_pretrained` with
//!   `FineGrainedFP8Config` writes (torch evaluates its `448.0 / max_abs` as the reciprocal
//!   times 448, and `1.0 / scales` as a reciprocal; no floor: an all-zero block keeps scale
//!   1.0); the default of `format=hf`, whose engines are transformers models.
//! - `deepgemm`: DeepGEMM's current `per_block_cast_to_fp8` (`x * (1.0 / sf)`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Largest finite float8 e4m3fn magnitude.
const E4M3_MAX: f32 = 448.0;

/// Floor of a block's amax in the recipes that have one (the `clamp(1e-4)` of the torch
/// helpers), so an all-zero block gets a finite, non-zero scale.
pub const FP8_AMAX_FLOOR: f32 = 1e-4;

/// An fp8 block-quantisation recipe (see the module docs).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
pub enum Fp8Recipe {
    /// vLLM's `per_block_cast_to_fp8`: factor `448 / a`, scale `a / 448`.
    #[default]
    Vllm,
    /// transformers' `Fp8Quantize`: factor `fl(1 / amax) * 448`, scale its reciprocal; 1.0 for
    /// an all-zero block.
    Transformers,
    /// DeepGEMM's `per_block_cast_to_fp8`: scale `sf = a / 448`, factor `1 / sf`.
    DeepGemm,
}

impl Fp8Recipe {
    /// Every recipe, in the order of their codes.
    pub const ALL: [Fp8Recipe; 3] = [
        Fp8Recipe::Vllm,
        Fp8Recipe::Transformers,
        Fp8Recipe::DeepGemm,
    ];

    /// The recipe's name in a layout string (`fp8=...`).
    pub const fn name(self) -> &'static str {
        match self {
            Fp8Recipe::Vllm => "vllm",
            Fp8Recipe::Transformers => "transformers",
            Fp8Recipe::DeepGemm => "deepgemm",
        }
    }

    /// A small number naming the recipe where a kernel takes it as an integer (the CUDA
    /// kernel's `recipe` argument): its index in [`Fp8Recipe::ALL`].
    pub const fn code(self) -> u32 {
        match self {
            Fp8Recipe::Vllm => 0,
            Fp8Recipe::Transformers => 1,
            Fp8Recipe::DeepGemm => 2,
        }
    }

    /// `(factor, weight_scale_inv)` of a block whose largest finite magnitude is `amax` (>= 0):
    /// each element is quantised as `e4m3(x * factor)`, and `weight_scale_inv` is stored.
    #[inline]
    pub fn block_scale(self, amax: f32) -> (f32, f32) {
        match self {
            Fp8Recipe::Vllm => {
                let a = amax.max(FP8_AMAX_FLOOR);
                (E4M3_MAX / a, a / E4M3_MAX)
            }
            Fp8Recipe::Transformers => {
                if amax > 0.0 {
                    let factor = (1.0 / amax) * E4M3_MAX;
                    (factor, 1.0 / factor)
                } else {
                    (1.0, 1.0)
                }
            }
            Fp8Recipe::DeepGemm => {
                let sf = amax.max(FP8_AMAX_FLOOR) / E4M3_MAX;
                (1.0 / sf, sf)
            }
        }
    }
}

impl fmt::Display for Fp8Recipe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Fp8Recipe {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Fp8Recipe::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| {
                format!(
                    "fp8 recipe {s:?}: expected vllm (vLLM's per_block_cast_to_fp8), transformers \
                     (transformers' Fp8Quantize) or deepgemm (DeepGEMM's 1/sf)"
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for r in Fp8Recipe::ALL {
            assert_eq!(r.name().parse::<Fp8Recipe>(), Ok(r));
            assert_eq!(Fp8Recipe::ALL[r.code() as usize], r);
        }
        let e = "sglang".parse::<Fp8Recipe>().unwrap_err();
        assert!(
            e.contains("\"sglang\"") && e.contains("transformers"),
            "{e}"
        );
        assert_eq!(Fp8Recipe::default(), Fp8Recipe::Vllm);
    }

    /// Reference values: each engine's own expression evaluated by torch 2.13 on f32 CPU
    /// tensors (vLLM `full_like(448) / t`, `t / 448`; transformers `448.0 / t`, `1.0 / that`;
    /// DeepGEMM `sf = t / 448`, `1 / sf`), as bit patterns. Each amax shows one recipe one ulp
    /// away from the others.
    #[test]
    fn block_scales_match_the_engines_expressions() {
        let bits = |(f, s): (f32, f32)| (f.to_bits(), s.to_bits());
        // (amax bits, vllm, transformers, deepgemm), each (factor, weight_scale_inv).
        #[allow(clippy::type_complexity)]
        let cases: [(u32, (u32, u32), (u32, u32), (u32, u32)); 5] = [
            (
                0x4040_0000,
                (0x4315_5555, 0x3bdb_6db7),
                (0x4315_5556, 0x3bdb_6db6),
                (0x4315_5555, 0x3bdb_6db7),
            ),
            (
                0x3fd9_999a,
                (0x4383_c3c4, 0x3b78_af8b),
                (0x4383_c3c3, 0x3b78_af8c),
                (0x4383_c3c4, 0x3b78_af8b),
            ),
            (
                0x3fa6_6666,
                (0x43ac_4ec5, 0x3b3e_2be2),
                (0x43ac_4ec5, 0x3b3e_2be3),
                (0x43ac_4ec6, 0x3b3e_2be2),
            ),
            (
                0x3c34_3958,
                (0x471f_1746, 0x37cd_f865),
                (0x471f_1746, 0x37cd_f864),
                (0x471f_1746, 0x37cd_f865),
            ),
            (
                0x40f6_6666,
                (0x4268_ba2f, 0x3c8c_cccd),
                (0x4268_ba2f, 0x3c8c_cccd),
                (0x4268_ba2e, 0x3c8c_cccd),
            ),
        ];
        for (amax, vllm, transformers, deepgemm) in cases {
            let amax = f32::from_bits(amax);
            assert_eq!(bits(Fp8Recipe::Vllm.block_scale(amax)), vllm, "vllm {amax}");
            assert_eq!(
                bits(Fp8Recipe::Transformers.block_scale(amax)),
                transformers,
                "transformers {amax}"
            );
            assert_eq!(
                bits(Fp8Recipe::DeepGemm.block_scale(amax)),
                deepgemm,
                "deepgemm {amax}"
            );
        }
        // An all-zero block: the floored recipes scale by 1e-4 / 448, transformers by 1.0.
        let floor = FP8_AMAX_FLOOR / 448.0;
        assert_eq!(
            Fp8Recipe::Vllm.block_scale(0.0),
            (448.0 / FP8_AMAX_FLOOR, floor)
        );
        assert_eq!(Fp8Recipe::DeepGemm.block_scale(0.0).1, floor);
        assert_eq!(Fp8Recipe::Transformers.block_scale(0.0), (1.0, 1.0));
        // Below the floor transformers has none: amax 1e-5 keeps its own scale.
        let (_, s) = Fp8Recipe::Transformers.block_scale(1e-5);
        assert!((s - 1e-5 / 448.0).abs() < 1e-12, "{s}");
    }
}
