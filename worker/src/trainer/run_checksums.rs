//! The checksum records of a piece's runs: one per part written to a rollout, naming the
//! destination bytes it covers and the xxh3 of its prepared bytes, which the rollout compares
//! with what it holds (see `crate::checksum`). The hash comes from wherever it was taken: a
//! pass over the staged bytes, or the pass that compared the runs with their bases.

use weightsync_schedules::table::WriteTarget;

use super::TrainerState;
use super::piece::{Part, TaskPiece};
use crate::checksum::{RunChecksum, xxh3};

/// The xxh3 of every run a prepared piece writes to a rollout.
pub(super) fn run_checksums(st: &TrainerState, piece: &TaskPiece, buf: &[u8]) -> Vec<RunChecksum> {
    part_checksums(st, piece, |_, part| {
        let a = part.staging_offset as usize;
        xxh3(&buf[a..a + part.len as usize])
    })
}

/// The checksum record of every part of a piece written to a rollout, its hash from
/// `hash(index of the part, part)`.
pub(super) fn part_checksums(
    st: &TrainerState,
    piece: &TaskPiece,
    hash: impl Fn(usize, &Part) -> u64,
) -> Vec<RunChecksum> {
    piece
        .parts
        .iter()
        .enumerate()
        .filter_map(|(i, part)| {
            let w = st.plan.writes[part.write as usize];
            let WriteTarget::Rollout(rollout) = w.dst else {
                return None;
            };
            let dst = &st.write_dst[part.write as usize];
            Some(RunChecksum {
                rollout,
                mr: dst.mr,
                offset: dst.offset + (part.dst_offset - w.dst_offset),
                len: part.len,
                xxh3: hash(i, part),
            })
        })
        .collect()
}
