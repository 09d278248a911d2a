//! A bench trainer's weights registered with its fabric as a write source, as the Python package
//! registers a training job's own tensors (`weightsync.Trainer.register`).
//!
//! Why: with the source registered, a same-dtype copy of a box that is one contiguous range of
//! its shard needs no staging at all: the fabric writes it straight from the weights (the
//! worker's zero-copy path, `direct_bytes` in its report). A bench whose trainers only hand
//! the pipeline a plain byte arena measures the sidecar's staged path instead, which copies
//! every such box into staging first. `--staged-sources` keeps that path measurable.
//!
//! The registered copy is on huge pages ([`PageAlignedBuffer::with_huge_pages`]), as a training
//! job's own large tensors are when PyTorch's CPU allocator is asked for them
//! (`THP_MEM_ALLOC_ENABLE=1`): every same-host pull pins the pages it reads, one per 2 MiB
//! there.
//!
//! The pipeline reads what it prepares through [`SourceView::read`] (a Rust slice) and the
//! fabric writes direct tasks from the registered buffer, so the weights are held twice, byte
//! for byte the same: reading a registered buffer as a slice would need `unsafe` outside the
//! fabric's own module, and the bench's timing does not depend on which of two equal copies a
//! byte comes from. The delta bench changes the weights between syncs
//! ([`RegisteredSource::modify`]): both copies, before the sync it times.

use weightsync_common::fabric::{Access, FabricBackend, Memory, PageAlignedBuffer, Region};
use weightsync_schedules::table::TrainerPlan;
use weightsync_worker::SourceView;

use super::E2eError;

/// A trainer's arena of weights, also registered (see the module docs).
#[derive(Debug)]
pub(crate) struct RegisteredSource {
    bytes: parking_lot::RwLock<Vec<u8>>,
    /// The registered copy; `None` for an empty arena (nothing to register) or one left
    /// unregistered ([`RegisteredSource::unregistered`]: `--staged-sources`).
    region: Option<Region>,
    /// Each shard's byte offset in the arena, by shard index.
    shard_offsets: Vec<u64>,
}

impl RegisteredSource {
    /// Registers a copy of `bytes` (the arena `plan` describes) with `fabric` as a write source.
    pub(crate) fn register<F: FabricBackend>(
        fabric: &F,
        plan: &TrainerPlan,
        bytes: Vec<u8>,
    ) -> Result<Self, E2eError> {
        let region = if bytes.is_empty() {
            None
        } else {
            let mut buf = PageAlignedBuffer::with_huge_pages(bytes.len()).map_err(|e| {
                E2eError::Setup(format!("trainer {}: source buffer: {e}", plan.rank))
            })?;
            buf.as_mut_slice().copy_from_slice(&bytes);
            let region = fabric
                .register(Memory::from(buf), Access::SOURCE)
                .map_err(|e| {
                    E2eError::Setup(format!(
                        "trainer {}: registering its source: {e}",
                        plan.rank
                    ))
                })?;
            Some(region)
        };
        Ok(RegisteredSource {
            bytes: parking_lot::RwLock::new(bytes),
            region,
            shard_offsets: plan.shards.iter().map(|s| s.offset).collect(),
        })
    }

    /// The arena `bytes` as a source nobody registered: every task is staged.
    pub(crate) fn unregistered(bytes: Vec<u8>) -> Self {
        RegisteredSource {
            bytes: parking_lot::RwLock::new(bytes),
            region: None,
            shard_offsets: Vec::new(),
        }
    }

    /// Edits the weights with `f` (between syncs), then brings the registered copy up to date.
    pub(crate) fn modify(&self, f: impl FnOnce(&mut [u8])) -> Result<(), E2eError> {
        let mut bytes = self.bytes.write();
        f(&mut bytes);
        if let Some(region) = &self.region {
            region
                .write_at(0, &bytes)
                .map_err(|e| E2eError::Setup(format!("updating a registered source: {e}")))?;
        }
        Ok(())
    }
}

impl SourceView for RegisteredSource {
    fn len(&self) -> u64 {
        self.bytes.read().len() as u64
    }

    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        f(&self.bytes.read())
    }

    fn registered_shard(&self, shard: u32) -> Option<(Region, u64)> {
        let at = *self.shard_offsets.get(shard as usize)?;
        Some((self.region.clone()?, at))
    }
}
