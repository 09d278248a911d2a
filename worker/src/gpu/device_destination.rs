//! [`DeviceDestination`]: a rollout's destination in device memory behind a fabric that writes
//! host memory (TCP; verbs without peer memory): the receiver's registered regions are
//! page-locked bounce buffers, and once a sync's writes all landed they are copied host to
//! device ([`DeviceLanding`]) before the version counts as landed.
//!
//! The device memory is either owned (buffers of the regions' sizes) or the caller's (an
//! engine's CUDA tensors, one allocation per region, borrowed and kept alive by their owner).
//! Each landing queues one `cuMemcpyHtoDAsync` per region on the device's stream and waits for
//! an event recorded after them, so nothing is in flight when it returns.
//!
//! Not here yet (issue 15 item 2): verification of the device bytes without copying them back
//! (a device-side checksum): the receiver verifies the bounce buffers, which hold exactly what
//! was copied.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use parking_lot::Mutex;
use weightsync_common::fabric::Region;

use super::{DeviceMemory, GpuDevice, GpuError, GpuSource, PinnedRegion, dma};
use crate::error::{Result, WorkerError};
use crate::rollout::DeviceLanding;

/// Device memory standing in for one region.
#[derive(Debug)]
enum Target {
    Owned(Mutex<CudaSlice<u8>>),
    Borrowed(GpuSource),
}

/// A receiver's regions bound to device memory (see the module docs).
#[derive(Debug)]
pub struct DeviceDestination {
    device: Arc<GpuDevice>,
    targets: Vec<Target>,
    /// The regions, page-locked (declared last: unregistered after the targets are gone).
    pinned: Vec<PinnedRegion>,
}

impl DeviceDestination {
    /// Owned device buffers of `regions`' sizes (zeroed).
    pub fn allocate(device: Arc<GpuDevice>, regions: &[Region]) -> Result<Self, GpuError> {
        let targets = regions
            .iter()
            .map(|r| Ok(Target::Owned(Mutex::new(device.alloc(r.len() as usize)?))))
            .collect::<Result<Vec<_>, GpuError>>()?;
        Self::bind(device, regions, targets)
    }

    /// The caller's device memory, one allocation per region (at least the region's size).
    pub fn borrowed(
        device: Arc<GpuDevice>,
        regions: &[Region],
        memory: Vec<DeviceMemory>,
    ) -> Result<Self, GpuError> {
        if memory.len() != regions.len() {
            return Err(GpuError::OutOfBounds {
                what: "device memory for the receiver's regions (one per region)",
                offset: 0,
                len: memory.len(),
                have: regions.len(),
            });
        }
        let targets = memory
            .into_iter()
            .map(|m| Ok(Target::Borrowed(m.borrow_on(&device)?)))
            .collect::<Result<Vec<_>, GpuError>>()?;
        Self::bind(device, regions, targets)
    }

    fn bind(
        device: Arc<GpuDevice>,
        regions: &[Region],
        targets: Vec<Target>,
    ) -> Result<Self, GpuError> {
        for (r, t) in regions.iter().zip(&targets) {
            let have = match t {
                Target::Owned(b) => b.lock().len(),
                Target::Borrowed(s) => s.len(),
            };
            if have < r.len() as usize {
                return Err(GpuError::OutOfBounds {
                    what: "device memory for a receiver region",
                    offset: 0,
                    len: r.len() as usize,
                    have,
                });
            }
        }
        let pinned = regions
            .iter()
            .map(|r| PinnedRegion::new(&device, r))
            .collect::<Result<Vec<_>, GpuError>>()?;
        Ok(DeviceDestination {
            device,
            targets,
            pinned,
        })
    }

    /// Region `mr`'s device bytes, copied back (for checks; a sync never needs it).
    pub fn download(&self, mr: usize) -> Result<Vec<u8>, GpuError> {
        let len = self.pinned.get(mr).map_or(0, |p| p.region().len() as usize);
        match self.targets.get(mr) {
            Some(Target::Owned(b)) => Ok(self.device.download(&b.lock().slice(0..len))?),
            Some(Target::Borrowed(s)) => {
                let mut out = vec![0u8; len];
                let stream = self.device.stream().clone();
                let queued = s.read_on(&stream, 0, len, |src| {
                    // SAFETY: `src..+len` lies in the borrowed memory (checked by `read_on`,
                    // which bound the context); `out` is a live host buffer of `len` bytes,
                    // untouched until the synchronise below.
                    unsafe { dma::d2h(&stream, out.as_mut_ptr(), src, len) }
                });
                let done = self.device.synchronize();
                queued.and(done)?;
                Ok(out)
            }
            None => Err(GpuError::OutOfBounds {
                what: "receiver region",
                offset: mr,
                len: 1,
                have: self.targets.len(),
            }),
        }
    }

    fn copy_all(&self, regions: &[Region]) -> Result<(), GpuError> {
        let stream = self.device.stream().clone();
        self.device.context().bind_to_thread()?;
        let mut queued = Ok(());
        for (r, t) in regions.iter().zip(&self.targets) {
            let (src, len) = (r.as_ptr() as *const u8, r.len() as usize);
            queued = match t {
                Target::Owned(b) => {
                    let mut b = b.lock();
                    let (dst, _write) = b.device_ptr_mut(&stream);
                    // SAFETY: the region is page-locked host memory of `len` bytes (bound in
                    // `bind`, checked equal below) that no write lands in between a sync's
                    // landing and the next arm; the target holds at least `len` bytes of this
                    // context; the event waited for below ends the copy before this returns.
                    unsafe { dma::h2d(&stream, dst, src, len) }
                }
                // A borrowed target is written as `read_on` tracks reads: its Drop waits for
                // the events recorded there; this step waits for its own below anyway.
                Target::Borrowed(s) => s.read_on(&stream, 0, len, |dst| {
                    // SAFETY: as for an owned target: `dst..+len` lies in the caller's memory
                    // (checked by `read_on`), which its owner does not read while a sync lands.
                    unsafe { dma::h2d(&stream, dst, src, len) }
                }),
            };
            if queued.is_err() {
                break;
            }
        }
        // Wait also when queuing failed half-way: what was queued reads the regions.
        let done = super::pending::wait_queued(&stream);
        queued.and(done)
    }
}

impl DeviceLanding for DeviceDestination {
    fn landed(&self, regions: &[Region]) -> Result<()> {
        let same = regions.len() == self.pinned.len()
            && regions
                .iter()
                .zip(&self.pinned)
                .all(|(r, p)| r.as_ptr() == p.region().as_ptr() && r.len() == p.region().len());
        if !same {
            return Err(WorkerError::InvalidPlan(
                "the device destination was bound to other regions than the receiver's".into(),
            ));
        }
        self.copy_all(regions).map_err(|source| WorkerError::Gpu {
            context: "copying the landed regions to the device".into(),
            source,
        })
    }
}
