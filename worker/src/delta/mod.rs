//! Delta sync: moving only the elements that changed since the version an engine holds.
//!
//! At RL learning rates most elements of a step's prepared bytes (bf16, fp8) are byte-identical
//! to the previous step's. A trainer that keeps the prepared bytes of the last version it wrote
//! (its *bases*, `trainer::delta`) encodes each run it writes to an engine against them
//! ([`codec`]) and writes the encoding one-sided into that engine's *inbox*, a registered
//! region beside its weights; the receiver applies every encoding into its destination once
//! every write landed and before it verifies (`rollout::inbox`). A run whose encoding is larger
//! than its threshold, or whose engine does not hold the base, goes dense as before.
//!
//! Where an encoding goes in the inbox follows from the destination address alone
//! ([`InboxMap`]): the inbox is a scaled-down shadow of the engine's regions laid end to end, so
//! a run of `len` bytes owns `len * inbox / total` bytes of it, no two runs share a byte, and no
//! one has to allocate anything per sync. What the receiver applies is told to it per sync
//! ([`DeltaRecord`](weightsync_common::protocol::DeltaRecord), beside the checksums), so a stale
//! encoding left in the inbox by an earlier sync is never read.

pub mod codec;
mod lanes;

use weightsync_schedules::table::Transform;

/// Bytes per element of the runs of a task with `transform`: the output dtype's size for copies
/// and casts; 1 for fp8 (its values are bytes; its few f32 scales rarely change, and a byte
/// grain costs them nothing).
pub(crate) fn element_size(transform: &Transform) -> usize {
    match transform {
        Transform::Fp8Block { .. } => 1,
        t => t.output_dtype().size().clamp(1, 8),
    }
}

/// Where each destination run's encoding lies in an engine's inbox (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxMap {
    /// Where each region starts when the regions are laid end to end.
    starts: Vec<u64>,
    /// Bytes of every region together.
    total: u64,
    /// Bytes of the inbox.
    inbox: u64,
}

impl InboxMap {
    /// The map of an engine whose regions have `region_lens` bytes and whose inbox has
    /// `inbox_len`.
    pub fn new(region_lens: &[u64], inbox_len: u64) -> InboxMap {
        let mut starts = Vec::with_capacity(region_lens.len());
        let mut total = 0u64;
        for &l in region_lens {
            starts.push(total);
            total += l;
        }
        InboxMap {
            starts,
            total,
            inbox: inbox_len,
        }
    }

    fn shadow(&self, at: u64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        (u128::from(at) * u128::from(self.inbox) / u128::from(self.total)) as u64
    }

    /// The inbox bytes `(offset, capacity)` owned by `len` bytes at `offset` of region `mr`
    /// (`None`: no such region, or the run lies outside it).
    pub fn slot(&self, mr: u16, offset: u64, len: u64) -> Option<(u64, u64)> {
        let start = *self.starts.get(mr as usize)?;
        let region_end = self
            .starts
            .get(mr as usize + 1)
            .copied()
            .unwrap_or(self.total);
        let a = start.checked_add(offset)?;
        let b = a.checked_add(len)?;
        if b > region_end {
            return None;
        }
        let (sa, sb) = (self.shadow(a), self.shadow(b));
        Some((sa, sb - sa))
    }
}

/// Inbox bytes for an engine whose regions hold `total` bytes, at `fraction` of them.
pub fn inbox_bytes(total: u64, fraction: f64) -> u64 {
    ((total as f64) * fraction.clamp(0.0, 1.0)).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_own_disjoint_slots_in_proportion() {
        let map = InboxMap::new(&[1000, 3000], 1000);
        // Adjacent runs of one region, and the first run of the next, never overlap.
        let a = map.slot(0, 0, 400).unwrap();
        let b = map.slot(0, 400, 600).unwrap();
        let c = map.slot(1, 0, 3000).unwrap();
        assert_eq!(a, (0, 100));
        assert_eq!(b, (100, 150));
        assert_eq!(c, (250, 750));
        assert_eq!(map.slot(1, 2999, 2), None);
        assert_eq!(map.slot(2, 0, 1), None);
    }
}
