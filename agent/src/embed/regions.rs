//! An engine's own tensors as a rollout's destinations: checked against the rank's planned
//! layout (name, dtype, shape: errors name the tensor, the expected and the actual), merged into
//! as few regions as the allocations allow (tensors adjacent in memory share one registration),
//! and placed: each planned tensor's actual region and offset.

use std::collections::BTreeMap;

use weightsync_common::DType;
use weightsync_schedules::table::RolloutPlan;
use weightsync_worker::{HostMemory, Placed, Placement};

use super::{DstTensor, EmbedError};

/// The regions to register and where each planned tensor lies in them.
pub(crate) struct PlacedRegions {
    pub regions: Vec<HostMemory>,
    pub placement: Placement,
}

fn mismatch(worker: &str, tensor: &str, expected: String, actual: String) -> EmbedError {
    EmbedError::LayoutMismatch {
        worker: worker.to_string(),
        tensor: tensor.to_string(),
        expected,
        actual,
    }
}

/// What an engine registers: its tensors in host memory, or (feature `cuda`) in device memory
/// of one GPU.
pub(crate) enum Destinations {
    /// Host tensors: the fabric writes them.
    Host(Vec<DstTensor>),
    /// CUDA tensors: landed in host staging, copied to them (`device_regions`).
    #[cfg(feature = "cuda")]
    Device(Vec<super::DeviceDstTensor>),
}

impl Destinations {
    /// Each tensor's name, shape and dtype, in order.
    pub(crate) fn metas(&self) -> Vec<(String, Vec<u64>, DType)> {
        match self {
            Destinations::Host(ts) => ts
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.dtype))
                .collect(),
            #[cfg(feature = "cuda")]
            Destinations::Device(ts) => ts
                .iter()
                .map(|t| (t.name.clone(), t.shape.clone(), t.dtype))
                .collect(),
        }
    }

    /// The tensors `shape_of` names, each given the shape it says (the others dropped).
    pub(crate) fn keep(self, shape_of: impl Fn(&str) -> Option<Vec<u64>>) -> Destinations {
        match self {
            Destinations::Host(ts) => Destinations::Host(
                ts.into_iter()
                    .filter_map(|t| {
                        Some(DstTensor {
                            shape: shape_of(&t.name)?,
                            ..t
                        })
                    })
                    .collect(),
            ),
            #[cfg(feature = "cuda")]
            Destinations::Device(ts) => Destinations::Device(
                ts.into_iter()
                    .filter_map(|t| {
                        Some(super::DeviceDstTensor {
                            shape: shape_of(&t.name)?,
                            ..t
                        })
                    })
                    .collect(),
            ),
        }
    }
}

/// Checks `tensors` against `planned` and places them (see the module docs).
pub(crate) fn place(
    worker: &str,
    planned: &RolloutPlan,
    tensors: Vec<DstTensor>,
) -> Result<PlacedRegions, EmbedError> {
    let found = check(
        worker,
        planned,
        tensors
            .into_iter()
            .map(|t| (t.name, t.dtype, t.shape, t.memory))
            .collect(),
        HostMemory::len,
    )?;
    let found = found
        .into_iter()
        .map(|(i, m)| (m.as_ptr() as usize, i, m))
        .collect();
    merge(worker, planned, found)
}

