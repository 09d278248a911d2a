//! Rust errors as the package's Python exceptions (`weightsync.errors`), with the worker, the
//! tensor, the version and (for a failed sync) the failure's kind as attributes, so a training
//! loop can tell what failed without parsing a message.
//!
//! The exception classes are plain Python (documented, picklable, subclassable); this module
//! only imports and raises them.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use weightsync_agent::embed::EmbedError;

/// Builds `weightsync.errors.<class>(message, **attrs)` as a Python exception.
pub(crate) fn raise(
    py: Python<'_>,
    class: &str,
    message: String,
    attrs: &[(&str, Py<PyAny>)],
) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let cls = py.import("weightsync.errors")?.getattr(class)?;
        let kw = PyDict::new(py);
        for (k, v) in attrs {
            kw.set_item(k, v)?;
        }
        let exc = cls.call((message.clone(),), Some(&kw))?;
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|e| e)
}

fn s(py: Python<'_>, v: &str) -> Py<PyAny> {
    v.into_pyobject(py)
        .map(|b| b.into_any().unbind())
        .unwrap_or_else(|_| py.None())
}

fn opt(py: Python<'_>, v: Option<&str>) -> Py<PyAny> {
    v.map(|v| s(py, v)).unwrap_or_else(|| py.None())
}

/// One [`EmbedError`] as its Python exception.
pub(crate) fn embed_error(py: Python<'_>, e: EmbedError) -> PyErr {
    let message = e.to_string();
    match &e {
        EmbedError::Connect { worker, .. } => {
            raise(py, "ConnectError", message, &[("worker", s(py, worker))])
        }
        EmbedError::Registration { worker, tensor, .. } => raise(
            py,
            "RegistrationError",
            message,
            &[
                ("worker", s(py, worker)),
                ("tensor", opt(py, tensor.as_deref())),
            ],
        ),
        EmbedError::LayoutMismatch {
            worker,
            tensor,
            expected,
            actual,
        } => raise(
            py,
            "LayoutMismatchError",
            message,
            &[
                ("worker", s(py, worker)),
                ("tensor", s(py, tensor)),
                ("expected", s(py, expected)),
                ("actual", s(py, actual)),
            ],
        ),
        EmbedError::StaleTensor { worker, tensor } => raise(
            py,
            "StaleTensorError",
            message,
            &[("worker", s(py, worker)), ("tensor", s(py, tensor))],
        ),
        EmbedError::SyncFailed {
            version,
            worker,
            kind,
            tensor,
            cause,
        } => {
            let version = version
                .into_pyobject(py)
                .map(|b| b.into_any().unbind())
                .unwrap_or_else(|_| py.None());
            raise(
                py,
                "SyncFailedError",
                message,
                &[
                    ("worker", s(py, worker)),
                    ("version", version),
                    ("kind", s(py, kind.name())),
                    ("tensor", opt(py, tensor.as_deref())),
                    ("cause", s(py, cause)),
                ],
            )
        }
        EmbedError::Busy {
            worker,
            version,
            running,
        } => {
            let int = |v: u64| {
                v.into_pyobject(py)
                    .map(|b| b.into_any().unbind())
                    .unwrap_or_else(|_| py.None())
            };
            raise(
                py,
                "PushRefusedError",
                message,
                &[
                    ("worker", s(py, worker)),
                    ("version", int(*version)),
                    ("running", int(*running)),
                ],
            )
        }
        EmbedError::Timeout { .. } => raise(py, "TimeoutError", message, &[]),
        EmbedError::Closed { worker } => {
            raise(py, "ClosedError", message, &[("worker", s(py, worker))])
        }
        // A caller's bad argument, as Python says it.
        EmbedError::InvalidStageReport { .. } => PyValueError::new_err(message),
        #[allow(unreachable_patterns)]
        _ => raise(py, "SyncError", message, &[]),
    }
}

/// The TLS files of a worker's `tls_cert=`, `tls_key=`, `tls_ca=` (all three or none; none:
/// the `WEIGHTSYNC_TLS_*` variables, else plain TCP); a `ValueError` names the one missing.
pub(crate) fn tls_files(
    cert: Option<std::path::PathBuf>,
    key: Option<std::path::PathBuf>,
    ca: Option<std::path::PathBuf>,
) -> PyResult<Option<weightsync_common::tls::TlsFiles>> {
    weightsync_common::tls::TlsFiles::from_parts(cert, key, ca)
        .map_err(|e| PyValueError::new_err(e.to_string()))
}
