//! The embedded engine's device path on a GPU (`engine` step of `worker/gpu-check.sh`): an
//! engine's own tensors in device memory, laid out unlike the plan (the plan's tensors in
//! reverse order back to back in one allocation, every third one in an allocation of its own),
//! registered through the placement path ([`StagedDeviceRegions`]: merged device ranges, host
//! staging the receiver registers, the landing bound to it); three versions land from a device
//! source over TCP loopback, and after each the device tensors are copied back with cudarc and
//! compared, byte for byte, with the CPU kernels' result. Between versions the tensors are
//! overwritten with a pattern, so each version's bytes must have been copied to the device
//! anew (a landing that skipped the host-to-device copies would leave the pattern).
//!
//! Not here: a torch tensor registered through the Python package (`Engine.register` of a CUDA
//! tensor needs a wheel built with `cuda`, which the check does not carry); the Rust path
//! below is the one that wheel calls.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr};
use serde_json::json;
use weightsync_common::fabric::TcpFabric;

use super::sync::{PIECE, WATERMARK, expected, fabric_config, plans, source_bytes, sync};
use super::{device, emit};
use crate::gpu::{DeviceMemory, DeviceSource, GpuSource, StagedDeviceRegions};
use crate::rollout::RolloutWorker;
use crate::trainer::{Destinations, PipelineMode, TrainerConfig, TrainerWorker};
use crate::{Placed, Placement};

const VERSIONS: u64 = 3;
const PATTERN: u8 = 0xa5;

/// Where one planned tensor lies: its allocation and offset in it.
struct Slot {
    buffer: usize,
    offset: usize,
    len: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs a CUDA GPU"]
async fn engine_cuda_tensors_land_three_versions() {
    let (tp, rp) = plans();
    let host = source_bytes(&tp);
    let want = expected(&tp, &rp, &host);
    let dev = Arc::new(device());

    // The engine's allocations: buffer 0 holds the planned tensors in reverse order, back to
    // back; every third tensor has a buffer of its own instead.
    let mut slots = Vec::with_capacity(rp.tensors.len());
    let mut lens = vec![0usize];
    for (i, t) in rp.tensors.iter().enumerate().rev() {
        let len = t.len as usize;
        if i % 3 == 2 {
            slots.push((
                i,
                Slot {
                    buffer: lens.len(),
                    offset: 0,
                    len,
                },
            ));
            lens.push(len);
        } else {
            slots.push((
                i,
                Slot {
                    buffer: 0,
                    offset: lens[0],
                    len,
                },
            ));
            lens[0] += len;
        }
    }
    slots.sort_by_key(|(i, _)| *i);
    let mut buffers: Vec<CudaSlice<u8>> = lens.iter().map(|&l| dev.alloc(l).unwrap()).collect();
    let bases: Vec<u64> = buffers
        .iter()
        .map(|b| b.device_ptr(dev.stream()).0)
        .collect();
    let memory = slots
        .iter()
        .map(|(_, s)| {
            let ptr = bases[s.buffer] + s.offset as u64;
            // SAFETY: `ptr..+len` lies in `buffers[s.buffer]`, a live allocation of GPU 0's
            // primary context that is dropped only after the rollout and its landing (the end
            // of this test, in that order); the test writes it only between syncs.
            unsafe { DeviceMemory::from_raw(0, ptr, s.len, Box::new(())) }
        })
        .collect();

    // The placement path: what `EngineHandle::register_device` does.
    let mut staged = StagedDeviceRegions::plan(memory).unwrap();
    let placement = Placement::new(
        rp.tensors
            .iter()
            .zip(staged.placements())
            .map(|(t, &(region, region_offset))| Placed {
                mr: t.mr,
                offset: t.offset,
                len: t.len,
                region,
                region_offset,
            })
            .collect(),
    );
    let staging = staged.take_staging();
    let regions = staging.len();
    let fr = TcpFabric::start(&fabric_config()).await.unwrap();
    let mut rollout =
        RolloutWorker::with_regions(fr, "rollout-0", rp.clone(), staging, placement).unwrap();
    rollout.set_device_landing(Arc::new(staged.bind(rollout.regions()).unwrap()));

    let source = Arc::new(
        DeviceSource::new(dev.clone(), GpuSource::Owned(dev.upload(&host).unwrap())).unwrap(),
    );
    let ft = TcpFabric::start(&fabric_config()).await.unwrap();
    let mut cfg = TrainerConfig::new("trainer-0", WATERMARK);
    cfg.piece_bytes = Some(PIECE);
    cfg.mode = PipelineMode::Pipelined;
    let mut trainer = TrainerWorker::new(ft, source, tp, cfg).unwrap();
    let mut dsts = Destinations::default();
    dsts.rollouts.insert(0, rollout.descriptors());
    trainer.set_destinations(&dsts).unwrap();

    let mut failures = Vec::new();
    for version in 1..=VERSIONS {
        for b in &mut buffers {
            let pattern = vec![PATTERN; b.len()];
            dev.stream().memcpy_htod(&pattern, b).unwrap();
        }
        dev.synchronize().unwrap();
        let (report, wall) = sync(&trainer, &rollout, version).await;
        let verified = rollout.verify(&report.checksums).is_ok();
        let got: Vec<Vec<u8>> = buffers.iter().map(|b| dev.download(b).unwrap()).collect();
        let mut mismatched = 0usize;
        let mut tensors_wrong = Vec::new();
        for ((i, s), t) in slots.iter().zip(&rp.tensors) {
            let have = &got[s.buffer][s.offset..s.offset + s.len];
            let need = &want[t.offset as usize..(t.offset + t.len) as usize];
            let n = have.iter().zip(need).filter(|(a, b)| a != b).count();
            if n > 0 {
                tensors_wrong.push(format!("{} ({i}): {n} bytes", t.name));
            }
            mismatched += n;
        }
        emit(json!({
            "check": "engine_device_destination", "version": version,
            "tensors": rp.tensors.len(), "allocations": buffers.len(),
            "staging_regions": regions, "bytes": report.bytes_written,
            "sync_s": wall, "every_byte_equal": mismatched == 0,
            "mismatched_bytes": mismatched, "checksums_verified": verified,
            "compared_with": "cudarc copies back",
        }));
        if mismatched > 0 || !verified {
            failures.push(format!(
                "version {version}: verified {verified}, wrong: {tensors_wrong:?}"
            ));
        }
    }
    drop(trainer);
    drop(rollout);
    drop(buffers);
    assert!(failures.is_empty(), "{failures:?}");
}
