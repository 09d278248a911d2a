//! Delta syncs end to end over the in-process fabric: byte-exact after every step, only the
//! changes on the wire, and the chain rules (an engine that does not hold the base refuses the
//! delta; a trainer whose last sync failed writes dense until one succeeds).

use std::collections::BTreeSet;
use std::time::Duration;

use super::tests::{SharedSource, expected, plans, source_bytes};
use super::*;
use crate::mem_fabric::MemFabric;
use crate::rollout::RolloutWorker;

fn setup_delta(
    watermark: u64,
) -> (
    TrainerWorker<MemFabric>,
    RolloutWorker<MemFabric>,
    SharedSource,
) {
    let (trainer, rollout, source, _) = setup_delta_with_peer(watermark);
    (trainer, rollout, source)
}

/// [`setup_delta`], and one more peer on the fabric (a stray writer).
fn setup_delta_with_peer(
    watermark: u64,
) -> (
    TrainerWorker<MemFabric>,
    RolloutWorker<MemFabric>,
    SharedSource,
    MemFabric,
) {
    let (tp, rp) = plans();
    let fab = MemFabric::new_switch("trainer-0");
    let stray = fab.peer("stray");
    let mut rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp.clone()).unwrap();
    let total: u64 = rp.mr_bytes.iter().sum();
    let source: SharedSource = Arc::new(parking_lot::RwLock::new(source_bytes(0)));
    let mut cfg = TrainerConfig::new("trainer-0", watermark);
    cfg.delta.keep_bases = true;
    let mut trainer = TrainerWorker::new(fab, source.clone(), tp, cfg).unwrap();
    with_inbox(&mut trainer, &mut rollout, total);
    (trainer, rollout, source, stray)
}

/// Gives `rollout` (of `bytes` bytes) its delta inbox, a quarter of them, and points `trainer`
/// at its regions and inbox.
fn with_inbox(
    trainer: &mut TrainerWorker<MemFabric>,
    rollout: &mut RolloutWorker<MemFabric>,
    bytes: u64,
) {
    rollout
        .enable_delta_inbox(crate::delta::inbox_bytes(bytes, 0.25))
        .unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    dsts.inboxes.insert(0, rollout.inbox_descriptor().unwrap());
    trainer.set_destinations(&dsts).unwrap();
}

/// Nudges every `every`-th element of w (bf16) and of b (f32) by a step's worth; only w's small
/// elements, so that no fp8 block's amax (and scale) moves: what an RL step does to most blocks.
fn nudge(src: &mut [u8], every: usize, step: u32) {
    let w_elems = 300 * 256;
    for i in (step as usize % every..w_elems).step_by(every) {
        let x = half::bf16::from_le_bytes([src[2 * i], src[2 * i + 1]]).to_f32();
        if x.abs() >= 2.0 {
            continue;
        }
        let y = half::bf16::from_f32(x * 0.75 + 0.25).to_le_bytes();
        src[2 * i..2 * i + 2].copy_from_slice(&y);
    }
    let b_at = w_elems * 2;
    for i in (0..100 * 64).step_by(every) {
        let at = b_at + 4 * i;
        let x = f32::from_le_bytes(src[at..at + 4].try_into().unwrap());
        src[at..at + 4].copy_from_slice(&(x + 3.0).to_le_bytes());
    }
}

fn only(rollout: u32, base: u64) -> DeltaSync {
    DeltaSync {
        base_version: base,
        rollouts: BTreeSet::from([rollout]),
    }
}

fn sync(version: u64) -> SyncId {
    SyncId {
        version,
        epoch: version + 1,
    }
}

