//! weightsync-cli: the `weightsync` command line, as a library so that two programs can be it:
//! the `weightsync` binary (`src/main.rs`) and the Python package's console script
//! (`weightsync` from the wheel, `python -m weightsync`), which calls [`main_with_args`] in the
//! interpreter's process.
//!
//! Each subcommand is a module of `cmd` over the library crates (the controller service, the
//! worker agents, the planner, the benchmarks). Errors from bad input end here as one message
//! (`error: what: why`) and exit status 1, whatever `RUST_BACKTRACE` says; clap's usage errors
//! exit 2; panics (bugs) keep Rust's report and its backtrace.
//!
//! # Layout
//! - `lib.rs`: the clap front ([`main_with_args`]); it only parses and dispatches.
//! - `cmd`: one module per subcommand (`demo`, `plan`, `simulate`, `controller`, `worker`,
//!   `bench`), each owning its `Args` and a `run` function.
//! - `logging`: stderr tracing for the commands (stdout stays clean for `--json`).
//! - `parent_death`: `worker --die-with-parent` (the sidecar ends with its training rank).
//!
//! A subcommand that starts copies of itself (`demo`'s workers, `bench`'s peers) asks
//! [`weightsync_common::program::Program::this`] how: the Python entry point sets it to the
//! interpreter with `-m weightsync`.

mod cmd;
mod logging;
mod parent_death;

use std::ffi::OsString;
use std::io::Write;

use clap::{Parser, Subcommand};

/// Move fresh model weights from the GPUs that train a model to the GPUs that serve it.
///
/// weightsync copies each new version of an RL job's weights from the training ranks straight
/// into the inference engines' own tensors, with one-sided writes along a routing table that a
/// controller plans once for the job. Try `weightsync demo` for a whole job on this machine.
#[derive(Debug, Parser)]
#[command(name = "weightsync", bin_name = "weightsync", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Try it: a whole job on this machine (controller, trainers, rollouts), with a dashboard.
    Demo(cmd::demo::Args),
    /// Print which bytes go where for a model, a training layout and an inference layout.
    Plan(cmd::plan::Args),
    /// Estimate a sync's time on a cluster of thousands of GPUs, beside the usual baselines.
    Simulate(cmd::simulate::Args),
    /// Run the controller of a job: workers register with it, the training loop asks it to sync.
    Controller(cmd::controller::Args),
    /// Run one trainer or rollout worker process of a job.
    Worker(cmd::worker::Args),
    /// Measure weightsync on this machine, each figure beside its baseline from the same run.
    Bench(cmd::bench::Args),
}

/// Exit status of an error from the command's input or its run (clap's usage errors exit 2).
pub const EXIT_ERROR: u8 = 1;

/// Runs the `weightsync` command line on `args` (the program name first, as
/// `std::env::args_os()` gives it) and returns the process's exit status: 0 on success, 2 for a
/// usage error, [`EXIT_ERROR`] for an error while running, printed to stderr as one message
/// with its causes (never a backtrace: those are for panics).
pub fn main_with_args<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let code = match Cli::try_parse_from(args) {
        Ok(cli) => match dispatch(cli.command) {
            Ok(()) => 0,
            Err(e) => {
                let _ = std::io::stdout().flush();
                eprintln!("error: {}", error_text(&e));
                EXIT_ERROR
            }
        },
        Err(e) => {
            // --help and --version are "errors" that print to stdout and exit 0.
            let _ = e.print();
            u8::try_from(e.exit_code()).unwrap_or(2)
        }
    };
    // In the Python process nothing flushes Rust's stdout at exit: do it here.
    let _ = std::io::stdout().flush();
    code
}

/// An error and its causes on one line, `what: why: why` (anyhow's alternate form, which
/// prints no backtrace even when one was captured).
fn error_text(e: &anyhow::Error) -> String {
    format!("{e:#}")
}

fn dispatch(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Demo(a) => cmd::demo::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Simulate(a) => cmd::simulate::run(a),
        Command::Controller(a) => cmd::controller::run(a),
        Command::Worker(a) => cmd::worker::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn help_opens_with_what_the_tool_does_and_lists_every_command() {
        let help = Cli::command().render_long_help().to_string();
        assert!(
            help.starts_with("Move fresh model weights from the GPUs that train a model"),
            "{help}"
        );
        assert!(!help.contains("clap"), "{help}");
        for c in ["demo", "plan", "simulate", "controller", "worker", "bench"] {
            assert!(
                help.lines().any(|l| l.trim_start().starts_with(c)),
                "{c} missing from\n{help}"
            );
        }
    }

    #[test]
    fn an_error_prints_its_causes_on_one_line() {
        let e = anyhow::anyhow!("unknown model").context("planning the job");
        assert_eq!(error_text(&e), "planning the job: unknown model");
    }

    #[test]
    fn usage_errors_exit_2_and_help_exits_0() {
        assert_eq!(main_with_args(["weightsync", "no-such-command"]), 2);
        assert_eq!(main_with_args(["weightsync", "--version"]), 0);
    }
}
