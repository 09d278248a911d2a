//! [`DeviceSource`]: a trainer's source in device memory, run through the one pipeline: an arena
//! laid out as the plan's shards say, or one device tensor per shard (a training process's own
//! CUDA tensors, registered in place: [`crate::TensorSet::register_device`]).
//!
//! The pipeline's stages describe their work as data ([`crate::source::device_stages`]); this
//! module executes those descriptions on a GPU:
//! - **fill** (source to staging): the piece's boxes as strided rows, `cuMemcpy2DAsync` from the
//!   arena straight into the piece's lease of the host staging arena, which is page-locked for
//!   as long as the trainer lives ([`PinnedRegion`]). Copy stream.
//! - **prepare** (a cast or fp8 strips of a contiguous box): the input range copied device to
//!   device into a device mirror of the staging arena (same offsets as the host lease), the
//!   NVRTC kernels (bit-identical to the CPU kernels) writing the values and scales next to it,
//!   then one D2H of the output into the host lease. Compute stream (the device's).
//!
//! Why two streams and per-lease events (review G6): the copy stream fills piece `k+1` while
//! the compute stream prepares piece `k`; each step ends by recording an event on its stream
//! after its own copies and waiting for that event only, on the blocking thread the stage runs
//! on, so no step waits for another lease's work and the lease is complete, as after the host
//! steps, when the step returns. The device mirror is used on the compute stream only, so
//! cudarc's per-allocation tracking of it never orders one stream after the other.
//!
//! Nothing is left queued when a step returns, also on error (the event is waited for before
//! the error is returned where copies were queued), which is what lets the staging stay
//! page-locked memory owned by the fabric and the arena be dropped by its owner after a sync.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, sys};
use parking_lot::Mutex;
use weightsync_common::fabric::Region;
use weightsync_schedules::table::{TrainerPlan, Transform};

use super::dma;
use super::{GpuDevice, GpuError, GpuSource, PinnedRegion};
use crate::error::{Result, WorkerError};
use crate::prepare::Fp8Shape;
use crate::source::device_stages::{DeviceStages, PrepareJob, PrepareKind, StridedCopy};
use crate::source::view::{SourceView, check_source};

/// A trainer source in device memory (see the module docs).
#[derive(Debug, Clone)]
pub struct DeviceSource {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    device: Arc<GpuDevice>,
    layout: Layout,
}

/// Where the shards lie.
#[derive(Debug)]
enum Layout {
    /// One arena, every shard at its plan offset.
    Arena(GpuSource),
    /// One memory per shard of the plan, in its order (`None`: an empty shard).
    Shards(Vec<Option<Arc<GpuSource>>>),
}

impl DeviceSource {
    /// The arena `arena` on `device` (refused when the arena belongs to another context).
    pub fn new(device: Arc<GpuDevice>, arena: GpuSource) -> Result<DeviceSource, GpuError> {
        if **arena.context() != **device.context() {
            return Err(GpuError::WrongContext {
                what: "the source arena",
            });
        }
        Ok(DeviceSource {
            inner: Arc::new(Inner {
                device,
                layout: Layout::Arena(arena),
            }),
        })
    }

    /// One memory per shard of a plan, in the plan's shard order (`None` for an empty shard),
    /// all on `device`.
    pub fn shards(
        device: Arc<GpuDevice>,
        shards: Vec<Option<Arc<GpuSource>>>,
    ) -> Result<DeviceSource, GpuError> {
        if shards
            .iter()
            .flatten()
            .any(|s| **s.context() != **device.context())
        {
            return Err(GpuError::WrongContext {
                what: "a source tensor",
            });
        }
        Ok(DeviceSource {
            inner: Arc::new(Inner {
                device,
                layout: Layout::Shards(shards),
            }),
        })
    }

    /// Borrows `len` bytes at device address `ptr` on GPU `ordinal` of this process (a torch
    /// CUDA tensor's storage) as the arena. [`GpuError::NoDriver`] without a driver.
    ///
    /// # Safety
    /// As [`super::BorrowedDevice::new`]: the range stays allocated, and unwritten while a
    /// sync runs, until the returned value (and every trainer built on it) is dropped.
    pub unsafe fn borrowed(
        ordinal: usize,
        ptr: sys::CUdeviceptr,
        len: usize,
    ) -> Result<DeviceSource, GpuError> {
        let device = Arc::new(GpuDevice::open(ordinal)?);
        // SAFETY: the caller's contract is BorrowedDevice::new's.
        let borrowed = unsafe { super::BorrowedDevice::new(&device, ptr, len) }?;
        DeviceSource::new(device, GpuSource::Borrowed(borrowed))
    }