/// Arms, runs the trainer (as a delta sync against `delta` when given), lands, applies, verifies,
/// and checks the destination against the kernels' own output.
async fn round(
    trainer: &TrainerWorker<MemFabric>,
    rollout: &RolloutWorker<MemFabric>,
    source: &SharedSource,
    version: u64,
    delta: Option<DeltaSync>,
) -> crate::Result<SyncReport> {
    rollout.arm(sync(version))?;
    let report = match &delta {
        Some(d) => {
            trainer
                .run_delta_sync_until(sync(version), d, std::future::pending())
                .await?
        }
        None => trainer.run_sync(sync(version)).await?,
    };
    rollout.await_landed(Duration::from_secs(10)).await?;
    rollout.apply_deltas(&report.deltas)?;
    rollout.verify(&report.checksums)?;
    let got = rollout.region(0).unwrap().to_vec().unwrap();
    assert_eq!(got, expected(&source.read()), "version {version}");
    assert_eq!(rollout.held_version(), Some(version));
    Ok(report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_land_byte_exact_and_move_a_fraction_of_the_bytes() {
    // 200 KiB forces the fp8 task into several pieces: its writes are split into parts.
    let (trainer, rollout, source) = setup_delta(200 << 10);
    let first = round(&trainer, &rollout, &source, 0, None).await.unwrap();
    assert!(first.deltas.is_empty());
    assert_eq!(trainer.delta_base().0, Some(0));
    for v in 1..5u64 {
        nudge(&mut source.write(), 97, v as u32);
        let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
            .await
            .unwrap();
        let d = report.delta;
        assert!(!report.deltas.is_empty(), "version {v}: {d:?}");
        assert!(d.changed > 0 && d.changed < d.elements, "{d:?}");
        assert!(
            d.wire_bytes() * 4 < d.dense_bytes,
            "version {v}: {} of {} bytes",
            d.wire_bytes(),
            d.dense_bytes
        );
        assert!(report.bytes_written < d.dense_bytes / 4, "{report:?}");
    }
    // Nothing changed: every run goes as an (empty) delta, and still verifies whole.
    let report = round(&trainer, &rollout, &source, 5, Some(only(0, 4)))
        .await
        .unwrap();
    assert_eq!(report.delta.changed, 0);
    // Nearly everything changed: the runs go dense (the fallback), byte-exact; only the fp8
    // scales, which did not move, may still go as a delta.
    *source.write() = source_bytes(7);
    let report = round(&trainer, &rollout, &source, 6, Some(only(0, 5)))
        .await
        .unwrap();
    let d = report.delta;
    assert!(d.delta_run_bytes <= 24, "{d:?}");
    assert!(
        report.bytes_written * 100 >= d.dense_bytes * 99,
        "{report:?}"
    );
}

/// An engine that does not hold the base (a failed or aborted round, a restart) refuses the
/// delta, naming the versions; a full sync makes it whole, and deltas follow again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_without_the_base_refuses_a_delta_and_a_full_sync_restores_it() {
    let (trainer, rollout, source) = setup_delta(1 << 20);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    nudge(&mut source.write(), 50, 1);
    round(&trainer, &rollout, &source, 1, Some(only(0, 0)))
        .await
        .unwrap();
    // Version 2 fails on the engine's side (aborted after arming): it holds nothing now.
    rollout.arm(sync(2)).unwrap();
    rollout.abort();
    assert_eq!(rollout.held_version(), None);
    // A trainer that (wrongly) sends a delta on top of 1 is refused, not silently applied.
    nudge(&mut source.write(), 50, 3);
    let err = round(&trainer, &rollout, &source, 3, Some(only(0, 1)))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, WorkerError::Delta { detail, .. } if detail.contains("holds none")),
        "{err}"
    );
    assert_eq!(rollout.held_version(), None);
    // The full sync the controller orders next restores it, then deltas resume.
    nudge(&mut source.write(), 50, 4);
    let full = round(&trainer, &rollout, &source, 4, None).await.unwrap();
    assert!(full.deltas.is_empty());
    nudge(&mut source.write(), 50, 5);
    let report = round(&trainer, &rollout, &source, 5, Some(only(0, 4)))
        .await
        .unwrap();
    assert!(!report.deltas.is_empty());
}

/// A trainer whose sync was cancelled holds no base: the next sync is dense whatever it is
/// asked, and byte-exact; deltas resume after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trainer_whose_sync_failed_writes_dense_until_one_succeeds() {
    let (trainer, rollout, source) = setup_delta(1 << 20);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    rollout.arm(sync(1)).unwrap();
    let err = trainer
        .run_delta_sync_until(sync(1), &only(0, 0), std::future::ready(()))
        .await
        .unwrap_err();
    assert!(matches!(err, WorkerError::Cancelled), "{err}");
    rollout.abort();
    assert_eq!(trainer.delta_base().0, None);
    nudge(&mut source.write(), 50, 2);
    // Asked for a delta on top of 0: the trainer's bases hold nothing, so it writes dense.
    let report = round(&trainer, &rollout, &source, 2, Some(only(0, 0)))
        .await
        .unwrap();
    assert!(report.deltas.is_empty());
    nudge(&mut source.write(), 50, 3);
    let report = round(&trainer, &rollout, &source, 3, Some(only(0, 2)))
        .await
        .unwrap();
    assert!(!report.deltas.is_empty());
}

