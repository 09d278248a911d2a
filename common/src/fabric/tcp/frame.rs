//! Wire format of the TCP backend's lanes: write frames one way, completions the other.
//!
//! A write frame is a fixed 64-byte little-endian header, followed by `len` payload bytes for a
//! WRITE and by nothing for a PULL (the receiver copies the bytes out of the writer's memory
//! itself, see `same_host`):
//!
//! | bytes | field    | meaning                                                        |
//! |-------|----------|----------------------------------------------------------------|
//! | 0     | op       | `1` = WRITE (payload follows), `2` = PULL (no payload)         |
//! | 1     | flags    | bit 0 signalled, bit 1 has immediate, bit 2 one part of a split write |
//! | 2..4  | parts    | number of parts of a split write (0 unless bit 2)              |
//! | 4..8  | imm      | immediate (0 unless bit 1)                                     |
//! | 8..16 | rkey     | remote key                                                     |
//! | 16..24| addr     | remote address of the first payload byte                       |
//! | 24..32| len      | payload length                                                 |
//! | 32..40| write_id | id shared by the parts of one split write (0 otherwise)        |
//! | 40..48| source   | PULL: the address of the first byte in the writer's memory; WRITE: 0 |
//! | 48..52| run      | PULL from a strided source: bytes per run; otherwise 0         |
//! | 52..56| head     | PULL from a strided source: the first byte's place in its run; otherwise 0 |
//! | 56..64| stride   | PULL from a strided source: bytes from run to run; otherwise 0 |
//!
//! A PULL is accepted only on a lane whose handshake agreed on same-host pulls. A PULL whose
//! source is strided ([`Stride`]) names its layout so that the receiver gathers the runs itself;
//! a WRITE's payload is already gathered by the writer's `sendmsg`, so it never carries one.
//!
//! Only *signalled* frames are answered, with a 24-byte completion that covers every frame since
//! the previous signalled one on the same lane (selective signalling, as on an RDMA send queue):
//!
//! | bytes | field  | meaning                                                  |
//! |-------|--------|----------------------------------------------------------|
//! | 0     | status | `0` = all landed, `1` = a remote access error            |
//! | 1     | kind   | the [`RemoteAccessKind`] code when status is 1, else 0   |
//! | 2..4  | zero   |                                                          |
//! | 4..8  | frames | frames covered (a consistency check)                     |
//! | 8..16 | rkey   | rkey of the first refused frame (0 when status is 0)     |
//! | 16..24| addr   | address of the first refused frame                       |
//!
//! The decoders are total: any 64 or 24 bytes give either a valid value or a [`FrameError`],
//! never a panic (a fuzz target in `common/fuzz` checks this).

use crate::fabric::error::RemoteAccessKind;
use crate::fabric::stride::Stride;

/// Size of a write-frame header.
pub const HEADER_LEN: usize = 64;
/// Size of a completion.
pub const COMPLETION_LEN: usize = 24;
/// Largest payload of one frame (bigger writes are split into several frames).
pub const MAX_FRAME_PAYLOAD: u64 = 1 << 30;
/// Most parts one split write may have.
pub const MAX_PARTS: u16 = 1024;

const OP_WRITE: u8 = 1;
const OP_PULL: u8 = 2;
const FLAG_SIGNALLED: u8 = 1;
const FLAG_IMM: u8 = 2;
const FLAG_PART: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_SIGNALLED | FLAG_IMM | FLAG_PART;

/// A decoding failure (the lane that sent it is dropped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The op byte is neither WRITE nor PULL.
    #[error("unknown op {0}")]
    UnknownOp(u8),
    /// Flag bits this version does not know.
    #[error("unknown flag bits {0:#04x}")]
    UnknownFlags(u8),
    /// The payload is longer than a frame may be.
    #[error("payload length {0} exceeds the frame limit")]
    TooLong(u64),
    /// `addr + len` overflows.
    #[error("address range overflows (addr {addr:#x}, len {len})")]
    AddressOverflow {
        /// Remote address of the first byte.
        addr: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A part of a split write without an immediate or with a part count out of range, or a
    /// whole frame with part fields set.
    #[error("bad split-write fields (parts {parts}, has imm {has_imm})")]
    BadParts {
        /// The part count the frame gave.
        parts: u16,
        /// Whether the frame carried an immediate.
        has_imm: bool,
    },
    /// An immediate value is set but the immediate flag is not.
    #[error("non-zero immediate {0:#x} without the immediate flag")]
    StrayImm(u32),
    /// A WRITE frame carries a source address.
    #[error("a WRITE frame names a source address ({0:#x}); only a PULL does")]
    StraySource(u64),
    /// A PULL's `source + len` overflows.
    #[error("pull source range overflows (source {start:#x}, len {len})")]
    SourceOverflow {
        /// Where the bytes start in the writer's memory.
        start: u64,
        /// Length in bytes.
        len: u64,
    },
    /// A strided PULL source that breaks the rules of [`Stride`].
    #[error("bad strided source (run {run}, head {head}, stride {stride}){why}")]
    BadStride {
        /// Bytes per run.
        run: u32,
        /// Offset of the first byte in its run.
        head: u32,
        /// Bytes from one run's start to the next.
        stride: u64,
        /// Which rule it broke.
        why: &'static str,
    },
    /// A completion whose status or kind byte is unknown.
    #[error("bad completion status {status} / kind {kind}")]
    BadCompletion {
        /// The status byte.
        status: u8,
        /// The kind byte.
        kind: u8,
    },
}

