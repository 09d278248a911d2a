//! From write ops to chains of `ibv_send_wr`: splitting, lane assignment, immediates, chaining.
//!
//! Pure planning ([`plan_pieces`]) decides which bytes go on which lane as which WR:
//! - a write larger than `stripe_min` is striped over every lane of the peer (one QP rarely fills
//!   a link); smaller writes go whole to one lane, lanes taken round-robin;
//! - a piece never exceeds the port's maximum message size;
//! - the immediate must be counted only once all of a write's bytes landed. On one RC queue pair
//!   writes are placed in order, so an unstriped write carries its immediate on its last piece.
//!   Queue pairs do not order among each other, so a striped write sends its body without
//!   immediate on all lanes and a *deferred* tail piece with the immediate, posted only after
//!   every body piece completed.
//!
//! - a write from a strided source ([`Stride`]) gathers its runs with one scatter/gather entry
//!   each; a WR takes at most the queue pair's `max_sge` of them, so such a write is cut into as
//!   many WRs as its runs need, all on its lane (the immediate on the last, as above).
//!
//! [`SendChain`] then links a lane's WRs into one list so that one `ibv_post_send` (one doorbell,
//! one MMIO write to the NIC) posts several of them.

use ibverbs_sys as ffi;

use crate::fabric::stride::Stride;

/// One op after local and remote resolution (plain data: addresses and keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResolvedOp {
    /// Local source address (of the first byte).
    pub local_addr: u64,
    /// lkey of the source registration.
    pub lkey: u32,
    /// Remote destination address.
    pub remote_addr: u64,
    /// rkey of the destination registration.
    pub rkey: u32,
    /// Bytes.
    pub len: u64,
    /// Immediate.
    pub imm: Option<u32>,
    /// How the source bytes lie from `local_addr` when they are not contiguous.
    pub stride: Option<Stride>,
}

/// One work request to post.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WritePiece {
    /// Index of the op it belongs to.
    pub op: usize,
    /// Lane (queue pair index of the peer).
    pub lane: usize,
    /// Local source address (of the first byte).
    pub local_addr: u64,
    /// lkey.
    pub lkey: u32,
    /// How the source bytes lie from `local_addr` when they are not contiguous (their runs
    /// then fit the WR's scatter/gather entries).
    pub stride: Option<Stride>,
    /// Bytes (fits the port's maximum message size).
    pub len: u32,
    /// Remote destination address.
    pub remote_addr: u64,
    /// rkey.
    pub rkey: u32,
    /// Immediate (`RDMA_WRITE_WITH_IMM`) or none (`RDMA_WRITE`).
    pub imm: Option<u32>,
}

/// Bytes of a striped write that travel last, with its immediate, after the body landed.
pub const DEFERRED_TAIL_BYTES: u64 = 4096;

/// The planned pieces of a batch: `now` can be posted at once; `deferred` only after every piece
/// of `now` completed successfully.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PiecePlan {
    /// Posted first.
    pub now: Vec<WritePiece>,
    /// Posted after `now` completed.
    pub deferred: Vec<WritePiece>,
}

/// The most a WR may carry: the port's maximum message size, and scatter/gather entries per WR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrLimits {
    /// Bytes per WR (the smaller of both sides' `max_msg_sz`).
    pub max_msg: u64,
    /// Scatter/gather entries per send WR (the queue pairs' `max_send_sge`).
    pub max_sge: u32,
}

