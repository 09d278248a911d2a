//! Which targets of a destination group get their writes listed in a task and which receive a
//! copy of a listed target's writes (`WriteCopies`): ranks laid out alike (another engine,
//! another attention replica) at evenly spaced ranks share one list, so a task to 128 ranks
//! lists its writes once or a few times instead of 128 times.
//!
//! Its own file because it is worked out once per destination group, apart from the per-task
//! emission that uses it, and it is what keeps the table small (and the receivers' expected
//! write counts right: [`TargetPlan::flush`]).

use smallvec::SmallVec;

use super::Planner;
use crate::layout_infer::{InferRank, InferenceLayout, Piece};
use crate::table::Shape;

/// How the tasks of one dgroup reach its targets: [`Planner::target_plan`].
pub(super) struct TargetPlan {
    /// The dgroup this is for (`u32::MAX`: none yet).
    pub(super) dgroup: u32,
    /// Targets whose writes are listed, in target order, with their destination tensors (looked
    /// up once per dgroup rather than once per task).
    pub(super) listed: SmallVec<[ListedDst; 2]>,
    /// The other targets, as copies of a listed one's writes.
    pub(super) copies: SmallVec<[TargetCopy; 4]>,
}

impl TargetPlan {
    /// A plan for no dgroup yet.
    pub(super) fn none() -> TargetPlan {
        TargetPlan {
            dgroup: u32::MAX,
            listed: SmallVec::new(),
            copies: SmallVec::new(),
        }
    }

    /// Counts the copied writes of the dgroup's tasks so far toward each receiving rank.
    pub(super) fn flush(&mut self, rollout_writes: &mut [u64]) {
        for c in &mut self.copies {
            for i in 0..c.count {
                rollout_writes[(c.first_rank + i * c.stride) as usize] += c.writes;
            }
            c.writes = 0;
        }
    }
}

/// A listed target: its piece and where its tensor (and scale tensor) lie.
pub(super) struct ListedDst {
    pub(super) piece: Piece,
    pub(super) shape: Shape,
    pub(super) elem: u64,
    pub(super) mr: u16,
    pub(super) offset: u64,
    /// Shape, MR and offset of the scale tensor (fp8).
    pub(super) scales: Option<(Shape, u16, u64)>,
    /// The current task's writes to it: first (relative to the task) and count.
    pub(super) task_writes: (u32, u32),
}

/// Ranks `first_rank + i * stride`, `i < count`, receiving the writes of listed target `base`
/// (an index into [`TargetPlan::listed`]); `writes` counts them for the dgroup's tasks so far.
#[derive(Clone, Copy)]
pub(super) struct TargetCopy {
    pub(super) base: u32,
    pub(super) first_rank: u32,
    pub(super) stride: u32,
    pub(super) count: u32,
    pub(super) writes: u64,
}

impl Planner<'_> {
    /// Which targets of dgroup `dgi` get their writes listed and which repeat a listed one's
    /// (another engine, another attention replica, laid out alike): the same for every task of
    /// the group, so worked out once per group. Copies are extended while their ranks stay
    /// evenly spaced; they come out in the order they close, then the still open ones in the
    /// order of their listed targets.
    pub(super) fn target_plan(&self, dgi: u32, plan: &mut TargetPlan, rollout_writes: &mut [u64]) {
        plan.flush(rollout_writes);
        let dg = &self.dgroups[dgi as usize];
        plan.dgroup = dgi;
        plan.listed.clear();
        plan.copies.clear();
        // Per listed target: the copy being extended.
        let mut open: SmallVec<[Option<TargetCopy>; 4]> = SmallVec::new();
        for k in 0..dg.n {
            let pc = self.target_piece(dg, k);
            let same = plan.listed.iter().position(|b| {
                let bp = &b.piece;
                self.layout_class[bp.rank as usize] == self.layout_class[pc.rank as usize]
                    && bp.tensor == pc.tensor
                    && bp.dst_start == pc.dst_start
                    && bp.scale == pc.scale
            });
            let Some(base) = same else {
                plan.listed.push(self.listed_dst(&pc));
                open.push(None);
                continue;
            };
            if let Some(c) = open[base].as_mut() {
                let next = c.first_rank as u64 + c.count as u64 * c.stride as u64;
                if c.count == 1 && pc.rank > c.first_rank {
                    c.stride = pc.rank - c.first_rank;
                    c.count = 2;
                    continue;
                }
                if c.count > 1 && pc.rank as u64 == next {
                    c.count += 1;
                    continue;
                }
            }
            plan.copies.extend(open[base].replace(TargetCopy {
                base: base as u32,
                first_rank: pc.rank,
                stride: 1,
                count: 1,
                writes: 0,
            }));
        }
        plan.copies.extend(open.into_iter().flatten());
    }

    /// Piece `pc` as a listed target, with its tensors looked up.
    fn listed_dst(&self, pc: &Piece) -> ListedDst {
        let rk = &self.infer.ranks[pc.rank as usize];
        let t = &rk.tensors[pc.tensor as usize];
        ListedDst {
            piece: *pc,
            shape: t.shape,
            elem: t.dtype.size() as u64,
            mr: t.mr,
            offset: t.offset,
            scales: pc.scale.map(|sc| {
                let st = &rk.tensors[sc.tensor as usize];
                (st.shape, st.mr, st.offset)
            }),
            task_writes: (0, 0),
        }
    }
}

/// Groups inference ranks whose tensors have the same shapes, dtypes, MRs and offsets (names may
/// differ: expert contents do, not their layout).
pub(super) fn layout_classes(infer: &InferenceLayout) -> Vec<u32> {
    let mut reps: Vec<usize> = Vec::new();
    let same = |a: &InferRank, b: &InferRank| {
        a.mr_bytes == b.mr_bytes
            && (std::sync::Arc::ptr_eq(&a.tensors, &b.tensors)
                || a.tensors.len() == b.tensors.len()
                    && a.tensors.iter().zip(b.tensors.iter()).all(|(x, y)| {
                        x.shape == y.shape
                            && x.dtype == y.dtype
                            && x.mr == y.mr
                            && x.offset == y.offset
                    }))
    };
    infer
        .ranks
        .iter()
        .map(
            |r| match reps.iter().position(|&k| same(&infer.ranks[k], r)) {
                Some(c) => c as u32,
                None => {
                    reps.push(r.rank as usize);
                    (reps.len() - 1) as u32
                }
            },
        )
        .collect()
}
