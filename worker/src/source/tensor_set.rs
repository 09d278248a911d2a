//! Caller-owned tensors as a trainer's source: the training job's own parameter shards,
//! registered in place, instead of an arena laid out the planner's way.
//!
//! Why: a training framework keeps each parameter's local shard in an allocation of its own
//! (FSDP2: one per parameter, at a stable address across optimizer steps). Copying them into an
//! arena before every sync would cost a pass over the weights; registering them once lets the
//! pipeline read each shard where it lies, and lets the fabric write a shard's bytes straight
//! from it when nothing needs preparing (a same-dtype copy of a contiguous box).
//!
//! Tensors in device memory (feature `cuda`: a training job's CUDA parameters) register through
//! [`TensorSet::register_device`] instead: they are not registered with the fabric (TCP cannot
//! read device memory), and the pipeline reads them through the device stages of a
//! [`crate::gpu::DeviceSource`] (strided DMA into pinned staging, the NVRTC kernels).
//!
//! [`HostMemory`] is the one entry for foreign memory: an `unsafe` constructor takes a pointer,
//! a length and an owner that keeps the memory alive (the Python package passes the tensor
//! object). Each tensor is registered with the fabric as [`Access::SOURCE`]; the registration
//! holds the owner until the last write from it is gone. [`TensorSet`] checks the tensors
//! against the shards a plan expects (name, dtype, local shape: errors name the parameter, the
//! expected and the actual), and [`PlanTensors`] is the per-plan view the pipeline reads.

use std::collections::BTreeMap;
use std::sync::Arc;

use weightsync_common::DType;
use weightsync_common::fabric::{
    Access, FabricBackend, Memory, MemoryLocation, MemoryOwner, RawMemory, Region,
};
use weightsync_schedules::table::TrainerPlan;

use super::view::SourceView;
use super::{ArenaTensor, arena_tensors};
use crate::error::SourceError;
use crate::error::{Result, WorkerError};

/// Host memory owned by someone else (a tensor of the training or inference process), kept
/// alive by an owner object for as long as anything may read or write it.
#[derive(Debug)]
pub struct HostMemory {
    raw: RawMemory,
}

impl HostMemory {
    /// Wraps `len` bytes at `ptr`, kept alive by `keepalive`. `len` may be 0 (`ptr` is then
    /// never used).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be host memory readable (and, for a destination, writable) from any
    /// thread, that stays valid and does not move while `keepalive` is alive. Its owner must not
    /// change it while a sync reads it (a source) and must not read it as a Rust reference while
    /// peers may write it (a destination).
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, keepalive: MemoryOwner) -> HostMemory {
        // SAFETY: the caller's contract above is RawMemory::owning's.
        let raw = unsafe { RawMemory::owning(ptr, len, MemoryLocation::Host, keepalive) };
        HostMemory { raw }
    }

    /// Address of the first byte.
    pub fn as_ptr(&self) -> *const u8 {
        self.raw.as_ptr()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.raw.len()
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.raw.is_empty()
    }

    /// The memory, for registration with the fabric.
    pub fn into_memory(self) -> Memory {
        Memory::Raw(self.raw)
    }

    /// One range over `parts` when each starts where the previous ends (so that one
    /// registration covers them all); gives them back otherwise. The joined memory keeps every
    /// part's owner alive.
    pub fn join(parts: Vec<HostMemory>) -> std::result::Result<HostMemory, Vec<HostMemory>> {
        let adjacent = parts
            .windows(2)
            .all(|w| w[0].as_ptr() as usize + w[0].len() == w[1].as_ptr() as usize);
        if parts.is_empty() || !adjacent {
            return Err(parts);
        }
        let ptr = parts[0].raw.as_ptr();
        let len = parts.iter().map(HostMemory::len).sum();
        // SAFETY: the parts are adjacent, so ptr..ptr+len is exactly their union; each part's
        // contract (valid, not moving while its owner lives) holds for its range, and the new
        // owner keeps every part (and so every part's owner) alive.
        let raw = unsafe { RawMemory::owning(ptr, len, MemoryLocation::Host, Box::new(parts)) };
        Ok(HostMemory { raw })
    }
}

/// One tensor a caller registers as a source.
#[derive(Debug)]
pub struct SourceTensor {
    /// The parameter's name (`name#k` for the k-th shard after the first of a parameter with
    /// several shards on this rank).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Local shape.
    pub shape: Vec<u64>,
    /// Its bytes (`numel * dtype size`).
    pub memory: HostMemory,
}

/// One tensor in device memory a caller registers as a source (feature `cuda`).
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct DeviceTensor {
    /// The parameter's name (as [`SourceTensor::name`]).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Local shape.
    pub shape: Vec<u64>,
    /// Its bytes on the GPU (`numel * dtype size`).
    pub memory: crate::gpu::DeviceMemory,
}

