//! Waiting without holding the GIL, interruptibly.
//!
//! Every blocking call of the package waits in slices of [`POLL`] with the GIL released
//! (`py.detach`), and between slices runs Python's signal handlers (`py.check_signals`), so
//! other Python threads run meanwhile and Ctrl-C raises `KeyboardInterrupt` within 50 ms.

use std::time::{Duration, Instant};

use pyo3::prelude::*;
use weightsync_agent::embed::EmbedError;

use crate::errors::{embed_error, raise};

/// One slice of a wait.
pub(crate) const POLL: Duration = Duration::from_millis(50);

/// Calls `attempt(slice)` (a blocking Rust wait that gives up with [`EmbedError::Timeout`]
/// after `slice`) with the GIL released until it ends, `timeout` seconds pass (then
/// `weightsync.TimeoutError` naming `what`) or a signal handler raises.
pub(crate) fn wait_interruptibly<T: Send>(
    py: Python<'_>,
    timeout: Option<f64>,
    what: &str,
    attempt: impl Fn(Duration) -> Result<T, EmbedError> + Sync,
) -> PyResult<T> {
    let deadline = match timeout {
        Some(t) if !(t >= 0.0 && t.is_finite()) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "timeout must be a non-negative number of seconds or None, got {t}"
            )));
        }
        Some(t) => Some(Instant::now() + Duration::from_secs_f64(t)),
        None => None,
    };
    loop {
        let slice = match deadline {
            Some(d) => POLL.min(d.saturating_duration_since(Instant::now())),
            None => POLL,
        };
        match py.detach(|| attempt(slice)) {
            Ok(v) => return Ok(v),
            Err(EmbedError::Timeout { .. }) => {}
            Err(e) => return Err(embed_error(py, e)),
        }
        py.check_signals()?;
        if deadline.is_some_and(|d| Instant::now() >= d) {
            let secs = timeout.unwrap_or_default();
            return Err(raise(
                py,
                "TimeoutError",
                format!("{what}: not done after {secs} s"),
                &[],
            ));
        }
    }
}
