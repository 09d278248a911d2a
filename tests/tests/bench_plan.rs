//! `weightsync bench plan` as users run it: the real binary timing whole `weightsync plan`
//! processes of its own beside a baseline binary (here the same one, so the outputs must be
//! identical), and refusing what it cannot run with an error that names it.

use std::process::Command;

use weightsync_tests::processes::weightsync_binary;

fn bench_plan(args: &[&str]) -> std::process::Output {
    Command::new(weightsync_binary())
        .args(["bench", "plan"])
        .args(args)
        .output()
        .expect("running weightsync bench plan")
}

#[test]
fn a_case_is_timed_beside_its_baseline_and_their_outputs_compared() {
    let bin = weightsync_binary();
    let out = bench_plan(&[
        "--json",
        "--runs",
        "2",
        "--model",
        "qwen3-0.6b",
        "--train",
        "fsdp=2",
        "--infer",
        "tp=2",
        "--baseline",
        bin.to_str().expect("utf-8 path"),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench plan failed: {stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("bench plan --json prints one JSON object");
    assert_eq!(report["bench"], "plan");
    let case = &report["cases"][0];
    assert_eq!(case["case"]["model"], "qwen3-0.6b");
    for who in ["weightsync", "baseline"] {
        let runs = &case[who];
        assert_eq!(
            runs["all_wall_s"].as_array().map(Vec::len),
            Some(2),
            "{who}"
        );
        assert!(
            runs["wall_s"].as_f64().unwrap_or(0.0) > 0.0,
            "{who}: {runs}"
        );
        // A planning process holds at least the model and its tables: over a megabyte.
        assert!(
            runs["peak_rss_bytes"].as_u64().unwrap_or(0) > 1 << 20,
            "{who}: {runs}"
        );
    }
    assert_eq!(case["outputs_identical"], true, "same binary, same plan");
    let ratio = case["wall_vs_baseline"].as_f64().expect("a ratio");
    assert!(ratio.is_finite() && ratio > 0.0, "{ratio}");
    // No goals for a case of one's own, and no slice measured for it.
    assert!(case["met"]["wall"].is_null() && case["largest_slice_bytes"].is_null());
}

#[test]
fn an_unknown_case_and_a_missing_baseline_are_named() {
    let out = bench_plan(&["--cases", "anchor,hugest"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("hugest"), "{stderr}");

    let out = bench_plan(&["--cases", "anchor", "--baseline", "/nonexistent/ws-main"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("/nonexistent/ws-main"), "{stderr}");
}
