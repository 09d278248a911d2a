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
