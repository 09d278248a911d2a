//! `weightsync._native.cli_main`: the `weightsync` command line inside the Python process, so
//! that the wheel's console script (and `python -m weightsync`) is the same program as the
//! Rust binary: [`weightsync_cli::main_with_args`].
//!
//! Subcommands that start copies of themselves (`demo`, `bench`) would start `current_exe()`,
//! which is the Python interpreter here: the caller says how to run the CLI again (`program`,
//! e.g. `[sys.executable, "-P", "-m", "weightsync"]`) and it is set for the process
//! ([`Program::set_this`]).

use std::ffi::OsString;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use weightsync_common::program::Program;

/// Runs the `weightsync` command line on `argv` (the program name first) with the GIL
/// released and returns its exit status. `program`: how this process runs the CLI again.
#[pyfunction]
#[pyo3(signature = (argv, program = None))]
pub(crate) fn cli_main(
    py: Python<'_>,
    argv: Vec<OsString>,
    program: Option<Vec<OsString>>,
) -> PyResult<u8> {
    if let Some(mut words) = program {
        if words.is_empty() {
            return Err(PyValueError::new_err(
                "program must name an executable (e.g. [sys.executable, '-m', 'weightsync'])",
            ));
        }
        let path = words.remove(0);
        let program = Program {
            path: path.into(),
            prefix: words,
        };
        Program::set_this(program).map_err(|set| {
            PyValueError::new_err(format!(
                "this process already runs the CLI again as `{set}`"
            ))
        })?;
    }
    Ok(py.detach(|| weightsync_cli::main_with_args(argv)))
}
