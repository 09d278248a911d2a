//! The one pipeline with a source the host cannot read: a host-memory stand-in for device memory
//! whose `read` yields nothing, so every byte must come through its [`DeviceStages`] (the
//! strided copies and prepare jobs run on the host, as a GPU source runs them with DMA and
//! kernels). The landed bytes must equal the host source's, piece splits and gathers included.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use half::bf16;
use weightsync_common::DType;
use weightsync_common::fabric::Region;
use weightsync_schedules::table::TrainerPlan;

use super::tests::{expected, gather_plans, one_copy_plans, plans, source_bytes};
use super::*;
use crate::mem_fabric::MemFabric;
use crate::prepare::{Fp8Shape, Threads, quantise_fp8};
use crate::rollout::RolloutWorker;
use crate::source::device_stages::host_emulation::{run_copies, run_job};
use crate::source::device_stages::{PrepareJob, StridedCopy};
use weightsync_common::protocol::Stage;

/// Host bytes posing as device memory: no host view, only the device stages.
#[derive(Debug)]
struct OffHost {
    arena: Arc<Vec<u8>>,
    calls: Arc<Calls>,
}

#[derive(Debug, Default)]
struct Calls {
    fills: AtomicU64,
    prepares: AtomicU64,
}

#[derive(Debug)]
struct OffHostStages {
    arena: Arc<Vec<u8>>,
    calls: Arc<Calls>,
    staging: Region,
}

impl OffHost {
    fn new(arena: Vec<u8>) -> (Arc<OffHost>, Arc<Calls>) {
        let calls = Arc::new(Calls::default());
        let src = OffHost {
            arena: Arc::new(arena),
            calls: calls.clone(),
        };
        (Arc::new(src), calls)
    }
}

impl SourceView for OffHost {
    fn len(&self) -> u64 {
        self.arena.len() as u64
    }
    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        f(&[])
    }
    fn device_stages(
        &self,
        _plan: &TrainerPlan,
        staging: &Region,
    ) -> Result<Option<Box<dyn DeviceStages>>> {
        Ok(Some(Box::new(OffHostStages {
            arena: self.arena.clone(),
            calls: self.calls.clone(),
            staging: staging.clone(),
        })))
    }
}

impl OffHostStages {
    fn shard<'a>(&'a self, plan: &TrainerPlan, shard: u32) -> &'a [u8] {
        let s = &plan.shards[shard as usize];
        &self.arena[s.offset as usize..(s.offset + s.bytes()) as usize]
    }

    /// The lease lies in the staging arena the stages were bound to (what a device source
    /// pins for DMA).
    fn check_in_staging(&self, bytes: &[u8]) {
        let base = self.staging.as_ptr() as usize;
        let at = bytes.as_ptr() as usize;
        assert!(at >= base && at + bytes.len() <= base + self.staging.len() as usize);
    }
}