/// Checks `tensors` (name, dtype, shape, memory) against `planned`: every planned tensor once,
/// nothing else, each of the planned dtype, shape and bytes (`len` of its memory). Returns each
/// planned tensor's index with its memory, in planned order.
pub(crate) fn check<M>(
    worker: &str,
    planned: &RolloutPlan,
    tensors: Vec<(String, DType, Vec<u64>, M)>,
    len: impl Fn(&M) -> usize,
) -> Result<Vec<(usize, M)>, EmbedError> {
    let mut by_name: BTreeMap<String, (DType, Vec<u64>, M)> = BTreeMap::new();
    for (name, dtype, shape, memory) in tensors {
        if by_name
            .insert(name.clone(), (dtype, shape, memory))
            .is_some()
        {
            return Err(EmbedError::Registration {
                worker: worker.to_string(),
                tensor: Some(name),
                reason: "registered twice".into(),
            });
        }
    }
    let mut found = Vec::with_capacity(planned.tensors.len());
    for (i, p) in planned.tensors.iter().enumerate() {
        let Some((dtype, shape, memory)) = by_name.remove(&p.name) else {
            return Err(EmbedError::Registration {
                worker: worker.to_string(),
                tensor: Some(p.name.clone()),
                reason: format!(
                    "the planned layout has {} {} {}, which was not registered",
                    p.name, p.dtype, p.shape
                ),
            });
        };
        let want: Vec<u64> = p.shape.dims().iter().map(|&d| d as u64).collect();
        if dtype != p.dtype {
            let (e, a) = (format!("dtype {}", p.dtype), format!("dtype {dtype}"));
            return Err(mismatch(worker, &p.name, e, a));
        }
        if shape != want {
            let (e, a) = (format!("shape {want:?}"), format!("shape {shape:?}"));
            return Err(mismatch(worker, &p.name, e, a));
        }
        if len(&memory) as u64 != p.len {
            let (e, a) = (
                format!("{} bytes", p.len),
                format!("{} bytes", len(&memory)),
            );
            return Err(mismatch(worker, &p.name, e, a));
        }
        found.push((i, memory));
    }
    if let Some(extra) = by_name.keys().next() {
        return Err(EmbedError::Registration {
            worker: worker.to_string(),
            tensor: Some(extra.clone()),
            reason: format!(
                "{extra} is not a tensor of this rank's planned layout ({} tensors)",
                planned.tensors.len()
            ),
        });
    }
    Ok(found)
}

/// Merges adjacent tensors into regions and places every planned tensor.
fn merge(
    worker: &str,
    planned: &RolloutPlan,
    mut found: Vec<(usize, usize, HostMemory)>,
) -> Result<PlacedRegions, EmbedError> {
    found.sort_by_key(|f| f.0);
    for w in found.windows(2) {
        if w[0].0 + w[0].2.len() > w[1].0 {
            let (a, b) = (&planned.tensors[w[0].1].name, &planned.tensors[w[1].1].name);
            return Err(EmbedError::Registration {
                worker: worker.to_string(),
                tensor: Some(b.clone()),
                reason: format!("{b} overlaps {a} in memory"),
            });
        }
    }
    let mut regions = Vec::new();
    let mut placed = Vec::with_capacity(found.len());
    let mut group: Vec<HostMemory> = Vec::new();
    let mut group_start = 0usize;
    let mut group_end = 0usize;
    for (addr, i, mem) in found {
        if group.is_empty() || addr != group_end {
            flush(&mut regions, &mut group, worker)?;
            group_start = addr;
        }
        group_end = addr + mem.len();
        let p = &planned.tensors[i];
        placed.push(Placed {
            mr: p.mr,
            offset: p.offset,
            len: p.len,
            region: regions.len() as u16,
            region_offset: (addr - group_start) as u64,
        });
        group.push(mem);
    }
    flush(&mut regions, &mut group, worker)?;
    Ok(PlacedRegions {
        regions,
        placement: Placement::new(placed),
    })
}

