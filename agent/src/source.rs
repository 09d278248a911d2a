//! Where a trainer sidecar's source weights come from, attached once its slice says how large
//! the source arena is (the slice lists the rank's shards and their offsets).

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::{
    arena_tensors, SafetensorsSource, ShmSource, SourceMemory, SourceView, TensorSet,
};

use crate::demo_weights::fill_trainer_arena;
use crate::driver::DriverError;

/// Where a trainer's source weights come from.
#[derive(Debug, Clone)]
pub enum SourceSpec {
    /// Demo: regenerated from `(seed, version)` before every sync.
    Demo {
        /// Seed.
        seed: u64,
    },
    /// A shared-memory file the training process exports (read-only), laid out as the plan's
    /// source arena.
    Shm(PathBuf),
    /// A safetensors file holding this rank's shards.
    Safetensors(PathBuf),
    /// Tensors the training process registered in place (an in-process trainer).
    Tensors(Arc<TensorSet>),
}

/// A source attached for one slice: what the worker reads, and for the demo the arena the
/// driver rewrites before each sync.
#[derive(Debug)]
pub(crate) struct AttachedSource {
    /// What the pipeline reads.
    pub view: Arc<dyn SourceView>,
    /// The demo's arena (`None` for a real source).
    pub demo_arena: Option<Arc<RwLock<Vec<u8>>>>,
}

impl SourceSpec {
    /// Attaches the source `plan`'s shards are read from (a shared-memory file is mapped
    /// read-only and costs no memory until read; the demo allocates and fills version 0).
    pub(crate) fn attach(&self, plan: &TrainerPlan) -> Result<AttachedSource, DriverError> {
        let need = plan.source_arena_bytes;
        Ok(match self {
            SourceSpec::Demo { seed } => {
                let len = usize::try_from(need).map_err(|e| {
                    DriverError::layout(format!("a source arena of {need} bytes: {e}"))
                })?;
                let mut bytes = vec![0u8; len];
                fill_trainer_arena(plan, *seed, 0, &mut bytes);
                let arena = Arc::new(RwLock::new(bytes));
                AttachedSource {
                    view: arena.clone(),
                    demo_arena: Some(arena),
                }
            }
            SourceSpec::Shm(path) => AttachedSource {
                view: Arc::new(SourceMemory::Shm(ShmSource::open(path, Some(need))?)),
                demo_arena: None,
            },
            SourceSpec::Safetensors(path) => {
                let s = SafetensorsSource::load(path, &arena_tensors(plan), need)?;
                AttachedSource {
                    view: Arc::new(SourceMemory::Safetensors(s)),
                    demo_arena: None,
                }
            }
            SourceSpec::Tensors(set) => AttachedSource {
                view: Arc::new(set.for_plan(plan)?),
                demo_arena: None,
            },
        })
    }
}
