//! The routing table as workers receive it: bincode from the controller (the whole table, or
//! one trainer's compact slice). Decoding must never panic or allocate without bound, a table
//! that decodes must re-encode to bytes that decode to the same table, and expanding a slice
//! (packed progressions, patterns, copies) must never panic and stay within its limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_schedules::{ExpandLimits, RoutingTable, TrainerSlice};

/// Small limits: a hostile slice may claim billions of writes; expansion must refuse them
/// before allocating.
const LIMITS: ExpandLimits = ExpandLimits {
    tasks: 1 << 14,
    writes: 1 << 16,
};

fn expand(slice: &TrainerSlice) {
    if let Ok(plan) = slice.expand_within(&LIMITS) {
        assert!(
            plan.copies.is_empty(),
            "an expanded plan has no copies left"
        );
        assert!(plan.tasks.len() as u64 <= LIMITS.tasks);
        assert!(plan.writes.len() as u64 <= LIMITS.writes);
        let rollouts = slice.rollout_ranks;
        for w in &plan.writes {
            if let weightsync_schedules::table::WriteTarget::Rollout(r) = w.dst {
                assert!(r < rollouts, "a write beyond the table's rollout ranks");
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // The bytes as one trainer's slice (what the controller ships to a trainer).
    if let Ok(slice) = TrainerSlice::from_bincode(data) {
        expand(&slice);
    }
    let Ok(table) = RoutingTable::from_bincode(data) else {
        return;
    };
    let again =
        RoutingTable::from_bincode(&table.to_bincode()).expect("re-decoding an encoded table");
    assert_eq!(again, table, "bincode round trip changed the table");
    for rank in 0..table.trainers.len().min(64) as u32 {
        if let Ok(slice) = table.slice(rank) {
            expand(&slice);
        }
    }
    let _ = table.slice(u32::MAX);
});
