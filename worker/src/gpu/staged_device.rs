//! [`StagedDeviceRegions`]: an engine's own CUDA tensors as a rollout's destination, through the
//! placement path: the tensors are merged into device ranges ([`crate::plan_device_regions`]),
//! each range gets a host staging region of its size that the fabric registers and writes (the
//! receiver's regions, placed as the engine's host tensors would be), and once a version landed
//! each staging region is copied to its device range ([`DeviceDestination`]: page-locked,
//! `cuMemcpyHtoDAsync` on the device's stream, one copy per region, waited for before the
//! version counts as landed, so before it is verified, committed and reported).
//!
//! Why staging and not the device memory itself: neither fabric writes and verifies device
//! memory today ([`crate::landing_route`]; verbs' GPUDirect registration is device review N14).
//!
//! Without a driver nothing is planned: [`StagedDeviceRegions::plan`] refuses with
//! [`GpuError::NoDriver`] before any cudarc call.

use std::sync::Arc;

use weightsync_common::fabric::Region;

use super::{DeviceDestination, DeviceMemory, GpuDevice, GpuError, driver_present};
use crate::{DeviceSpan, HostMemory, plan_device_regions};

/// Device tensors merged into ranges, with the host staging the fabric will write (see the
/// module docs). Built by [`plan`](Self::plan), bound to the registered staging by
/// [`bind`](Self::bind).
#[derive(Debug)]
pub struct StagedDeviceRegions {
    device: Arc<GpuDevice>,
    /// One per range: the tensors of that range, joined.
    memory: Vec<DeviceMemory>,
    /// One per range, zeroed, the range's size: what the receiver registers.
    staging: Vec<HostMemory>,
    /// For each input tensor, in input order: `(region, offset in it)`.
    at: Vec<(u16, u64)>,
}

impl StagedDeviceRegions {
    /// Plans `tensors` (device memory of one GPU, in the caller's order): refuses tensors on
    /// several GPUs or overlapping ones, then any without a driver; opens the GPU's primary
    /// context.
    pub fn plan(tensors: Vec<DeviceMemory>) -> Result<StagedDeviceRegions, GpuError> {
        let ordinal = tensors.first().map_or(0, DeviceMemory::ordinal);
        if let Some(other) = tensors.iter().find(|t| t.ordinal() != ordinal) {
            return Err(GpuError::MixedDevices {
                first: ordinal,
                other: other.ordinal(),
            });
        }
        let ranges: Vec<(u64, u64)> = tensors.iter().map(|t| (t.ptr, t.len as u64)).collect();
        let plan = plan_device_regions(&ranges)?;
        if !driver_present() {
            return Err(GpuError::NoDriver);
        }
        let device = Arc::new(GpuDevice::open(ordinal)?);
        let mut slots: Vec<Option<DeviceMemory>> = tensors.into_iter().map(Some).collect();
        let memory = plan
            .members
            .iter()
            .zip(&plan.spans)
            .map(|(members, span)| {
                let parts = members
                    .iter()
                    .map(|&i| slots[i].take().expect("one span each"));
                join(ordinal, *span, parts.collect())
            })
            .collect();
        let staging = plan.spans.iter().map(|s| zeroed_host(s.len)).collect();
        Ok(StagedDeviceRegions {
            device,
            memory,
            staging,
            at: plan.at,
        })
    }

    /// For each tensor given to [`plan`](Self::plan), in that order: its staging region and
    /// offset (what the placement names as its actual place).
    pub fn placements(&self) -> &[(u16, u64)] {
        &self.at
    }

    /// The staging regions to register as the receiver's, taken once (empty afterwards).
    pub fn take_staging(&mut self) -> Vec<HostMemory> {
        std::mem::take(&mut self.staging)
    }

    /// Binds the device ranges to the receiver's registered staging `regions` (page-locking
    /// them): the landing to set on the receiver.
    pub fn bind(self, regions: &[Region]) -> Result<DeviceDestination, GpuError> {
        DeviceDestination::borrowed(self.device, regions, self.memory)
    }
}

/// Zeroed host memory of `len` bytes that owns itself.
fn zeroed_host(len: u64) -> HostMemory {
    let mut bytes = vec![0u8; len as usize].into_boxed_slice();
    let ptr = bytes.as_mut_ptr();
    // SAFETY: the boxed slice's heap buffer does not move when the box moves into the keepalive,
    // which the HostMemory holds for as long as the memory is used; nothing else refers to it.
    unsafe { HostMemory::from_raw(ptr, len as usize, Box::new(bytes)) }
}

/// The device tensors of one span, back to back from its start, as one range kept alive by all
/// their owners.
fn join(ordinal: usize, span: DeviceSpan, parts: Vec<DeviceMemory>) -> DeviceMemory {
    let owners: Vec<_> = parts.into_iter().map(|p| p.owner).collect();
    // SAFETY: `plan_device_regions` put exactly these parts, back to back, in `span`; each
    // part's `from_raw` contract (device memory of GPU `ordinal` that stays allocated while its
    // owner lives, not written while a sync uses it) covers its bytes, so the span is covered
    // while all the owners, moved into the joined value, live.
    unsafe { DeviceMemory::from_raw(ordinal, span.addr, span.len as usize, Box::new(owners)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Device memory that is never dereferenced (planning without a driver stops first).
    fn fake(ordinal: usize, ptr: u64, len: usize) -> DeviceMemory {
        // SAFETY: not dereferenced: without a driver `plan` refuses before any use, and with
        // one it refuses these (mixed GPUs, or no such allocation) before any copy.
        unsafe { DeviceMemory::from_raw(ordinal, ptr, len, Box::new(())) }
    }

    #[test]
    fn device_tensors_are_refused_by_name_without_a_driver() {
        let got = StagedDeviceRegions::plan(vec![fake(0, 0x1000, 64)]);
        if driver_present() {
            return; // the device check covers this machine
        }
        let err = got.unwrap_err();
        assert!(matches!(err, GpuError::NoDriver), "{err}");
        assert!(err.to_string().contains("no CUDA driver"), "{err}");
    }

    #[test]
    fn tensors_on_two_gpus_or_overlapping_are_refused_by_name_before_the_driver_is_asked() {
        let err =
            StagedDeviceRegions::plan(vec![fake(0, 0x1000, 64), fake(1, 0x2000, 64)]).unwrap_err();
        assert!(
            matches!(err, GpuError::MixedDevices { first: 0, other: 1 }),
            "{err}"
        );
        assert!(err.to_string().contains("cuda:0 and cuda:1"), "{err}");
        let err =
            StagedDeviceRegions::plan(vec![fake(0, 0x1000, 64), fake(0, 0x1020, 64)]).unwrap_err();
        assert!(err.to_string().contains("overlaps"), "{err}");
    }

    #[test]
    fn staging_is_zeroed_host_memory_of_the_range_size() {
        let m = zeroed_host(100);
        assert_eq!(m.len(), 100);
        // SAFETY: the memory is 100 bytes owned by `m`, alive and unaliased here.
        let bytes = unsafe { std::slice::from_raw_parts(m.as_ptr(), m.len()) };
        assert!(bytes.iter().all(|&b| b == 0));
    }
}
