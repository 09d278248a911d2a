//! `weightsync`: the one binary. Everything is in the library ([`weightsync_cli`]), which the
//! Python package's console script runs too; this only hands it the process's arguments.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(weightsync_cli::main_with_args(std::env::args_os()))
}
