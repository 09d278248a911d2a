//! `weightsync simulate`. (Being built.)

/// Arguments of `weightsync simulate`.
#[derive(Debug, clap::Args)]
pub struct Args {}

/// Runs `weightsync simulate`.
pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("`weightsync simulate` is not built yet")
}
