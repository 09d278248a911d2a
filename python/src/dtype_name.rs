//! Element-type names as Python callers spell them.

use pyo3::PyResult;
use pyo3::exceptions::PyValueError;
use weightsync_common::DType;

/// `"bf16"`, `"bfloat16"`, `"torch.bfloat16"`, ... → [`DType`].
pub(crate) fn parse(name: &str) -> PyResult<DType> {
    Ok(match name.trim_start_matches("torch.") {
        "bf16" | "bfloat16" => DType::BF16,
        "f16" | "float16" | "half" => DType::F16,
        "f32" | "float32" | "float" => DType::F32,
        "f8_e4m3" | "float8_e4m3fn" | "fp8" | "e4m3" => DType::F8E4M3,
        other => {
            return Err(PyValueError::new_err(format!(
                "dtype {other:?}: expected bf16, f16, f32 or f8_e4m3 (torch names work too)"
            )));
        }
    })
}
