//! Engines laid out alike: a layout whose engines are copies of its first one, but for their
//! ranks ([`InferenceLayout::engine_period`]).
//!
//! Its own file because it is what lets the planner look at one engine where there are many:
//! `dp` engines hold the same tensors and receive the same boxes, so validating, grouping and
//! sorting engine 0's pieces says everything about the others, whose pieces are engine 0's with
//! the rank moved by a whole engine. At 10,240 GPUs that is 97 thousand pieces instead of
//! 6.2 million. [`InferenceLayout::build`] always lays engines out so; a layout made by hand may
//! not, and is then planned piece by piece, as before.

use rayon::prelude::*;

use super::{InferRank, InferenceLayout, Piece};

/// How a layout repeats its first engine (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePeriod {
    /// Engines (at least 1).
    pub engines: u32,
    /// Ranks per engine: engine `e` holds ranks `e * ranks .. (e + 1) * ranks`.
    pub ranks: u32,
    /// Pieces per engine: engine `e`'s are `pieces[e * pieces .. (e + 1) * pieces]`, each
    /// engine 0's piece at the same position with its rank moved by `e * ranks`.
    pub pieces: usize,
}

impl InferenceLayout {
    /// Whether every engine is engine 0 but for its ranks, and how: engine 0 is the ranks
    /// listed first with `engine == 0`, every rank `i` is listed at its index with engine
    /// `i / ranks` and local rank `i % ranks`, holds the tensors and MR sizes of rank
    /// `i % ranks`, and the pieces are engine 0's repeated engine after engine with the rank
    /// moved. `None` when any of that fails (or there are no ranks).
    pub fn engine_period(&self) -> Option<EnginePeriod> {
        let n = self.ranks.iter().take_while(|r| r.engine == 0).count();
        if n == 0 || !self.ranks.len().is_multiple_of(n) || n > u32::MAX as usize {
            return None;
        }
        let engines = self.ranks.len() / n;
        let first: &[InferRank] = &self.ranks[..n];
        let ranks_alike = self.ranks.iter().enumerate().all(|(i, r)| {
            let f = &first[i % n];
            r.rank as usize == i
                && r.engine as usize == i / n
                && r.local_rank as usize == i % n
                && r.mr_bytes == f.mr_bytes
                && (std::sync::Arc::ptr_eq(&r.tensors, &f.tensors) || r.tensors == f.tensors)
        });
        if !ranks_alike {
            return None;
        }
        let per = self
            .pieces
            .iter()
            .take_while(|p| (p.rank as usize) < n)
            .count();
        if per.checked_mul(engines) != Some(self.pieces.len()) {
            return None;
        }
        let engine0: &[Piece] = &self.pieces[..per];
        let shift = n as u64;
        let pieces_alike =
            self.pieces[per..]
                .par_chunks(per.max(1))
                .enumerate()
                .all(|(e, chunk)| {
                    let by = (e as u64 + 1) * shift;
                    chunk.iter().zip(engine0).all(|(p, f)| {
                        u64::from(p.rank) == u64::from(f.rank) + by
                            && Piece { rank: p.rank, ..*f } == *p
                    })
                });
        pieces_alike.then_some(EnginePeriod {
            engines: engines as u32,
            ranks: n as u32,
            pieces: per,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ExpertForm, Model};

    fn layout(spec: &str) -> InferenceLayout {
        let m = Model::preset("qwen3-30b-a3b", ExpertForm::PerExpert).unwrap();
        InferenceLayout::build(&m, &spec.parse().unwrap()).unwrap()
    }

    #[test]
    fn built_layouts_repeat_their_first_engine() {
        let l = layout("tp=2,ep=4,dp=3,dtype=fp8");
        let p = l.engine_period().expect("periodic");
        assert_eq!((p.engines, p.ranks), (3, 4));
        assert_eq!(p.pieces * 3, l.pieces.len());
        let one = layout("tp=2");
        let p = one.engine_period().expect("one engine");
        assert_eq!((p.engines, p.ranks, p.pieces), (1, 2, one.pieces.len()));
    }

    #[test]
    fn a_layout_whose_engines_differ_is_not_periodic() {
        let base = layout("tp=2,dp=2");
        let per = base.engine_period().unwrap().pieces;
        // A piece of engine 1 moved to another tensor offset.
        let mut l = base.clone();
        l.pieces[per + 3].dst_start[0] += 1;
        assert_eq!(l.engine_period(), None);
        // A piece of engine 1 naming the wrong rank.
        let mut l = base.clone();
        l.pieces[per].rank = 0;
        assert_eq!(l.engine_period(), None);
        // One piece fewer in engine 1.
        let mut l = base.clone();
        l.pieces.pop();
        assert_eq!(l.engine_period(), None);
        // Engine 1's rank holding other MR sizes.
        let mut l = base.clone();
        l.ranks[2].mr_bytes[0] += 1;
        assert_eq!(l.engine_period(), None);
        // A rank listed out of place.
        let mut l = base.clone();
        l.ranks.swap(2, 3);
        assert_eq!(l.engine_period(), None);
        // No ranks.
        let mut l = base;
        l.ranks.clear();
        l.pieces.clear();
        assert_eq!(l.engine_period(), None);
    }
}