/// Plans the WRs of `ops` over `lanes` lanes. `first_lane` rotates the round-robin start between
/// batches.
pub fn plan_pieces(
    ops: &[ResolvedOp],
    lanes: usize,
    stripe_min: u64,
    limits: WrLimits,
    first_lane: usize,
) -> PiecePlan {
    let lanes = lanes.max(1);
    let limits = WrLimits {
        max_msg: limits.max_msg.clamp(1, u64::from(u32::MAX)),
        max_sge: limits.max_sge.max(1),
    };
    let mut plan = PiecePlan::default();
    let mut next_lane = first_lane % lanes;
    for (index, op) in ops.iter().enumerate() {
        if op.len == 0 {
            if let Some(imm) = op.imm {
                // A zero-length WRITE_WITH_IMM: only the notification travels.
                plan.now.push(piece(index, next_lane, op, 0, 0, Some(imm)));
                next_lane = (next_lane + 1) % lanes;
            }
            continue;
        }
        let striped = lanes > 1 && op.len > stripe_min;
        if !striped {
            push_split(
                &mut plan.now,
                index,
                next_lane,
                op,
                0,
                op.len,
                op.imm,
                limits,
            );
            next_lane = (next_lane + 1) % lanes;
            continue;
        }
        let (body_len, tail) = match op.imm {
            Some(imm) => {
                let tail = DEFERRED_TAIL_BYTES.min(op.len);
                (op.len - tail, Some((op.len - tail, tail, imm)))
            }
            None => (op.len, None),
        };
        if body_len > 0 {
            let stripes = super::super::op::stripe(body_len, lanes, stripe_min, 4096);
            for (k, (offset, len)) in stripes.into_iter().enumerate() {
                let lane = (next_lane + k) % lanes;
                push_split(&mut plan.now, index, lane, op, offset, len, None, limits);
            }
        }
        if let Some((offset, len, imm)) = tail {
            push_split(
                &mut plan.deferred,
                index,
                next_lane,
                op,
                offset,
                len,
                Some(imm),
                limits,
            );
        }
        next_lane = (next_lane + 1) % lanes;
    }
    plan
}

fn piece(
    op_index: usize,
    lane: usize,
    op: &ResolvedOp,
    offset: u64,
    len: u32,
    imm: Option<u32>,
) -> WritePiece {
    let (local_addr, stride) = match op.stride {
        None => (op.local_addr + offset, None),
        Some(s) => {
            let (at, s) = s.advance(op.local_addr, offset);
            (at, (s.head + u64::from(len) > s.run).then_some(s))
        }
    };
    WritePiece {
        op: op_index,
        lane,
        local_addr,
        lkey: op.lkey,
        stride,
        len,
        remote_addr: op.remote_addr + offset,
        rkey: op.rkey,
        imm,
    }
}

/// Pushes `[offset, offset + len)` of `op` as pieces of at most `max_msg` bytes (and, from a
/// strided source, `max_sge` runs) on one lane; the immediate goes on the last one (RC places a
/// lane's writes in order).
#[allow(clippy::too_many_arguments)]
fn push_split(
    out: &mut Vec<WritePiece>,
    op_index: usize,
    lane: usize,
    op: &ResolvedOp,
    offset: u64,
    len: u64,
    imm: Option<u32>,
    limits: WrLimits,
) {
    let mut done = 0;
    while done < len {
        let mut n = (len - done).min(limits.max_msg);
        if let Some(s) = op.stride {
            let (_, here) = s.advance(op.local_addr, offset + done);
            n = n.min(here.bytes_in(u64::from(limits.max_sge)));
        }
        let last = done + n == len;
        out.push(piece(
            op_index,
            lane,
            op,
            offset + done,
            n as u32,
            if last { imm } else { None },
        ));
        done += n;
    }
}

/// A linked list of send WRs with their scatter entries, ready for one `ibv_post_send`.
///
/// The WRs and SGEs live in boxed slices that never move, so the `next` and `sg_list` pointers
/// stay valid for the life of the chain.
pub struct SendChain {
    wrs: Box<[ffi::ibv_send_wr]>,
    _sges: Box<[ffi::ibv_sge]>,
}

impl std::fmt::Debug for SendChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendChain")
            .field("wrs", &self.wrs.len())
            .finish()
    }
}