/// A split write's identity: its parts share `write_id`; the immediate counts once all arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Part {
    /// Writer-chosen id, unique per writer process.
    pub write_id: u64,
    /// Total number of parts (at least 2).
    pub parts: u16,
}

/// A decoded write-frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// Whether the receiver answers with a completion after this frame.
    pub signalled: bool,
    /// Immediate to count once the payload (or, for a part, the whole write) landed.
    pub imm: Option<u32>,
    /// Set when this frame is one part of a split write.
    pub part: Option<Part>,
    /// Remote key.
    pub rkey: u64,
    /// Remote address of the first payload byte.
    pub addr: u64,
    /// Payload length.
    pub len: u64,
    /// Set for a PULL: where the bytes start in the writer's memory. No payload follows the
    /// header; the receiver copies `len` bytes from there (same host only).
    pub source: Option<u64>,
    /// Set for a PULL whose source bytes lie as runs at a stride from `source` (never for a
    /// WRITE: its payload travels gathered).
    pub stride: Option<Stride>,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0] = if self.source.is_some() {
            OP_PULL
        } else {
            OP_WRITE
        };
        let mut flags = 0;
        if self.signalled {
            flags |= FLAG_SIGNALLED;
        }
        if self.imm.is_some() {
            flags |= FLAG_IMM;
        }
        if self.part.is_some() {
            flags |= FLAG_PART;
        }
        b[1] = flags;
        b[2..4].copy_from_slice(&self.part.map_or(0, |p| p.parts).to_le_bytes());
        b[4..8].copy_from_slice(&self.imm.unwrap_or(0).to_le_bytes());
        b[8..16].copy_from_slice(&self.rkey.to_le_bytes());
        b[16..24].copy_from_slice(&self.addr.to_le_bytes());
        b[24..32].copy_from_slice(&self.len.to_le_bytes());
        b[32..40].copy_from_slice(&self.part.map_or(0, |p| p.write_id).to_le_bytes());
        b[40..48].copy_from_slice(&self.source.unwrap_or(0).to_le_bytes());
        if let Some(s) = self.stride {
            // Runs fit 32 bits and the head is inside its run (WriteOp::validate).
            b[48..52].copy_from_slice(&(s.run as u32).to_le_bytes());
            b[52..56].copy_from_slice(&(s.head as u32).to_le_bytes());
            b[56..64].copy_from_slice(&s.stride.to_le_bytes());
        }
        b
    }

    /// Bytes that follow this header on the wire.
    pub fn wire_payload(&self) -> u64 {
        if self.source.is_some() { 0 } else { self.len }
    }

    /// Decodes and validates a header.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<FrameHeader, FrameError> {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let pull = match b[0] {
            OP_WRITE => false,
            OP_PULL => true,
            op => return Err(FrameError::UnknownOp(op)),
        };
        let flags = b[1];
        if flags & !KNOWN_FLAGS != 0 {
            return Err(FrameError::UnknownFlags(flags & !KNOWN_FLAGS));
        }
        let parts = u16::from_le_bytes([b[2], b[3]]);
        let imm_raw = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let (rkey, addr, len, write_id) = (u64_at(8), u64_at(16), u64_at(24), u64_at(32));
        let source_raw = u64_at(40);
        let stride = decode_stride(b, pull)?;
        let source = if pull {
            let end = match stride {
                None => source_raw.checked_add(len),
                Some(s) => s.end(source_raw, len),
            };
            if end.is_none() {
                return Err(FrameError::SourceOverflow {
                    start: source_raw,
                    len,
                });
            }
            Some(source_raw)
        } else if source_raw != 0 {
            return Err(FrameError::StraySource(source_raw));
        } else {
            None
        };
        let has_imm = flags & FLAG_IMM != 0;
        if !has_imm && imm_raw != 0 {
            return Err(FrameError::StrayImm(imm_raw));
        }
        if len > MAX_FRAME_PAYLOAD {
            return Err(FrameError::TooLong(len));
        }
        if addr.checked_add(len).is_none() {
            return Err(FrameError::AddressOverflow { addr, len });
        }
        let part = if flags & FLAG_PART != 0 {
            if !has_imm || !(2..=MAX_PARTS).contains(&parts) {
                return Err(FrameError::BadParts { parts, has_imm });
            }
            Some(Part { write_id, parts })
        } else {
            if parts != 0 || write_id != 0 {
                return Err(FrameError::BadParts { parts, has_imm });
            }
            None
        };
        Ok(FrameHeader {
            signalled: flags & FLAG_SIGNALLED != 0,
            imm: has_imm.then_some(imm_raw),
            part,
            rkey,
            addr,
            len,
            source,
            stride,
        })
    }
}

