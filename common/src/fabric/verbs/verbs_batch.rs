//! Write futures waiting for completions: the table the progress thread completes.
//!
//! A posting call registers a token with the number of lanes its pieces went to; each lane's
//! final WR is signalled. A lane's share ends with the completion of that final WR: a success
//! means every piece of the share was acknowledged by the peer (an RC queue completes in order).
//! An error completion records, per lane, the *first* piece that did not land, and whether it
//! really failed (e.g. the peer refused the rkey) or was only flushed because another WR on the
//! same queue pair failed before it. Every outstanding WR of a failed queue pair completes with a
//! flush error, signalled or not, so the final WR's completion always arrives and the share
//! always ends. When all shares ended the waiter gets the list of [`LaneFailure`]s (empty: all
//! landed) and decides what to re-post on a fresh queue pair.

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::super::error::FabricError;
use super::verbs_completion::PieceTarget;
use super::verbs_wr::WritePiece;

/// How one lane's share of a posting call went wrong.
#[derive(Debug, Clone)]
pub struct LaneFailure {
    /// The lane.
    pub lane: usize,
    /// Index (in the posting call) of the first piece on this lane that did not land; every
    /// earlier piece of the lane landed, every later one did not.
    pub first_piece: u32,
    /// Why.
    pub error: FabricError,
    /// `true`: the piece was only flushed (never executed) and may be re-posted; `false`: the
    /// piece itself failed.
    pub flushed: bool,
}

struct Entry {
    lanes_left: usize,
    targets: Vec<PieceTarget>,
    failures: BTreeMap<usize, LaneFailure>,
    done: oneshot::Sender<Vec<LaneFailure>>,
}

/// Pending posting calls by token.
#[derive(Default)]
pub struct BatchTable {
    entries: Mutex<HashMap<u64, Entry>>,
}

impl std::fmt::Debug for BatchTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchTable")
            .field("pending", &self.entries.lock().len())
            .finish()
    }
}

impl BatchTable {
    /// Registers `token`, whose pieces went to `lanes` lanes. `targets[i]` describes piece `i`.
    pub fn register(
        &self,
        token: u64,
        lanes: usize,
        targets: Vec<PieceTarget>,
    ) -> oneshot::Receiver<Vec<LaneFailure>> {
        let (tx, rx) = oneshot::channel();
        if lanes == 0 {
            let _ = tx.send(Vec::new());
            return rx;
        }
        self.entries.lock().insert(
            token,
            Entry {
                lanes_left: lanes,
                targets,
                failures: BTreeMap::new(),
                done: tx,
            },
        );
        rx
    }

    /// Where piece `piece` of `token` was going, if the token is still pending.
    pub fn target(&self, token: u64, piece: u32) -> Option<PieceTarget> {
        self.entries
            .lock()
            .get(&token)
            .and_then(|e| e.targets.get(piece as usize).cloned())
    }

    /// The final WR of one lane's share of `token` succeeded.
    pub fn lane_done(&self, token: u64) {
        self.share_ended(token);
    }

    /// A WR of `token` completed with an error. `is_final` says whether it was the lane's final
    /// WR (which ends the lane's share).
    pub fn piece_failed(
        &self,
        token: u64,
        piece: u32,
        is_final: bool,
        error: FabricError,
        flushed: bool,
    ) {
        let mut entries = self.entries.lock();
        let Some(entry) = entries.get_mut(&token) else {
            return;
        };
        let Some(lane) = entry.targets.get(piece as usize).map(|t| t.lane) else {
            return;
        };
        entry.failures.entry(lane).or_insert(LaneFailure {
            lane,
            first_piece: piece,
            error,
            flushed,
        });
        drop(entries);
        if is_final {
            self.share_ended(token);
        }
    }

    fn share_ended(&self, token: u64) {
        let mut entries = self.entries.lock();
        let finished = match entries.get_mut(&token) {
            Some(e) => {
                e.lanes_left = e.lanes_left.saturating_sub(1);
                e.lanes_left == 0
            }
            None => false,
        };
        if finished {
            if let Some(e) = entries.remove(&token) {
                let _ = e.done.send(e.failures.into_values().collect());
            }
        }
    }

    /// Forgets `token` (its waiter gave up or failed before posting everything).
    pub fn forget(&self, token: u64) {
        self.entries.lock().remove(&token);
    }

    /// Tokens still pending.
    pub fn pending(&self) -> usize {
        self.entries.lock().len()
    }
}

/// What to do after a posting call ended with `failures`.
#[derive(Debug, Default)]
pub struct Repost {
    /// Pieces that never executed (flushed), to post again on fresh queue pairs, in order.
    pub pieces: Vec<WritePiece>,
    /// The first real failure (a piece the peer refused), if any: the call's error.
    pub refused: Option<FabricError>,
    /// The piece that failed with `refused`.
    pub refused_piece: Option<WritePiece>,
    /// The error to report if re-posting is given up (the first failure of any kind).
    pub first_error: Option<FabricError>,
}