#[derive(Debug)]
struct Held {
    dtype: DType,
    shape: Vec<u64>,
    /// `None` for an empty tensor (nothing to register) or one in device memory.
    region: Option<Region>,
    /// The tensor in device memory (`None` for host memory or an empty tensor).
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::gpu::GpuSource>>,
}

impl Held {
    fn holds_bytes(&self) -> bool {
        #[cfg(feature = "cuda")]
        if self.device.is_some() {
            return true;
        }
        self.region.is_some()
    }
}

/// A trainer's registered tensors, by name (see the module docs).
#[derive(Debug)]
pub struct TensorSet {
    tensors: BTreeMap<String, Held>,
    /// The GPU the tensors are on, when they were registered in device memory.
    #[cfg(feature = "cuda")]
    device: Option<Arc<crate::gpu::GpuDevice>>,
}

/// The bytes a tensor of `dtype` and `shape` holds, or an error naming it when its memory
/// (`have` bytes) is not that long.
fn shape_bytes(name: &str, dtype: DType, shape: &[u64], have: u64) -> Result<u64> {
    let want = shape.iter().product::<u64>() * dtype.size() as u64;
    if have != want {
        return Err(SourceError::Layout(format!(
            "tensor {name:?} ({dtype} {shape:?}) should hold {want} bytes, its memory has {have}"
        ))
        .into());
    }
    Ok(want)
}

impl TensorSet {
    /// Registers every non-empty tensor with `fabric` as a write source. Refuses a duplicate
    /// name or a tensor whose byte length is not its shape's.
    pub fn register<F: FabricBackend>(fabric: &F, tensors: Vec<SourceTensor>) -> Result<Self> {
        let mut held = BTreeMap::new();
        for t in tensors {
            let want = shape_bytes(&t.name, t.dtype, &t.shape, t.memory.len() as u64)?;
            let region = if want == 0 {
                None
            } else {
                let r = fabric
                    .register(t.memory.into_memory(), Access::SOURCE)
                    .map_err(|e| WorkerError::fabric(format!("registering {}", t.name), e))?;
                Some(r)
            };
            let entry = Held {
                dtype: t.dtype,
                shape: t.shape,
                region,
                #[cfg(feature = "cuda")]
                device: None,
            };
            if held.insert(t.name.clone(), entry).is_some() {
                return Err(
                    SourceError::Layout(format!("tensor {:?} appears twice", t.name)).into(),
                );
            }
        }
        Ok(TensorSet {
            tensors: held,
            #[cfg(feature = "cuda")]
            device: None,
        })
    }

    /// Takes tensors in device memory, all on one GPU (feature `cuda`): opens that GPU (a
    /// clean [`crate::gpu::GpuError::NoDriver`] without a driver) and checks that each tensor
    /// lies inside one allocation of it. Refuses a duplicate name, a tensor whose byte length is
    /// not its shape's, and tensors on several GPUs (one trainer reads one GPU).
    #[cfg(feature = "cuda")]
    pub fn register_device(tensors: Vec<DeviceTensor>) -> Result<Self> {
        let ordinals: std::collections::BTreeSet<usize> =
            tensors.iter().map(|t| t.memory.ordinal()).collect();
        let ordinal = match ordinals.len() {
            0 => return Err(SourceError::Layout("no tensors to register".into()).into()),
            1 => ordinals.into_iter().next().unwrap_or(0),
            _ => {
                return Err(SourceError::Layout(format!(
                    "tensors on GPUs {ordinals:?}: a trainer reads the tensors of one GPU"
                ))
                .into());
            }
        };
        let gpu = |context: String| move |source| WorkerError::Gpu { context, source };
        let dev = Arc::new(
            crate::gpu::GpuDevice::open(ordinal)
                .map_err(gpu(format!("opening GPU {ordinal} for the source tensors")))?,
        );
        let mut held = BTreeMap::new();
        for t in tensors {
            let want = shape_bytes(&t.name, t.dtype, &t.shape, t.memory.len() as u64)?;
            let device = if want == 0 {
                None
            } else {
                let what = format!("tensor {:?} at GPU {ordinal}", t.name);
                Some(Arc::new(t.memory.borrow_on(&dev).map_err(gpu(what))?))
            };
            let entry = Held {
                dtype: t.dtype,
                shape: t.shape,
                region: None,
                device,
            };
            if held.insert(t.name.clone(), entry).is_some() {
                return Err(
                    SourceError::Layout(format!("tensor {:?} appears twice", t.name)).into(),
                );
            }
        }
        Ok(TensorSet {
            tensors: held,
            device: Some(dev),
        })
    }

