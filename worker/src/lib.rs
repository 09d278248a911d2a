//! weightsync-worker: the two halves of a sync that run beside the GPUs, as a library.
//!
//! A [`TrainerWorker`] executes one training rank's slice of the routing table each sync: its
//! pieces go through host-to-device staging, preparation (gather, cast, fp8 block quantisation)
//! and one-sided WRITEs under a staging watermark, and it returns only when every destination
//! acknowledged every write. A [`RolloutWorker`] holds one inference rank's tensors in memory it
//! registered once, arms immediate counters for a version before anyone writes, reports the
//! version landed only when every expected write did, and verifies checksums of what landed.
//!
//! Neither knows the controller or the control protocol: `weightsync_agent` drives them from
//! the controller's messages, and benches and tests drive them directly. Both are generic over
//! the fabric (`weightsync_common::fabric::FabricBackend`: TCP, or ibverbs with `rdma`).
//!
//! # Layout
//! - `trainer/`: [`TrainerWorker`] and its pipeline (`piece`: watermark-sized pieces of tasks;
//!   `stages`: H2D and prepare of one piece; `staging`: the registered staging arena;
//!   `direct`: the same-dtype copies written straight from registered source memory, zero
//!   copy; `pipeline`: the scheduler that overlaps the stages, and the barrier).
//! - `rollout/`: [`RolloutWorker`], the receiver, over memory it allocates or over an engine's
//!   own tensors ([`RolloutWorker::with_regions`]) with a [`Placement`] of the planned tensors
//!   (`placement`, below both halves: a trainer relocates its writes with it).
//! - `prepare/`: the CPU preparation kernels ([`cast`], [`gather_box`], [`quantise_fp8`]) and
//!   their scalar conversions (`convert`), with an AVX-512 fp8 path.
//! - `source/`: the trainer's source wherever it lives ([`SourceMemory`]: an arena in a
//!   shared-memory export, a safetensors file, host memory; [`TensorSet`]: the training job's
//!   own tensors registered in place, from [`HostMemory`], the one entry for foreign memory),
//!   and how the trainer reads any of them ([`SourceView`], and the device stages of a source
//!   the host cannot read).
//! - [`delta`]: delta syncs (only the elements that changed travel, into an engine's inbox):
//!   the codec and the inbox layout; the trainer's bases live in `trainer/delta`, the
//!   receiver's apply in `rollout/inbox`.
//! - `sync`: [`SyncId`], the version and epoch both halves name; `watermark`: the staging
//!   budget; `imm_tag`: immediates that carry the sync's epoch; `checksum`: the xxh3 of write
//!   runs; `timeline`: per-stage spans of a sync.
//! - `gpu` (feature `cuda`): GPU source memory that the trainer pipeline reads through its device
//!   stages (DMA into pinned staging, NVRTC kernels bit-identical to the CPU ones), and device
//!   destinations a rollout lands into.
//! - `error`: [`WorkerError`], every way a sync can be refused or fail, and [`SourceError`].
//!
//! Modules import downward only: `trainer/` and `rollout/` on top, then `source/` (with the
//! [`SourceView`] the trainer reads through), then `placement`, `sync`, `error` and the kernels.
//!
//! The vocabulary shared with the control protocol (`Stage`, `TimelineEvent`, `RunChecksum`)
//! lives in `weightsync_common::protocol`; this crate uses those types as they are.
#![deny(missing_docs)]

mod checksum;
pub mod delta;
mod error;
#[cfg(feature = "cuda")]
pub mod gpu;
mod imm_tag;
#[cfg(test)]
mod mem_fabric;
mod placement;
mod prepare;
mod rollout;
mod source;
mod sync;
mod timeline;
mod trainer;
mod watermark;

pub use checksum::xxh3;
pub use error::{Result, SourceError, WorkerError};
pub use imm_tag::{EPOCH_BITS, ImmTag, MAX_UNITS, UNIT_BITS, UnitOutOfRange, imm_for};
pub use placement::{
    DestinationMemory, DevicePlanError, DeviceRegions, DeviceSpan, DeviceSupport, LandingRoute,
    Placed, Placement, landing_route, plan_device_regions,
};
pub use prepare::convert::{
    E4M3_MAX, bf16_to_f32, e4m3_to_f32, f16_to_f32, f32_to_bf16, f32_to_e4m3_saturating, f32_to_f16,
};
pub use prepare::{
    FP8_AMAX_FLOOR, Fp8Shape, PrepareError, Threads, cast, gather_box, quantise_fp8,
    quantise_fp8_as, quantise_fp8_block_rows,
};
pub use rollout::{DeviceLanding, Landed, RolloutWorker, Verified};
#[cfg(feature = "cuda")]
pub use source::DeviceTensor;
pub use source::view::SourceView;
pub use source::{
    ArenaTensor, HostMemory, HostSource, PlanTensors, SafetensorsSource, ShmHeader, ShmSource,
    ShmWriter, SourceMemory, SourceTensor, TensorSet, arena_tensors, check_layout, shard_names,
};
pub use sync::SyncId;
pub use timeline::{Timeline, TimelineRecorder};
pub use trainer::{
    DeltaConfig, DeltaSync, Destinations, PipelineMode, SyncReport, TrainerConfig, TrainerWorker,
};
pub use watermark::{LEASE_ALIGN, Lease, Watermark, WatermarkError};
