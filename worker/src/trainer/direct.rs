//! Zero copy: the tasks a trainer writes straight from its registered source memory.
//!
//! A `Copy` task (same dtype on both sides) needs no preparation: its prepared bytes *are* its
//! box's bytes in the shard. When the source says where the shard lies in registered memory
//! ([`SourceView::registered_shard`]), the pipeline posts the task's writes from there: no H2D
//! into staging, no prepare, no watermark lease. The same holds for a `Copy` of a gathered
//! region: the gather arena is registered, and the region lies in it densely. Everything else
//! (casts, fp8, an arena nobody registered) goes through staging. The report counts both
//! (`staged_bytes`, `direct_bytes`), which is how a caller knows that a bf16 -> bf16 parameter
//! was copied by nobody but the fabric.
//!
//! The box need not be one contiguous range of its shard. A box whose rows are evenly spaced (a
//! column slice of a row-major matrix: FSDP row shards written to tensor-parallel engines that
//! split the matrix by columns) is written in place as well: each write names its source as
//! runs at a stride ([`Stride`]), and the fabric gathers them as it copies (scatter/gather
//! entries on a NIC, iovecs on a socket or in `process_vm_readv`). Before, such boxes were
//! first gathered into staging by a copy: about a quarter of the bytes of the 4 -> 4 bf16
//! benchmark. Only a box cut in two dims besides its last partial one still is, and one whose
//! runs are shorter than the fabric finds worth gathering ([`min_strided_run`]: on the
//! same-host TCP path, where the kernel pins each run's pages on its own, runs under 8 KiB
//! cost more than a memcpy does).
//!
//! [`min_strided_run`]: weightsync_common::fabric::FabricBackend::min_strided_run
//!
//! The same contiguity saves a copy for tasks that do need preparing: a cast or an fp8 task whose
//! box is one contiguous byte range of its shard ([`TrainerPlan::in_place_input`]) is prepared
//! reading the source where it lies, straight into the staging lease; its H2D copy into staging
//! is skipped (host sources in this build: the copy would be a memcpy of the same bytes the
//! kernel then reads once more). A cast or fp8 box that strides through its shard is still
//! gathered by H2D first.

use weightsync_common::fabric::{Region, Stride};
use weightsync_schedules::table::{Source, Task, TrainerPlan, Transform};

use crate::source::view::SourceView;

/// Where a task's prepared bytes already lie in registered memory.
#[derive(Debug, Clone)]
pub(crate) struct DirectSource {
    /// The registration holding them.
    pub region: Region,
    /// Byte offset of the task's first prepared byte there.
    pub base: u64,
    /// `(run, stride)` in bytes when the box strides through its shard: output byte `q` lies
    /// at `base + (q / run) * stride + q % run`. `None`: the bytes are one range from `base`.
    pub runs: Option<(u64, u64)>,
}

impl DirectSource {
    /// Where output byte `q` of the task starts in the registration, and how the bytes from
    /// there lie (for a write's source).
    pub(crate) fn at(&self, q: u64) -> (u64, Option<Stride>) {
        match self.runs {
            None => (self.base + q, None),
            Some((run, stride)) => (
                self.base + (q / run) * stride + q % run,
                Some(Stride {
                    run,
                    stride,
                    head: q % run,
                }),
            ),
        }
    }
}

/// Where task `task` can be written from without staging (`None`: it goes through staging).
/// A box whose runs are shorter than `min_run` bytes is staged: the fabric says that gathering
/// them first is cheaper ([`min_strided_run`]).
///
/// [`min_strided_run`]: weightsync_common::fabric::FabricBackend::min_strided_run
pub(crate) fn direct_source(
    plan: &TrainerPlan,
    task: &Task,
    source: &dyn SourceView,
    gather: Option<&Region>,
    min_run: u64,
) -> Option<DirectSource> {
    let Transform::Copy { dtype } = task.transform else {
        return None;
    };
    let shard = match task.source {
        Source::Shard { shard } => shard,
        Source::Gather { offset } => {
            let g = gather?;
            let end = offset + task.region.numel() * dtype.size() as u64;
            return (end <= g.len()).then(|| DirectSource {
                region: g.clone(),
                base: offset,
                runs: None,
            });
        }
    };
    let s = plan.shards.get(shard as usize)?;
    let sub = plan.source_box(task)?;
    let dims = s.global.shape();
    if s.dtype != dtype {
        return None;
    }
    let size = dtype.size() as u64;
    let (run, stride) = sub.strided_in(dims.dims())?;
    let (run, stride) = (run * size, stride * size);
    let numel = sub.numel();
    let runs = (run < numel * size).then_some((run, stride));
    if runs.is_some() && !(min_run..=Stride::MAX_RUN).contains(&run) {
        return None;
    }
    let (region, at) = source.registered_shard(shard)?;
    let base = at + sub.first_element_in(dims.dims()) * size;
    let direct = DirectSource { region, base, runs };
    // The last byte must lie inside the registration.
    let (last, _) = direct.at(numel * size - 1);
    (last < direct.region.len()).then_some(direct)
}
