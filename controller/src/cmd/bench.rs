//! `weightsync bench ...`: whole-system benchmarks, each beside its baseline in the same run.

/// Arguments of `weightsync bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub which: Which,
}

/// Which benchmark to run.
#[derive(Debug, clap::Subcommand)]
pub enum Which {}

/// Runs `weightsync bench ...`.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.which {}
}
