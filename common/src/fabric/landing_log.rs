//! What landed in a receiver's memory, and when: the record that lets an owner check bytes while
//! the rest of a round is still landing, and know afterwards that no write touched them since.
//!
//! A rollout proves a version by hashing every byte that landed and comparing with the trainers'
//! checksums. Done after the last write, that pass reads every byte from memory again once the
//! round is over, and it is then the whole cost of committing. Done while the round lands, each
//! run is read soon after its bytes arrived, but a hash taken early proves nothing about the
//! bytes later unless one knows that nothing wrote them in between: a stale write of an aborted
//! round, landing after the real one, must still be caught. This log gives that knowledge:
//!
//! - A backend that can see every write land (the TCP backend's receive threads do) calls
//!   [`RegisteredMemory::landing`](super::RegisteredMemory::landing) before the first payload byte of a frame touches the
//!   registration, and drops the returned [`LandingTicket`] once the frame has landed or
//!   stopped (error, revocation, reset): the log holds the frame's range with a sequence number
//!   taken at its start and one taken at its end.
//! - The owner attaches one log to its registrations ([`Region::log_landings`](super::Region::log_landings)); a backend that
//!   cannot see writes land (RDMA NICs place bytes without the receiver's CPU) refuses, and the
//!   owner then checks everything after the round, as before.
//! - The owner reads [`LandingLog::seq`] before hashing a range. The hash still holds at a later
//!   time if every frame that overlaps the range ended at or before that sequence number
//!   ([`LogSnapshot::unchanged_since`]): a frame that began later, ended later or never ended
//!   (it may still be landing) means the bytes may have changed, and the range is read again.
//!
//! Sequence numbers are handed out under the log's lock, after the frame's bytes are in memory
//! for an end and before any is for a start, so "ended at or before `s`" really means "every
//! byte of it was in memory when `s` was read". Writes the owner makes itself are not seen: the
//! log is about what peers write. The log keeps at most [`MAX_ENTRIES`] frames between two
//! [`restart`](LandingLog::restart)s; past that it forgets them and says so, and every check
//! fails until the next restart, so a full log costs speed, never correctness.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};

/// Most frames a log keeps between two restarts (a receiver restarts it every round).
pub const MAX_ENTRIES: usize = 1 << 20;

/// One frame that began to land: where, and the sequence numbers of its start and end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LandingRecord {
    /// The owner's tag of the registration it landed in (see [`Region::log_landings`](super::Region::log_landings)).
    pub tag: u16,
    /// Offset in the registration.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// Sequence number taken before its first byte touched memory.
    pub begun: u64,
    /// Sequence number taken after it landed or stopped (`None`: it is still landing).
    pub ended: Option<u64>,
}

impl LandingRecord {
    fn overlaps(&self, tag: u16, offset: u64, len: u64) -> bool {
        self.tag == tag && self.offset < offset + len && offset < self.offset + self.len
    }
}

#[derive(Debug, Default)]
struct LogState {
    /// Bumped by every start and end.
    seq: u64,
    /// Id of the next frame.
    next_id: u64,
    /// Frames since the last restart by id: every one, or only those still landing once the log
    /// overflowed.
    entries: HashMap<u64, LandingRecord>,
    /// Ids of the frames that ended, in end order (none kept while overflowed).
    ended: Vec<u64>,
    /// More than `MAX_ENTRIES` frames came since the last restart.
    overflowed: bool,
}

impl LogState {
    fn forget_ended(&mut self) {
        self.entries.retain(|_, e| e.ended.is_none());
        self.ended.clear();
    }
}

/// The frames that landed in an owner's registrations (see the module docs).
#[derive(Debug, Default)]
pub struct LandingLog {
    state: Mutex<LogState>,
    changed: Condvar,
}

/// Proof that a frame is landing; dropping it records the frame's end.
#[derive(Debug)]
pub struct LandingTicket {
    log: Arc<LandingLog>,
    id: u64,
}

impl Drop for LandingTicket {
    fn drop(&mut self) {
        let mut st = self.log.state.lock();
        st.seq += 1;
        let seq = st.seq;
        if let Some(e) = st.entries.get_mut(&self.id) {
            e.ended = Some(seq);
            if st.overflowed {
                st.entries.remove(&self.id);
            } else {
                st.ended.push(self.id);
            }
        }
        drop(st);
        self.log.changed.notify_all();
    }
}

