//! Source memory: the trainer's flat source arena, wherever the training process keeps it.
//!
//! Why one type: the pipeline reads byte ranges of the arena laid out by the routing table
//! (every local shard at its [`LocalShard::offset`]), and must not care whether the bytes are a
//! buffer it was handed, a shared-memory file the training process exports (the normal sidecar
//! deployment), a safetensors checkpoint, or GPU memory (feature `cuda`). Every variant checks
//! its bounds, and the constructors refuse a source that does not match what the table says
//! (too short, a tensor missing, a dtype or shape mismatch) before anything is written anywhere.
//!
//! # Layout
//! - [`host`]: memory handed to the worker (owned, rewritable between syncs).
//! - [`shm`]: a shared-memory file attached read-only (memmap2), stamped with a seqlock
//!   generation so that a sync notices a write, a replacement or a truncation.
//! - [`safetensors_file`]: a safetensors file whose tensors are placed at their arena offsets.
//! - [`tensor_set`]: caller-owned tensors registered in place (an in-process trainer), read
//!   shard by shard and written straight from where they lie when nothing needs preparing.
//! - [`view`]: [`SourceView`](view::SourceView), how the trainer pipeline reads any of them;
//!   [`device_stages`]: the fill and prepare steps a source the host cannot read supplies.
//!   Both sit here, below the trainer, so that a source never names the trainer.
//! - `crate::gpu::DeviceSource` (feature `cuda`): device memory (owned, a CUDA IPC mapping, or
//!   borrowed), read by the pipeline through its device stages (DMA into pinned staging).
//!
//! [`LocalShard::offset`]: weightsync_schedules::table::LocalShard

pub mod device_stages;
pub mod host;
pub mod safetensors_file;
pub mod shm;
pub mod tensor_set;
pub mod view;

pub use host::HostSource;
pub use safetensors_file::SafetensorsSource;
pub use shm::{ShmHeader, ShmSource, ShmWriter};
#[cfg(feature = "cuda")]
pub use tensor_set::DeviceTensor;
pub use tensor_set::{HostMemory, PlanTensors, SourceTensor, TensorSet};

use weightsync_common::DType;
use weightsync_schedules::table::TrainerPlan;

use crate::error::SourceError;
use view::SourceView;

/// One tensor of the source arena as the training layout places it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArenaTensor {
    /// Name in the source (the parameter's name).
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape of this (local) tensor, row-major and dense.
    pub shape: Vec<usize>,
    /// Byte offset in the arena.
    pub offset: u64,
}

impl ArenaTensor {
    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size() as u64
    }
}

/// The names of a rank's shards, given each shard's parameter name in order: the parameter's
/// name, and `name#k` for its k-th shard after the first (k = 1, 2, ...) when a parameter has
/// several shards on the rank.
pub fn shard_names<'a>(params: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut seen = std::collections::BTreeMap::<&str, usize>::new();
    params
        .into_iter()
        .map(|base| {
            let k = seen.entry(base).or_insert(0);
            let name = if *k == 0 {
                base.to_string()
            } else {
                format!("{base}#{k}")
            };
            *k += 1;
            name
        })
        .collect()
}

/// The arena layout a trainer's plan expects: one [`ArenaTensor`] per local shard, named after
/// its parameter ([`shard_names`]).
pub fn arena_tensors(plan: &TrainerPlan) -> Vec<ArenaTensor> {
    let names = shard_names(plan.shards.iter().map(|s| {
        plan.params
            .get(s.param as usize)
            .map_or("<unknown parameter>", |p| &*p.name)
    }));
    plan.shards
        .iter()
        .zip(names)
        .map(|(s, name)| ArenaTensor {
            name,
            dtype: s.dtype,
            shape: s.global.len[..s.global.ndim as usize]
                .iter()
                .map(|&d| d as usize)
                .collect(),
            offset: s.offset,
        })
        .collect()
}

/// The trainer's source arena.
#[derive(Debug)]
#[non_exhaustive]
pub enum SourceMemory {
    /// Memory handed to the worker.
    Host(HostSource),
    /// A shared-memory file attached read-only.
    Shm(ShmSource),
    /// A safetensors file, placed at the arena offsets.
    Safetensors(SafetensorsSource),
    /// GPU memory (feature `cuda`), with the device it is on.
    #[cfg(feature = "cuda")]
    Gpu(crate::gpu::DeviceSource),
}

