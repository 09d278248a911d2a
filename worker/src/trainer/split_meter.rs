//! Splitting a sync's wall time into wire, idle and overhead (the [`TimeSplit`] a report carries).
//!
//! Why a meter rather than the timeline: the timeline's spans overlap (piece `k` is written while
//! `k+1` is prepared), so summing them says nothing about where the *wall* went. The meter keeps
//! three counts (writes in flight, pieces of work running, waits pending) and, at every change
//! of one of them, charges the time since the previous change to one part, chosen by the counts
//! as they were: some write in flight -> wire; else work running -> overhead; else a wait pending
//! -> idle; else (between steps: scheduling, spawning, building write lists) -> overhead. The
//! parts therefore tile the wall exactly, with no double counting (see [`TimeSplit`] for what
//! each part covers).
//!
//! Besides the split it integrates the number of writes in flight over the wire time
//! ([`SplitMeter::mean_writes_in_flight`]): a wire that is busy but with one small write at a
//! time is under-used, which the split alone would not show.
//!
//! The cost is one uncontended mutex per change, a handful per piece.

use std::time::Instant;

use parking_lot::Mutex;
use weightsync_common::protocol::TimeSplit;

/// What a span of the pipeline is doing (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Activity {
    /// Writes posted and not yet acknowledged.
    Write,
    /// The trainer's own work: H2D, prepare, checksums.
    Work,
    /// Waiting on something outside the trainer: a watermark lease, gathered rows.
    Wait,
}

#[derive(Debug, Default)]
struct Counts {
    /// Nanoseconds since the origin of the last change.
    last_ns: u64,
    writes: u64,
    work: u64,
    waits: u64,
    wire_ns: u64,
    idle_ns: u64,
    overhead_ns: u64,
    /// Integral of the writes in flight over time, write-nanoseconds.
    write_ns: u128,
}

impl Counts {
    /// Charges `[last_ns, now_ns)` to the part the counts select, then moves `last_ns`.
    fn charge(&mut self, now_ns: u64) {
        let dt = now_ns.saturating_sub(self.last_ns);
        if self.writes > 0 {
            self.wire_ns += dt;
            self.write_ns += u128::from(dt) * u128::from(self.writes);
        } else if self.work > 0 {
            self.overhead_ns += dt;
        } else if self.waits > 0 {
            self.idle_ns += dt;
        } else {
            self.overhead_ns += dt;
        }
        self.last_ns = self.last_ns.max(now_ns);
    }

    fn count(&mut self, a: Activity) -> &mut u64 {
        match a {
            Activity::Write => &mut self.writes,
            Activity::Work => &mut self.work,
            Activity::Wait => &mut self.waits,
        }
    }
}

/// The meter of one sync (see the module docs).
#[derive(Debug)]
pub(crate) struct SplitMeter {
    origin: Instant,
    counts: Mutex<Counts>,
}

impl SplitMeter {
    /// Starts the wall clock now.
    pub(crate) fn start() -> SplitMeter {
        SplitMeter {
            origin: Instant::now(),
            counts: Mutex::default(),
        }
    }

    fn now_ns(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// `n` units of `a` begin now; they end when the guard drops.
    pub(crate) fn begin(&self, a: Activity, n: u64) -> ActivityGuard<'_> {
        self.begin_at(a, n, self.now_ns());
        ActivityGuard {
            meter: self,
            activity: a,
            n,
        }
    }

    fn begin_at(&self, a: Activity, n: u64, now_ns: u64) {
        let mut c = self.counts.lock();
        c.charge(now_ns);
        *c.count(a) += n;
    }

    fn end_at(&self, a: Activity, n: u64, now_ns: u64) {
        let mut c = self.counts.lock();
        c.charge(now_ns);
        let k = c.count(a);
        *k = k.saturating_sub(n);
    }

    /// The split of the wall from the start to now.
    pub(crate) fn finish(&self) -> TimeSplit {
        self.finish_at(self.now_ns())
    }

    fn finish_at(&self, now_ns: u64) -> TimeSplit {
        let mut c = self.counts.lock();
        c.charge(now_ns);
        TimeSplit {
            wall_ns: c.wire_ns + c.idle_ns + c.overhead_ns,
            wire_ns: c.wire_ns,
            idle_ns: c.idle_ns,
            overhead_ns: c.overhead_ns,
        }
    }

    /// Writes in flight on average while any was (0 when none ever was).
    pub(crate) fn mean_writes_in_flight(&self) -> f64 {
        let c = self.counts.lock();
        if c.wire_ns == 0 {
            0.0
        } else {
            c.write_ns as f64 / c.wire_ns as f64
        }
    }
}

/// Ends its units of activity when dropped (also when the future holding it is dropped).
#[derive(Debug)]
pub(crate) struct ActivityGuard<'a> {
    meter: &'a SplitMeter,
    activity: Activity,
    n: u64,
}

impl Drop for ActivityGuard<'_> {
    fn drop(&mut self) {
        self.meter
            .end_at(self.activity, self.n, self.meter.now_ns());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every instant is charged once, by precedence wire > work > wait > gap.
    #[test]
    fn parts_tile_the_wall_by_precedence() {
        let m = SplitMeter::start();
        // 0..10 gap (overhead); 10..30 waiting (idle); 30..50 work (overhead) while still
        // waiting; 50..80 two writes in flight over the work (wire); 80..90 one write (wire);
        // 90..100 waiting only (idle); 100..105 gap (overhead).
        m.begin_at(Activity::Wait, 1, 10);
        m.begin_at(Activity::Work, 1, 30);
        m.begin_at(Activity::Write, 2, 50);
        m.end_at(Activity::Work, 1, 60);
        m.end_at(Activity::Write, 1, 80);
        m.end_at(Activity::Write, 1, 90);
        m.end_at(Activity::Wait, 1, 100);
        let s = m.finish_at(105);
        assert_eq!(s.wire_ns, 40);
        assert_eq!(s.idle_ns, 20 + 10);
        assert_eq!(s.overhead_ns, 10 + 20 + 5);
        assert_eq!(s.wall_ns, 105);
        assert_eq!(s.wire_ns + s.idle_ns + s.overhead_ns, s.wall_ns);
        // 30 ns with two writes, 10 with one, over 40 ns of wire.
        assert!((m.mean_writes_in_flight() - 70.0 / 40.0).abs() < 1e-9);
    }

    #[test]
    fn guards_end_their_activity_when_dropped() {
        let m = SplitMeter::start();
        {
            let _w = m.begin(Activity::Write, 3);
            std::hint::black_box(vec![0u8; 1 << 16]);
        }
        let c = m.counts.lock();
        assert_eq!((c.writes, c.work, c.waits), (0, 0, 0));
        assert!(c.wire_ns > 0);
    }
}