impl LandingLog {
    /// An empty log.
    pub fn new() -> Arc<LandingLog> {
        Arc::new(LandingLog::default())
    }

    /// A frame of `len` bytes at `offset` of the registration tagged `tag` is about to land.
    fn begin(self: &Arc<Self>, tag: u16, offset: u64, len: u64) -> LandingTicket {
        let mut st = self.state.lock();
        st.seq += 1;
        if !st.overflowed && st.entries.len() >= MAX_ENTRIES {
            tracing::warn!(
                "landing log full ({MAX_ENTRIES} frames since its restart): what landed is \
                 checked again after the round"
            );
            st.overflowed = true;
            st.forget_ended();
        }
        let (id, begun) = (st.next_id, st.seq);
        st.next_id += 1;
        st.entries.insert(
            id,
            LandingRecord {
                tag,
                offset,
                len,
                begun,
                ended: None,
            },
        );
        LandingTicket {
            log: self.clone(),
            id,
        }
    }

    /// The current sequence number: every frame that ended at or before it is wholly in memory.
    pub fn seq(&self) -> u64 {
        self.state.lock().seq
    }

    /// Starts a new round: forgets the frames that ended (and an overflow), keeps the ones
    /// still landing. Readers of the previous round must be done with their cursors.
    pub fn restart(&self) {
        let mut st = self.state.lock();
        st.forget_ended();
        st.overflowed = false;
    }

    /// Waits until a frame ended after the `cursor` frames already seen (or `stop` is set and
    /// [`wake`](Self::wake) called): the frames that ended since, with the cursor moved past
    /// them. `None` once `stop` is set.
    pub fn wait_ended(&self, cursor: &mut usize, stop: &AtomicBool) -> Option<Vec<LandingRecord>> {
        let mut st = self.state.lock();
        loop {
            if stop.load(Ordering::Acquire) {
                return None;
            }
            if st.ended.len() > *cursor {
                let out = st.ended[*cursor..]
                    .iter()
                    .filter_map(|id| st.entries.get(id).copied())
                    .collect();
                *cursor = st.ended.len();
                return Some(out);
            }
            self.changed.wait(&mut st);
        }
    }

    /// Wakes every [`wait_ended`](Self::wait_ended) (after its caller set `stop`).
    pub fn wake(&self) {
        let _st = self.state.lock();
        self.changed.notify_all();
    }

    /// The frames since the last restart, for checks against hashes taken earlier.
    pub fn snapshot(&self) -> LogSnapshot {
        let (mut entries, overflowed) = {
            let st = self.state.lock();
            let entries: Vec<LandingRecord> = st.entries.values().copied().collect();
            (entries, st.overflowed)
        };
        entries.sort_by_key(|e| (e.tag, e.offset));
        let longest = entries.iter().map(|e| e.len).max().unwrap_or(0);
        LogSnapshot {
            entries,
            longest,
            overflowed,
        }
    }
}

/// The frames of a log at one instant, sorted by where they landed.
#[derive(Debug, Clone)]
pub struct LogSnapshot {
    entries: Vec<LandingRecord>,
    longest: u64,
    overflowed: bool,
}

impl LogSnapshot {
    /// Whether bytes `[offset, offset + len)` of the registration tagged `tag`, read after the
    /// log's sequence number was `seq`, are still what they were then: every frame overlapping
    /// them ended at or before `seq`. False when the log overflowed since its restart.
    pub fn unchanged_since(&self, tag: u16, offset: u64, len: u64, seq: u64) -> bool {
        if self.overflowed {
            return false;
        }
        // Frames are sorted by (tag, offset); one overlapping the range starts after
        // `offset - longest` and before `offset + len`.
        let from = self
            .entries
            .partition_point(|e| (e.tag, e.offset) < (tag, offset.saturating_sub(self.longest)));
        self.entries[from..]
            .iter()
            .take_while(|e| (e.tag, e.offset) < (tag, offset + len))
            .filter(|e| e.overlaps(tag, offset, len))
            .all(|e| e.ended.is_some_and(|end| end <= seq))
    }
}

/// Where a registration's landings are logged: the owner's log and the tag it gave the region.
#[derive(Debug, Clone)]
pub(crate) struct LogAttachment {
    pub log: Arc<LandingLog>,
    pub tag: u16,
}

