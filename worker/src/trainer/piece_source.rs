//! Where a piece's bytes are written from: its staging lease, the registered source memory the
//! task reads (a same-dtype copy written with no staging), or both (a piece compared with its
//! base where the source holds it: its encodings in the lease, its dense runs in the source).

use weightsync_common::fabric::{Region, RegionDescriptor, WriteOp};

use super::direct::DirectSource;

/// Where a piece's prepared bytes are when it is written.
pub(super) enum PieceSource {
    /// In a staging lease, dense from `at`.
    Staged { region: Region, at: u64 },
    /// In registered source memory, starting at byte `from` of the task's output.
    Direct { direct: DirectSource, from: u64 },
    /// As `Direct`, its encodings in a staging lease at `at` ([`piece_in_place`]).
    Encodings {
        region: Region,
        at: u64,
        direct: DirectSource,
        from: u64,
    },
}

impl PieceSource {
    /// A write of `len` bytes at `offset` into the piece's prepared bytes, to `dst` at
    /// `dst_offset`.
    pub(super) fn op(
        &self,
        offset: u64,
        dst: &RegionDescriptor,
        dst_offset: u64,
        len: u64,
    ) -> WriteOp {
        match self {
            PieceSource::Staged { region, at } => {
                WriteOp::new(region, at + offset, dst, dst_offset, len)
            }
            PieceSource::Direct { direct, from } | PieceSource::Encodings { direct, from, .. } => {
                let (at, stride) = direct.at(from + offset);
                let op = WriteOp::new(&direct.region, at, dst, dst_offset, len);
                match stride {
                    Some(s) => op.with_stride(s),
                    None => op,
                }
            }
        }
    }
}