/// Splits `pieces` (the posting call, indexed as in its tokens) by `failures`: on each failed
/// lane, pieces before the first failure landed; the failed piece itself is dropped if it really
/// failed; it and the later ones of that lane are re-posted otherwise (they were only flushed).
pub fn plan_repost(pieces: &[WritePiece], failures: &[LaneFailure]) -> Repost {
    let mut out = Repost::default();
    for f in failures {
        if out.first_error.is_none() {
            out.first_error = Some(f.error.clone());
        }
        if !f.flushed && out.refused.is_none() {
            out.refused = Some(f.error.clone());
            out.refused_piece = pieces.get(f.first_piece as usize).copied();
        }
    }
    for (i, p) in pieces.iter().enumerate() {
        let Some(f) = failures.iter().find(|f| f.lane == p.lane) else {
            continue;
        };
        let i = i as u32;
        if i > f.first_piece || (i == f.first_piece && f.flushed) {
            out.pieces.push(*p);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(lane: usize) -> PieceTarget {
        PieceTarget {
            peer: "p:1".into(),
            lane,
            rkey: 1,
            offset: 0,
            len: 8,
        }
    }

    #[test]
    fn resolves_clean_after_every_lane() {
        let t = BatchTable::default();
        let mut rx = t.register(5, 2, vec![target(0), target(1)]);
        t.lane_done(5);
        assert!(rx.try_recv().is_err(), "one lane left");
        t.lane_done(5);
        assert!(rx.try_recv().unwrap().is_empty());
        assert_eq!(t.pending(), 0);
        // Late completions of a resolved token are ignored.
        t.lane_done(5);
        t.piece_failed(5, 0, true, FabricError::Shutdown, true);
    }

    #[test]
    fn records_the_first_failed_piece_per_lane_and_waits_for_finals() {
        let t = BatchTable::default();
        // Pieces 0,1,2 on lane 0; piece 3 on lane 1.
        let mut rx = t.register(9, 2, vec![target(0), target(0), target(0), target(1)]);
        assert_eq!(t.target(9, 3).unwrap().lane, 1);
        assert!(t.target(9, 7).is_none());
        t.piece_failed(9, 1, false, FabricError::Config("refused".into()), false);
        t.piece_failed(9, 2, true, FabricError::Shutdown, true);
        assert!(rx.try_recv().is_err(), "lane 1 still in flight");
        t.lane_done(9);
        let failures = rx.try_recv().unwrap();
        assert_eq!(failures.len(), 1);
        let f = &failures[0];
        assert_eq!((f.lane, f.first_piece, f.flushed), (0, 1, false));
        assert!(f.error.to_string().contains("refused"));
    }

    #[test]
    fn nothing_to_wait_for_resolves_at_once() {
        let t = BatchTable::default();
        let mut rx = t.register(1, 0, Vec::new());
        assert!(rx.try_recv().unwrap().is_empty());
        let _rx = t.register(2, 1, Vec::new());
        t.forget(2);
        assert_eq!(t.pending(), 0);
    }

    fn piece(lane: usize, local_addr: u64) -> WritePiece {
        WritePiece {
            op: 0,
            lane,
            local_addr,
            lkey: 1,
            len: 8,
            remote_addr: local_addr,
            rkey: 2,
            imm: None,
        }
    }

    #[test]
    fn repost_skips_landed_and_refused_pieces() {
        // Lane 0: pieces 0, 2, 4; lane 1: pieces 1, 3.
        let pieces: Vec<WritePiece> = (0..5).map(|i| piece(i % 2, i as u64 * 8)).collect();
        let refused = FabricError::Config("refused".into());
        let failures = vec![
            // Piece 2 was refused: 0 landed, 2 is dropped, 4 was flushed.
            LaneFailure {
                lane: 0,
                first_piece: 2,
                error: refused.clone(),
                flushed: false,
            },
            // Lane 1 flushed from piece 1 on: both of its pieces go again.
            LaneFailure {
                lane: 1,
                first_piece: 1,
                error: FabricError::Shutdown,
                flushed: true,
            },
        ];
        let r = plan_repost(&pieces, &failures);
        let again: Vec<u64> = r.pieces.iter().map(|p| p.local_addr / 8).collect();
        assert_eq!(again, vec![1, 3, 4]);
        assert!(r.refused.unwrap().to_string().contains("refused"));
        assert_eq!(r.refused_piece.unwrap().local_addr, 16);
        assert!(r.first_error.is_some());

        let clean = plan_repost(&pieces, &[]);
        assert!(clean.pieces.is_empty() && clean.refused.is_none() && clean.first_error.is_none());
    }
}
