//! Fuzzes the TCP receiver's frame state machine (`fabric::tcp::replay`): any byte stream on an
//! authenticated lane, split into receives of any size, against a receiver with one writable
//! and one read-only region and any write window. It must never panic or touch memory outside
//! what a frame may write (the copies into registered memory are the `unsafe` ones), never
//! change the read-only region, send only whole, decodable completions, and never count more
//! frames landed than it read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use weightsync_common::fabric::tcp::frame::HEADER_LEN;
use weightsync_common::fabric::tcp::replay::{replay_frames, FILL};

fuzz_target!(|data: &[u8]| {
    let r = replay_frames(data);
    assert!(
        r.read_only.iter().all(|&b| b == FILL),
        "a read-only region changed"
    );
    let frames = (data.len().saturating_sub(2) / HEADER_LEN) as u64;
    assert!(r.stats.frames_received + r.stats.refused <= frames);
    assert!(r.stats.outside_window <= r.stats.refused);
    let answered: u64 = r.completions.iter().map(|c| u64::from(c.frames)).sum();
    assert!(answered <= r.stats.frames_received + r.stats.refused);
});
