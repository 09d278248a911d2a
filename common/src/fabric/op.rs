//! A one-sided write, and the pure planning every backend applies to a batch of them.
//!
//! The cost model of RDMA NICs (and of our TCP emulation, where each request costs a header and a
//! few syscalls) rewards few large requests spread over several queue pairs. So before posting a
//! batch a backend:
//! 1. merges runs that are contiguous on both sides ([`merge_contiguous`]): same source
//!    registration and same destination region, each write starting where the previous ended;
//! 2. splits writes larger than a threshold into roughly equal pieces ([`stripe`]) so that one big
//!    write uses every lane to its peer; or, knowing how much each lane still has queued, places
//!    each write on the lanes that will carry it soonest ([`place`]), splitting it only where that
//!    makes it land sooner.
//!
//! A write's source may be strided ([`Stride`]: equal runs at a constant stride, gathered by the
//! backend as it copies); such a write is split like any other (each piece's source follows
//! from [`WriteOp::source_at`]) but never merged.
//!
//! Immediates survive both steps with their meaning intact: "this write has fully landed". A run
//! is merged only while no write before its last carries an immediate, so the merged write carries
//! at most one (the last one's). A split write still counts once: each backend must count the
//! immediate only after every piece has landed (TCP tags pieces with a shared write id; see
//! `tcp`).

use super::descriptor::RegionDescriptor;
use super::error::{FabricError, Result};
use super::region::Region;
use super::stride::Stride;

/// Write `len` bytes from `src` at `src_offset` into the remote region `dst` at `dst_offset`,
/// optionally carrying a 32-bit immediate the receiver counts once the bytes have landed.
#[derive(Debug, Clone)]
pub struct WriteOp {
    /// Local source registration (a clone keeps it alive while the write is in flight).
    pub src: Region,
    /// Offset into `src`.
    pub src_offset: u64,
    /// Bytes to write.
    pub len: u64,
    /// Remote destination.
    pub dst: RegionDescriptor,
    /// Offset into `dst`.
    pub dst_offset: u64,
    /// Immediate counted by the receiver's [`ImmCounter`](super::ImmCounter).
    pub imm: Option<u32>,
    /// How the source bytes lie when they are not one contiguous range from `src_offset`
    /// (`src_offset` is then the first byte's offset; see [`Stride`]).
    pub src_stride: Option<Stride>,
}

impl WriteOp {
    /// A write without immediate.
    pub fn new(
        src: &Region,
        src_offset: u64,
        dst: &RegionDescriptor,
        dst_offset: u64,
        len: u64,
    ) -> WriteOp {
        WriteOp {
            src: src.clone(),
            src_offset,
            len,
            dst: dst.clone(),
            dst_offset,
            imm: None,
            src_stride: None,
        }
    }

    /// The same write reading its source as `stride` describes (a contiguous layout, one run
    /// as long as the write, stays plain).
    pub fn with_stride(mut self, stride: Stride) -> WriteOp {
        let contiguous = stride.head + self.len <= stride.run;
        self.src_stride = (!contiguous).then_some(stride);
        self
    }

    /// Where the bytes `n` into this write start in the source, and how they lie from there.
    pub fn source_at(&self, n: u64) -> (u64, Option<Stride>) {
        match self.src_stride {
            None => (self.src_offset + n, None),
            Some(s) => {
                let (at, s) = s.advance(self.src_offset, n);
                (at, Some(s))
            }
        }
    }

    /// One past the last source byte this write reads; `None` when that overflows.
    pub fn source_end(&self) -> Option<u64> {
        match self.src_stride {
            None => self.src_offset.checked_add(self.len),
            Some(s) => s.end(self.src_offset, self.len),
        }
    }

    /// The same write carrying `imm`.
    pub fn with_imm(mut self, imm: u32) -> WriteOp {
        self.imm = Some(imm);
        self
    }

