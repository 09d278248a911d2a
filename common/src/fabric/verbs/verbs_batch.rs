//! Write futures waiting for completions: the table the progress thread completes, and the
//! planner that decides what a failed posting call means.
//!
//! A posting call registers a token, then posts its pieces lane by lane in *chunks* (as many as
//! the send queue and the receive credits allow at a time). The last WR of every chunk is
//! signalled and marked final; a chunk ends with that WR's completion. A success means every piece
//! of the chunk was acknowledged by the peer (an RC queue completes in order). An error completion
//! records, per lane, the *first* piece that did not land and the [`FailureCause`]. Every
//! outstanding WR of a failed queue pair completes with a flush error, signalled or not, so the
//! final WR's completion always arrives and the chunk always ends. When posting is done and every
//! chunk ended, the waiter gets the list of [`LaneFailure`]s (empty: all landed) and
//! [`plan_repost`] decides what may go again on a fresh queue pair.
//!
//! The entry keeps the write's source regions alive until every chunk ended, also when the waiter
//! gave up early (a timeout, a reset, another peer's error): dropping the last handle of a source
//! deregisters it, and an `ibv_dereg_mr` under WRs still in flight fails them with
//! `IBV_WC_LOC_PROT_ERR` and with them every other write on that queue pair.
//!
//! # What a flush means
//! `IBV_WC_WR_FLUSH_ERR` says only that the WR was outstanding when the queue pair entered the
//! error state, not that the responder never executed it: a WR executed at the peer whose ACK had
//! not yet come back is flushed by a cut, a reset, lost ACKs (`RETRY_EXC_ERR`) or a local error on
//! a later WR. Re-posting such a WRITE_WITH_IMM would count its immediate twice, so a flushed piece
//! with an immediate is never re-posted: the write fails instead (the contract allows a write
//! reported failed whose bytes landed). Imm-less pieces are re-posted (the same bytes land again).
//! Only behind a NAK (the peer refused a WR, or its receive queue stayed empty: RNR) does the
//! responder discard everything that follows, and there the flushed pieces, immediates included,
//! really did not run.

use std::collections::{BTreeMap, HashMap};

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::super::error::FabricError;
use super::super::region::Region;
use super::verbs_completion::{FailureCause, PieceTarget};
use super::verbs_wr::WritePiece;

/// How one lane's share of a posting call went wrong.
#[derive(Debug, Clone)]
pub struct LaneFailure {
    /// The lane.
    pub lane: usize,
    /// Index (in the posting call) of the first piece on this lane that did not land for sure;
    /// every earlier piece of the lane landed.
    pub first_piece: u32,
    /// Why.
    pub error: FabricError,
    /// What the failure says about the piece and those behind it.
    pub cause: FailureCause,
}

struct Entry {
    /// Chunks posted (or being posted) whose final WR has not completed.
    chunks_open: usize,
    /// No more chunks will be posted.
    posting_done: bool,
    targets: Vec<PieceTarget>,
    failures: BTreeMap<usize, LaneFailure>,
    done: Option<oneshot::Sender<Vec<LaneFailure>>>,
    /// Source regions, alive until every chunk ended.
    _keep: Vec<Region>,
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
    /// Registers `token`. `targets[i]` describes piece `i`; `keep` stays alive until every chunk
    /// of the token ended.
    pub fn register(
        &self,
        token: u64,
        targets: Vec<PieceTarget>,
        keep: Vec<Region>,
    ) -> oneshot::Receiver<Vec<LaneFailure>> {
        let (tx, rx) = oneshot::channel();
        self.entries.lock().insert(
            token,
            Entry {
                chunks_open: 0,
                posting_done: false,
                targets,
                failures: BTreeMap::new(),
                done: Some(tx),
                _keep: keep,
            },
        );
        rx
    }

    /// A chunk of `token` is about to be posted (called before `ibv_post_send`, so that its
    /// completion can never be seen first).
    pub fn open_chunk(&self, token: u64) {
        if let Some(e) = self.entries.lock().get_mut(&token) {
            e.chunks_open += 1;
        }
    }

    /// The chunk opened last was not posted after all (no room, or the post failed before its
    /// final WR): no completion will end it.
    pub fn chunk_not_posted(&self, token: u64) {
        self.chunk_ended(token);
    }

    /// Every chunk of `token` has been posted.
    pub fn posting_done(&self, token: u64) {
        let mut entries = self.entries.lock();
        if let Some(e) = entries.get_mut(&token) {
            e.posting_done = true;
        }
        Self::finish_if_done(&mut entries, token);
    }

