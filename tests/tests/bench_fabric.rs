//! `weightsync bench fabric` as users run it: two real processes on loopback, every lane count on
//! both paths a lane can take, and the report saying which path really carried the bytes. This
//! is also the cross-process check of same-host pulls: the bench's peer is a separate process,
//! so its receive threads copy out of the driver's memory only if the kernel lets one process
//! read another's.

use std::process::Command;

use weightsync_tests::processes::weightsync_binary;

/// Whether this kernel lets the bench's peer (a child) read its parent's memory: no Yama, or
/// Yama's `ptrace_scope` 0. Elsewhere the receiver declines pulls and the lanes carry payloads.
fn cross_process_reads_allowed() -> bool {
    match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
        Err(_) => true,
        Ok(scope) => scope.trim() == "0",
    }
}

#[test]
fn both_paths_move_the_bytes_and_the_report_says_which_carried_them() {
    let out = Command::new(weightsync_binary())
        .args([
            "bench", "fabric", "--quick", "--blocks", "1048576", "--json",
        ])
        .output()
        .expect("running weightsync bench fabric");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench fabric failed: {stderr}");
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("bench fabric --json prints one JSON object");
    assert_eq!(report["bench"], "fabric");
    let rows = report["rows"].as_array().expect("rows");
    // 1, 2 and 4 lanes, each on both paths.
    assert_eq!(rows.len(), 6, "{rows:?}");
    let pulls = cross_process_reads_allowed();
    for row in rows {
        assert_eq!(row["block_bytes"], 1 << 20, "{row}");
        let gbps = row["gbps"].as_f64().expect("a rate");
        assert!(gbps.is_finite() && gbps > 0.0, "{row}");
        let on_wire = row["socket_bytes_per_byte"].as_f64().expect("a share");
        match row["path"].as_str().expect("a path") {
            // Every byte through the sockets, and its frame headers.
            "socket" => assert!((1.0..1.01).contains(&on_wire), "{row}"),
            // Only 48-byte headers for 1 MiB frames, where the kernel lets the peer pull;
            // payloads as before where it does not.
            "pull" if pulls => assert!(on_wire < 0.001, "pulls expected here: {row}"),
            "pull" => assert!((1.0..1.01).contains(&on_wire), "{row}"),
            other => panic!("unknown path {other}: {row}"),
        }
    }
    // The multi-address rows count what crossed each address: pulls are off there.
    for row in report["multi_address"].as_array().expect("multi_address") {
        let sent: u64 = row["addresses"]
            .as_array()
            .expect("addresses")
            .iter()
            .map(|a| a["bytes_sent"].as_u64().expect("bytes"))
            .sum();
        assert!(sent > 0, "{row}");
    }
}
