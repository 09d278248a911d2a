//! The `(name, tensor, dtype)` lists the Python layer passes to `register`, read into
//! [`ForeignTensor`]s with errors that name the tensor and the worker.

use pyo3::prelude::*;
use weightsync_common::DType;

use crate::dtype_name;
use crate::errors::raise;
use crate::foreign_tensor::{Access, ForeignTensor};

/// One entry: name, object, optional dtype to reinterpret same-size elements as.
pub(crate) type Entry<'py> = (String, Bound<'py, PyAny>, Option<String>);

/// A named foreign tensor.
pub(crate) struct Named {
    pub(crate) name: String,
    pub(crate) tensor: ForeignTensor,
}

/// Reads every entry; the first that cannot be used raises `RegistrationError` naming it.
pub(crate) fn read(
    py: Python<'_>,
    worker: &str,
    entries: Vec<Entry<'_>>,
    access: Access,
) -> PyResult<Vec<Named>> {
    let mut out = Vec::with_capacity(entries.len());
    for (name, obj, dtype) in entries {
        let fail = |e: PyErr| {
            raise(
                py,
                "RegistrationError",
                format!("{worker}: tensor {name}: {}", e.value(py)),
                &[
                    (
                        "worker",
                        worker
                            .into_pyobject(py)
                            .map(|b| b.into_any().unbind())
                            .unwrap_or_else(|_| py.None()),
                    ),
                    (
                        "tensor",
                        name.as_str()
                            .into_pyobject(py)
                            .map(|b| b.into_any().unbind())
                            .unwrap_or_else(|_| py.None()),
                    ),
                ],
            )
        };
        let dtype: Option<DType> = dtype
            .as_deref()
            .map(dtype_name::parse)
            .transpose()
            .map_err(fail)?;
        let tensor = ForeignTensor::from_object(&obj, dtype, access).map_err(fail)?;
        out.push(Named { name, tensor });
    }
    Ok(out)
}
