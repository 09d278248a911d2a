//! The routing table as workers receive it: bincode from the controller (whole, or one trainer's
//! slice). Decoding must never panic or allocate without bound, and a table that decodes must
//! re-encode to bytes that decode to the same table.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_schedules::RoutingTable;

fuzz_target!(|data: &[u8]| {
    let Ok(table) = RoutingTable::from_bincode(data) else {
        return;
    };
    let again =
        RoutingTable::from_bincode(&table.to_bincode()).expect("re-decoding an encoded table");
    assert_eq!(again, table, "bincode round trip changed the table");
    for rank in 0..table.trainers.len().min(64) as u32 {
        let _ = table.slice(rank);
    }
    let _ = table.slice(u32::MAX);
});
