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

#[test]
fn simulate_changed_predicts_a_delta_sync_beside_the_full_one() {
    let args = [
        "simulate",
        "--model",
        "qwen3-0.6b",
        "--train",
        "fsdp=4",
        "--infer",
        "tp=2,dp=2",
        "--dtype",
        "fp8",
        "--json",
    ];
    let out = weightsync(&[&args[..], &["--changed", "0.02"]].concat());
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let d = &v["delta"];
    let f = |k: &str| d[k].as_f64().unwrap_or_else(|| panic!("no {k} in {d}"));
    assert_eq!(f("changed"), 0.02);
    assert_eq!(f("full_bound_s"), v["bound_s"].as_f64().unwrap());
    assert_eq!(f("full_predicted_s"), v["predicted_s"].as_f64().unwrap());
    assert!(
        f("delta_bound_s") > 0.0 && f("delta_bound_s") < f("full_bound_s"),
        "{d}"
    );
    assert!(f("predicted_s") >= f("delta_bound_s") && f("predicted_s") < f("full_predicted_s"));
    assert!(
        f("wire_bytes") < f("dense_bytes") && f("wire_fraction") < 1.0,
        "{d}"
    );
    // The memory rate of the encode and apply defaults to --prep-gbs.
    assert_eq!(f("scan_gbs"), 1000.0);
    // Without --changed there is no delta sync; a changed fraction out of range is named.
    let plain = weightsync(&args);
    let v: serde_json::Value = serde_json::from_slice(&plain.stdout).unwrap();
    assert!(v.get("delta").is_none());
    let bad = weightsync(&[&args[..], &["--changed", "2"]].concat());
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--changed") && err.contains("fraction"),
        "{err}"
    );
}
