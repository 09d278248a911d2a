//! What a user sees of the `weightsync` binary before any job runs: `--help` says what the tool
//! is for, and an ordinary input error is one message naming what was wrong, with no stack
//! trace even where `RUST_BACKTRACE=1` is set (common among Rust users; anyhow would print its
//! captured backtrace if `main` returned the error).

use std::process::{Command, Output};

fn weightsync(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_weightsync"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LIB_BACKTRACE", "1")
        .output()
        .expect("the weightsync binary runs")
}

#[test]
fn help_speaks_to_users() {
    let out = weightsync(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let help = String::from_utf8(out.stdout).unwrap();
    let first = help.lines().next().unwrap_or_default();
    assert!(
        first.starts_with("Move fresh model weights") && first.contains("train"),
        "{help}"
    );
    assert!(!help.contains("thin clap front"), "{help}");
    assert!(
        help.contains("Try it: a whole job on this machine"),
        "{help}"
    );
    assert!(help.contains("Usage: weightsync <COMMAND>"), "{help}");
}

#[test]
fn an_unknown_model_is_one_message_without_a_backtrace() {
    let out = weightsync(&[
        "plan",
        "--model",
        "no-such-model",
        "--train",
        "fsdp=2",
        "--infer",
        "tp=1",
    ]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains("no-such-model"), "{err}");
    assert!(!err.to_lowercase().contains("stack backtrace"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn a_bad_layout_is_one_message_without_a_backtrace() {
    let out = weightsync(&[
        "plan",
        "--model",
        "qwen3-0.6b",
        "--train",
        "fsdp=two",
        "--infer",
        "tp=1",
    ]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("fsdp=two"),
        "{err}"
    );
    assert!(!err.to_lowercase().contains("stack backtrace"), "{err}");
}

#[test]
fn a_usage_error_exits_2() {
    let out = weightsync(&["plan", "--no-such-flag"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--no-such-flag"), "{err}");
}