    /// The device.
    pub fn device(&self) -> &Arc<GpuDevice> {
        &self.inner.device
    }

    /// Arena bytes (0 for one memory per shard).
    pub fn len(&self) -> usize {
        match &self.inner.layout {
            Layout::Arena(a) => a.len(),
            Layout::Shards(_) => 0,
        }
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Inner {
    /// Shard `shard`'s memory and where the shard starts in it, checked to hold the shard.
    fn shard(&self, plan: &TrainerPlan, shard: u32) -> Result<(&GpuSource, usize, usize)> {
        let s = plan.shards.get(shard as usize).ok_or_else(|| {
            WorkerError::InvalidPlan(format!("shard {shard} of {}", plan.shards.len()))
        })?;
        let (memory, at) = match &self.layout {
            Layout::Arena(a) => (a, s.offset as usize),
            Layout::Shards(v) => match v.get(shard as usize) {
                Some(Some(m)) => (&**m, 0),
                _ => {
                    return Err(WorkerError::InvalidPlan(format!(
                        "shard {shard} has no device tensor"
                    )));
                }
            },
        };
        let len = s.bytes() as usize;
        if at + len > memory.len() {
            return Err(WorkerError::SourceTooShort {
                what: format!("shard {shard} of the device source"),
                need: (at + len) as u64,
                have: memory.len() as u64,
            });
        }
        Ok((memory, at, len))
    }
}

impl SourceView for DeviceSource {
    fn len(&self) -> u64 {
        DeviceSource::len(self) as u64
    }

    fn check_plan(&self, plan: &TrainerPlan) -> Result<()> {
        match &self.inner.layout {
            Layout::Arena(a) => check_source(plan, a.len() as u64),
            Layout::Shards(v) => {
                if v.len() != plan.shards.len() {
                    return Err(WorkerError::InvalidPlan(format!(
                        "the device tensors were bound to a plan of {} shards, this one has {}",
                        v.len(),
                        plan.shards.len()
                    )));
                }
                (0..v.len() as u32)
                    .filter(|&i| plan.shards[i as usize].bytes() > 0)
                    .try_for_each(|i| self.inner.shard(plan, i).map(|_| ()))
            }
        }
    }

    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        // No host view: the pipeline reads through `device_stages`, which every trainer built
        // on this source has (an empty slice fails any host read by its own bounds check).
        f(&[])
    }

    fn device_stages(
        &self,
        plan: &TrainerPlan,
        staging: &Region,
    ) -> Result<Option<Box<dyn DeviceStages>>> {
        let gpu = |context: &str| {
            let context = format!("binding the device source to the staging arena: {context}");
            move |source| WorkerError::Gpu { context, source }
        };
        let device = &self.inner.device;
        let pinned = PinnedRegion::new(device, staging).map_err(gpu("page-locking"))?;
        let copy = device
            .context()
            .new_stream()
            .map_err(|e| gpu("creating the copy stream")(e.into()))?;
        let max_pitch = device
            .context()
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)
            .map_err(|e| gpu("reading the maximum pitch")(e.into()))?
            .max(1) as usize;
        let prepares = plan.tasks.iter().any(|t| {
            matches!(
                t.transform,
                Transform::Cast { .. } | Transform::Fp8Block { .. }
            )
        });
        let mirror = if prepares {
            // Compile and load the kernels now: a missing NVRTC refuses the trainer before any
            // byte is written, not the first sync.
            device
                .kernel_image()
                .map_err(gpu("compiling the preparation kernels"))?;
            Some(
                device
                    .alloc(staging.len() as usize)
                    .map_err(gpu("allocating the device staging"))?,
            )
        } else {
            None
        };
        Ok(Some(Box::new(SourceStages {
            source: self.inner.clone(),
            copy,
            max_pitch,
            mirror: Mutex::new(mirror),
            pinned,
        })))
    }
}

/// A [`DeviceSource`]'s stages, bound to one trainer's staging arena.
#[derive(Debug)]
struct SourceStages {
    source: Arc<Inner>,
    /// Source-to-staging copies.
    copy: Arc<CudaStream>,
    max_pitch: usize,
    /// The device mirror of the staging arena (preparation input and output at the lease's
    /// offsets); `None` when the plan prepares nothing.
    mirror: Mutex<Option<CudaSlice<u8>>>,
    /// Declared last: unregistered after the streams' users are gone.
    pinned: PinnedRegion,
}

