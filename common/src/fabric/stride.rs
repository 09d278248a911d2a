//! Strided sources: one write whose bytes lie in the source as equal runs at a constant stride.
//!
//! Why: a trainer's shard often holds a destination box as rows that are not adjacent: an FSDP
//! shard of a `[rows, cols]` matrix split by rows, written to tensor-parallel engines that split
//! the same matrix by columns, holds each engine's box as `rows` runs of `cols / tp` elements,
//! one every `cols` elements. Without a way to say so, every such box is first gathered into
//! staging by a copy, and then written: the CPU (or the GPU's copy engine) touches those bytes
//! once more than the fabric does. A NIC takes a list of source ranges per work request (its
//! scatter/gather entries); a socket takes an iovec list; `process_vm_readv` takes a remote
//! iovec list. So a write may name its source as a [`Stride`], and each backend hands the list
//! to the hardware or the kernel, which gathers while it copies.
//!
//! The destination side of a write stays one contiguous range: the receiver's checks
//! (rkey, bounds, permission) and its counting are those of any write.
//!
//! A write may start part-way into a run (a write is any byte range of a task's output, and
//! backends split writes at any offset): `head` says how far. Byte `i` of a write whose first
//! byte is at source offset `s` lies at
//! `s - head + ((head + i) / run) * stride + (head + i) % run`.

/// How a write's source bytes lie: runs of `run` bytes, one every `stride` bytes, the write's
/// first byte `head` bytes into its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stride {
    /// Bytes per run (at least 1, at most [`Stride::MAX_RUN`]).
    pub run: u64,
    /// Bytes from the start of one run to the start of the next (at least `run`).
    pub stride: u64,
    /// How far into its run the write's first byte lies (below `run`).
    pub head: u64,
}

impl Stride {
    /// Longest run a strided source may have: runs travel as 32-bit lengths (a scatter/gather
    /// entry's, the TCP frame's). A source with longer runs is written as one write per run.
    pub const MAX_RUN: u64 = u32::MAX as u64;

    /// A strided layout starting at the beginning of a run.
    pub fn new(run: u64, stride: u64) -> Stride {
        Stride {
            run,
            stride,
            head: 0,
        }
    }

    /// What is wrong with this layout, if anything.
    pub fn problem(&self) -> Option<String> {
        if self.run == 0 || self.run > Self::MAX_RUN {
            Some(format!(
                "run of {} bytes (1 to {} allowed)",
                self.run,
                Self::MAX_RUN
            ))
        } else if self.stride < self.run {
            Some(format!(
                "stride {} shorter than its run {}",
                self.stride, self.run
            ))
        } else if self.head >= self.run {
            Some(format!(
                "head {} not inside its run of {}",
                self.head, self.run
            ))
        } else {
            None
        }
    }

    /// One past the last source byte of `len` bytes starting at `offset` (`offset` when `len`
    /// is 0); `None` when that overflows or `offset` is before its run's start.
    pub fn end(&self, offset: u64, len: u64) -> Option<u64> {
        if len == 0 {
            return Some(offset);
        }
        let start = offset.checked_sub(self.head)?;
        let last = self.head.checked_add(len - 1)?;
        let at = (last / self.run)
            .checked_mul(self.stride)?
            .checked_add(last % self.run)?;
        start.checked_add(at)?.checked_add(1)
    }

    /// The source of the bytes `n` further into the write: their offset and layout.
    pub fn advance(&self, offset: u64, n: u64) -> (u64, Stride) {
        let p = self.head + n;
        let head = p % self.run;
        let at = offset - self.head + (p / self.run) * self.stride + head;
        (at, Stride { head, ..*self })
    }

    /// The contiguous source ranges `(offset, len)` of `len` bytes starting at `offset`, in
    /// order.
    pub fn segments(&self, offset: u64, len: u64) -> Segments {
        Segments {
            at: offset,
            first: self.run - self.head,
            left: len,
            gap: self.stride - self.run,
            run: self.run,
        }
    }

    /// How many contiguous ranges `len` bytes take.
    pub fn count(&self, len: u64) -> u64 {
        if len == 0 {
            0
        } else {
            (self.head + len).div_ceil(self.run)
        }
    }

    /// The most bytes from the write's current position that fit in `ranges` contiguous ranges.
    pub fn bytes_in(&self, ranges: u64) -> u64 {
        match ranges {
            0 => 0,
            k => (self.run - self.head).saturating_add((k - 1).saturating_mul(self.run)),
        }
    }
}

/// Iterator of [`Stride::segments`].
#[derive(Debug, Clone)]
pub struct Segments {
    at: u64,
    first: u64,
    left: u64,
    gap: u64,
    run: u64,
}

impl Iterator for Segments {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.left == 0 {
            return None;
        }
        let n = self.first.min(self.left);
        let out = (self.at, n);
        self.left -= n;
        self.at += n + self.gap;
        self.first = self.run;
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Byte `i`'s source offset by the formula of the module docs.
    fn byte_at(s: &Stride, offset: u64, i: u64) -> u64 {
        offset - s.head + ((s.head + i) / s.run) * s.stride + (s.head + i) % s.run
    }

    #[test]
    fn segments_advance_and_end_agree_with_the_byte_formula() {
        for (run, stride, head, offset, len) in [
            (6u64, 10u64, 0u64, 100u64, 30u64),
            (6, 10, 4, 104, 13),
            (6, 6, 5, 5, 20),
            (1, 3, 0, 0, 7),
            (4096, 8192, 100, 100, 3 * 4096 + 7),
        ] {
            let s = Stride { run, stride, head };
            assert_eq!(s.problem(), None);
            let bytes: Vec<u64> = s
                .segments(offset, len)
                .flat_map(|(o, n)| o..o + n)
                .collect();
            let want: Vec<u64> = (0..len).map(|i| byte_at(&s, offset, i)).collect();
            assert_eq!(bytes, want, "{s:?}");
            assert_eq!(s.segments(offset, len).count() as u64, s.count(len));
            assert_eq!(s.end(offset, len), Some(want.last().unwrap() + 1));
            for n in 0..len {
                let (o, t) = s.advance(offset, n);
                assert_eq!(o, want[n as usize], "{s:?} n {n}");
                let rest: Vec<u64> = t.segments(o, len - n).flat_map(|(o, n)| o..o + n).collect();
                assert_eq!(rest, want[n as usize..], "{s:?} n {n}");
            }
            for k in 1..=s.count(len) {
                let fit = s.bytes_in(k).min(len);
                assert!(s.count(fit) <= k, "{s:?} k {k}");
            }
        }
    }

    #[test]
    fn bad_layouts_are_named() {
        assert!(Stride::new(0, 4).problem().unwrap().contains("run of 0"));
        assert!(Stride::new(8, 4).problem().unwrap().contains("stride 4"));
        let s = Stride {
            run: 4,
            stride: 8,
            head: 4,
        };
        assert!(s.problem().unwrap().contains("head 4"));
        assert_eq!(s.end(3, 1), None, "offset before its run's start");
        assert_eq!(Stride::new(4, u64::MAX).end(0, 9), None, "overflow");
    }
}