/// The strided-source fields of a header: all zero, or (on a PULL only) a valid layout.
fn decode_stride(b: &[u8; HEADER_LEN], pull: bool) -> Result<Option<Stride>, FrameError> {
    let run = u32::from_le_bytes([b[48], b[49], b[50], b[51]]);
    let head = u32::from_le_bytes([b[52], b[53], b[54], b[55]]);
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[56..64]);
    let stride = u64::from_le_bytes(a);
    let bad = |why| FrameError::BadStride {
        run,
        head,
        stride,
        why,
    };
    if run == 0 {
        return if head == 0 && stride == 0 {
            Ok(None)
        } else {
            Err(bad(": fields without a run"))
        };
    }
    if !pull {
        return Err(bad(": only a PULL names its source's layout"));
    }
    let s = Stride {
        run: run.into(),
        stride,
        head: head.into(),
    };
    match s.problem() {
        None => Ok(Some(s)),
        Some(_) => Err(bad("")),
    }
}

/// The receiver's answer to a signalled frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Frames covered (since the previous completion on this lane, this one included).
    pub frames: u32,
    /// The first refusal among them, if any: kind, rkey, addr.
    pub error: Option<(RemoteAccessKind, u64, u64)>,
}

fn kind_code(kind: RemoteAccessKind) -> u8 {
    match kind {
        RemoteAccessKind::WrongRkey => 1,
        RemoteAccessKind::OutOfBounds => 2,
        RemoteAccessKind::NoWritePermission => 3,
        RemoteAccessKind::Deregistered => 4,
        RemoteAccessKind::OutsideWindow => 5,
    }
}

fn code_kind(code: u8) -> Option<RemoteAccessKind> {
    Some(match code {
        1 => RemoteAccessKind::WrongRkey,
        2 => RemoteAccessKind::OutOfBounds,
        3 => RemoteAccessKind::NoWritePermission,
        4 => RemoteAccessKind::Deregistered,
        5 => RemoteAccessKind::OutsideWindow,
        _ => return None,
    })
}

impl Completion {
    /// Encodes the completion.
    pub fn encode(&self) -> [u8; COMPLETION_LEN] {
        let mut b = [0u8; COMPLETION_LEN];
        if let Some((kind, rkey, addr)) = self.error {
            b[0] = 1;
            b[1] = kind_code(kind);
            b[8..16].copy_from_slice(&rkey.to_le_bytes());
            b[16..24].copy_from_slice(&addr.to_le_bytes());
        }
        b[4..8].copy_from_slice(&self.frames.to_le_bytes());
        b
    }

