//! `--die-with-parent`: a sidecar that ends with the process that started it.
//!
//! Why: a trainer sidecar started by its training rank (torchrun's child) outlives a rank
//! killed with `kill -9` unless something ends it, and an orphaned sidecar keeps its rank
//! registered with the controller, so the restarted rank's own sidecar is refused or races it.
//! The kernel's parent-death signal (`PR_SET_PDEATHSIG`, Linux) sends SIGTERM when the parent
//! exits; a parent already gone before it was set (we are re-parented to init) ends us at once.
//! Opt-in: a sidecar started by a shell script that exits on purpose must keep running.

use anyhow::Context;

/// Asks the kernel to send this process SIGTERM when its parent exits, and exits now if the
/// parent is already gone.
pub fn die_with_parent() -> anyhow::Result<()> {
    use rustix::process::{Signal, set_parent_process_death_signal};
    set_parent_process_death_signal(Some(Signal::TERM))
        .context("setting the parent-death signal (PR_SET_PDEATHSIG)")?;
    // Re-parented before the signal was set: the parent died already.
    if std::os::unix::process::parent_id() == 1 {
        tracing::error!("--die-with-parent: the parent process is gone; exiting");
        std::process::exit(1);
    }
    Ok(())
}
