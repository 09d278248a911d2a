//! Lane faults at the worker level: the real trainer and rollout libraries over the real TCP
//! fabric, with a [`LaneProxy`](weightsync_tests::proxy::LaneProxy) in front of each rollout.

use std::time::{Duration, Instant};

use weightsync_common::fabric::FabricConfig;
use weightsync_tests::proxied_cluster::{JOB_TOKEN, ProxiedCluster, SyncOutcome, tiny_table};
use weightsync_tests::proxy::ProxyMode;
use weightsync_worker::SyncId;

const WATERMARK: u64 = 1 << 20;

fn config(io_timeout_ms: u64) -> FabricConfig {
    FabricConfig {
        io_timeout_ms,
        connect_timeout_ms: 2_000,
        ..FabricConfig::loopback(JOB_TOKEN, 2)
    }
}

fn sync(version: u64, epoch: u64) -> SyncId {
    SyncId { version, epoch }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lane_dropped_mid_payload_never_commits_and_the_next_sync_does() {
    let table = tiny_table("fsdp=2", "tp=2");
    let c = ProxiedCluster::start(&table, WATERMARK, &config(5_000))
        .await
        .expect("cluster starts");
    c.fill_sources(1);
    let first = c.sync(sync(1, 1), Duration::from_secs(20)).await;
    assert!(first.committed(), "clean sync 1: {first:?}");
    let per_rollout = c.proxies[0].upstream_bytes();
    assert!(
        per_rollout > 64 << 10,
        "sync 1 moved only {per_rollout} bytes through proxy 0"
    );

    // Sync 2: rollout 0's lanes are cut once a third of its bytes went through.
    c.fill_sources(2);
    c.proxies[0].set_mode(ProxyMode::CutAfter {
        upstream_bytes: per_rollout / 3,
    });
    let cut = c.sync(sync(2, 2), Duration::from_secs(10)).await;
    assert!(c.proxies[0].cuts() >= 1, "the proxy never cut a lane");
    eprintln!(
        "sync with a lane cut after {} bytes: {cut:?}",
        per_rollout / 3
    );
    match &cut {
        // A writer that re-established the lane and re-sent everything may still commit: then
        // every checksum matched, which is the promise.
        SyncOutcome::Committed => {}
        SyncOutcome::TrainerFailed(e) | SyncOutcome::NotLanded(e) => {
            assert!(!e.is_empty(), "a failure must say why");
        }
        SyncOutcome::VerifyFailed(e) => {
            panic!("a cut lane let a sync land with wrong bytes (caught only by verify): {e}")
        }
    }

    // Sync 3 (version 2 again, new epoch) commits and verifies.
    let again = c.sync(sync(2, 3), Duration::from_secs(20)).await;
    assert!(again.committed(), "sync after the cut: {again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_that_stops_reading_times_out_instead_of_hanging() {
    let table = tiny_table("fsdp=2", "tp=1");
    let io_timeout = Duration::from_millis(1_500);
    let c = ProxiedCluster::start(&table, WATERMARK, &config(io_timeout.as_millis() as u64))
        .await
        .expect("cluster starts");
    c.fill_sources(1);
    let first = c.sync(sync(1, 1), Duration::from_secs(20)).await;
    assert!(first.committed(), "clean sync 1: {first:?}");

    c.fill_sources(2);
    c.proxies[0].set_mode(ProxyMode::Stall);
    let started = Instant::now();
    // The outer bound only turns a hang into a test failure; the writer must give up on its own.
    let stalled = c.sync(sync(2, 2), Duration::from_secs(60)).await;
    let took = started.elapsed();
    match &stalled {
        SyncOutcome::TrainerFailed(e) => assert!(
            !e.contains("hung"),
            "the trainer hung on a peer that stopped reading: {e}"
        ),
        other => panic!("a sync to a stalled peer must fail in the trainer, got {other:?}"),
    }
    assert!(
        took < Duration::from_secs(55),
        "the writer took {took:?} to notice a stalled peer (io timeout {io_timeout:?})"
    );

    c.proxies[0].set_mode(ProxyMode::Forward);
    let again = c.sync(sync(2, 3), Duration::from_secs(20)).await;
    assert!(again.committed(), "sync after the stall: {again:?}");
}
