//! Zero copy: the tasks a trainer writes straight from its registered source memory.
//!
//! A `Copy` task (same dtype on both sides) whose box is one contiguous byte range of its shard
//! needs no preparation: its prepared bytes *are* that range. When the source says where the
//! shard lies in registered memory ([`SourceView::registered_shard`]), the pipeline posts the
//! task's writes from there: no H2D into staging, no prepare, no watermark lease. The same holds
//! for a `Copy` of a gathered region: the gather arena is registered, and the region lies in it
//! densely. Everything
//! else (casts, fp8, a box that strides through its shard, an arena nobody registered) goes
//! through staging as before. The report counts both (`staged_bytes`, `direct_bytes`), which is
//! how a caller knows that a bf16 -> bf16 parameter was copied by nobody but the fabric.
//!
//! The same contiguity saves a copy for tasks that do need preparing: a cast or an fp8 task whose
//! box is one contiguous byte range of its shard ([`TrainerPlan::in_place_input`]) is prepared
//! reading the source where it lies, straight into the staging lease; its H2D copy into staging is skipped
//! (host sources in this build: the copy would be a memcpy of the same bytes the kernel then
//! reads once more). A box that strides through its shard is still gathered by H2D first.

use weightsync_common::fabric::Region;
use weightsync_schedules::table::{Source, Task, TrainerPlan, Transform};

use super::SourceView;

/// Where task `task` can be written from without staging: the registration holding its shard
/// and the byte offset of its box there (`None`: it goes through staging).
pub(crate) fn direct_source(
    plan: &TrainerPlan,
    task: &Task,
    source: &dyn SourceView,
    gather: Option<&Region>,
) -> Option<(Region, u64)> {
    let Transform::Copy { dtype } = task.transform else {
        return None;
    };
    let shard = match task.source {
        Source::Shard { shard } => shard,
        Source::Gather { offset } => {
            let g = gather?;
            let end = offset + task.region.numel() * dtype.size() as u64;
            return (end <= g.len()).then(|| (g.clone(), offset));
        }
    };
    let s = plan.shards.get(shard as usize)?;
    let sub = plan.source_box(task)?;
    let dims = s.global.shape();
    if s.dtype != dtype || !sub.is_contiguous_in(dims.dims()) {
        return None;
    }
    let (region, at) = source.registered_shard(shard)?;
    let offset = at + sub.first_element_in(dims.dims()) * dtype.size() as u64;
    let end = offset + sub.numel() * dtype.size() as u64;
    (end <= region.len()).then_some((region, offset))
}