    /// Checks the local range and the remote range against the descriptor (the peer checks again:
    /// this only catches mistakes early, with a clear message).
    pub fn validate(&self) -> Result<()> {
        let src_len = self.src.len();
        if let Some(problem) = self.src_stride.and_then(|s| s.problem()) {
            return Err(FabricError::Unsupported(format!(
                "write source layout: {problem}"
            )));
        }
        if self.source_end().is_none_or(|end| end > src_len) {
            return Err(FabricError::LocalOutOfBounds {
                what: "write source",
                offset: self.src_offset,
                len: self.len,
                region_len: src_len,
            });
        }
        if !self.src.is_registered() {
            return Err(FabricError::LocalDeregistered {
                what: "write source",
                rkey: self.src.rkey(),
            });
        }
        if !self.dst.contains(self.dst_offset, self.len) {
            return Err(FabricError::RemoteAccess {
                kind: super::RemoteAccessKind::OutOfBounds,
                peer: self.dst.endpoint.clone(),
                rkey: self.dst.rkey,
                offset: self.dst_offset,
                len: self.len,
            });
        }
        Ok(())
    }

    /// Whether `next` continues this write on both sides and may be merged into it.
    pub fn can_absorb(&self, next: &WriteOp) -> bool {
        self.imm.is_none()
            && self.src_stride.is_none()
            && next.src_stride.is_none()
            && self.src.same_registration(&next.src)
            && self.src_offset.checked_add(self.len) == Some(next.src_offset)
            && self.dst.rkey == next.dst.rkey
            && self.dst.endpoint == next.dst.endpoint
            && self.dst.base == next.dst.base
            && self.dst_offset.checked_add(self.len) == Some(next.dst_offset)
    }
}

/// Merges runs contiguous on both sides into single writes. Writes are first ordered by
/// destination (peer, rkey, offset) so that runs written out of order still merge; the result
/// carries the same bytes and the same multiset of immediates.
pub fn merge_contiguous(mut ops: Vec<WriteOp>) -> Vec<WriteOp> {
    if ops.len() < 2 {
        return ops;
    }
    ops.sort_by(|a, b| {
        (&a.dst.endpoint, a.dst.rkey, a.dst_offset).cmp(&(
            &b.dst.endpoint,
            b.dst.rkey,
            b.dst_offset,
        ))
    });
    let mut out: Vec<WriteOp> = Vec::with_capacity(ops.len());
    for op in ops {
        match out.last_mut() {
            Some(last) if last.can_absorb(&op) => {
                last.len += op.len;
                last.imm = op.imm;
            }
            _ => out.push(op),
        }
    }
    out
}

/// Splits `len` bytes into at most `lanes` pieces of at least `min_piece` bytes, each but the
/// last a multiple of `align` (a power of two). Returns `(offset, len)` pairs covering
/// `[0, len)` in order. A length at or below `min_piece` stays one piece.
pub fn stripe(len: u64, lanes: usize, min_piece: u64, align: u64) -> Vec<(u64, u64)> {
    let align = align.max(1);
    let max_pieces = len.checked_div(min_piece).unwrap_or(lanes as u64).max(1);
    let pieces = (lanes as u64).min(max_pieces).max(1);
    if pieces == 1 {
        return vec![(0, len)];
    }
    let per = (len / pieces).div_ceil(align) * align;
    let mut out = Vec::with_capacity(pieces as usize);
    let mut off = 0;
    while off < len {
        let n = per.min(len - off);
        out.push((off, n));
        off += n;
    }
    out
}