/// Waits for an event recorded on `stream` now: the end of this step's work there (never
/// skipped on a stale error: [`super::pending::wait_queued`]).
fn finish(stream: &CudaStream) -> Result<(), GpuError> {
    super::pending::wait_queued(stream)
}

impl SourceStages {
    fn fill_rows(
        &self,
        memory: &GpuSource,
        at: usize,
        shard_len: usize,
        copies: &[StridedCopy],
        input: &mut [u8],
    ) -> Result<(), GpuError> {
        for c in copies {
            let bad = c.rows > 1 && c.pitch < c.width;
            if bad || c.src_end() > shard_len as u64 || c.dst_end() > input.len() as u64 {
                return Err(GpuError::OutOfBounds {
                    what: "strided copy of a shard into staging",
                    offset: c.src as usize,
                    len: (c.rows * c.width) as usize,
                    have: shard_len,
                });
            }
        }
        let dst = input.as_mut_ptr();
        let queued = memory.read_on(&self.copy, at, shard_len, |shard| {
            for c in copies {
                // SAFETY: the rows lie inside the shard and the input (checked above); the
                // shard is device memory of the copy stream's context (checked by `read_on`,
                // which also bound the context), read-only during a sync by the source's
                // contract; `input` is borrowed mutably for this call, and `finish` below waits
                // for the copies before it returns.
                unsafe {
                    dma::d2h_rows(
                        &self.copy,
                        shard + c.src,
                        c.pitch as usize,
                        dst.add(c.dst as usize),
                        c.width as usize,
                        c.rows as usize,
                        self.max_pitch,
                    )?
                };
            }
            Ok(())
        });
        // Wait also when queuing failed half-way: what was queued writes `input`.
        let done = finish(&self.copy);
        queued.and(done)
    }

    fn prepare_on_device(
        &self,
        memory: &GpuSource,
        at: usize,
        job: &PrepareJob,
        lease_offset: usize,
        lease: &mut [u8],
    ) -> Result<(), GpuError> {
        let Some(out) = job.output() else {
            return Ok(()); // a copy is never prepared in place
        };
        let (out_start, out_end) = (out.start as usize, out.end as usize);
        let input = job.input as usize;
        let mut mirror = self.mirror.lock();
        let Some(mirror) = mirror.as_mut() else {
            return Err(GpuError::OutOfBounds {
                what: "device staging (the plan prepares nothing)",
                offset: lease_offset,
                len: lease.len(),
                have: 0,
            });
        };
        if input > out_start || out_end > lease.len() || lease_offset + lease.len() > mirror.len() {
            return Err(GpuError::OutOfBounds {
                what: "device staging",
                offset: lease_offset,
                len: lease.len(),
                have: mirror.len(),
            });
        }
        let device = &self.source.device;
        let stream = device.stream().clone();
        // The lease's input before its output, in the mirror at the lease's offset.
        let (mut head, mut tail) = mirror.split_at_mut(lease_offset + out_start);
        let mut input_view = head.slice_mut(lease_offset..lease_offset + input);
        let mut out_view = tail.slice_mut(0..out_end - out_start);
        let work = (|| {
            {
                let (dst, _write) = input_view.device_ptr_mut(&stream);
                memory.read_on(&stream, at, input, |src| {
                    // SAFETY: `src..+input` is the piece's input inside the arena (bounds and
                    // context checked by `read_on`, which bound the context); `dst` is the
                    // lease's input range of the mirror, used by this step only (the mirror is
                    // locked) and ordered after earlier users by `_write`; the two are distinct
                    // allocations; `finish` waits for the copy before returning.
                    unsafe { dma::d2d(&stream, dst, src, input) }
                })?;
            }
            match &job.kind {
                PrepareKind::Copy => {}
                PrepareKind::Cast { from, to, values } => {
                    let n = (values.end - values.start) as usize;
                    let mut v = out_view.slice_mut(0..n);
                    device.cast(&input_view, *from, &mut v, *to)?;
                }
                PrepareKind::Fp8 {
                    from,
                    recipe,
                    cols,
                    strips,
                } => {
                    for s in strips {
                        let src = input_view.slice(s.input.start as usize..s.input.end as usize);
                        let rel = |x: u64| x as usize - out_start;
                        let (mut values, mut rest) = out_view.split_at_mut(rel(s.values.end));
                        let mut values = values.slice_mut(rel(s.values.start)..);
                        let skip = rel(s.values.end);
                        let mut scales =
                            rest.slice_mut(rel(s.scales.start) - skip..rel(s.scales.end) - skip);
                        let shape = Fp8Shape {
                            rows: s.rows() as usize,
                            cols: *cols as usize,
                        };
                        let (v, c) = (&mut values, &mut scales);
                        device.quantise_fp8_as(*recipe, &src, *from, shape, v, c)?;
                    }
                }
            }
            let (src, _read) = out_view.device_ptr(&stream);
            // SAFETY: `src` is the lease's output range of the mirror (`out_end - out_start`
            // bytes, ordered after the kernels by `_read` and stream order); the host range is
            // the same bytes of `lease`, inside it (checked above), page-locked staging borrowed
            // mutably for this call; `finish` waits for the copy before returning.
            unsafe {
                dma::d2h(
                    &stream,
                    lease.as_mut_ptr().add(out_start),
                    src,
                    out_end - out_start,
                )
            }
        })();
        let done = finish(&stream);
        work.and(done)
    }
}