    /// Checks the tensors against the shards `expected` (a rank's layout): every non-empty
    /// shard has a tensor of its name, dtype and shape, and no tensor is left over. Empty
    /// shards need no tensor.
    pub fn check(&self, expected: &[ArenaTensor]) -> std::result::Result<(), SourceError> {
        let mut used = std::collections::BTreeSet::new();
        for e in expected.iter().filter(|e| e.bytes() > 0) {
            let Some(t) = self.tensors.get(&e.name) else {
                return Err(SourceError::Layout(format!(
                    "parameter {:?} (local shard {:?} of {}) has no registered tensor",
                    e.name, e.shape, e.dtype
                )));
            };
            used.insert(e.name.as_str());
            if t.dtype != e.dtype {
                return Err(SourceError::DTypeMismatch {
                    name: e.name.clone(),
                    expected: e.dtype,
                    found: t.dtype.to_string(),
                });
            }
            let found: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            if found != e.shape {
                return Err(SourceError::ShapeMismatch {
                    name: e.name.clone(),
                    expected: e.shape.clone(),
                    found,
                });
            }
        }
        let extra: Vec<&str> = self
            .tensors
            .iter()
            .filter(|(n, t)| !used.contains(n.as_str()) && t.holds_bytes())
            .map(|(n, _)| n.as_str())
            .collect();
        if !extra.is_empty() {
            return Err(SourceError::Layout(format!(
                "tensors that are no shard of this rank: {}",
                extra.join(", ")
            )));
        }
        Ok(())
    }

    /// The view of these tensors for `plan`, after checking them against its shards.
    pub fn for_plan(self: &Arc<Self>, plan: &TrainerPlan) -> Result<PlanTensors> {
        let expected = arena_tensors(plan);
        self.check(&expected)?;
        let shards = expected
            .iter()
            .map(|e| {
                self.tensors
                    .get(&e.name)
                    .and_then(|t| t.region.clone())
                    .filter(|_| e.bytes() > 0)
            })
            .collect();
        #[cfg(feature = "cuda")]
        let device = match &self.device {
            None => None,
            Some(dev) => {
                let shards = expected
                    .iter()
                    .map(|e| {
                        self.tensors
                            .get(&e.name)
                            .and_then(|t| t.device.clone())
                            .filter(|_| e.bytes() > 0)
                    })
                    .collect();
                let source =
                    crate::gpu::DeviceSource::shards(dev.clone(), shards).map_err(|source| {
                        WorkerError::Gpu {
                            context: "binding the source tensors to the plan".into(),
                            source,
                        }
                    })?;
                Some(source)
            }
        };
        Ok(PlanTensors {
            _set: self.clone(),
            shards,
            #[cfg(feature = "cuda")]
            device,
        })
    }
}

/// The registered tensors of a [`TensorSet`] in a plan's shard order: what the pipeline reads.
#[derive(Debug)]
pub struct PlanTensors {
    _set: Arc<TensorSet>,
    /// Per shard of the plan, its tensor's registration (`None`: an empty shard, or tensors in
    /// device memory).
    shards: Vec<Option<Region>>,
    /// The tensors in device memory, as the plan's shards (feature `cuda`).
    #[cfg(feature = "cuda")]
    device: Option<crate::gpu::DeviceSource>,
}

impl SourceView for PlanTensors {
    fn len(&self) -> u64 {
        0
    }

    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        // No arena: every read goes through `read_shard`.
        f(&[])
    }

    fn check_plan(&self, plan: &TrainerPlan) -> Result<()> {
        if plan.shards.len() != self.shards.len() {
            return Err(WorkerError::InvalidPlan(format!(
                "the tensors were bound to a plan of {} shards, this one has {}",
                self.shards.len(),
                plan.shards.len()
            )));
        }
        Ok(())
    }

    fn read_shard(
        &self,
        _plan: &TrainerPlan,
        shard: u32,
        f: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<()> {
        match self.shards.get(shard as usize) {
            Some(Some(region)) => {
                // SAFETY: the region is host memory registered as a write source only, so no
                // peer writes into it; its owner promised (HostMemory::from_raw) not to change
                // it while a sync reads it, and the slice lives only for this call.
                let bytes = unsafe { region.as_slice() };
                f(bytes)
            }
            Some(None) => f(&[]),
            None => Err(WorkerError::InvalidPlan(format!(
                "shard {shard} of {}",
                self.shards.len()
            ))),
        }
    }

    fn registered_shard(&self, shard: u32) -> Option<(Region, u64)> {
        self.shards.get(shard as usize)?.clone().map(|r| (r, 0))
    }

    #[cfg(feature = "cuda")]
    fn device_stages(
        &self,
        plan: &TrainerPlan,
        staging: &Region,
    ) -> Result<Option<Box<dyn super::device_stages::DeviceStages>>> {
        match &self.device {
            Some(d) => d.device_stages(plan, staging),
            None => Ok(None),
        }
    }
}