    /// Where piece `piece` of `token` was going, if the token is still pending.
    pub fn target(&self, token: u64, piece: u32) -> Option<PieceTarget> {
        self.entries
            .lock()
            .get(&token)
            .and_then(|e| e.targets.get(piece as usize).cloned())
    }

    /// The final WR of one chunk of `token` succeeded.
    pub fn chunk_done(&self, token: u64) {
        self.chunk_ended(token);
    }

    /// A WR of `token` completed with an error. `is_final` says whether it was its chunk's final
    /// WR (which ends the chunk).
    pub fn piece_failed(
        &self,
        token: u64,
        piece: u32,
        is_final: bool,
        error: FabricError,
        cause: FailureCause,
    ) {
        {
            let mut entries = self.entries.lock();
            let Some(entry) = entries.get_mut(&token) else {
                return;
            };
            if let Some(lane) = entry.targets.get(piece as usize).map(|t| t.lane) {
                entry.failures.entry(lane).or_insert(LaneFailure {
                    lane,
                    first_piece: piece,
                    error,
                    cause,
                });
            }
        }
        if is_final {
            self.chunk_ended(token);
        }
    }

    fn chunk_ended(&self, token: u64) {
        let mut entries = self.entries.lock();
        if let Some(e) = entries.get_mut(&token) {
            e.chunks_open = e.chunks_open.saturating_sub(1);
        }
        Self::finish_if_done(&mut entries, token);
    }

    fn finish_if_done(entries: &mut HashMap<u64, Entry>, token: u64) {
        let finished = entries
            .get(&token)
            .is_some_and(|e| e.posting_done && e.chunks_open == 0);
        if finished
            && let Some(e) = entries.remove(&token)
            && let Some(done) = e.done
        {
            let _ = done.send(e.failures.into_values().collect());
        }
    }

    /// The waiter of `token` gave up (or failed before posting everything): nobody is answered
    /// any more, but the entry (and the source regions it keeps) stays until every chunk already
    /// posted ended.
    pub fn forget(&self, token: u64) {
        let mut entries = self.entries.lock();
        if let Some(e) = entries.get_mut(&token) {
            e.done = None;
            e.posting_done = true;
        }
        Self::finish_if_done(&mut entries, token);
    }

    /// Tokens still pending.
    pub fn pending(&self) -> usize {
        self.entries.lock().len()
    }
}

/// What to do after a posting call ended with `failures`.
#[derive(Debug, Default)]
pub struct Repost {
    /// Pieces that did not run, or carry no immediate, to post again on fresh queue pairs, in
    /// order.
    pub pieces: Vec<WritePiece>,
    /// The first piece that failed itself (the peer refused it, or it failed on the way), if
    /// any: the call's error.
    pub refused: Option<FabricError>,
    /// The piece that failed with `refused`.
    pub refused_piece: Option<WritePiece>,
    /// A piece with an immediate that may have run and so must not be re-posted, with the error
    /// of its lane: the call fails with it (unless something was refused).
    pub lost: Option<(WritePiece, FabricError)>,
    /// The error to report if re-posting is given up (the first failure of any kind).
    pub first_error: Option<FabricError>,
}