impl SourceMemory {
    /// Arena length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            SourceMemory::Host(h) => h.as_slice().len() as u64,
            SourceMemory::Shm(s) => s.as_slice().len() as u64,
            SourceMemory::Safetensors(s) => s.as_slice().len() as u64,
            #[cfg(feature = "cuda")]
            SourceMemory::Gpu(g) => g.len() as u64,
        }
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What kind of source this is, for logs and errors.
    pub fn kind(&self) -> &'static str {
        match self {
            SourceMemory::Host(_) => "host memory",
            SourceMemory::Shm(_) => "shared-memory file",
            SourceMemory::Safetensors(_) => "safetensors file",
            #[cfg(feature = "cuda")]
            SourceMemory::Gpu(_) => "gpu memory",
        }
    }

    /// The whole arena as host bytes (`OnDevice` for GPU memory).
    pub fn as_host(&self) -> Result<&[u8], SourceError> {
        match self {
            SourceMemory::Host(h) => Ok(h.as_slice()),
            SourceMemory::Shm(s) => Ok(s.as_slice()),
            SourceMemory::Safetensors(s) => Ok(s.as_slice()),
            #[cfg(feature = "cuda")]
            SourceMemory::Gpu(_) => Err(SourceError::OnDevice),
        }
    }

    /// Bounds-checked host bytes `[offset, offset + len)` of the arena.
    pub fn bytes(&self, offset: u64, len: u64) -> Result<&[u8], SourceError> {
        let arena = self.len();
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= arena)
            .ok_or(SourceError::OutOfBounds { offset, len, arena })?;
        let host = self.as_host()?;
        Ok(&host[offset as usize..end as usize])
    }

    /// Refuses a source shorter than the `need` bytes the table says.
    pub fn check_len(&self, need: u64) -> Result<(), SourceError> {
        if self.len() < need {
            return Err(SourceError::TooShort {
                what: format!("the source arena ({})", self.kind()),
                need,
                have: self.len(),
            });
        }
        Ok(())
    }

    /// Checks the source against a trainer's plan: long enough for its arena.
    pub fn check_plan(&self, plan: &TrainerPlan) -> Result<(), SourceError> {
        self.check_len(plan.source_arena_bytes)?;
        check_layout(&arena_tensors(plan), plan.source_arena_bytes)
    }
}

/// Checks that every tensor lies inside an arena of `arena_len` bytes and names are unique.
pub fn check_layout(tensors: &[ArenaTensor], arena_len: u64) -> Result<(), SourceError> {
    let mut names = std::collections::BTreeSet::new();
    for t in tensors {
        if !names.insert(t.name.as_str()) {
            return Err(SourceError::Layout(format!(
                "tensor {:?} appears twice",
                t.name
            )));
        }
        let end = t.offset.checked_add(t.bytes());
        if end.is_none_or(|e| e > arena_len) {
            return Err(SourceError::Layout(format!(
                "tensor {:?} ({} bytes at offset {}) does not fit the {arena_len}-byte arena",
                t.name,
                t.bytes(),
                t.offset
            )));
        }
    }
    Ok(())
}

/// Lets the trainer pipeline read any source: host bytes, or a GPU arena through its device
/// stages.
impl SourceView for SourceMemory {
    fn len(&self) -> u64 {
        SourceMemory::len(self)
    }
    fn read(&self, f: &mut dyn FnMut(&[u8])) {
        // A GPU source has no host view; the pipeline reads it through its device stages, and
        // an empty slice makes any host read fail its own bounds check with a clear error.
        f(self.as_host().unwrap_or(&[]))
    }

    fn begin_read(&self) -> crate::error::Result<view::ReadStamp> {
        match self {
            SourceMemory::Shm(s) => Ok(s.begin_read()?),
            _ => Ok(view::ReadStamp::default()),
        }
    }

    fn end_read(&self, stamp: view::ReadStamp) -> crate::error::Result<()> {
        match self {
            SourceMemory::Shm(s) => Ok(s.end_read(stamp)?),
            _ => Ok(()),
        }
    }

    fn read_shard(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        f: &mut dyn FnMut(&[u8]) -> crate::error::Result<()>,
    ) -> crate::error::Result<()> {
        // A file shrunk since the sync began is refused by name before its pages are touched.
        if let SourceMemory::Shm(s) = self {
            s.check_intact()?;
        }
        view::read_arena_shard(self, plan, shard, f)
    }

    #[cfg(feature = "cuda")]
    fn device_stages(
        &self,
        plan: &TrainerPlan,
        staging: &weightsync_common::fabric::Region,
    ) -> crate::error::Result<Option<Box<dyn device_stages::DeviceStages>>> {
        match self {
            SourceMemory::Gpu(g) => SourceView::device_stages(g, plan, staging),
            _ => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_bounds_checked() {
        let src = SourceMemory::Host(HostSource::new(vec![1, 2, 3, 4, 5]));
        assert_eq!(src.bytes(1, 3).unwrap(), &[2, 3, 4]);
        assert_eq!(src.bytes(5, 0).unwrap(), &[] as &[u8]);
        let err = src.bytes(3, 3).unwrap_err();
        assert!(err.to_string().contains("offset 3"), "{err}");
        assert!(src.bytes(u64::MAX, 2).is_err());
        let err = src.check_len(6).unwrap_err();
        assert!(err.to_string().contains("needs 6"), "{err}");
        assert!(src.check_len(5).is_ok());
    }

    #[test]
    fn layout_check_names_the_bad_tensor() {
        let t = |name: &str, offset| ArenaTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: vec![2, 4],
            offset,
        };
        assert!(check_layout(&[t("a", 0), t("b", 16)], 32).is_ok());
        let err = check_layout(&[t("a", 0), t("b", 20)], 32).unwrap_err();
        assert!(err.to_string().contains("\"b\""), "{err}");
        let err = check_layout(&[t("a", 0), t("a", 16)], 32).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
    }
}
