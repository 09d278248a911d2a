//! `weightsync`: the one binary. A thin clap front: each subcommand is a module of [`cmd`] over
//! the library crates (the controller service, the worker agents, the planner, the benchmarks).
//!
//! # Layout
//! - `main.rs`: the clap front; it only dispatches.
//! - [`cmd`]: one module per subcommand (`demo`, `plan`, `simulate`, `controller`, `worker`,
//!   `bench`), each owning its `Args` and a `run` function.
//! - [`logging`]: stderr tracing for the commands (stdout stays clean for `--json`).

mod cmd;
mod logging;

use clap::{Parser, Subcommand};

/// Move fresh model weights from RL training GPUs to rollout GPUs with one-sided writes.
#[derive(Debug, Parser)]
#[command(name = "weightsync", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Everything on loopback: controller, trainers and rollouts with a real model's shapes.
    Demo(cmd::demo::Args),
    /// Compute and print the static routing table for a model and two layouts.
    Plan(cmd::plan::Args),
    /// Simulate a sync at cluster scale against a cluster model, with baselines.
    Simulate(cmd::simulate::Args),
    /// Run the controller.
    Controller(cmd::controller::Args),
    /// Run a trainer or rollout worker.
    Worker(cmd::worker::Args),
    /// Benchmarks, each beside its baseline in the same run.
    Bench(cmd::bench::Args),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Demo(a) => cmd::demo::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Simulate(a) => cmd::simulate::run(a),
        Command::Controller(a) => cmd::controller::run(a),
        Command::Worker(a) => cmd::worker::run(a),
        Command::Bench(a) => cmd::bench::run(a),
    }
}
