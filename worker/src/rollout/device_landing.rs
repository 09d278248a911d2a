//! [`DeviceLanding`]: where a receiver's landed bytes go when its destination is device memory
//! and the fabric can only write host memory (TCP, or verbs without peer memory).
//!
//! Why a bounce and not a second receiver: the receiver's registered regions stay what the
//! fabric writes into, counts and verifies (immediates, the landing log, checksums); a
//! destination in device memory adds one step at the end of [`RolloutWorker::await_landed`]:
//! the landed regions are copied host to device before the version is reported landed, so a
//! version never counts as landed while its bytes are not in the device tensors.
//!
//! [`RolloutWorker::await_landed`]: super::RolloutWorker::await_landed

use weightsync_common::fabric::Region;

use crate::error::Result;

/// Copies a receiver's landed regions to the device memory they stand in for (see the module
/// docs); `crate::gpu::DeviceDestination` is the CUDA one.
pub trait DeviceLanding: Send + Sync + std::fmt::Debug {
    /// Called once every expected write of a sync landed in `regions` (the receiver's regions,
    /// in MR order); returns when their bytes are in the device memory.
    fn landed(&self, regions: &[Region]) -> Result<()>;
}
