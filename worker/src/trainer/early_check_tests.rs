//! The rollout's early check with the pipeline over the in-process fabric: once a round was
//! verified, the next rounds' runs are hashed while they land, and verification still compares
//! every run with the trainer's checksum and still catches bytes that changed after the hash.

use std::time::{Duration, Instant};

use weightsync_common::fabric::{Access, FabricBackend, WriteOp};

use super::tests::{SharedSource, expected, setup, source_bytes};
use super::*;
use crate::mem_fabric::MemFabric;
use crate::rollout::RolloutWorker;

/// Offset of `b`, the last tensor of the rollout's MR (see `tests::plans`).
const B_AT: u64 = 77056;

/// One round of step `step`, landed (not verified).
async fn land(
    trainer: &TrainerWorker<MemFabric>,
    rollout: &RolloutWorker<MemFabric>,
    source: &SharedSource,
    step: u32,
) -> SyncReport {
    *source.write() = source_bytes(step);
    let sync = SyncId {
        version: u64::from(step) + 1,
        epoch: u64::from(step) + 1,
    };
    rollout.arm(sync).unwrap();
    let report = trainer.run_sync(sync).await.unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    report
}

/// Waits until the early check hashed `bytes`.
async fn hashed_early(rollout: &RolloutWorker<MemFabric>, bytes: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while rollout.early_hashed_bytes() < bytes {
        assert!(
            Instant::now() < deadline,
            "the early check hashed {} of {bytes} bytes",
            rollout.early_hashed_bytes()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_of_a_verified_plan_are_hashed_while_landing_and_still_compared() {
    let (trainer, rollout, source, _) = setup(200 << 10, PipelineMode::Pipelined);
    let first = land(&trainer, &rollout, &source, 0).await;
    let v = rollout.verify(&first.checksums).unwrap();
    assert_eq!(v.early_bytes, 0, "the first round teaches the runs");
    for step in 1..3 {
        let report = land(&trainer, &rollout, &source, step).await;
        hashed_early(&rollout, v.bytes).await;
        let again = rollout.verify(&report.checksums).unwrap();
        assert_eq!(again.bytes, v.bytes);
        assert_eq!(again.early_bytes, again.bytes, "step {step}");
        let got = rollout.region(0).unwrap().to_vec().unwrap();
        assert_eq!(got, expected(&source.read()), "step {step}");
        // The early hashes are compared with the trainer's checksums, not trusted.
        let mut wrong = report.checksums.clone();
        wrong[0].xxh3 ^= 1;
        let err = rollout.verify(&wrong).unwrap_err();
        assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_corrupted_on_the_way_fails_the_early_hash_naming_the_tensor() {
    let (trainer, rollout, source, fab) = setup(1 << 20, PipelineMode::Pipelined);
    let first = land(&trainer, &rollout, &source, 0).await;
    let v = rollout.verify(&first.checksums).unwrap();
    fab.corrupt_at(&rollout.descriptors()[0], B_AT);
    let report = land(&trainer, &rollout, &source, 1).await;
    hashed_early(&rollout, v.bytes).await;
    let err = rollout.verify(&report.checksums).unwrap_err();
    assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
    assert!(err.to_string().contains("in b on rollout rank 0"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_landing_after_the_early_hash_are_read_again_and_caught() {
    let (trainer, rollout, source, fab) = setup(1 << 20, PipelineMode::Pipelined);
    let first = land(&trainer, &rollout, &source, 0).await;
    let v = rollout.verify(&first.checksums).unwrap();
    let report = land(&trainer, &rollout, &source, 1).await;
    hashed_early(&rollout, v.bytes).await;
    // A stray write (no immediate: nothing counts it) over the start of b, after b's run was
    // hashed and before verification.
    let dst = rollout.descriptors()[0].clone();
    let good = rollout.region(0).unwrap().copy_to_vec(B_AT, 64).unwrap();
    let src = fab.alloc(64, Access::SOURCE).unwrap();
    src.write_at(0, &[0xEE; 64]).unwrap();
    fab.write(WriteOp::new(&src, 0, &dst, B_AT, 64))
        .await
        .unwrap();
    let err = rollout.verify(&report.checksums).unwrap_err();
    assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
    assert!(err.to_string().contains("in b on rollout rank 0"), "{err}");
    // Put the right bytes back the same way: b is read again and passes; the other runs keep
    // the hashes taken while they landed.
    src.write_at(0, &good).unwrap();
    fab.write(WriteOp::new(&src, 0, &dst, B_AT, 64))
        .await
        .unwrap();
    let again = rollout.verify(&report.checksums).unwrap();
    assert!(again.early_bytes > 0, "{again:?}");
    assert!(
        again.early_bytes < again.bytes,
        "b was read again: {again:?}"
    );
}
