//! An engine's CUDA tensors as a rollout's destinations (feature `cuda`), through the same
//! placement path as host tensors: checked against the planned layout as they are
//! ([`super::regions::check`]), merged into device ranges, each range standing behind one host
//! staging region the receiver registers ([`StagedDeviceRegions`]), and each planned tensor
//! placed in its staging region. Once the receiver registered the staging, the device ranges
//! are bound to it as the receiver's device landing: each landed version is copied to the
//! tensors (one host-to-device copy per region, waited for) before it counts as landed.

use weightsync_schedules::table::RolloutPlan;
use weightsync_worker::gpu::{GpuError, StagedDeviceRegions};
use weightsync_worker::{DevicePlanError, Placed, Placement};

use super::regions::{PlacedRegions, check};
use super::{DeviceDstTensor, EmbedError};

/// The staging to register, where each planned tensor lies in it, and the device ranges to
/// bind to it once registered.
pub(crate) struct PlacedDevice {
    pub placed: PlacedRegions,
    pub staged: StagedDeviceRegions,
}

/// Checks `tensors` against `planned` and places them in host staging (see the module docs).
pub(crate) fn place_device(
    worker: &str,
    planned: &RolloutPlan,
    tensors: Vec<DeviceDstTensor>,
) -> Result<PlacedDevice, EmbedError> {
    let found = check(
        worker,
        planned,
        tensors
            .into_iter()
            .map(|t| (t.name, t.dtype, t.shape, t.memory))
            .collect(),
        |m| m.len(),
    )?;
    let (indices, memory): (Vec<usize>, Vec<_>) = found.into_iter().unzip();
    let name_of = |k: usize| planned.tensors[indices[k]].name.clone();
    let mut staged = StagedDeviceRegions::plan(memory).map_err(|e| {
        let (tensor, reason) = match &e {
            GpuError::DevicePlan(DevicePlanError::Overlap { earlier, later }) => (
                Some(name_of(*later)),
                format!(
                    "{} overlaps {} in device memory",
                    name_of(*later),
                    name_of(*earlier)
                ),
            ),
            GpuError::DevicePlan(DevicePlanError::Empty(k)) => {
                (Some(name_of(*k)), "an empty device tensor".into())
            }
            _ => (None, format!("CUDA tensors as destinations: {e}")),
        };
        EmbedError::Registration {
            worker: worker.to_string(),
            tensor,
            reason,
        }
    })?;
    let placed = indices
        .iter()
        .zip(staged.placements())
        .map(|(&i, &(region, region_offset))| {
            let p = &planned.tensors[i];
            Placed {
                mr: p.mr,
                offset: p.offset,
                len: p.len,
                region,
                region_offset,
            }
        })
        .collect();
    let regions = staged.take_staging();
    Ok(PlacedDevice {
        placed: PlacedRegions {
            regions,
            placement: Placement::new(placed),
        },
        staged,
    })
}

#[cfg(test)]
mod tests {
    use weightsync_common::DType;
    use weightsync_schedules::table::{DstTensor as Planned, Shape};
    use weightsync_worker::gpu::{DeviceMemory, driver_present};

    use super::*;

    /// Two bf16 [2, 4] tensors planned back to back in MR 0.
    fn planned() -> RolloutPlan {
        let t = |name: &str, offset| Planned {
            name: name.into(),
            shape: Shape::new(&[2, 4]),
            dtype: DType::BF16,
            mr: 0,
            offset,
            len: 16,
        };
        RolloutPlan {
            rank: 0,
            engine: 0,
            local_rank: 0,
            mr_bytes: vec![32],
            tensors: vec![t("a", 0), t("b", 16)],
            expect: Vec::new(),
        }
    }

    /// A CUDA tensor that is never dereferenced: each case here is refused before any copy.
    fn tensor(name: &str, ptr: u64) -> DeviceDstTensor {
        // SAFETY: never dereferenced (see above): refused by the checks, by the planner or for
        // want of a driver; with a driver, `bind` is never reached.
        let memory = unsafe { DeviceMemory::from_raw(0, ptr, 16, Box::new(())) };
        DeviceDstTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![2, 4],
            memory,
        }
    }

    #[test]
    fn cuda_tensors_are_checked_named_and_refused_without_a_driver() {
        let err = |ts| place_device("rollout-0", &planned(), ts).err().unwrap();
        let e = err(vec![tensor("a", 0x1000)]);
        assert!(e.to_string().contains("tensor b"), "missing: {e}");
        let e = err(vec![tensor("a", 0x1000), tensor("b", 0x1008)]);
        assert!(
            matches!(&e, EmbedError::Registration { tensor: Some(t), reason, .. }
                if t == "b" && reason.contains("b overlaps a in device memory")),
            "{e}"
        );
        if !driver_present() {
            let e = err(vec![tensor("a", 0x1000), tensor("b", 0x1010)]);
            assert!(
                e.to_string().contains("no CUDA driver library"),
                "without a driver: {e}"
            );
        }
    }
}