impl DeviceStages for OffHostStages {
    fn fill(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        copies: &[StridedCopy],
        input: &mut [u8],
    ) -> Result<()> {
        self.check_in_staging(input);
        run_copies(copies, self.shard(plan, shard), input);
        self.calls.fills.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn prepare(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        input_at: u64,
        job: &PrepareJob,
        lease_offset: u64,
        lease: &mut [u8],
    ) -> Result<()> {
        self.check_in_staging(lease);
        assert_eq!(
            lease.as_ptr() as usize - self.staging.as_ptr() as usize,
            lease_offset as usize
        );
        let shard = self.shard(plan, shard);
        let input = &shard[input_at as usize..(input_at + job.input) as usize];
        run_job(job, input, lease);
        self.calls.prepares.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

/// Casts and fp8 strips read in place go through the device prepare step, split over several
/// pieces by a small watermark, in both pipeline modes; the bytes equal the host kernels'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_source_prepares_in_place_through_its_stages() {
    for mode in [PipelineMode::Pipelined, PipelineMode::Serialised] {
        let (tp, rp) = plans();
        let fab = MemFabric::new_switch("trainer-0");
        let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
        let bytes = source_bytes(3);
        let (src, calls) = OffHost::new(bytes.clone());
        let mut cfg = TrainerConfig::new("trainer-0", 200 << 10);
        cfg.mode = mode;
        let mut trainer = TrainerWorker::new(fab.clone(), src, tp, cfg).unwrap();
        let mut dsts = Destinations::default();
        dsts.rollouts.insert(0, rollout.descriptors());
        trainer.set_destinations(&dsts).unwrap();
        let sync = SyncId {
            version: 1,
            epoch: 1,
        };
        rollout.arm(sync).unwrap();
        let report = trainer.run_sync(sync).await.unwrap();
        rollout.await_landed(Duration::from_secs(10)).await.unwrap();
        rollout.verify(&report.checksums).unwrap();
        assert_eq!(
            rollout.region(0).unwrap().to_vec().unwrap(),
            expected(&bytes),
            "{mode:?}"
        );
        assert!(report.pieces > 2);
        assert_eq!(calls.prepares.load(Ordering::Relaxed), report.pieces);
        assert_eq!(calls.fills.load(Ordering::Relaxed), 0);
    }
}

/// A copy task (no registered memory to write from) is staged by the device fill step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_source_fills_staging_through_its_stages() {
    let (tp, rp) = one_copy_plans();
    let fab = MemFabric::new_switch("trainer-0");
    let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let bytes: Vec<u8> = (0..256u32).map(|i| (i * 7 % 251) as u8).collect();
    let (src, calls) = OffHost::new(bytes.clone());
    let mut trainer =
        TrainerWorker::new(fab.clone(), src, tp, TrainerConfig::new("trainer-0", 4096)).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    trainer.set_destinations(&dsts).unwrap();
    let sync = SyncId {
        version: 1,
        epoch: 1,
    };
    rollout.arm(sync).unwrap();
    let report = trainer.run_sync(sync).await.unwrap();
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    rollout.verify(&report.checksums).unwrap();
    assert_eq!(rollout.read_tensor("w").unwrap(), bytes[64..192].to_vec());
    assert_eq!((report.direct_bytes, report.staged_bytes), (0, 128));
    assert_eq!(calls.fills.load(Ordering::Relaxed), report.pieces);
}

/// Two trainers on device sources with a straddling fp8 block: the gather sends are filled
/// from the device, the owner quantises from its (host) gather arena, the other trainer on
/// its device; the rollout holds the whole tensor's fp8 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_sources_gather_a_straddling_block() {
    let (t0p, t1p, rp) = gather_plans();
    let fab = MemFabric::new_switch("trainer-0");
    let f1 = fab.peer("trainer-1");
    let rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let full: Vec<u8> = (0..256 * 256u32)
        .flat_map(|i| bf16::from_f32(((i * 31) % 977) as f32 * 0.01 - 4.0).to_le_bytes())
        .collect();
    let row = 512usize;
    let (s0, c0) = OffHost::new(full[..100 * row].to_vec());
    let (s1, c1) = OffHost::new(full[100 * row..].to_vec());
    let mut w0 = TrainerWorker::new(
        fab.clone(),
        s0,
        t0p,
        TrainerConfig::new("trainer-0", 1 << 20),
    )
    .unwrap();
    let mut w1 = TrainerWorker::new(f1, s1, t1p, TrainerConfig::new("trainer-1", 1 << 20)).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    dsts.trainers.insert(0, w0.gather_descriptor().unwrap());
    w0.set_destinations(&dsts).unwrap();
    w1.set_destinations(&dsts).unwrap();
    let sync = SyncId {
        version: 1,
        epoch: 1,
    };
    rollout.arm(sync).unwrap();
    let (r0, r1) = tokio::join!(w0.run_sync(sync), w1.run_sync(sync));
    let (r0, r1) = (r0.unwrap(), r1.unwrap());
    rollout.await_landed(Duration::from_secs(10)).await.unwrap();
    let sums: Vec<_> = r0.checksums.iter().chain(&r1.checksums).copied().collect();
    rollout.verify(&sums).unwrap();
    let mut values = vec![0u8; 256 * 256];
    let mut scales = vec![0u8; 16];
    let shape = Fp8Shape {
        rows: 256,
        cols: 256,
    };
    quantise_fp8(
        &full,
        DType::BF16,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .unwrap();
    assert_eq!(rollout.read_tensor("g").unwrap(), values);
    assert_eq!(rollout.read_tensor("g_scale_inv").unwrap(), scales);
    let fills = c0.fills.load(Ordering::Relaxed) + c1.fills.load(Ordering::Relaxed);
    assert!(fills > 0, "the gather sends were staged by the device fill");
    assert!(c1.prepares.load(Ordering::Relaxed) > 0);
}

/// A device destination's stand-in: what it was handed when the sync counted as landed.
#[derive(Debug, Default)]
struct RecordingLanding {
    copies: parking_lot::Mutex<Vec<Vec<u8>>>,
}

impl crate::rollout::DeviceLanding for RecordingLanding {
    fn landed(&self, regions: &[Region]) -> Result<()> {
        let mut copies = self.copies.lock();
        copies.clear();
        for r in regions {
            copies.push(r.copy_to_vec(0, r.len() as usize).unwrap());
        }
        Ok(())
    }
}

/// A receiver with a device landing hands it every landed byte before `await_landed` returns,
/// once per sync, from a device source to a device destination through the one pipeline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_destination_gets_every_landed_byte_before_landed() {
    let (tp, rp) = plans();
    let fab = MemFabric::new_switch("trainer-0");
    let mut rollout = RolloutWorker::new(fab.peer("rollout-0"), "rollout-0", rp).unwrap();
    let landing = Arc::new(RecordingLanding::default());
    rollout.set_device_landing(landing.clone());
    for step in 0..2u32 {
        let bytes = source_bytes(step);
        let (src, _) = OffHost::new(bytes.clone());
        let mut t = TrainerWorker::new(
            fab.clone(),
            src,
            tp.clone(),
            TrainerConfig::new("t", 200 << 10),
        )
        .unwrap();
        let mut dsts = Destinations::default();
        dsts.rollouts.insert(0, rollout.descriptors());
        t.set_destinations(&dsts).unwrap();
        let sync = SyncId {
            version: step as u64,
            epoch: step as u64 + 1,
        };
        rollout.arm(sync).unwrap();
        let report = t.run_sync(sync).await.unwrap();
        let landed = rollout.await_landed(Duration::from_secs(10)).await.unwrap();
        assert!(landed.timeline.events.iter().any(|e| e.stage == Stage::H2d));
        assert_eq!(
            *landing.copies.lock(),
            vec![expected(&bytes)],
            "step {step}"
        );
        rollout.verify(&report.checksums).unwrap();
    }
}
