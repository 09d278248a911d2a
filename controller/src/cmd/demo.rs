//! `weightsync demo`. (Being built.)

/// Arguments of `weightsync demo`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `weightsync demo`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`weightsync demo` is not built yet")
}
