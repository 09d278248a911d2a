//! How the trainer pipeline reads a source, whatever it is: [`SourceView`].
//!
//! Why here, beside the sources and below the trainer: every source type (`source/`, and
//! `crate::gpu`'s device sources) implements the view, and the trainer only calls it. With the
//! trait on this floor the sources never name the trainer, and the trainer imports downward
//! only. The checks a flat arena must pass against a plan ([`check_source`]) live with it.

use weightsync_common::fabric::Region;
use weightsync_schedules::table::{MAX_DIMS, TrainerPlan};

use super::device_stages::DeviceStages;
use crate::error::{Result, WorkerError};

/// A host-visible view of the trainer's source: its training shards, one by one.
///
/// The pipeline asks for a shard's bytes ([`SourceView::read_shard`]) and, for a write it can
/// post straight from the source, where the shard lies in registered memory
/// ([`SourceView::registered_shard`]). The default methods read a flat arena laid out as the
/// plan's [`LocalShard`](weightsync_schedules::table::LocalShard)s say (every shard at its
/// offset): what the sidecars' sources are. A set of caller-registered tensors
/// ([`crate::TensorSet`]) overrides them.
///
/// The bytes must not change while a sync runs (the training loop triggers a sync after its
/// optimizer step and before the next one writes the weights).
pub trait SourceView: Send + Sync + std::fmt::Debug + 'static {
    /// Length of the arena in bytes (0 for a source that is no arena).
    fn len(&self) -> u64;
    /// Whether the arena is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Calls `f` with the arena's bytes.
    fn read(&self, f: &mut dyn FnMut(&[u8]));

    /// Refuses a source that does not hold every shard of `plan` (an arena: too short).
    fn check_plan(&self, plan: &TrainerPlan) -> Result<()> {
        check_source(plan, self.len())
    }

    /// Before a sync reads its first byte: refuses a source that cannot be read whole now, and
    /// returns what [`end_read`](Self::end_read) compares with (a shared-memory file's
    /// generation). The default: nothing to check.
    fn begin_read(&self) -> Result<ReadStamp> {
        Ok(ReadStamp::default())
    }

    /// After a sync read its last byte: fails when the source changed since
    /// [`begin_read`](Self::begin_read) returned `stamp` (what was read may mix two versions).
    fn end_read(&self, stamp: ReadStamp) -> Result<()> {
        let _ = stamp;
        Ok(())
    }

    /// Calls `f` with shard `shard`'s bytes (dense, row-major over its box).
    fn read_shard(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        read_arena_shard(self, plan, shard, f)
    }

    /// The registered memory holding shard `shard` and the shard's byte offset in it, when
    /// the fabric can write straight from the source (`None`: copy it through staging).
    fn registered_shard(&self, shard: u32) -> Option<(Region, u64)> {
        let _ = shard;
        None
    }

    /// For a source the host cannot read (device memory): its fill and prepare steps, bound
    /// to the trainer's staging arena `staging` (e.g. registered with the driver for DMA for
    /// as long as they live). `None` (the default): a host source, read by the host stages.
    /// Called once, when the trainer is built; an error refuses the trainer.
    fn device_stages(
        &self,
        plan: &TrainerPlan,
        staging: &Region,
    ) -> Result<Option<Box<dyn DeviceStages>>> {
        let _ = (plan, staging);
        Ok(None)
    }
}

impl SourceView for Vec<u8> {
    fn len(&self) -> u64 {
        self.len() as u64
    }
    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        f(self)
    }
}

/// Host memory the owner may rewrite between syncs (tests, benches, an in-process trainer).
impl SourceView for parking_lot::RwLock<Vec<u8>> {
    fn len(&self) -> u64 {
        self.read().len() as u64
    }
    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        f(&parking_lot::RwLock::read(self))
    }
}

/// Host memory the owner may rewrite between syncs (std lock).
impl SourceView for std::sync::RwLock<Vec<u8>> {
    fn len(&self) -> u64 {
        self.read().map_or(0, |v| v.len() as u64)
    }
    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        match std::sync::RwLock::read(self) {
            Ok(v) => f(&v),
            Err(poisoned) => f(&poisoned.into_inner()),
        }
    }
}

/// What a source was when a sync began reading it ([`SourceView::begin_read`]): a
/// shared-memory file's seqlock generation, `None` for a source with nothing to compare.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReadStamp(pub Option<u64>);

/// Shard `shard`'s bytes of a flat arena laid out as `plan`'s shards say (the default
/// [`SourceView::read_shard`]).
pub fn read_arena_shard<V: SourceView + ?Sized>(
    view: &V,
    plan: &TrainerPlan,
    shard: u32,
    f: &mut dyn FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    let s = plan.shards.get(shard as usize).ok_or_else(|| {
        WorkerError::InvalidPlan(format!("shard {shard} of {}", plan.shards.len()))
    })?;
    let mut result = Ok(());
    view.read(&mut |bytes: &[u8]| {
        result = source_range(bytes, s.offset as usize, s.bytes() as usize, || {
            format!("shard of {}", param_name(plan, s.param))
        })
        .and_then(&mut *f);
    });
    result
}

/// `bytes[start..start + len]` of a source, or [`WorkerError::SourceTooShort`] naming `what()`
/// needed them.
pub(crate) fn source_range(
    bytes: &[u8],
    start: usize,
    len: usize,
    what: impl FnOnce() -> String,
) -> Result<&[u8]> {
    bytes
        .get(start..start + len)
        .ok_or_else(|| WorkerError::SourceTooShort {
            what: what(),
            need: (start + len) as u64,
            have: bytes.len() as u64,
        })
}

/// Whether an arena of `have` bytes holds every shard the plan reads. A decoded plan is not
/// trusted: each shard is sized without overflowing or panicking.
pub(crate) fn check_source(plan: &TrainerPlan, have: u64) -> Result<()> {
    if have < plan.source_arena_bytes {
        return Err(WorkerError::SourceTooShort {
            what: format!("the source arena of training rank {}", plan.rank),
            need: plan.source_arena_bytes,
            have,
        });
    }
    for s in &plan.shards {
        let n = s.global.ndim as usize;
        let end = (n <= MAX_DIMS)
            .then(|| {
                s.global.len[..n]
                    .iter()
                    .try_fold(s.dtype.size() as u64, |acc, &l| acc.checked_mul(l as u64))
            })
            .flatten()
            .and_then(|bytes| s.offset.checked_add(bytes));
        let Some(end) = end else {
            return Err(WorkerError::InvalidPlan(format!(
                "shard of {} has a box of {n} dims too large to address",
                param_name(plan, s.param)
            )));
        };
        if end > have {
            return Err(WorkerError::SourceTooShort {
                what: format!("shard of {}", param_name(plan, s.param)),
                need: end,
                have,
            });
        }
    }
    Ok(())
}

/// The parameter's name for messages.
pub(crate) fn param_name(plan: &TrainerPlan, param: u32) -> String {
    plan.params
        .get(param as usize)
        .map_or_else(|| format!("param #{param}"), |p| p.name.to_string())
}
