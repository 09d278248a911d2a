//! Where an engine's own tensors are: the map from the planned layout to the regions an engine
//! registered.
//!
//! The planner lays out each inference rank's tensors in its own coordinates (memory region,
//! offset), as if the rollout allocated them. An engine that lands weights straight into its
//! parameters has them wherever its allocator put them; it registers those allocations (merged
//! where adjacent) and sends a [`Placement`]: for each planned tensor, its planned
//! `(mr, offset, len)` and its actual `(region, offset)`. A trainer relocates every write with it
//! ([`Placement::relocate`]); a write must lie inside one planned tensor. Checksums are taken in
//! actual coordinates, so the rollout verifies against its actual regions. A rollout that
//! allocated its tensors as planned has no placement (the identity).
//!
//! An engine's tensors may be device memory (CUDA). Where the fabric cannot write device memory
//! and verify it (TCP; verbs without GPUDirect registration), the regions the fabric writes are
//! host staging, one per merged device range, copied to the device once a version landed:
//! [`landing_route`] decides the route, [`plan_device_regions`] merges the device tensors into
//! those ranges and says where each tensor lies in its staging (the same `(region, offset)` the
//! placement names), so each landed region is one host-to-device copy. Both are pure: the CUDA
//! side (`gpu::StagedDeviceRegions`) only executes them.

use serde::{Deserialize, Serialize};

/// One planned tensor and where it actually lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    /// Planned memory region.
    pub mr: u16,
    /// Planned byte offset in it.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
    /// Actual region (index in the rollout's registered regions).
    pub region: u16,
    /// Actual byte offset in that region.
    pub region_offset: u64,
}

/// Every planned tensor of one rollout and where it lies (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Sorted by `(mr, offset)`; tensors do not overlap.
    pub tensors: Vec<Placed>,
}

impl Placement {
    /// A placement of `tensors` (sorted here).
    pub fn new(mut tensors: Vec<Placed>) -> Placement {
        tensors.sort_by_key(|t| (t.mr, t.offset));
        Placement { tensors }
    }

    /// The actual `(region, offset)` of planned bytes `[offset, offset + len)` of `mr`, when they
    /// lie inside one planned tensor.
    pub fn relocate(&self, mr: u16, offset: u64, len: u64) -> Option<(u16, u64)> {
        let i = self
            .tensors
            .partition_point(|t| (t.mr, t.offset) <= (mr, offset))
            .checked_sub(1)?;
        let t = &self.tensors[i];
        let inside = t.mr == mr && offset >= t.offset && offset + len <= t.offset + t.len;
        inside.then(|| (t.region, t.region_offset + (offset - t.offset)))
    }
}

/// Where an engine's destination memory is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestinationMemory {
    /// Host memory: the fabric writes it.
    Host,
    /// Device memory of CUDA GPU `ordinal`.
    Device {
        /// The GPU.
        ordinal: usize,
    },
}

/// What the fabric (and the receiver over it) can do with device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSupport {
    /// The fabric registers device memory for one-sided writes (verbs with dma-buf or
    /// nvidia-peermem).
    pub registers_device_memory: bool,
    /// The receiver verifies landed bytes where they lie in device memory (a device-side
    /// checksum); without it the bytes must land where the host can read them.
    pub verifies_device_bytes: bool,
}

/// How a sync's bytes reach an engine's destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LandingRoute {
    /// The fabric writes the destination (host memory).
    Direct,
    /// The fabric writes device memory registered with it.
    DirectToDevice,
    /// The fabric writes page-locked host staging; once a version landed, each staging region is
    /// copied host to device (one copy per region, synchronised before the version counts).
    StagedToDevice {
        /// Why not straight into the device memory.
        why: &'static str,
    },
}

/// The route for `memory` over a fabric that can do `support` (see the module docs).
pub fn landing_route(memory: DestinationMemory, support: DeviceSupport) -> LandingRoute {
    match memory {
        DestinationMemory::Host => LandingRoute::Direct,
        DestinationMemory::Device { .. } if !support.registers_device_memory => {
            LandingRoute::StagedToDevice {
                why: "the fabric cannot register device memory",
            }
        }
        DestinationMemory::Device { .. } if !support.verifies_device_bytes => {
            LandingRoute::StagedToDevice {
                why: "the receiver verifies landed bytes in host memory only",
            }
        }
        DestinationMemory::Device { .. } => LandingRoute::DirectToDevice,
    }
}

/// A device range that merged tensors occupy: one staging region and one copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceSpan {
    /// Device address of the first byte.
    pub addr: u64,
    /// Bytes.
    pub len: u64,
}

/// Device tensors merged into ranges (see [`plan_device_regions`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceRegions {
    /// The merged ranges, by address; staging region `i` stands in for `spans[i]`.
    pub spans: Vec<DeviceSpan>,
    /// For each input tensor, in input order: `(region, offset in it)`.
    pub at: Vec<(u16, u64)>,
    /// For each span, the input tensors it holds (by address).
    pub members: Vec<Vec<usize>>,
}

/// Why device tensors cannot be merged into regions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DevicePlanError {
    /// An empty tensor (it has no part in the layout).
    #[error("device tensor {0} is empty")]
    Empty(usize),
    /// Two tensors share bytes.
    #[error("device tensor {later} overlaps device tensor {earlier} in memory")]
    Overlap {
        /// The one at the lower address.
        earlier: usize,
        /// The other.
        later: usize,
    },
    /// The address range wraps.
    #[error("device tensor {0} runs past the end of the address space")]
    Overflow(usize),
    /// More ranges than a placement can name.
    #[error("more than 65535 separate device allocations")]
    TooMany,
}

