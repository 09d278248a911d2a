//! Logging for the binary's commands: `tracing` to stderr, filtered by `RUST_LOG` (default
//! given per command), so stdout stays clean for `--json` output.
//!
//! Colour only for a person at a terminal: when stderr is a file or a pipe (a worker's log file,
//! CI, `2>log`) the lines carry no ANSI escape codes, and `NO_COLOR` (<https://no-color.org>)
//! turns them off everywhere.

use std::io::IsTerminal;

/// Installs the stderr subscriber once; later calls do nothing.
pub fn init(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR"),
        ))
        .with_target(false)
        .try_init();
}

/// Whether to colour: at a terminal, unless `NO_COLOR` is set to anything but the empty string.
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::colour;

    #[test]
    fn colour_only_at_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(
            !colour(false, None),
            "a file or a pipe gets no escape codes"
        );
        assert!(!colour(true, Some("1".into())));
        assert!(
            colour(true, Some("".into())),
            "an empty NO_COLOR is unset, as no-color.org says"
        );
    }
}