/// Splits `pieces` (the posting call, indexed as in its tokens) by `failures`. On each failed
/// lane, pieces before the first failure landed. From the first failure on:
/// - a piece that failed itself ([`FailureCause::Nak`], [`FailureCause::Failed`]) is dropped and
///   reported;
/// - a piece known not to have run is re-posted, immediate or not;
/// - a piece that may have run is re-posted only without an immediate; one with an immediate is
///   *lost*: re-posting it could count its immediate twice.
pub fn plan_repost(pieces: &[WritePiece], failures: &[LaneFailure]) -> Repost {
    let mut out = Repost::default();
    for f in failures {
        if out.first_error.is_none() {
            out.first_error = Some(f.error.clone());
        }
        let itself = matches!(f.cause, FailureCause::Nak | FailureCause::Failed);
        if itself && out.refused.is_none() {
            out.refused = Some(f.error.clone());
            out.refused_piece = pieces.get(f.first_piece as usize).copied();
        }
    }
    for (i, p) in pieces.iter().enumerate() {
        let Some(f) = failures.iter().find(|f| f.lane == p.lane) else {
            continue;
        };
        let i = i as u32;
        if i < f.first_piece {
            continue;
        }
        let did_not_run = if i == f.first_piece {
            match f.cause {
                FailureCause::Nak | FailureCause::Failed => continue,
                FailureCause::ReceiverNotReady | FailureCause::FlushedBehindNak => true,
                FailureCause::Flushed => false,
            }
        } else {
            f.cause.later_pieces_did_not_run()
        };
        if did_not_run || p.imm.is_none() {
            out.pieces.push(*p);
        } else if out.lost.is_none() {
            out.lost = Some((*p, f.error.clone()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::{Access, Memory, RegionDescriptor, RegisteredMemory};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn target(lane: usize) -> PieceTarget {
        PieceTarget {
            peer: "p:1".into(),
            lane,
            rkey: 1,
            lkey: 2,
            offset: 0,
            len: 8,
        }
    }

    #[test]
    fn resolves_clean_after_every_chunk_and_the_end_of_posting() {
        let t = BatchTable::default();
        let mut rx = t.register(5, vec![target(0), target(1)], Vec::new());
        t.open_chunk(5);
        t.open_chunk(5);
        t.chunk_done(5);
        t.chunk_done(5);
        assert!(rx.try_recv().is_err(), "posting is not done yet");
        t.posting_done(5);
        assert!(rx.try_recv().unwrap().is_empty());
        assert_eq!(t.pending(), 0);
        // Late completions of a resolved token are ignored.
        t.chunk_done(5);
        t.piece_failed(5, 0, true, FabricError::Shutdown, FailureCause::Flushed);
    }

    #[test]
    fn records_the_first_failed_piece_per_lane_and_waits_for_finals() {
        let t = BatchTable::default();
        // Pieces 0,1,2 on lane 0; piece 3 on lane 1.
        let mut rx = t.register(
            9,
            vec![target(0), target(0), target(0), target(1)],
            Vec::new(),
        );
        t.open_chunk(9);
        t.open_chunk(9);
        t.posting_done(9);
        assert_eq!(t.target(9, 3).unwrap().lane, 1);
        assert!(t.target(9, 7).is_none());
        t.piece_failed(
            9,
            1,
            false,
            FabricError::Config("refused".into()),
            FailureCause::Nak,
        );
        t.piece_failed(
            9,
            2,
            true,
            FabricError::Shutdown,
            FailureCause::FlushedBehindNak,
        );
        assert!(rx.try_recv().is_err(), "lane 1 still in flight");
        t.chunk_done(9);
        let failures = rx.try_recv().unwrap();
        assert_eq!(failures.len(), 1);
        let f = &failures[0];
        assert_eq!((f.lane, f.first_piece, f.cause), (0, 1, FailureCause::Nak));
        assert!(f.error.to_string().contains("refused"));
    }

    #[test]
    fn nothing_posted_resolves_at_once() {
        let t = BatchTable::default();
        let mut rx = t.register(1, Vec::new(), Vec::new());
        t.open_chunk(1);
        t.chunk_not_posted(1);
        t.posting_done(1);
        assert!(rx.try_recv().unwrap().is_empty());
        let _rx = t.register(2, Vec::new(), Vec::new());
        t.forget(2);
        assert_eq!(t.pending(), 0);
    }

    fn source(calls: Arc<AtomicUsize>) -> Region {
        let mem = RegisteredMemory::new(Memory::alloc(64).unwrap());
        let desc = RegionDescriptor {
            endpoint: "me:1".into(),
            base: mem.as_ptr() as u64,
            len: 64,
            rkey: 0,
        };
        Region::new(
            mem,
            Access::SOURCE,
            desc,
            Box::new(move || {
                calls.fetch_add(1, Ordering::SeqCst);
            }),
        )
    }

    /// V11: a write that gave up (timeout, reset, another peer's error) while its WRs are in
    /// flight must not deregister their source: the table keeps it until the chunks ended.
    #[test]
    fn sources_stay_registered_until_every_posted_chunk_ended() {
        let t = BatchTable::default();
        let deregistered = Arc::new(AtomicUsize::new(0));
        let src = source(deregistered.clone());
        let rx = t.register(3, vec![target(0)], vec![src.clone()]);
        t.open_chunk(3);
        // The caller gives up: its future (and its handle of the source) is dropped.
        drop(rx);
        drop(src);
        t.forget(3);
        assert_eq!(
            deregistered.load(Ordering::SeqCst),
            0,
            "the source was deregistered under a WR still in flight"
        );
        t.piece_failed(3, 0, true, FabricError::Shutdown, FailureCause::Flushed);
        assert_eq!(deregistered.load(Ordering::SeqCst), 1);
        assert_eq!(t.pending(), 0);
    }

    fn piece(lane: usize, local_addr: u64, imm: Option<u32>) -> WritePiece {
        WritePiece {
            op: 0,
            lane,
            local_addr,
            lkey: 1,
            stride: None,
            len: 8,
            remote_addr: local_addr,
            rkey: 2,
            imm,
        }
    }

    fn failure(lane: usize, first_piece: u32, cause: FailureCause) -> LaneFailure {
        LaneFailure {
            lane,
            first_piece,
            error: FabricError::Config(format!("lane {lane} failed")),
            cause,
        }
    }

    fn indices(pieces: &[WritePiece]) -> Vec<u64> {
        pieces.iter().map(|p| p.local_addr / 8).collect()
    }

    #[test]
    fn repost_skips_landed_and_refused_pieces() {
        // Lane 0: pieces 0, 2, 4; lane 1: pieces 1, 3.
        let pieces: Vec<WritePiece> = (0..5).map(|i| piece(i % 2, i as u64 * 8, None)).collect();
        let failures = vec![
            // Piece 2 was refused: 0 landed, 2 is dropped, 4 did not run.
            failure(0, 2, FailureCause::Nak),
            // Lane 1 flushed from piece 1 on: both of its (imm-less) pieces go again.
            failure(1, 1, FailureCause::Flushed),
        ];
        let r = plan_repost(&pieces, &failures);
        assert_eq!(indices(&r.pieces), vec![1, 3, 4]);
        assert!(r.refused.unwrap().to_string().contains("lane 0"));
        assert_eq!(r.refused_piece.unwrap().local_addr, 16);
        assert!(r.first_error.is_some());
        assert!(r.lost.is_none());

        let clean = plan_repost(&pieces, &[]);
        assert!(clean.pieces.is_empty() && clean.refused.is_none() && clean.first_error.is_none());
    }

    /// V3: a flush does not mean the peer never executed the WR. A flushed piece carrying an
    /// immediate is never re-posted (its immediate may already be counted); the call fails.
    #[test]
    fn a_flushed_piece_with_an_immediate_is_never_reposted() {
        // One lane: an imm-less body piece, a piece with immediate 7, another imm-less piece.
        let pieces = vec![piece(0, 0, None), piece(0, 8, Some(7)), piece(0, 16, None)];
        for cause in [FailureCause::Flushed, FailureCause::Failed] {
            let r = plan_repost(&pieces, &[failure(0, 0, cause)]);
            assert!(
                r.pieces.iter().all(|p| p.imm.is_none()),
                "{cause:?}: an immediate was re-posted: {:?}",
                r.pieces
            );
            let (lost, _) = r.lost.expect("the write with an immediate must fail");
            assert_eq!(lost.imm, Some(7));
            // Imm-less pieces may go again (the same bytes land twice, harmlessly).
            assert!(indices(&r.pieces).contains(&2));
        }
        // The flushed piece with the immediate as the first failure, too.
        let r = plan_repost(&pieces, &[failure(0, 1, FailureCause::Flushed)]);
        assert_eq!(indices(&r.pieces), vec![2]);
        assert_eq!(r.lost.map(|(p, _)| p.imm), Some(Some(7)));
    }

    /// Behind a NAK (a refusal or RNR) the responder discarded what followed: re-posting those
    /// pieces, immediates included, cannot count anything twice.
    #[test]
    fn pieces_behind_a_nak_are_reposted_with_their_immediates() {
        let pieces = vec![
            piece(0, 0, Some(1)),
            piece(0, 8, Some(2)),
            piece(0, 16, None),
        ];
        let r = plan_repost(&pieces, &[failure(0, 0, FailureCause::ReceiverNotReady)]);
        assert_eq!(
            indices(&r.pieces),
            vec![0, 1, 2],
            "RNR: nothing ran, all go again"
        );
        assert!(r.lost.is_none() && r.refused.is_none());
        let r = plan_repost(&pieces, &[failure(0, 1, FailureCause::FlushedBehindNak)]);
        assert_eq!(indices(&r.pieces), vec![1, 2]);
        assert!(r.lost.is_none());
        let r = plan_repost(&pieces, &[failure(0, 0, FailureCause::Nak)]);
        assert_eq!(indices(&r.pieces), vec![1, 2]);
        assert_eq!(r.refused_piece.map(|p| p.imm), Some(Some(1)));
        assert!(r.lost.is_none());
    }
}