/// Merges device tensors `(address, bytes)` that lie back to back into ranges, and places each
/// tensor in its range (the module docs say why).
pub fn plan_device_regions(tensors: &[(u64, u64)]) -> Result<DeviceRegions, DevicePlanError> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].0);
    let mut spans: Vec<DeviceSpan> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut at = vec![(0u16, 0u64); tensors.len()];
    let mut prev: Option<(usize, u64)> = None; // (tensor, end)
    for i in order {
        let (addr, len) = tensors[i];
        if len == 0 {
            return Err(DevicePlanError::Empty(i));
        }
        let end = addr.checked_add(len).ok_or(DevicePlanError::Overflow(i))?;
        match prev {
            Some((p, pend)) if addr < pend => {
                return Err(DevicePlanError::Overlap {
                    earlier: p,
                    later: i,
                });
            }
            Some((_, pend)) if addr == pend => {
                let region = (spans.len() - 1) as u16;
                let span = spans.last_mut().expect("a previous tensor opened a span");
                at[i] = (region, addr - span.addr);
                span.len += len;
                members.last_mut().expect("with its members").push(i);
            }
            _ => {
                if spans.len() >= u16::MAX as usize {
                    return Err(DevicePlanError::TooMany);
                }
                at[i] = (spans.len() as u16, 0);
                spans.push(DeviceSpan { addr, len });
                members.push(vec![i]);
            }
        }
        prev = Some((i, end));
    }
    Ok(DeviceRegions { spans, at, members })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_destinations_are_staged_unless_the_fabric_writes_and_verifies_device_memory() {
        let dev = DestinationMemory::Device { ordinal: 0 };
        assert_eq!(
            landing_route(DestinationMemory::Host, DeviceSupport::default()),
            LandingRoute::Direct
        );
        assert!(matches!(
            landing_route(dev, DeviceSupport::default()),
            LandingRoute::StagedToDevice { why } if why.contains("cannot register")
        ));
        let registers = DeviceSupport {
            registers_device_memory: true,
            verifies_device_bytes: false,
        };
        assert!(matches!(
            landing_route(dev, registers),
            LandingRoute::StagedToDevice { why } if why.contains("verifies")
        ));
        let both = DeviceSupport {
            registers_device_memory: true,
            verifies_device_bytes: true,
        };
        assert_eq!(landing_route(dev, both), LandingRoute::DirectToDevice);
    }

    #[test]
    fn adjacent_device_tensors_merge_into_one_copy_each_range() {
        // Tensor 0 and 2 back to back at 0x1000 (listed out of order), 1 in another allocation,
        // 3 right after 1.
        let t = [
            (0x1100, 0x80),
            (0x9000, 0x40),
            (0x1000, 0x100),
            (0x9040, 0x10),
        ];
        let p = plan_device_regions(&t).unwrap();
        assert_eq!(
            p.spans,
            vec![
                DeviceSpan {
                    addr: 0x1000,
                    len: 0x180
                },
                DeviceSpan {
                    addr: 0x9000,
                    len: 0x50
                },
            ]
        );
        assert_eq!(p.at, vec![(0, 0x100), (1, 0), (0, 0), (1, 0x40)]);
        assert_eq!(p.members, vec![vec![2, 0], vec![1, 3]]);
        // Every tensor's bytes, at its staging offset, map back to its own device address.
        for (i, &(addr, len)) in t.iter().enumerate() {
            let (r, off) = p.at[i];
            let span = p.spans[r as usize];
            assert_eq!(span.addr + off, addr);
            assert!(off + len <= span.len);
        }
        // One byte apart: two ranges, two copies.
        let p = plan_device_regions(&[(0x1000, 0x10), (0x1011, 0x10)]).unwrap();
        assert_eq!(p.spans.len(), 2);
    }

    #[test]
    fn overlapping_empty_and_wrapping_device_tensors_are_named() {
        assert_eq!(
            plan_device_regions(&[(0x1000, 0x100), (0x10ff, 0x10)]),
            Err(DevicePlanError::Overlap {
                earlier: 0,
                later: 1
            })
        );
        assert_eq!(
            plan_device_regions(&[(0x1000, 0x10), (0x2000, 0)]),
            Err(DevicePlanError::Empty(1))
        );
        assert_eq!(
            plan_device_regions(&[(u64::MAX - 4, 0x10)]),
            Err(DevicePlanError::Overflow(0))
        );
        assert_eq!(plan_device_regions(&[]).unwrap().spans, vec![]);
    }

    #[test]
    fn writes_relocate_inside_one_tensor_only() {
        let p = Placement::new(vec![
            Placed {
                mr: 0,
                offset: 256,
                len: 100,
                region: 1,
                region_offset: 0,
            },
            Placed {
                mr: 0,
                offset: 0,
                len: 200,
                region: 0,
                region_offset: 64,
            },
        ]);
        assert_eq!(p.relocate(0, 10, 50), Some((0, 74)));
        assert_eq!(p.relocate(0, 256, 100), Some((1, 0)));
        assert_eq!(p.relocate(0, 300, 60), None, "past its tensor");
        assert_eq!(p.relocate(0, 150, 120), None, "across two tensors");
        assert_eq!(p.relocate(1, 0, 1), None, "no such region");
    }
}
