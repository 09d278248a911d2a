//! `weightsync plan`. (Being built.)

/// Arguments of `weightsync plan`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `weightsync plan`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`weightsync plan` is not built yet")
}
