//! `weightsync worker`. (Being built.)

/// Arguments of `weightsync worker`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `weightsync worker`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`weightsync worker` is not built yet")
}
