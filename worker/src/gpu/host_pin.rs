//! [`PinnedRegion`]: a fabric registration's host memory page-locked with the CUDA driver
//! (`cuMemHostRegister`), so that copies between it and device memory are true DMA at full
//! PCIe speed and asynchronous.
//!
//! Why register instead of allocating pinned memory: the staging arena (and a rollout's bounce
//! buffers) are allocated and registered by the fabric, which owns them and posts writes from
//! them; page-locking that same memory lets the driver copy straight into the bytes the fabric
//! sends, with no extra copy. The value holds a clone of the region, so the memory outlives the
//! page-locking; Drop unregisters it. Callers wait for every copy touching it before dropping.

use weightsync_common::fabric::{MemoryLocation, Region};

use cudarc::driver::sys;

use super::{GpuDevice, GpuError};

/// A host region page-locked with the driver for as long as this lives.
#[derive(Debug)]
pub struct PinnedRegion {
    region: Region,
    ctx: std::sync::Arc<cudarc::driver::CudaContext>,
    /// Whether this value registered the memory (else someone had already: not unregistered).
    owned: bool,
}

impl PinnedRegion {
    /// Page-locks `region`'s memory (host memory only; all of it).
    pub fn new(dev: &GpuDevice, region: &Region) -> Result<PinnedRegion, GpuError> {
        if region.memory().location() != MemoryLocation::Host {
            return Err(GpuError::NotHostMemory {
                what: "the region to page-lock",
            });
        }
        dev.context().bind_to_thread()?;
        let len = (region.len() as usize).max(1);
        // SAFETY: `region` is live host memory of `len` bytes that stays allocated while the
        // clone held below lives, i.e. until Drop unregisters it; page-locking does not change
        // its contents. PORTABLE: every context of the process sees it as pinned.
        let res = unsafe {
            sys::cuMemHostRegister_v2(
                region.as_ptr().cast(),
                len,
                sys::CU_MEMHOSTREGISTER_PORTABLE,
            )
        };
        let owned = match res {
            sys::CUresult::CUDA_SUCCESS => true,
            // Already page-locked (by the application, or a second binding): usable as is.
            sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => false,
            other => {
                return Err(GpuError::PinHost {
                    len,
                    source: other.result().unwrap_err(),
                });
            }
        };
        Ok(PinnedRegion {
            region: region.clone(),
            ctx: dev.context().clone(),
            owned,
        })
    }

    /// The region.
    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Whether `bytes` lie inside the page-locked memory.
    pub fn contains(&self, bytes: &[u8]) -> bool {
        let base = self.region.as_ptr() as usize;
        let at = bytes.as_ptr() as usize;
        at >= base && at + bytes.len() <= base + self.region.len() as usize
    }
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        if self.owned && self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the memory was registered by `new` and is unregistered once, here, while
            // still allocated (the region clone is dropped after this); the owners of this
            // value wait for every copy into or out of it before dropping it.
            let _ = unsafe { sys::cuMemHostUnregister(self.region.as_ptr().cast()) };
        }
    }
}