/// Engines not named in the sync's delta set get dense writes from the same pieces.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engines_outside_the_delta_set_get_dense_writes() {
    let (trainer, rollout, source) = setup_delta(1 << 20);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    nudge(&mut source.write(), 50, 1);
    let report = round(&trainer, &rollout, &source, 1, Some(only(7, 0)))
        .await
        .unwrap();
    assert!(report.deltas.is_empty());
    assert_eq!(report.bytes_written, report.delta.dense_bytes);
}

/// A task that went dense is written as a full sync writes it (nothing compared, its base left
/// stale) for `REFRESH_EVERY - 2` syncs, refreshes its base on the next, compares on the one
/// after, and goes back to deltas once its changes thinned out; byte-exact throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dense_task_skips_its_base_refreshes_it_and_returns_to_deltas() {
    use super::delta::REFRESH_EVERY;
    let (trainer, rollout, source) = setup_delta(1 << 20);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    nudge(&mut source.write(), 97, 1);
    let report = round(&trainer, &rollout, &source, 1, Some(only(0, 0)))
        .await
        .unwrap();
    assert!(!report.deltas.is_empty());
    // Everything changes: compared, found dense.
    *source.write() = source_bytes(100);
    let report = round(&trainer, &rollout, &source, 2, Some(only(0, 1)))
        .await
        .unwrap();
    assert!(
        report.delta.changed * 2 > report.delta.elements,
        "{:?}",
        report.delta
    );
    let mut v = 3;
    // Dense: nothing compared, nothing encoded, every byte written.
    for _ in 0..REFRESH_EVERY - 2 {
        *source.write() = source_bytes(100 + v as u32);
        let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
            .await
            .unwrap();
        assert_eq!(report.delta.elements, 0, "version {v}: {:?}", report.delta);
        assert!(report.deltas.is_empty());
        assert_eq!(report.bytes_written, report.delta.dense_bytes);
        v += 1;
    }
    // Changes thin out. The refresh: base copied, nothing compared, written dense.
    nudge(&mut source.write(), 97, v as u32);
    let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    assert_eq!(report.delta.elements, 0, "refresh: {:?}", report.delta);
    assert!(report.deltas.is_empty());
    v += 1;
    // The sync after compares against the refreshed base (a sample: it still expects dense).
    nudge(&mut source.write(), 97, v as u32);
    let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    let d = report.delta;
    assert!(
        d.elements > 0 && d.changed * 10 < d.elements,
        "probe: {d:?}"
    );
    v += 1;
    // Found sparse: deltas again.
    nudge(&mut source.write(), 97, v as u32);
    let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    let d = report.delta;
    assert!(!report.deltas.is_empty(), "{d:?}");
    assert!(d.wire_bytes() * 4 < d.dense_bytes, "{d:?}");
}

/// A stale base is never encoded against: while a task is dense the engine holds newer bytes
/// than its base, and a source that returns to the base's bytes (a delta against that base
/// would be empty) must still be written whole; the compare after the refresh is against the
/// refreshed bytes, not older ones. Every sync is verified and compared byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_base_is_never_used_for_a_delta() {
    use super::delta::REFRESH_EVERY;
    let (trainer, rollout, source) = setup_delta(1 << 20);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    // Compared at 1 and found dense: the base holds 1's bytes, then goes stale.
    let old = source_bytes(100);
    *source.write() = old.clone();
    round(&trainer, &rollout, &source, 1, Some(only(0, 0)))
        .await
        .unwrap();
    // The dense syncs alternate between other bytes and the stale base's.
    let mut v = 2;
    while v < u64::from(REFRESH_EVERY) {
        *source.write() = if v % 2 == 0 {
            source_bytes(200)
        } else {
            old.clone()
        };
        let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
            .await
            .unwrap();
        assert!(report.deltas.is_empty(), "version {v}");
        assert_eq!(report.delta.elements, 0, "version {v}");
        v += 1;
    }
    // The refresh writes new bytes; the compare after it (same bytes) finds nothing changed
    // against them (against the old base nearly everything would be).
    *source.write() = source_bytes(300);
    let refresh = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    assert_eq!(refresh.delta.elements, 0, "{:?}", refresh.delta);
    v += 1;
    let probe = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    let d = probe.delta;
    assert!(d.elements > 0 && d.changed == 0, "{d:?}");
    // Back to deltas: nothing changed, empty deltas; then the old base's bytes are a change.
    v += 1;
    let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    assert!(!report.deltas.is_empty(), "{:?}", report.delta);
    assert_eq!(report.delta.changed, 0, "{:?}", report.delta);
    *source.write() = old;
    v += 1;
    let report = round(&trainer, &rollout, &source, v, Some(only(0, v - 1)))
        .await
        .unwrap();
    assert!(
        report.delta.changed * 2 > report.delta.elements,
        "{:?}",
        report.delta
    );
}

