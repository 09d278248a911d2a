//! Drives the receiver's frame state machine from bytes, without sockets: what the
//! `receiver_frames` fuzz target (`common/fuzz`) and its seed replay test
//! (`common/tests/receiver_seeds.rs`) call.
//!
//! The state machine is the one every authenticated inbound lane runs (`receiver::run_lane`):
//! header decoding, the registration and write-window checks, payloads copied into registered
//! memory (the `unsafe` copies of `inbound`), refused payloads drained, split writes assembled,
//! completions coalesced. Only the socket is replaced ([`ReplayIo`](super::lane_io)), and the
//! registrations get fixed rkeys and addresses so that a fuzzer can aim at them.
//!
//! Input: byte 0 picks how many bytes each receive call hands out (1 to 256: frames split
//! anywhere), byte 1 the read-ahead (bit 0: a pulling lane's, otherwise one header) and the
//! write window (bits 1-2: always open, closed, armed for epoch [`ARMED_EPOCH`]); the rest is
//! the lane's byte stream. The lane has not agreed to pulls, so a PULL frame ends it as it
//! would on a socket.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};

use parking_lot::Mutex;

use super::addresses::LocalAddress;
use super::frame::{COMPLETION_LEN, Completion, HEADER_LEN};
use super::inbound::AHEAD;
use super::lane_io::ReplayIo;
use super::registry::{RegistrationTable, WriteWindow};
use super::{Counters, Shared, TcpStats};
use crate::fabric::config::FabricConfig;
use crate::fabric::descriptor::Access;
use crate::fabric::imm_counter::ImmCounter;
use crate::fabric::memory::Memory;
use crate::fabric::region::RegisteredMemory;

/// rkey of the writable region.
pub const WRITABLE_RKEY: u64 = 1;
/// Address of the writable region's first byte.
pub const WRITABLE_BASE: u64 = 0x1_0000;
/// Bytes of the writable region.
pub const WRITABLE_LEN: usize = 4096;
/// rkey of a region registered without remote write (a writer's source).
pub const READ_ONLY_RKEY: u64 = 2;
/// Address of the read-only region's first byte.
pub const READ_ONLY_BASE: u64 = 0x2_0000;
/// Bytes of the read-only region.
pub const READ_ONLY_LEN: usize = 256;
/// The epoch the window is armed for when byte 1 asks for an armed window.
pub const ARMED_EPOCH: u64 = 7;
/// What the writable region holds before any frame, and the read-only one always.
pub const FILL: u8 = 0xa5;

/// What one replay did.
#[derive(Debug, Clone)]
pub struct Replay {
    /// How the lane ended: `Ok` on a clean close between frames, else the error that dropped it.
    pub ended: Result<(), String>,
    /// The receiver's counters.
    pub stats: TcpStats,
    /// The completions it sent, decoded (an undecodable one is a bug: it panics).
    pub completions: Vec<Completion>,
    /// The writable region's bytes afterwards.
    pub writable: Vec<u8>,
    /// The read-only region's bytes afterwards (always all [`FILL`]).
    pub read_only: Vec<u8>,
    /// The receiver's immediate counter (what arrived, what was torn).
    pub imm: ImmCounter,
}

