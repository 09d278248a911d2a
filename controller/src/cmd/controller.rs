//! `weightsync controller`. (Being built.)

/// Arguments of `weightsync controller`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `weightsync controller`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`weightsync controller` is not built yet")
}