/// The apply's hash of a run it rewrote stands in for reading the run again only while no frame
/// touched it since: a stray write landing in an applied run after the apply is caught, and
/// once the right bytes are back the run is read again and passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_landing_in_an_applied_run_after_the_apply_is_caught() {
    use weightsync_common::fabric::{Access, FabricBackend, WriteOp};
    let (trainer, rollout, source, stray) = setup_delta_with_peer(200 << 10);
    round(&trainer, &rollout, &source, 0, None).await.unwrap();
    nudge(&mut source.write(), 97, 1);
    rollout.arm(sync(1)).unwrap();
    let report = trainer
        .run_delta_sync_until(sync(1), &only(0, 0), std::future::pending())
        .await
        .unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    rollout.apply_deltas(&report.deltas).unwrap();
    // A stray write (no immediate: nothing counts it) over the start of an applied run.
    let run = report.deltas[0];
    let region = rollout.region(run.mr).unwrap();
    let good = region.copy_to_vec(run.offset, 64).unwrap();
    let mut bad = good.clone();
    bad[0] ^= 0x40;
    let src = stray.alloc(64, Access::SOURCE).unwrap();
    let dst = rollout.descriptors()[run.mr as usize].clone();
    for bytes in [&bad, &good] {
        src.write_at(0, bytes).unwrap();
        stray
            .write(WriteOp::new(&src, 0, &dst, run.offset, 64))
            .await
            .unwrap();
        let res = rollout.verify(&report.checksums);
        if bytes == &bad {
            let err = res.unwrap_err();
            assert!(matches!(err, WorkerError::ChecksumMismatch { .. }), "{err}");
            assert_eq!(rollout.held_version(), None);
        } else {
            res.unwrap();
        }
    }
    assert_eq!(region.to_vec().unwrap(), expected(&source.read()));
}

/// A same-dtype copy of a registered tensor keeping a base is compared where the tensor lies:
/// nothing of it is staged (only its encoding is), its delta lands byte-exact and verifies, and
/// when everything changed its run goes dense straight from the tensor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registered_copy_is_compared_in_place_and_goes_dense_from_the_source() {
    use weightsync_schedules::table::TensorBox;
    let (tp, rp) = super::tests::copy_plans(TensorBox::new(&[0, 0], &[16, 8]));
    let fab = MemFabric::new_switch("trainer-0");
    let mut rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    // The training job's tensor: written between syncs only, while nothing reads it.
    let tensor = Arc::new(parking_lot::Mutex::new(
        (0..256u32)
            .map(|i| (i * 7 % 251) as u8)
            .collect::<Vec<u8>>(),
    ));
    let ptr = tensor.lock().as_mut_ptr();
    // SAFETY: the vector (never resized) is kept alive by the owner passed along; the test
    // writes it only between syncs, when no write reads it.
    let memory = unsafe { crate::HostMemory::from_raw(ptr, 256, Box::new(tensor.clone())) };
    let set = Arc::new(
        crate::TensorSet::register(
            &fab,
            vec![crate::SourceTensor {
                name: "w".into(),
                dtype: weightsync_common::DType::BF16,
                shape: vec![16, 8],
                memory,
            }],
        )
        .unwrap(),
    );
    let source = Arc::new(set.for_plan(&tp).unwrap());
    let mut cfg = TrainerConfig::new("trainer-0", 4096);
    cfg.delta.keep_bases = true;
    cfg.delta.keep_direct = true;
    let mut trainer = TrainerWorker::new(fab.clone(), source, tp, cfg).unwrap();
    with_inbox(&mut trainer, &mut rollout, 256);
    let reports = three_in_place_syncs(
        &trainer,
        &mut rollout,
        |v| change(v, &mut tensor.lock()),
        || tensor.lock().clone(),
    )
    .await;
    for (v, report) in reports.iter().enumerate() {
        assert_eq!((report.staged_bytes, report.direct_bytes), (0, 256), "v{v}");
    }
    assert_eq!(reports[1].delta.changed, 2, "{:?}", reports[1].delta);
    assert_eq!(reports[1].deltas.len(), 1);
    assert!(reports[1].bytes_written < 16, "{:?}", reports[1]);
    assert!(reports[2].deltas.is_empty());
    assert_eq!(reports[2].bytes_written, 256);
}