    /// Decodes and validates a completion.
    pub fn decode(b: &[u8; COMPLETION_LEN]) -> Result<Completion, FrameError> {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let frames = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        let bad = FrameError::BadCompletion {
            status: b[0],
            kind: b[1],
        };
        if b[2] != 0 || b[3] != 0 {
            return Err(bad);
        }
        match b[0] {
            0 if b[1] == 0 && u64_at(8) == 0 && u64_at(16) == 0 => Ok(Completion {
                frames,
                error: None,
            }),
            1 => {
                let kind = code_kind(b[1]).ok_or(bad)?;
                Ok(Completion {
                    frames,
                    error: Some((kind, u64_at(8), u64_at(16))),
                })
            }
            _ => Err(bad),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips() {
        for h in [
            FrameHeader {
                signalled: true,
                imm: Some(0xdead_beef),
                part: Some(Part {
                    write_id: 99,
                    parts: 4,
                }),
                rkey: u64::MAX,
                addr: 1 << 40,
                len: 12345,
                source: None,
                stride: None,
            },
            FrameHeader {
                signalled: false,
                imm: None,
                part: None,
                rkey: 1,
                addr: 0,
                len: 0,
                source: None,
                stride: None,
            },
            FrameHeader {
                signalled: false,
                imm: Some(0),
                part: None,
                rkey: 7,
                addr: u64::MAX - MAX_FRAME_PAYLOAD,
                len: MAX_FRAME_PAYLOAD,
                source: None,
                stride: None,
            },
            FrameHeader {
                signalled: true,
                imm: Some(3),
                part: Some(Part {
                    write_id: 5,
                    parts: 2,
                }),
                rkey: 9,
                addr: 4096,
                len: 1 << 20,
                source: Some(0x7f00_0000_1000),
                stride: None,
            },
            FrameHeader {
                signalled: false,
                imm: None,
                part: None,
                rkey: 9,
                addr: 4096,
                len: 0,
                source: Some(0),
                stride: None,
            },
        ] {
            assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn header_rejects_garbage() {
        let good = FrameHeader {
            signalled: true,
            imm: Some(5),
            part: None,
            rkey: 1,
            addr: 100,
            len: 10,
            source: None,
            stride: None,
        }
        .encode();
        let mut b = good;
        b[0] = 3;
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::UnknownOp(3)));
        // A WRITE never names a source; a PULL's source range must not overflow.
        let mut b = good;
        b[40] = 1;
        assert_eq!(FrameHeader::decode(&b), Err(FrameError::StraySource(1)));
        let mut b = good;
        b[0] = OP_PULL;
        b[40..48].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::SourceOverflow { .. })
        ));
        let mut b = good;
        b[1] |= 0x80;
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::UnknownFlags(_))
        ));
        let mut b = good;
        b[24..32].copy_from_slice(&(MAX_FRAME_PAYLOAD + 1).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::TooLong(_))
        ));
        let mut b = good;
        b[16..24].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::AddressOverflow { .. })
        ));
        let mut b = good;
        b[1] |= FLAG_PART; // a part with parts == 0
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::BadParts { .. })
        ));
        let mut b = good;
        b[1] &= !FLAG_IMM;
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::StrayImm(5))
        ));
    }

    #[test]
    fn strided_pulls_round_trip_and_bad_layouts_are_refused() {
        let pull = FrameHeader {
            signalled: false,
            imm: Some(1),
            part: None,
            rkey: 9,
            addr: 4096,
            len: 10_000,
            source: Some(0x7f00_0000_0010),
            stride: Some(Stride {
                run: 3072,
                stride: 6144,
                head: 16,
            }),
        };
        assert_eq!(FrameHeader::decode(&pull.encode()), Ok(pull));
        let good = pull.encode();
        // A WRITE never names a layout.
        let mut b = good;
        b[0] = OP_WRITE;
        b[40..48].fill(0);
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::BadStride { .. })
        ));
        // Head outside its run, stride shorter than the run, fields without a run.
        for (at, value) in [(52usize, 3072u64), (56, 3071)] {
            let mut b = good;
            let n = if at == 52 { 4 } else { 8 };
            b[at..at + n].copy_from_slice(&value.to_le_bytes()[..n]);
            assert!(
                matches!(FrameHeader::decode(&b), Err(FrameError::BadStride { .. })),
                "field at {at}"
            );
        }
        let mut b = good;
        b[48..52].fill(0);
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::BadStride { .. })
        ));
        // The source range (runs included) must not overflow, nor start before its run.
        let mut b = good;
        b[40..48].copy_from_slice(&(u64::MAX - 15_000).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::SourceOverflow { .. })
        ));
        let mut b = good;
        b[40..48].copy_from_slice(&8u64.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b),
            Err(FrameError::SourceOverflow { .. })
        ));
    }

    #[test]
    fn completion_round_trips_and_rejects_garbage() {
        for c in [
            Completion {
                frames: 3,
                error: None,
            },
            Completion {
                frames: 1,
                error: Some((RemoteAccessKind::Deregistered, 77, 4096)),
            },
        ] {
            assert_eq!(Completion::decode(&c.encode()), Ok(c));
        }
        let mut b = [0u8; COMPLETION_LEN];
        b[0] = 1;
        b[1] = 9;
        assert!(Completion::decode(&b).is_err());
        b[0] = 0;
        b[1] = 0;
        b[9] = 1;
        assert!(Completion::decode(&b).is_err());
    }
}