/// Registers-to-be: one region of the adjacent tensors gathered so far.
fn flush(
    regions: &mut Vec<HostMemory>,
    group: &mut Vec<HostMemory>,
    worker: &str,
) -> Result<(), EmbedError> {
    if group.is_empty() {
        return Ok(());
    }
    let joined = HostMemory::join(std::mem::take(group)).map_err(|_| EmbedError::Registration {
        worker: worker.to_string(),
        tensor: None,
        reason: "adjacent tensors could not be joined into one region".into(),
    })?;
    if regions.len() >= u16::MAX as usize {
        return Err(EmbedError::Registration {
            worker: worker.to_string(),
            tensor: None,
            reason: "more than 65535 separate allocations".into(),
        });
    }
    regions.push(joined);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use weightsync_schedules::table::{DstTensor as Planned, Shape};

    use super::*;

    /// Three bf16 [2, 4] tensors planned back to back in MR 0.
    fn planned() -> RolloutPlan {
        let t = |name: &str, offset| Planned {
            name: name.into(),
            shape: Shape::new(&[2, 4]),
            dtype: DType::BF16,
            mr: 0,
            offset,
            len: 16,
        };
        RolloutPlan {
            rank: 0,
            engine: 0,
            local_rank: 0,
            mr_bytes: vec![48],
            tensors: vec![t("a", 0), t("b", 16), t("c", 32)],
            expect: Vec::new(),
        }
    }

    fn tensor(name: &str, bytes: &Arc<Vec<u8>>, at: usize, shape: &[u64]) -> DstTensor {
        let len = shape.iter().product::<u64>() as usize * 2;
        // SAFETY: `at..at + len` lies in the vector, which the owner keeps alive; nothing reads
        // or writes it in this test.
        let memory = unsafe {
            HostMemory::from_raw(
                bytes[at..].as_ptr() as *mut u8,
                len,
                Box::new(bytes.clone()),
            )
        };
        DstTensor {
            name: name.into(),
            dtype: DType::BF16,
            shape: shape.to_vec(),
            memory,
        }
    }

    #[test]
    fn adjacent_tensors_share_a_region_and_each_is_placed_where_it_lies() {
        let one = Arc::new(vec![0u8; 48]);
        let ts = vec![
            tensor("a", &one, 32, &[2, 4]),
            tensor("b", &one, 0, &[2, 4]),
            tensor("c", &one, 16, &[2, 4]),
        ];
        let p = place("rollout-0", &planned(), ts).unwrap();
        assert_eq!(p.regions.len(), 1);
        assert_eq!(p.regions[0].len(), 48);
        assert_eq!(p.placement.relocate(0, 0, 16), Some((0, 32)), "a");
        assert_eq!(p.placement.relocate(0, 20, 4), Some((0, 4)), "inside b");
        assert_eq!(p.placement.relocate(0, 32, 16), Some((0, 16)), "c");
        let apart: Vec<_> = (0..3).map(|_| Arc::new(vec![0u8; 64])).collect();
        let ts = ["a", "b", "c"]
            .iter()
            .zip(&apart)
            .map(|(n, v)| tensor(n, v, 0, &[2, 4]))
            .collect();
        assert_eq!(place("rollout-0", &planned(), ts).unwrap().regions.len(), 3);
    }

    #[test]
    fn missing_extra_and_misshapen_tensors_are_named() {
        let v = Arc::new(vec![0u8; 128]);
        let err = |ts: Vec<DstTensor>| place("rollout-0", &planned(), ts).err().unwrap();
        let e = err(vec![
            tensor("a", &v, 0, &[2, 4]),
            tensor("b", &v, 16, &[2, 4]),
        ]);
        assert!(e.to_string().contains("tensor c"), "{e}");
        let e = err(vec![
            tensor("a", &v, 0, &[2, 4]),
            tensor("b", &v, 16, &[4, 2]),
            tensor("c", &v, 32, &[2, 4]),
        ]);
        assert!(
            matches!(&e, EmbedError::LayoutMismatch { tensor, expected, .. }
                if tensor == "b" && expected.contains("[2, 4]")),
            "{e}"
        );
        let e = err(vec![
            tensor("a", &v, 0, &[2, 4]),
            tensor("b", &v, 16, &[2, 4]),
            tensor("c", &v, 32, &[2, 4]),
            tensor("d", &v, 48, &[2, 4]),
        ]);
        assert!(e.to_string().contains("d is not a tensor"), "{e}");
        let e = err(vec![
            tensor("a", &v, 0, &[2, 4]),
            tensor("b", &v, 8, &[2, 4]),
            tensor("c", &v, 32, &[2, 4]),
        ]);
        assert!(e.to_string().contains("overlaps"), "{e}");
    }
}
