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
//! box is one contiguous byte range of its shard ([`in_place_source`]) is prepared reading the
//! source where it lies, straight into the staging lease; its H2D copy into staging is skipped
//! (host sources in this build: the copy would be a memcpy of the same bytes the kernel then
//! reads once more). A box that strides through its shard is still gathered by H2D first.

use weightsync_common::fabric::Region;
use weightsync_schedules::table::{Source, Task, TensorBox, TrainerPlan, Transform};

use super::SourceView;

/// Whether `b`, a box of a dense row-major tensor of shape `dims`, is one contiguous byte
/// range: every dim before some `d` has extent 1 and every dim after `d` is whole.
pub(crate) fn is_contiguous(b: &TensorBox, dims: &[u32]) -> bool {
    let n = b.ndim as usize;
    if b.len[..n].contains(&0) {
        return true;
    }
    let Some(d) = (0..n).find(|&i| b.len[i] != 1) else {
        return true;
    };
    (d + 1..n).all(|i| b.start[i] == 0 && b.len[i] == dims[i])
}

/// Row-major element index of `b`'s first element in a tensor of shape `dims`.
fn first_element(b: &TensorBox, dims: &[u32]) -> u64 {
    let n = b.ndim as usize;
    (0..n).fold(0u64, |acc, i| acc * dims[i] as u64 + b.start[i] as u64)
}

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
    if s.dtype != dtype || !is_contiguous(&sub, dims.dims()) {
        return None;
    }
    let (region, at) = source.registered_shard(shard)?;
    let offset = at + first_element(&sub, dims.dims()) * dtype.size() as u64;
    let end = offset + sub.numel() * dtype.size() as u64;
    (end <= region.len()).then_some((region, offset))
}

/// Where a cast or fp8 task reads its input in place (see the module docs): the byte offset of
/// its box in its shard, when the box is one contiguous range of a shard of the input dtype.
pub(crate) fn in_place_source(plan: &TrainerPlan, task: &Task) -> Option<u64> {
    let from = match task.transform {
        Transform::Cast { from, .. } | Transform::Fp8Block { from, .. } => from,
        Transform::Copy { .. } => return None,
    };
    let Source::Shard { shard } = task.source else {
        return None;
    };
    let s = plan.shards.get(shard as usize)?;
    let sub = plan.source_box(task)?;
    let dims = s.global.shape();
    if s.dtype != from || !is_contiguous(&sub, dims.dims()) {
        return None;
    }
    let offset = first_element(&sub, dims.dims()) * from.size() as u64;
    (offset + sub.numel() * from.size() as u64 <= s.bytes()).then_some(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_boxes_are_rows_of_whole_trailing_dims() {
        let dims = [4, 6, 8];
        assert!(is_contiguous(
            &TensorBox::new(&[1, 0, 0], &[2, 6, 8]),
            &dims
        ));
        assert!(is_contiguous(
            &TensorBox::new(&[1, 2, 0], &[1, 3, 8]),
            &dims
        ));
        assert!(is_contiguous(
            &TensorBox::new(&[1, 2, 3], &[1, 1, 4]),
            &dims
        ));
        assert!(!is_contiguous(
            &TensorBox::new(&[1, 2, 0], &[2, 3, 8]),
            &dims
        ));
        assert!(!is_contiguous(
            &TensorBox::new(&[0, 0, 0], &[4, 6, 4]),
            &dims
        ));
        assert_eq!(
            first_element(&TensorBox::new(&[1, 2, 3], &[1, 1, 4]), &dims),
            48 + 16 + 3
        );
    }
}