impl SendChain {
    /// Builds the chain: `(piece, wr_id, signalled)` per WR, in posting order. A piece from a
    /// strided source gets one scatter/gather entry per run.
    pub fn new(items: &[(WritePiece, u64, bool)]) -> SendChain {
        // Where each WR's entries start in `sges`, and how many it has.
        let mut spans = Vec::with_capacity(items.len());
        let mut sges: Vec<ffi::ibv_sge> = Vec::with_capacity(items.len());
        for (p, _, _) in items {
            let first = sges.len();
            let len = u64::from(p.len);
            match p.stride {
                None if len > 0 => sges.push(ffi::ibv_sge {
                    addr: p.local_addr,
                    length: p.len,
                    lkey: p.lkey,
                }),
                None => {}
                Some(s) => sges.extend(s.segments(p.local_addr, len).map(|(addr, n)| {
                    ffi::ibv_sge {
                        addr,
                        // A run is at most Stride::MAX_RUN bytes, and a piece at most u32::MAX.
                        length: n as u32,
                        lkey: p.lkey,
                    }
                })),
            }
            spans.push((first, sges.len() - first));
        }
        let mut sges = sges.into_boxed_slice();
        let mut wrs: Box<[ffi::ibv_send_wr]> = items
            .iter()
            .map(|(p, wr_id, signalled)| {
                let mut wr = ffi::ibv_send_wr {
                    wr_id: *wr_id,
                    num_sge: 0,
                    opcode: if p.imm.is_some() {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
                    } else {
                        ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE
                    },
                    send_flags: if *signalled {
                        ffi::ibv_send_flags::IBV_SEND_SIGNALED.0
                    } else {
                        0
                    },
                    ..Default::default()
                };
                wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
                    remote_addr: p.remote_addr,
                    rkey: p.rkey,
                };
                // The immediate travels in network byte order.
                wr.__bindgen_anon_1.imm_data = p.imm.unwrap_or(0).to_be();
                wr
            })
            .collect();
        let n = wrs.len();
        let wr_base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            let (first, count) = spans[i];
            wr.num_sge = count as i32;
            wr.sg_list = if count == 0 {
                std::ptr::null_mut()
            } else {
                // Pointer arithmetic inside the boxed slice; no dereference here.
                sges.as_mut_ptr().wrapping_add(first)
            };
            wr.next = if i + 1 < n {
                wr_base.wrapping_add(i + 1)
            } else {
                std::ptr::null_mut()
            };
        }
        SendChain { wrs, _sges: sges }
    }

    /// Number of WRs.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// Whether the chain is empty.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// The WRs (for inspection).
    pub fn wrs(&self) -> &[ffi::ibv_send_wr] {
        &self.wrs
    }

    /// The index in this chain of the WR `wr` points at (`bad_wr` of a failed post), if it is
    /// one of ours. Compares addresses only; nothing is dereferenced.
    pub fn index_of(&self, wr: *const ffi::ibv_send_wr) -> Option<usize> {
        let base = self.wrs.as_ptr() as usize;
        let size = std::mem::size_of::<ffi::ibv_send_wr>();
        let at = (wr as usize).checked_sub(base)?;
        (at % size == 0 && at / size < self.wrs.len()).then_some(at / size)
    }

    /// Pointer to the first WR, for `ibv_post_send`; null when empty.
    pub fn head(&mut self) -> *mut ffi::ibv_send_wr {
        if self.wrs.is_empty() {
            std::ptr::null_mut()
        } else {
            self.wrs.as_mut_ptr()
        }
    }
}

