//! Logging for the binary's commands: `tracing` to stderr, filtered by `RUST_LOG` (default
//! given per command), so stdout stays clean for `--json` output.

/// Installs the stderr subscriber once; later calls do nothing.
pub fn init(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
