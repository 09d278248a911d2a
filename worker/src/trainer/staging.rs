//! The staging arena: one registered buffer of exactly `watermark` bytes, reused by every sync.
//!
//! RDMA registration pins pages and programs the NIC's translation tables: far too slow for the
//! data path. So the trainer registers its staging once, when it is built, and every piece of
//! every sync borrows a range of it through a [`Lease`] from the arena's [`Watermark`]. Because
//! the arena *is* the budget, the staging in flight cannot exceed the watermark.
//!
//! This is the one place the trainer turns registered memory into Rust slices. It is sound
//! because (1) the region is registered [`Access::SOURCE`]: no peer can write into it; (2) leases
//! are disjoint ranges handed out by the arena's own watermark, and a slice borrows its lease
//! (mutably for a mutable slice), so two live slices never alias; (3) the fabric only *reads*
//! a range while a write from it is in flight, and the pipeline holds no slice of a lease then.

use std::sync::Arc;

use weightsync_common::fabric::{Access, FabricBackend, MemoryLocation, Region};

use crate::error::{Result, WorkerError};
use crate::watermark::{Lease, Watermark};

/// The registered staging buffer and the watermark that leases it out.
#[derive(Debug)]
pub(crate) struct StagingArena {
    region: Region,
    watermark: Arc<Watermark>,
}

impl StagingArena {
    /// Allocates and registers `bytes` of staging.
    pub(crate) fn new<F: FabricBackend>(fabric: &F, bytes: u64) -> Result<StagingArena> {
        if bytes == 0 {
            return Err(WorkerError::InvalidPlan(
                "the watermark must be at least one byte".into(),
            ));
        }
        let region = fabric
            .alloc(bytes as usize, Access::SOURCE)
            .map_err(|e| WorkerError::fabric("registering the staging arena", e))?;
        if region.memory().location() != MemoryLocation::Host {
            return Err(WorkerError::InvalidPlan(
                "staging must be host memory in this build".into(),
            ));
        }
        Ok(StagingArena {
            region,
            watermark: Watermark::new(bytes),
        })
    }

    /// The registration writes are posted from.
    pub(crate) fn region(&self) -> &Region {
        &self.region
    }

    /// The budget.
    pub(crate) fn watermark(&self) -> &Arc<Watermark> {
        &self.watermark
    }

    fn check(&self, lease: &Lease) -> Result<()> {
        if !lease.is_from(&self.watermark) || lease.offset() + lease.len() > self.region.len() {
            return Err(WorkerError::Stage {
                stage: "staging",
                detail: "a lease from another arena was used".into(),
            });
        }
        Ok(())
    }

    /// The bytes of a lease, mutably.
    pub(crate) fn bytes_mut<'a>(&'a self, lease: &'a mut Lease) -> Result<&'a mut [u8]> {
        self.check(lease)?;
        // SAFETY: the lease lies inside the region (checked above) and the region is live host
        // memory owned by `self.region` for as long as `self` lives. The range is exclusively
        // ours: leases from one watermark are disjoint, we borrow the lease mutably for the
        // slice's life, the region is SOURCE-only so no peer writes into it, and the pipeline
        // posts no write from this lease while this slice lives (see the module docs).
        Ok(unsafe {
            std::slice::from_raw_parts_mut(
                self.region.as_ptr().add(lease.offset() as usize),
                lease.len() as usize,
            )
        })
    }
}
