//! A stale write: bytes and an immediate from an aborted sync that arrive during the next one.
//!
//! Worker level, with a raw writer of the same job (it knows the token, the descriptors and the
//! old sync's immediates: the worst case of a slow trainer from the aborted sync).

use std::time::Duration;

use weightsync_common::fabric::{Access, FabricBackend, FabricConfig, WriteOp};
use weightsync_tests::proxied_cluster::{JOB_TOKEN, ProxiedCluster, SyncOutcome, tiny_table};
use weightsync_worker::ImmTag;
use weightsync_worker::SyncId;

const WATERMARK: u64 = 1 << 20;

async fn cluster() -> ProxiedCluster {
    let table = tiny_table("fsdp=2", "tp=1");
    ProxiedCluster::start(&table, WATERMARK, &FabricConfig::loopback(JOB_TOKEN, 2))
        .await
        .expect("cluster starts")
}

/// Writes, to every unit of every rollout, as many writes as that unit expects, each carrying
/// the immediate of `epoch` and garbage bytes at the start of the unit's first tensor.
async fn stale_writes(c: &ProxiedCluster, epoch: u64) -> u64 {
    let src = c.probe.alloc(4096, Access::SOURCE).expect("source");
    src.write_at(0, &[0xEE; 4096]).expect("fill");
    let mut sent = 0;
    for r in &c.rollouts {
        let descs = r.descriptors();
        let tensor = &r.plan().tensors[0];
        let dst = &descs[tensor.mr as usize];
        for e in &r.plan().expect {
            let imm = ImmTag::new(epoch, u32::from(e.unit)).expect("unit").imm();
            for _ in 0..e.writes {
                let len = tensor.len.min(4096);
                c.probe
                    .write(WriteOp::new(&src, 0, dst, tensor.offset, len).with_imm(imm))
                    .await
                    .expect("the stale write itself lands (its bytes are writable)");
                sent += 1;
            }
        }
    }
    sent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_write_of_an_aborted_sync_is_not_counted_by_the_next() {
    let c = cluster().await;
    c.fill_sources(1);
    assert!(
        c.sync(
            SyncId {
                version: 1,
                epoch: 1
            },
            Duration::from_secs(20)
        )
        .await
        .committed()
    );

    // Sync epoch 2 is armed, then aborted (a trainer died): its immediates are retired.
    c.arm(SyncId {
        version: 2,
        epoch: 2,
    })
    .expect("arm 2");
    c.abort_all();
    // The retry (epoch 3) is armed; the aborted sync's writes arrive now, a full count of them.
    let retry = SyncId {
        version: 2,
        epoch: 3,
    };
    c.arm(retry).expect("arm 3");
    let sent = stale_writes(&c, 2).await;
    assert!(sent > 0);
    // Nothing of the retry was written: it must not look landed.
    for r in &c.rollouts {
        let landed = r.await_landed(Duration::from_millis(500)).await;
        assert!(
            landed.is_err(),
            "{sent} stale writes of epoch 2 made epoch 3 look landed"
        );
    }
    // The next attempt (epoch 4) commits and verifies.
    c.fill_sources(2);
    let next = c
        .sync(
            SyncId {
                version: 2,
                epoch: 4,
            },
            Duration::from_secs(20),
        )
        .await;
    assert!(next.committed(), "sync after stale writes: {next:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_bytes_landing_after_the_real_ones_fail_verification_by_tensor() {
    let c = cluster().await;
    c.fill_sources(1);
    assert!(
        c.sync(
            SyncId {
                version: 1,
                epoch: 1
            },
            Duration::from_secs(20)
        )
        .await
        .committed()
    );
    c.arm(SyncId {
        version: 2,
        epoch: 2,
    })
    .expect("arm 2");
    c.abort_all();

    // Epoch 3 lands for real; then, before verification, a stale write of epoch 2 overwrites
    // the start of a tensor. Its immediate is not counted, but its bytes are wrong: the sync
    // must not commit, and the error must name the tensor.
    c.fill_sources(2);
    let retry = SyncId {
        version: 2,
        epoch: 3,
    };
    c.arm(retry).expect("arm 3");
    let handle = tokio::runtime::Handle::current();
    let name = c.rollouts[0].plan().tensors[0].name.clone();
    let outcome = c
        .write_land_verify(retry, Duration::from_secs(20), |c| {
            tokio::task::block_in_place(|| handle.block_on(stale_writes(c, 2)));
        })
        .await;
    match outcome {
        SyncOutcome::VerifyFailed(e) => assert!(e.contains(&name), "error must name {name}: {e}"),
        other => panic!("stale bytes after landing must fail verification, got {other:?}"),
    }
    let next = c
        .sync(
            SyncId {
                version: 2,
                epoch: 4,
            },
            Duration::from_secs(20),
        )
        .await;
    assert!(next.committed(), "sync after the stale bytes: {next:?}");
}