impl LogAttachment {
    pub fn begin(&self, offset: u64, len: u64) -> LandingTicket {
        self.log.begin(self.tag, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attach(tag: u16) -> (Arc<LandingLog>, LogAttachment) {
        let log = LandingLog::new();
        let a = LogAttachment {
            log: log.clone(),
            tag,
        };
        (log, a)
    }

    #[test]
    fn a_hash_holds_only_if_every_overlapping_frame_ended_before_it() {
        let (log, a) = attach(0);
        let t = a.begin(0, 100);
        drop(t);
        let s0 = log.seq();
        let snap = log.snapshot();
        assert!(snap.unchanged_since(0, 0, 100, s0));
        assert!(snap.unchanged_since(0, 50, 10, s0));
        // A frame landing after the hash, overlapping it by one byte.
        let late = a.begin(99, 10);
        let snap = log.snapshot();
        assert!(
            !snap.unchanged_since(0, 0, 100, s0),
            "a frame still landing"
        );
        assert!(
            snap.unchanged_since(0, 0, 99, s0),
            "it does not touch 0..99"
        );
        drop(late);
        let snap = log.snapshot();
        assert!(
            !snap.unchanged_since(0, 0, 100, s0),
            "it ended after the hash"
        );
        assert!(snap.unchanged_since(0, 0, 100, log.seq()));
        // Another registration's frames do not matter.
        assert!(snap.unchanged_since(1, 0, 100, s0));
    }

    #[test]
    fn a_frame_begun_before_the_hash_and_ended_after_it_invalidates_it() {
        let (log, a) = attach(3);
        let t = a.begin(1000, 4096);
        let s0 = log.seq();
        drop(t);
        assert!(!log.snapshot().unchanged_since(3, 0, 1 << 20, s0));
    }

    #[test]
    fn wait_ended_hands_out_each_ended_frame_once_and_stops_when_told() {
        let (log, a) = attach(0);
        let stop = Arc::new(AtomicBool::new(false));
        drop(a.begin(0, 8));
        drop(a.begin(8, 8));
        let mut cursor = 0;
        let got = log.wait_ended(&mut cursor, &stop).unwrap();
        assert_eq!(got.iter().map(|e| e.offset).collect::<Vec<_>>(), vec![0, 8]);
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = {
            let (log, stop) = (log.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut cursor = cursor;
                tx.send(log.wait_ended(&mut cursor, &stop)).unwrap();
                log.wait_ended(&mut cursor, &stop)
            })
        };
        drop(a.begin(16, 8));
        let first = rx.recv().unwrap();
        assert_eq!(first.map(|v| v[0].offset), Some(16));
        stop.store(true, Ordering::Release);
        log.wake();
        let second = waiter.join().unwrap();
        assert!(second.is_none());
    }

    #[test]
    fn restart_forgets_ended_frames_but_not_one_still_landing() {
        let (log, a) = attach(0);
        drop(a.begin(0, 100));
        let open = a.begin(200, 100);
        log.restart();
        let s = log.seq();
        let snap = log.snapshot();
        assert!(
            snap.unchanged_since(0, 0, 100, s),
            "forgotten: it ended before the round"
        );
        assert!(!snap.unchanged_since(0, 200, 100, s), "still landing");
        drop(open);
        let mut cursor = 0;
        let stop = AtomicBool::new(false);
        let got = log.wait_ended(&mut cursor, &stop).unwrap();
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].offset, 200);
        assert!(log.snapshot().unchanged_since(0, 200, 100, log.seq()));
    }

    #[test]
    fn an_overflowed_log_vouches_for_nothing_until_restarted() {
        let (log, a) = attach(0);
        let open = a.begin(9000, 1);
        {
            let mut st = log.state.lock();
            for id in 1000..1000 + MAX_ENTRIES as u64 {
                let e = LandingRecord {
                    tag: 0,
                    offset: id * 10,
                    len: 1,
                    begun: 0,
                    ended: Some(0),
                };
                st.entries.insert(id, e);
            }
        }
        drop(a.begin(5000, 1));
        let s = log.seq();
        assert!(!log.snapshot().unchanged_since(0, 0, 10, s));
        log.restart();
        let snap = log.snapshot();
        assert!(snap.unchanged_since(0, 0, 10, log.seq()));
        assert!(
            !snap.unchanged_since(0, 9000, 1, log.seq()),
            "a frame landing across the overflow is still known to be landing"
        );
        drop(open);
    }
}
