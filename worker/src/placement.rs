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

#[cfg(test)]
mod tests {
    use super::*;

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