/// Where one write's bytes go over the lanes to its peer: `(lane, offset, len)` pieces covering
/// `[0, len)` in order.
///
/// `queued[l]` is what lane `l` still has to carry (posted, not yet acknowledged). A lane is a
/// FIFO, so a piece lands once everything queued before it has, and the write lands with its last
/// piece. The plan fills the least-loaded lanes up to a common level (water-filling): on idle
/// lanes that is [`stripe`]'s even split, so a lone write still uses every lane. When the
/// least-loaded lane already has at least `len` queued, the lanes are busy with earlier writes;
/// splitting would then make this one land no sooner, only cost more frames, completions and
/// wake-ups per byte, so it goes whole to that lane. Pieces are at least `min_piece` (a shorter
/// write stays whole) and all but the last a multiple of `align` (a power of two). Ties go to
/// the lane at or after `first` (a caller rotates it to spread equal lanes).
pub fn place(
    len: u64,
    queued: &[u64],
    min_piece: u64,
    align: u64,
    first: usize,
) -> Vec<(usize, u64, u64)> {
    let lanes = queued.len().max(1);
    let mut order: Vec<usize> = (0..queued.len()).collect();
    order.sort_by_key(|&l| (queued[l], (l + lanes - first % lanes) % lanes));
    let least = order.first().copied().unwrap_or(0);
    let max_pieces = len.checked_div(min_piece).unwrap_or(lanes as u64);
    let max_pieces = (max_pieces as usize).min(queued.len());
    if max_pieces < 2 || queued[least] >= len {
        return vec![(least, 0, len)];
    }
    // The most lanes whose water-filled shares are all at least `min_piece`.
    let level = |k: usize| {
        let total: u128 = u128::from(len)
            + order[..k]
                .iter()
                .map(|&l| u128::from(queued[l]))
                .sum::<u128>();
        total / k as u128
    };
    let Some(k) = (2..=max_pieces)
        .rev()
        .find(|&k| level(k) >= u128::from(queued[order[k - 1]]) + u128::from(min_piece))
    else {
        return vec![(least, 0, len)];
    };
    let h = level(k);
    let align = align.max(1);
    let mut out = Vec::with_capacity(k);
    let mut off = 0;
    for (i, &lane) in order[..k].iter().enumerate() {
        let n = if i + 1 == k {
            len - off
        } else {
            let share = (h - u128::from(queued[lane])) as u64;
            (share / align * align).min(len - off)
        };
        if n > 0 {
            out.push((lane, off, n));
            off += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::{Access, Memory, RegisteredMemory};

    fn region(len: usize) -> Region {
        let mem = RegisteredMemory::new(Memory::alloc(len).unwrap());
        let base = mem.as_ptr() as u64;
        Region::new(
            mem,
            Access::SOURCE,
            RegionDescriptor {
                endpoint: "local:0".into(),
                base,
                len: len as u64,
                rkey: 1,
            },
            Box::new(|| {}),
        )
    }

    fn dst(rkey: u64) -> RegionDescriptor {
        RegionDescriptor {
            endpoint: "peer:1".into(),
            base: 0,
            len: 1 << 20,
            rkey,
        }
    }

    #[test]
    fn merges_runs_contiguous_on_both_sides_only() {
        let src = region(4096);
        let d = dst(9);
        let ops = vec![
            WriteOp::new(&src, 100, &d, 1100, 50),
            WriteOp::new(&src, 0, &d, 1000, 100),
            WriteOp::new(&src, 150, &d, 1150, 10).with_imm(7),
            // Contiguous on dst but not on src: stays separate.
            WriteOp::new(&src, 500, &d, 1160, 10),
            // Another region.
            WriteOp::new(&src, 170, &dst(10), 1170, 10),
        ];
        let merged = merge_contiguous(ops);
        assert_eq!(merged.len(), 3);
        assert_eq!(
            (merged[0].src_offset, merged[0].dst_offset, merged[0].len),
            (0, 1000, 160)
        );
        assert_eq!(merged[0].imm, Some(7));
        assert_eq!(merged[1].src_offset, 500);
    }

    #[test]
    fn never_merges_past_an_immediate() {
        let src = region(4096);
        let d = dst(9);
        let ops = vec![
            WriteOp::new(&src, 0, &d, 0, 10).with_imm(1),
            WriteOp::new(&src, 10, &d, 10, 10).with_imm(2),
        ];
        let merged = merge_contiguous(ops);
        assert_eq!(merged.len(), 2);
        assert_eq!((merged[0].imm, merged[1].imm), (Some(1), Some(2)));
    }

    #[test]
    fn stripe_covers_exactly_with_aligned_pieces() {
        for (len, lanes, min) in [
            (1u64 << 20, 4usize, 256u64 << 10),
            (1_000_003, 3, 1000),
            (10, 4, 100),
            (0, 4, 100),
            (64 << 20, 2, 1 << 20),
        ] {
            let p = stripe(len, lanes, min, 4096);
            assert!(p.len() <= lanes.max(1));
            let mut next = 0;
            for &(o, n) in &p {
                assert_eq!(o, next);
                next += n;
            }
            assert_eq!(next, len);
            for &(_, n) in &p[..p.len() - 1] {
                assert_eq!(n % 4096, 0);
            }
        }
        assert_eq!(stripe(1 << 20, 4, 256 << 10, 4096).len(), 4);
        assert_eq!(stripe(1 << 20, 4, 1 << 20, 4096).len(), 1);
    }

    fn covers(pieces: &[(usize, u64, u64)], len: u64) {
        let mut next = 0;
        for &(_, o, n) in pieces {
            assert_eq!(o, next, "{pieces:?}");
            assert!(n > 0, "{pieces:?}");
            next += n;
        }
        assert_eq!(next, len, "{pieces:?}");
    }

    #[test]
    fn place_splits_evenly_over_idle_lanes() {
        let p = place(1 << 20, &[0; 4], 256 << 10, 4096, 0);
        covers(&p, 1 << 20);
        assert_eq!(p.len(), 4);
        let mut lanes: Vec<usize> = p.iter().map(|x| x.0).collect();
        lanes.sort();
        assert_eq!(lanes, [0, 1, 2, 3]);
        assert!(p.iter().all(|x| x.2 == 256 << 10));
        // Too short to split, or a single lane: one piece on the tie-winning lane.
        assert_eq!(
            place(100 << 10, &[0; 4], 256 << 10, 4096, 2),
            [(2, 0, 100 << 10)]
        );
        assert_eq!(place(1 << 20, &[0], 256 << 10, 4096, 0), [(0, 0, 1 << 20)]);
    }

    #[test]
    fn place_keeps_a_write_whole_behind_busy_lanes() {
        // Every lane has more queued than the write: the least-loaded lane takes it whole.
        let p = place(1 << 20, &[8 << 20, 3 << 20, 5 << 20], 256 << 10, 4096, 0);
        assert_eq!(p, [(1, 0, 1 << 20)]);
    }

    #[test]
    fn place_fills_the_emptier_lanes_first() {
        let mib = 1u64 << 20;
        // Lane 0 idle, lane 1 with 2 MiB queued: a 4 MiB write levels them at 3 MiB.
        let p = place(4 * mib, &[0, 2 * mib], 256 << 10, 4096, 0);
        covers(&p, 4 * mib);
        assert_eq!(p, [(0, 0, 3 * mib), (1, 3 * mib, mib)]);
        // A lane whose share would be below the minimum piece is left out.
        let p = place(mib, &[0, 900 << 10], 256 << 10, 4096, 0);
        assert_eq!(p, [(0, 0, mib)]);
        // Odd sizes and unaligned minimums still cover the write exactly.
        for (len, queued) in [
            (1_000_003u64, vec![0u64, 10, 20_000]),
            (64 << 20, vec![1, 2, 3, 4]),
            (5 * mib + 7, vec![mib, 0, 3 * mib, 0]),
        ] {
            let p = place(len, &queued, 1000, 4096, 1);
            covers(&p, len);
            assert!(p.len() <= queued.len());
        }
    }

    #[test]
    fn validate_names_the_bad_range() {
        let src = region(100);
        let d = dst(1);
        let err = WriteOp::new(&src, 90, &d, 0, 20).validate().unwrap_err();
        assert!(err.to_string().contains("write source"), "{err}");
        let err = WriteOp::new(&src, 0, &d, (1 << 20) - 5, 20)
            .validate()
            .unwrap_err();
        assert!(matches!(err, FabricError::RemoteAccess { .. }));
    }
}