/// Splits `n` WRs into consecutive doorbell groups of at most `per_doorbell`.
pub fn doorbell_groups(n: usize, per_doorbell: usize) -> Vec<std::ops::Range<usize>> {
    let per = per_doorbell.max(1);
    (0..n)
        .step_by(per)
        .map(|start| start..(start + per).min(n))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(len: u64, imm: Option<u32>) -> ResolvedOp {
        ResolvedOp {
            local_addr: 0x10_0000,
            lkey: 11,
            remote_addr: 0x90_0000,
            rkey: 22,
            len,
            imm,
            stride: None,
        }
    }

    fn limits(max_msg: u64) -> WrLimits {
        WrLimits {
            max_msg,
            max_sge: 16,
        }
    }

    fn covered(pieces: &[&WritePiece], op: &ResolvedOp) -> u64 {
        let mut ranges: Vec<(u64, u64)> = pieces
            .iter()
            .map(|p| (p.remote_addr - op.remote_addr, u64::from(p.len)))
            .collect();
        ranges.sort();
        let mut next = 0;
        for (o, n) in ranges {
            assert_eq!(o, next, "pieces must tile the op without gaps or overlap");
            next += n;
        }
        next
    }

    #[test]
    fn small_writes_round_robin_whole_with_their_immediate() {
        let ops = [op(100, Some(1)), op(200, None), op(300, Some(3))];
        let plan = plan_pieces(&ops, 2, 1 << 20, limits(1 << 31), 1);
        assert!(plan.deferred.is_empty());
        let lanes: Vec<usize> = plan.now.iter().map(|p| p.lane).collect();
        assert_eq!(lanes, vec![1, 0, 1]);
        assert_eq!(plan.now[0].imm, Some(1));
        assert_eq!(plan.now[1].imm, None);
        assert_eq!(plan.now[2].len, 300);
    }

    #[test]
    fn striped_write_defers_a_tail_with_the_immediate() {
        let o = op(4 << 20, Some(9));
        let plan = plan_pieces(&[o], 4, 256 << 10, limits(1 << 31), 0);
        assert!(plan.now.iter().all(|p| p.imm.is_none()));
        let body_lanes: std::collections::BTreeSet<usize> =
            plan.now.iter().map(|p| p.lane).collect();
        assert_eq!(body_lanes.len(), 4, "the body uses every lane");
        assert_eq!(plan.deferred.len(), 1);
        assert_eq!(plan.deferred[0].imm, Some(9));
        assert_eq!(u64::from(plan.deferred[0].len), DEFERRED_TAIL_BYTES);
        let all: Vec<&WritePiece> = plan.now.iter().chain(&plan.deferred).collect();
        assert_eq!(covered(&all, &o), 4 << 20);
        // Local and remote addresses move together.
        for p in &all {
            assert_eq!(p.local_addr - o.local_addr, p.remote_addr - o.remote_addr);
        }
    }

    #[test]
    fn striped_write_without_immediate_has_no_deferred_part() {
        let o = op(1 << 20, None);
        let plan = plan_pieces(&[o], 2, 256 << 10, limits(1 << 31), 0);
        assert!(plan.deferred.is_empty());
        let all: Vec<&WritePiece> = plan.now.iter().collect();
        assert_eq!(covered(&all, &o), 1 << 20);
    }

    #[test]
    fn pieces_respect_the_max_message_size_and_keep_imm_last() {
        let o = op(10_000, Some(5));
        let plan = plan_pieces(&[o], 1, 0, limits(4096), 0);
        assert_eq!(plan.now.len(), 3);
        assert!(plan.now.iter().all(|p| p.len <= 4096 && p.lane == 0));
        assert_eq!(plan.now.iter().filter(|p| p.imm.is_some()).count(), 1);
        assert_eq!(plan.now[2].imm, Some(5));
        let all: Vec<&WritePiece> = plan.now.iter().collect();
        assert_eq!(covered(&all, &o), 10_000);
    }

    #[test]
    fn zero_length_ops_send_only_an_immediate() {
        let plan = plan_pieces(&[op(0, None), op(0, Some(4))], 2, 0, limits(1 << 31), 0);
        assert_eq!(plan.now.len(), 1);
        assert_eq!((plan.now[0].len, plan.now[0].imm), (0, Some(4)));
    }

    #[test]
    fn strided_writes_gather_their_runs_within_the_sge_limit() {
        // Runs of 3000 bytes every 8192, starting 1000 bytes into a run: 40 000 bytes.
        let s = Stride {
            run: 3000,
            stride: 8192,
            head: 1000,
        };
        let o = ResolvedOp {
            stride: Some(s),
            ..op(40_000, Some(7))
        };
        let lim = WrLimits {
            max_msg: 1 << 31,
            max_sge: 4,
        };
        // Short of the stripe threshold: every WR on one lane, the immediate on the last.
        let plan = plan_pieces(&[o], 2, 1 << 20, lim, 0);
        assert!(plan.deferred.is_empty());
        let all: Vec<&WritePiece> = plan.now.iter().collect();
        assert_eq!(covered(&all, &o), 40_000);
        assert!(plan.now.iter().all(|p| p.lane == plan.now[0].lane));
        assert_eq!(plan.now.iter().filter(|p| p.imm.is_some()).count(), 1);
        assert_eq!(plan.now.last().unwrap().imm, Some(7));
        let items: Vec<(WritePiece, u64, bool)> = plan.now.iter().map(|&p| (p, 0, false)).collect();
        let chain = SendChain::new(&items);
        // Every source byte, in order, from the WRs' scatter/gather lists.
        let mut bytes = Vec::new();
        for wr in chain.wrs() {
            assert!((1..=4).contains(&wr.num_sge), "{}", wr.num_sge);
            for k in 0..wr.num_sge as usize {
                // SAFETY: sg_list points at num_sge entries of the chain's own SGE slice.
                let sge = unsafe { *wr.sg_list.add(k) };
                bytes.extend(sge.addr..sge.addr + u64::from(sge.length));
            }
        }
        let want: Vec<u64> = s
            .segments(o.local_addr, o.len)
            .flat_map(|(a, n)| a..a + n)
            .collect();
        assert_eq!(bytes, want);
    }

    #[test]
    fn chain_links_wrs_and_sets_opcodes_flags_and_imm() {
        let pieces = [
            WritePiece {
                op: 0,
                lane: 0,
                local_addr: 0x1000,
                lkey: 1,
                stride: None,
                len: 64,
                remote_addr: 0x2000,
                rkey: 2,
                imm: None,
            },
            WritePiece {
                op: 1,
                lane: 0,
                local_addr: 0x1040,
                lkey: 1,
                stride: None,
                len: 0,
                remote_addr: 0x2040,
                rkey: 2,
                imm: Some(0x0102_0304),
            },
        ];
        let mut chain = SendChain::new(&[(pieces[0], 77, false), (pieces[1], 78, true)]);
        assert_eq!(chain.len(), 2);
        let head = chain.head();
        let wrs = chain.wrs();
        assert_eq!(head as *const _, &wrs[0] as *const _);
        assert_eq!(wrs[0].next as *const _, &wrs[1] as *const _);
        assert!(wrs[1].next.is_null());
        assert_eq!(wrs[0].opcode, ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE);
        assert_eq!(
            wrs[1].opcode,
            ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM
        );
        assert_eq!(wrs[0].send_flags, 0);
        assert_eq!(wrs[1].send_flags, ffi::ibv_send_flags::IBV_SEND_SIGNALED.0);
        assert_eq!((wrs[0].wr_id, wrs[1].wr_id), (77, 78));
        assert_eq!(wrs[0].num_sge, 1);
        assert_eq!(wrs[1].num_sge, 0);
        assert!(wrs[1].sg_list.is_null());
        // SAFETY: sg_list of WR 0 points into the chain's own SGE slice, alive while `chain` is.
        let sge = unsafe { *wrs[0].sg_list };
        assert_eq!((sge.addr, sge.length, sge.lkey), (0x1000, 64, 1));
        // SAFETY: reading plain-old-data unions we wrote in `SendChain::new`.
        let (remote, imm) = unsafe { (wrs[0].wr.rdma, wrs[1].__bindgen_anon_1.imm_data) };
        assert_eq!((remote.remote_addr, remote.rkey), (0x2000, 2));
        assert_eq!(u32::from_be(imm), 0x0102_0304);
        // bad_wr of a failed post maps back to its index.
        assert_eq!(chain.index_of(&chain.wrs()[1]), Some(1));
        assert_eq!(chain.index_of(std::ptr::null()), None);
    }

    #[test]
    fn doorbell_groups_cover_in_order() {
        assert_eq!(doorbell_groups(0, 4), Vec::<std::ops::Range<usize>>::new());
        assert_eq!(doorbell_groups(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(doorbell_groups(3, 0), vec![0..1, 1..2, 2..3]);
    }
}