/// A same-dtype copy of a contiguous box of a plain (unregistered) source keeping a base is
/// compared where the source holds it too: only its runs that go dense are copied into
/// staging (none for a delta, all when everything changed), byte-exact and verified each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unregistered_copy_is_compared_in_place_and_stages_only_dense_runs() {
    use weightsync_schedules::table::TensorBox;
    let (tp, rp) = super::tests::copy_plans(TensorBox::new(&[0, 0], &[16, 8]));
    let fab = MemFabric::new_switch("trainer-0");
    let mut rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let source: SharedSource = Arc::new(parking_lot::RwLock::new(
        (0..256u32).map(|i| (i * 7 % 251) as u8).collect(),
    ));
    let mut cfg = TrainerConfig::new("trainer-0", 4096);
    cfg.delta.keep_bases = true;
    let mut trainer = TrainerWorker::new(fab.clone(), source.clone(), tp, cfg).unwrap();
    with_inbox(&mut trainer, &mut rollout, 256);
    let reports = three_in_place_syncs(
        &trainer,
        &mut rollout,
        |v| change(v, &mut source.write()),
        || source.read().clone(),
    )
    .await;
    for (v, report) in reports.iter().enumerate() {
        assert_eq!(report.direct_bytes, 0, "v{v}");
    }
    assert_eq!((reports[1].delta.changed, reports[1].deltas.len()), (2, 1));
    assert_eq!(reports[1].staged_bytes, 0, "{:?}", reports[1]);
    assert!(reports[2].deltas.is_empty());
    assert_eq!(
        (reports[2].staged_bytes, reports[2].bytes_written),
        (256, 256)
    );
}

/// What the in-place tests change before sync `v`: nothing, then two bytes, then every byte.
fn change(v: u64, bytes: &mut [u8]) {
    match v {
        1 => {
            bytes[10] ^= 1;
            bytes[201] ^= 0x80;
        }
        2 => bytes.iter_mut().for_each(|b| *b = b.wrapping_add(1)),
        _ => {}
    }
}

/// Syncs 0, 1 and 2 of `trainer` into `rollout` (the first full, then deltas against the one
/// before), `change(v)` applied to the source before each: each lands, applies and verifies,
/// and the engine then holds what `held()` reads of the source. Returns the trainer's reports.
async fn three_in_place_syncs(
    trainer: &TrainerWorker<MemFabric>,
    rollout: &mut RolloutWorker<MemFabric>,
    mut change: impl FnMut(u64),
    held: impl Fn() -> Vec<u8>,
) -> Vec<SyncReport> {
    let mut reports = Vec::new();
    for v in 0..3u64 {
        change(v);
        rollout.arm(sync(v)).unwrap();
        let report = match v {
            0 => trainer.run_sync(sync(v)).await.unwrap(),
            _ => trainer
                .run_delta_sync_until(sync(v), &only(0, v - 1), std::future::pending())
                .await
                .unwrap(),
        };
        rollout.await_landed(Duration::from_secs(10)).await.unwrap();
        rollout.apply_deltas(&report.deltas).unwrap();
        rollout.verify(&report.checksums).unwrap();
        assert_eq!(rollout.read_tensor("w").unwrap(), held(), "v{v}");
        reports.push(report);
    }
    reports
}