impl DeviceStages for SourceStages {
    fn fill(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        copies: &[StridedCopy],
        input: &mut [u8],
    ) -> Result<()> {
        let (memory, at, len) = self.source.shard(plan, shard)?;
        debug_assert!(
            self.pinned.contains(input),
            "staging outside the pinned arena"
        );
        self.fill_rows(memory, at, len, copies, input)
            .map_err(|source| WorkerError::Gpu {
                context: format!("copying shard {shard} of the device source into staging"),
                source,
            })
    }

    fn prepare(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        input_at: u64,
        job: &PrepareJob,
        lease_offset: u64,
        lease: &mut [u8],
    ) -> Result<()> {
        let (memory, at, len) = self.source.shard(plan, shard)?;
        if input_at + job.input > len as u64 {
            return Err(WorkerError::SourceTooShort {
                what: format!("shard {shard} of the device source"),
                need: input_at + job.input,
                have: len as u64,
            });
        }
        debug_assert!(
            self.pinned.contains(lease),
            "staging outside the pinned arena"
        );
        self.prepare_on_device(
            memory,
            at + input_at as usize,
            job,
            lease_offset as usize,
            lease,
        )
        .map_err(|source| WorkerError::Gpu {
            context: format!("preparing a piece of shard {shard} on the device"),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_borrowed_device_source_is_a_clean_error_without_a_driver() {
        if super::super::driver_present() {
            return; // the device check covers the machine with a driver
        }
        // SAFETY: without a driver nothing is dereferenced: open fails first.
        let err = unsafe { DeviceSource::borrowed(0, 0x1000, 64) }.unwrap_err();
        assert!(matches!(err, GpuError::NoDriver), "{err}");
        assert!(err.to_string().contains("libcuda"), "{err}");
    }

    fn tensor(name: &str, ordinal: usize) -> crate::DeviceTensor {
        crate::DeviceTensor {
            name: name.into(),
            dtype: weightsync_common::DType::BF16,
            shape: vec![2, 2],
            // SAFETY: never dereferenced: registration fails before (no driver, two GPUs).
            memory: unsafe {
                super::super::DeviceMemory::from_raw(ordinal, 0x1000, 8, Box::new(()))
            },
        }
    }

    #[test]
    fn device_tensors_are_clean_errors_without_a_driver_or_on_two_gpus() {
        let err =
            crate::TensorSet::register_device(vec![tensor("a", 0), tensor("b", 1)]).unwrap_err();
        assert!(err.to_string().contains("GPUs {0, 1}"), "{err}");
        let err = crate::TensorSet::register_device(Vec::new()).unwrap_err();
        assert!(err.to_string().contains("no tensors"), "{err}");
        if super::super::driver_present() {
            return; // the device check covers the machine with a driver
        }
        let err = crate::TensorSet::register_device(vec![tensor("a", 0)]).unwrap_err();
        assert!(
            matches!(
                &err,
                WorkerError::Gpu {
                    source: GpuError::NoDriver,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("GPU 0"), "{err}");
        assert!(err.to_string().contains("libcuda"), "{err}");
    }
}
