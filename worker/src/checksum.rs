//! Checksums of write runs: how a rollout proves that what landed is what a trainer prepared.
//!
//! A trainer prepares only pieces of a destination tensor (its shard's rows, possibly split by
//! the watermark), so it cannot hash a whole tensor. What both sides can see is the *run*: the
//! bytes of one posted write, `[offset, offset + len)` of a destination MR. The trainer hashes
//! each run's prepared bytes with xxh3 right after preparing them; the rollout hashes the same
//! range of its memory after the sync landed and compares. A mismatch names the destination
//! tensor(s) the run lies in. Because every destination byte is written exactly once per sync,
//! the runs of all trainers tile the destination tensors exactly, so the rollout also checks that
//! the records cover every tensor byte once: verification can never pass vacuously.
//!
//! The rollout's pass over what landed is the whole cost of committing a version once its bytes
//! are in place, so it reads the region where the bytes are, a cache-sized chunk at a time into
//! a buffer its thread keeps ([`xxh3_in_region`]): no allocation and no copy of a whole run,
//! which would fault in fresh pages for every run of every sync and cost more than the hash.
//!
//! The record is the protocol's [`RunChecksum`]: what a trainer reports is what the controller
//! forwards and what a rollout checks, with no conversion on the way.

use weightsync_common::fabric::{FabricError, Region};
use xxhash_rust::xxh3::Xxh3;

pub use weightsync_common::protocol::RunChecksum;

/// Bytes of a region read at a time by [`xxh3_in_region`]: they stay in the core's cache
/// between the copy and the hash.
pub const HASH_CHUNK: usize = 128 << 10;

/// xxh3-64 of bytes (the one hash both sides use).
pub fn xxh3(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// The [`xxh3`] of `len` bytes at `offset` of `region`, read a chunk of `scratch.len()` bytes at
/// a time through `scratch` (an empty `scratch` gets [`HASH_CHUNK`] bytes). Fails as
/// [`Region::read_at`] does (out of bounds, memory that is not host memory).
pub fn xxh3_in_region(
    region: &Region,
    offset: u64,
    len: u64,
    scratch: &mut Vec<u8>,
) -> Result<u64, FabricError> {
    if scratch.is_empty() {
        scratch.resize(HASH_CHUNK, 0);
    }
    let chunk = scratch.len() as u64;
    if len <= chunk {
        let part = &mut scratch[..len as usize];
        region.read_at(offset, part)?;
        return Ok(xxh3(part));
    }
    let mut hasher = Xxh3::new();
    let mut at = 0;
    while at < len {
        let part = &mut scratch[..(len - at).min(chunk) as usize];
        region.read_at(offset + at, part)?;
        hasher.update(part);
        at += part.len() as u64;
    }
    Ok(hasher.digest())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_common::fabric::{Access, FabricBackend};

    #[test]
    fn hashing_in_place_equals_hashing_a_copy_at_every_length_and_chunk() {
        let fabric = crate::mem_fabric::MemFabric::new_switch("rollout");
        let len = 3 * HASH_CHUNK + 4099;
        let region = fabric.alloc(len, Access::RECEIVE).unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 131 + (i >> 7)) as u8).collect();
        region.write_at(0, &bytes).unwrap();
        let lens = [
            0usize,
            1,
            16,
            17,
            128,
            129,
            240,
            241,
            1024,
            4099,
            HASH_CHUNK - 1,
        ]
        .into_iter()
        .chain([HASH_CHUNK, HASH_CHUNK + 1, 2 * HASH_CHUNK + 7, len - 13]);
        for n in lens {
            let at = 13;
            let want = xxh3(&bytes[at..at + n]);
            for scratch_len in [0usize, 64, 1000, HASH_CHUNK] {
                let mut scratch = vec![0u8; scratch_len];
                let got = xxh3_in_region(&region, at as u64, n as u64, &mut scratch).unwrap();
                assert_eq!(got, want, "len {n}, scratch {scratch_len}");
            }
        }
    }

    #[test]
    fn a_run_outside_the_region_is_an_error_not_a_hash() {
        let fabric = crate::mem_fabric::MemFabric::new_switch("rollout");
        let region = fabric.alloc(4096, Access::RECEIVE).unwrap();
        let mut scratch = Vec::new();
        assert!(xxh3_in_region(&region, 4000, 97, &mut scratch).is_err());
        assert!(xxh3_in_region(&region, 0, 4096, &mut scratch).is_ok());
    }
}
