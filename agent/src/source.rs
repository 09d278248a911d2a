//! Where a trainer sidecar's source weights come from, attached once its slice says how large
//! the source arena is (the slice lists the rank's shards and their offsets).

use std::path::PathBuf;
use std::sync::Arc;

use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::{
    SafetensorsSource, ShmSource, SourceMemory, SourceView, TensorSet, arena_tensors,
};

use crate::driver::DriverError;

/// A source the embedding program makes itself once the slice says the arena's layout (the
/// CLI's demo generates its weights this way; an engine plugin or a test may supply its own).
pub trait ProvideSource: std::fmt::Debug + Send + Sync + 'static {
    /// What the pipeline reads for `plan`'s shards, laid out as `plan`'s source arena
    /// (`plan.source_arena_bytes` long, each shard at its offset).
    fn attach(&self, plan: &TrainerPlan) -> Result<Arc<dyn SourceView>, DriverError>;
}

/// Where a trainer's source weights come from.
#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// A shared-memory file the training process exports (read-only), laid out as the plan's
    /// source arena.
    Shm(PathBuf),
    /// A safetensors file holding this rank's shards.
    Safetensors(PathBuf),
    /// Tensors the training process registered in place (an in-process trainer).
    Tensors(Arc<TensorSet>),
    /// Made by the embedding program when the slice arrives ([`ProvideSource`]).
    Provided(Arc<dyn ProvideSource>),
}

impl SourceSpec {
    /// Attaches the source `plan`'s shards are read from (a shared-memory file is mapped
    /// read-only and costs no memory until read).
    pub(crate) fn attach(&self, plan: &TrainerPlan) -> Result<Arc<dyn SourceView>, DriverError> {
        let need = plan.source_arena_bytes;
        Ok(match self {
            SourceSpec::Shm(path) => {
                Arc::new(SourceMemory::Shm(ShmSource::open(path, Some(need))?))
            }
            SourceSpec::Safetensors(path) => {
                let s = SafetensorsSource::load(path, &arena_tensors(plan), need)?;
                Arc::new(SourceMemory::Safetensors(s))
            }
            SourceSpec::Tensors(set) => Arc::new(set.for_plan(plan)?),
            SourceSpec::Provided(p) => p.attach(plan)?,
        })
    }
}
