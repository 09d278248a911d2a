//! Element types of weights as they are stored on either side of a sync.
//!
//! Training keeps parameters in bf16 / fp16 / fp32; inference engines take bf16 or fp8 e4m3
//! (with fp32 block scales). The planner and the preparation kernels speak of tensors in these
//! terms, so the enum lives here where every crate sees it.

use serde::{Deserialize, Serialize};

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DType {
    /// bfloat16.
    BF16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision (also the dtype of fp8 block scales, `weight_scale_inv`).
    F32,
    /// float8 e4m3fn (no infinities, one NaN pattern per sign, max 448).
    F8E4M3,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            DType::F8E4M3 => 1,
        }
    }

    /// The name used in safetensors headers and Hugging Face configs.
    pub const fn name(self) -> &'static str {
        match self {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::F8E4M3 => "f8_e4m3",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(DType::BF16),
            "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
            "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
            "f8_e4m3" | "fp8" | "e4m3" | "float8_e4m3fn" | "f8e4m3" => Ok(DType::F8E4M3),
            other => Err(format!(
                "unknown dtype {other:?} (expected bf16, f16, f32 or fp8)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_aliases_and_rejects_unknown() {
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("fp8".parse::<DType>().unwrap(), DType::F8E4M3);
        let err = "int4".parse::<DType>().unwrap_err();
        assert!(err.contains("int4"), "{err}");
        assert_eq!(DType::F32.size(), 4);
    }
}