/// Replays `input` (see the module docs) against a fresh receiver.
pub fn replay_frames(input: &[u8]) -> Replay {
    let (chunk, mode, stream) = match input {
        [c, m, rest @ ..] => (usize::from(*c) + 1, *m, rest),
        _ => (1, 0, &[][..]),
    };
    let read_ahead = if mode & 1 != 0 { AHEAD } else { HEADER_LEN };
    let window = match (mode >> 1) & 3 {
        1 => WriteWindow::Closed,
        2 | 3 => WriteWindow::Armed { epoch: ARMED_EPOCH },
        _ => WriteWindow::Always,
    };
    let region = |len: usize| {
        let memory = RegisteredMemory::new(Memory::alloc(len).expect("a small allocation"));
        fill(&memory, FILL);
        memory
    };
    let (writable, read_only) = (region(WRITABLE_LEN), region(READ_ONLY_LEN));
    let table = RegistrationTable::default();
    table.insert_fixed(
        WRITABLE_RKEY,
        WRITABLE_BASE,
        writable.clone(),
        Access::RECEIVE,
    );
    table.insert_fixed(
        READ_ONLY_RKEY,
        READ_ONLY_BASE,
        read_only.clone(),
        Access::SOURCE,
    );
    table.set_window(window);
    let shared = Shared {
        config: FabricConfig::loopback("replay", 1),
        key: [0; 32],
        instance: 0,
        table: Arc::new(table),
        imm: ImmCounter::new(),
        stop: AtomicBool::new(false),
        assembly: Mutex::default(),
        stats: Counters::default(),
        local: vec![LocalAddress::new(([127, 0, 0, 1], 0).into())],
        expected_peers: std::sync::atomic::AtomicUsize::new(0),
        send_epoch: AtomicU64::new(0),
    };
    let io = ReplayIo::new(stream, chunk);
    let ended =
        super::receiver::run_lane(&io, None, 1, 0, &shared, read_ahead).map_err(|e| e.to_string());
    let sent = io.sent.lock().clone();
    assert_eq!(sent.len() % COMPLETION_LEN, 0, "a torn completion was sent");
    let completions = sent
        .chunks_exact(COMPLETION_LEN)
        .map(|c| {
            Completion::decode(c.try_into().expect("COMPLETION_LEN bytes"))
                .expect("the receiver sent an undecodable completion")
        })
        .collect();
    let stats = super::stats_of(&shared.stats);
    Replay {
        ended,
        stats,
        completions,
        writable: contents(&writable),
        read_only: contents(&read_only),
        imm: shared.imm.clone(),
    }
}

fn fill(memory: &RegisteredMemory, byte: u8) {
    let live = memory.live().expect("a fresh region is live");
    // SAFETY: the region is live (guard held) and `len` bytes long; nothing else refers to
    // its memory yet.
    unsafe { std::ptr::write_bytes(live.as_ptr(), byte, live.len()) };
}

fn contents(memory: &RegisteredMemory) -> Vec<u8> {
    let live = memory.live().expect("nothing revokes a replay's regions");
    // SAFETY: the region is live and `len` bytes long, and the lane that wrote it has ended,
    // so nothing writes it during the copy.
    unsafe { std::slice::from_raw_parts(live.as_ptr(), live.len()) }.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::tcp::frame::FrameHeader;

    fn write(addr: u64, payload: &[u8], epoch: u64, signalled: bool) -> Vec<u8> {
        let mut b = FrameHeader {
            signalled,
            imm: Some(9),
            part: None,
            rkey: WRITABLE_RKEY,
            addr,
            len: payload.len() as u64,
            source: None,
            stride: None,
            epoch,
        }
        .encode()
        .to_vec();
        b.extend_from_slice(payload);
        b
    }

    #[test]
    fn a_replayed_lane_lands_refuses_and_answers_like_a_socket_one() {
        for chunk in [0u8, 6, 255] {
            for ahead in [0u8, 1] {
                // Armed for ARMED_EPOCH: the first frame lands, the stale one is refused.
                let mut input = vec![chunk, ahead | (2 << 1)];
                input.extend(write(WRITABLE_BASE + 8, &[1, 2, 3, 4], ARMED_EPOCH, false));
                input.extend(write(WRITABLE_BASE, &[9; 16], ARMED_EPOCH - 1, true));
                let r = replay_frames(&input);
                assert_eq!(r.ended, Ok(()), "chunk {chunk}");
                assert_eq!(&r.writable[8..12], &[1, 2, 3, 4]);
                assert!(
                    r.writable[..8].iter().all(|&b| b == FILL),
                    "stale bytes landed"
                );
                assert_eq!(r.stats.outside_window, 1);
                assert_eq!(r.completions.len(), 1);
                assert_eq!(r.completions[0].frames, 2);
                assert_eq!(
                    r.completions[0].error.map(|e| e.0),
                    Some(crate::fabric::RemoteAccessKind::WrongEpoch)
                );
                assert_eq!(r.imm.unclaimed(9), 1, "only the landed write counted");
            }
        }
    }
}
