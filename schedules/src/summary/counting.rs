//! The counting engine behind [`Summary::of`](super::Summary::of): what every trainer sends and
//! every rank receives, counted from the table's compact form without expanding it.
//!
//! Why apart from the figures (`summary/mod.rs`): the figures are definitions (what a byte to
//! move or a route is); this file is how they are counted fast. A run of tasks of the same
//! patterns whose base records progress in step is counted at once, in closed form
//! ([`trainer_terms`], [`Counts::chunk`]); write copies as progressions of ranks
//! ([`Received`]); everything else task by task, exactly as [`trainer_terms_each_task`], the
//! reference the fast count is tested against.

use std::collections::BTreeMap;

use crate::compact::{
    BASE_FIELDS, PatternCopy, PatternWrite, TASK_FIELDS, TaskPattern, TrainerRoutes,
};
use crate::cost::CostModel;
use crate::packed::Records;

/// Runs counted at once ([`Counts::chunk`]), so the tests can tell the fast path ran.
#[cfg(test)]
pub(super) static CHUNKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Per rollout rank, bytes and writes received, summed from arithmetic progressions of ranks
/// without visiting each rank: one difference array per stride.
#[derive(Default)]
pub(super) struct Received {
    /// Per stride: added (bytes, writes) at the progression's first rank, taken away past its
    /// last; summed along the stride at the end.
    by_stride: BTreeMap<u32, (Vec<u64>, Vec<u64>)>,
}

impl Received {
    /// Adds `bytes` and `wrs` to ranks `first + i * stride`, `i < count`, that are below `nr`.
    pub(super) fn add(
        &mut self,
        nr: usize,
        first: u32,
        stride: u32,
        count: u32,
        bytes: u64,
        wrs: u64,
    ) {
        let first = first as u64;
        if count == 0 || first >= nr as u64 {
            return;
        }
        // Stride 0: one rank, `count` times over.
        let (count, stride, bytes, wrs) = if stride == 0 {
            (1, 1, bytes * count as u64, wrs * count as u64)
        } else {
            let fit = (nr as u64 - 1 - first) / stride as u64 + 1;
            (
                count.min(fit.min(u32::MAX as u64) as u32),
                stride,
                bytes,
                wrs,
            )
        };
        let (b, w) = self
            .by_stride
            .entry(stride)
            .or_insert_with(|| (vec![0; nr], vec![0; nr]));
        b[first as usize] = b[first as usize].wrapping_add(bytes);
        w[first as usize] = w[first as usize].wrapping_add(wrs);
        let end = first + count as u64 * stride as u64;
        if end < nr as u64 {
            b[end as usize] = b[end as usize].wrapping_sub(bytes);
            w[end as usize] = w[end as usize].wrapping_sub(wrs);
        }
    }

    /// Adds what `other` holds (differences add up, in wrapping arithmetic, in any order).
    pub(super) fn add_all(&mut self, other: Received) {
        for (stride, (ob, ow)) in other.by_stride {
            match self.by_stride.entry(stride) {
                std::collections::btree_map::Entry::Vacant(v) => {
                    v.insert((ob, ow));
                }
                std::collections::btree_map::Entry::Occupied(mut o) => {
                    let (b, w) = o.get_mut();
                    for (x, y) in b.iter_mut().zip(&ob) {
                        *x = x.wrapping_add(*y);
                    }
                    for (x, y) in w.iter_mut().zip(&ow) {
                        *x = x.wrapping_add(*y);
                    }
                }
            }
        }
    }

    /// Adds everything received into `rx` and `rx_wrs`.
    pub(super) fn sum_into(self, rx: &mut [u64], rx_wrs: &mut [u64]) {
        for (stride, (mut b, mut w)) in self.by_stride {
            let s = stride as usize;
            for r in s..b.len() {
                b[r] = b[r].wrapping_add(b[r - s]);
                w[r] = w[r].wrapping_add(w[r - s]);
            }
            for r in 0..b.len() {
                rx[r] += b[r];
                rx_wrs[r] += w[r];
            }
        }
    }
}

/// What [`Summary::of`] counts, task by task.
pub(super) struct Counts {
    /// Per trainer: bytes and work requests sent, gather bytes received.
    pub(super) tx: Vec<u64>,
    pub(super) tx_wrs: Vec<u64>,
    pub(super) grx: Vec<u64>,
    /// Per rollout: bytes and work requests of listed writes received.
    pub(super) rx: Vec<u64>,
    pub(super) rx_wrs: Vec<u64>,
    /// What write copies deliver, by progressions of ranks.
    pub(super) copied: Received,
    pub(super) routes: u64,
    pub(super) tasks: u64,
    pub(super) gather: u64,
    pub(super) gather_wrs: u64,
    pub(super) gather_local: u64,
}

impl Counts {
    pub(super) fn new(nt: usize, nr: usize) -> Counts {
        Counts {
            tx: vec![0; nt],
            tx_wrs: vec![0; nt],
            grx: vec![0; nt],
            rx: vec![0; nr],
            rx_wrs: vec![0; nr],
            copied: Received::default(),
            routes: 0,
            tasks: 0,
            gather: 0,
            gather_wrs: 0,
            gather_local: 0,
        }
    }

    /// Adds what `other` counted.
    pub(super) fn add(&mut self, other: Counts) {
        for (a, b) in [
            (&mut self.tx, &other.tx),
            (&mut self.tx_wrs, &other.tx_wrs),
            (&mut self.grx, &other.grx),
            (&mut self.rx, &other.rx),
            (&mut self.rx_wrs, &other.rx_wrs),
        ] {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
        self.copied.add_all(other.copied);
        self.routes += other.routes;
        self.tasks += other.tasks;
        self.gather += other.gather;
        self.gather_wrs += other.gather_wrs;
        self.gather_local += other.gather_local;
    }

    /// Counts one task of trainer `me`, of pattern `p`, whose writes land at `bases`.
    pub(super) fn task(
        &mut self,
        me: usize,
        r: &TrainerRoutes,
        p: &TaskPattern,
        bases: &[[u64; 2]],
    ) {
        let (nt, nr) = (self.tx.len(), self.rx.len());
        self.tasks += 1;
        let pw = r.pattern_writes(p);
        let mut last: Option<u32> = None;
        for (w, b) in pw.iter().zip(bases) {
            let (rank, len) = (b[0] as usize, w.len as u64);
            if !w.to_trainer {
                self.tx[me] += len;
                self.tx_wrs[me] += 1;
                if rank < nr {
                    self.rx[rank] += len;
                    self.rx_wrs[rank] += 1;
                }
                if last != Some(rank as u32) {
                    self.routes += 1;
                    last = Some(rank as u32);
                }
            } else if rank == me {
                self.gather_local += len;
            } else {
                self.tx[me] += len;
                self.tx_wrs[me] += 1;
                if rank < nt {
                    self.grx[rank] += len;
                }
                self.gather += len;
                self.gather_wrs += 1;
            }
        }
        for c in r.pattern_copies(p) {
            let (a, n) = (c.from as usize, c.num as usize);
            let (Some(part), Some(base)) = (pw.get(a..a + n), bases.get(a)) else {
                continue;
            };
            if n == 0 || c.count == 0 {
                continue;
            }
            let bytes: u64 = part.iter().map(|w| w.len as u64).sum();
            let first = (base[0] as u32).wrapping_add(c.rank_offset);
            self.tx[me] += bytes * c.count as u64;
            self.tx_wrs[me] += n as u64 * c.count as u64;
            self.copied
                .add(nr, first, c.stride, c.count, bytes, n as u64);
            // Ranks in a progression differ from one to the next (none when the stride is 0):
            // a route each, but for a first rank equal to the last one.
            let lastr = first.wrapping_add((c.count - 1).wrapping_mul(c.stride));
            if c.stride == 0 {
                self.routes += (last != Some(first)) as u64;
            } else {
                self.routes += c.count as u64 - (last == Some(first)) as u64;
            }
            last = Some(lastr);
        }
    }
}

/// Counts one trainer's tasks into the counts; returns its time terms ([`trainer_terms`]).
pub(super) type CountTrainer =
    fn(&mut Counts, usize, &TrainerRoutes, &CostModel) -> [(f64, &'static str); 3];

/// What a trainer's tasks need of the device side: bytes copied host-to-device, bytes
/// prepared, and the pipeline's fill (its largest task's copy and preparation).
#[derive(Default)]
pub(super) struct DeviceLoad {
    h2d: u64,
    prep: u64,
    fill: f64,
}

impl DeviceLoad {
    /// Adds `n` tasks of pattern `p` (`n > 0`).
    pub(super) fn add(&mut self, p: &TaskPattern, n: u64, cost: &CostModel) {
        let input = task_input_bytes(p);
        if !p.gather {
            self.h2d += n * input;
        }
        self.prep += n * input;
        self.fill = self
            .fill
            .max(input as f64 / cost.h2d_bytes_per_s + input as f64 / cost.prep_bytes_per_s);
    }

    /// The trainer's time under the cost model by what limits it (its NIC, sending `tx` bytes
    /// in `tx_wrs` work requests; its host-to-device copies; its preparation), each with the
    /// pipeline's fill.
    pub(super) fn terms(&self, tx: u64, tx_wrs: u64, cost: &CostModel) -> [(f64, &'static str); 3] {
        [
            (cost.nic_time(tx, tx_wrs) + self.fill, "trainer NIC"),
            (
                self.h2d as f64 / cost.h2d_bytes_per_s + self.fill,
                "host-to-device copies",
            ),
            (
                self.prep as f64 / cost.prep_bytes_per_s + self.fill,
                "preparation",
            ),
        ]
    }
}

/// Counts trainer `me`'s tasks into `c` task by task; returns its time under the cost model
/// by what limits it (its NIC, its host-to-device copies, its preparation), each with the
/// pipeline's fill.
pub(super) fn trainer_terms_each_task(
    c: &mut Counts,
    me: usize,
    r: &TrainerRoutes,
    cost: &CostModel,
) -> [(f64, &'static str); 3] {
    let mut load = DeviceLoad::default();
    let mut cursor = r.cursor();
    while let Some(task) = cursor.next() {
        let Some(p) = r.patterns.get(task.pattern as usize) else {
            continue;
        };
        load.add(p, 1, cost);
        c.task(me, r, p, task.bases);
    }
    load.terms(c.tx[me], c.tx_wrs[me], cost)
}

/// [`trainer_terms_each_task`]'s figures, counted a run at a time where the packed lists allow:
/// a repeating run of tasks whose patterns do not step (the same shapes, repetition after
/// repetition) over base records that progress with the repetitions (a repeating base run
/// whose period divides the bases of one repetition of tasks). There write `k`'s rank at
/// repetition `i` is `a_k + i * s_k`, so what a write sends and what it lands on are
/// progressions ([`Runs::chunk`]). Elsewhere (literal runs, runs of tasks that do not line up
/// with their bases, malformed lists) tasks are counted one by one, decoded exactly as
/// [`TrainerRoutes::cursor`] deals them.
pub(super) fn trainer_terms(
    c: &mut Counts,
    me: usize,
    r: &TrainerRoutes,
    cost: &CostModel,
) -> [(f64, &'static str); 3] {
    let mut load = DeviceLoad::default();
    let mut tasks = r.tasks.iter::<TASK_FIELDS>();
    let mut bases = r.bases.iter::<BASE_FIELDS>();
    let mut buf: Vec<[u64; BASE_FIELDS]> = Vec::new();
    let mut pats: Vec<&TaskPattern> = Vec::new();
    'tasks: loop {
        let one_by_one = match c.chunk(me, r, &mut tasks, &mut bases, &mut pats, &mut load, cost) {
            Ok((n_tasks, n_bases)) => {
                tasks.skip_in_run(n_tasks);
                bases.skip_in_run(n_bases);
                continue;
            }
            Err(k) => k,
        };
        for _ in 0..one_by_one {
            // One task, as the cursor deals it.
            let Some([pattern, _, _]) = tasks.next() else {
                break 'tasks;
            };
            let p = usize::try_from(pattern)
                .ok()
                .and_then(|i| r.patterns.get(i));
            buf.clear();
            buf.extend(bases.by_ref().take(p.map_or(0, |p| p.num_writes) as usize));
            if let Some(p) = p {
                load.add(p, 1, cost);
                c.task(me, r, p, &buf);
            }
        }
    }
    load.terms(c.tx[me], c.tx_wrs[me], cost)
}

impl Counts {
    /// Counts, at once, the repetitions of the task run ahead that line up with a run of base
    /// records (see [`trainer_terms`]); returns the tasks and base records counted, or, when
    /// the next task is not the start of at least two such repetitions, how many tasks to count
    /// one by one before trying again (the rest of a run that cannot line up: a literal one,
    /// one whose patterns step; else the rest of the repetition; at least one).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn chunk<'r>(
        &mut self,
        me: usize,
        r: &'r TrainerRoutes,
        tasks: &mut Records<'r, TASK_FIELDS>,
        bases: &mut Records<'r, BASE_FIELDS>,
        pats: &mut Vec<&'r TaskPattern>,
        load: &mut DeviceLoad,
        cost: &CostModel,
    ) -> Result<(u64, u64), u64> {
        let tv = tasks.run_ahead().ok_or(1u64)?;
        if tv.step.is_empty() {
            return Err(tv.left().max(1));
        }
        let rest_of_rep = (tv.period - tv.j) as u64;
        if tv.j != 0 {
            return Err(rest_of_rep);
        }
        // The repetition's patterns, the same in every repetition.
        pats.clear();
        let mut per_rep = 0u64;
        for j in 0..tv.period as usize {
            let p = usize::try_from(tv.first[j * TASK_FIELDS])
                .ok()
                .and_then(|i| r.patterns.get(i));
            let Some(p) = p.filter(|_| tv.step[j * TASK_FIELDS] == 0) else {
                return Err(tv.left().max(1));
            };
            per_rep += p.num_writes as u64;
            pats.push(p);
        }
        let reps = (tv.count - tv.r) as u64;
        // The bases: `at` the first one's place in its run; rank of base `i` of the chunk at
        // repetition 0, and its step from one repetition to the next.
        let (n, bv) = if per_rep == 0 {
            (reps, None)
        } else {
            let bv = bases.run_ahead().ok_or(rest_of_rep)?;
            if bv.step.is_empty() || !per_rep.is_multiple_of(bv.period as u64) {
                return Err(rest_of_rep);
            }
            (reps.min(bv.left() / per_rep), Some(bv))
        };
        if n < 2 {
            return Err(rest_of_rep);
        }
        #[cfg(test)]
        CHUNKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let rank_of = |i: u64| -> (u64, u64) {
            let bv = bv.as_ref().expect("a task with writes has bases");
            let at = bv.at() + i;
            let a = bv.field(at, 0);
            (a, bv.field(at + per_rep, 0).wrapping_sub(a))
        };
        let (nt, nr) = (self.tx.len(), self.rx.len());
        let mut first_base = 0u64;
        for p in pats.iter() {
            load.add(p, n, cost);
            self.tasks += n;
            let pw = r.pattern_writes(p);
            let cp = r.pattern_copies(p);
            let nw = p.num_writes as u64;
            // Whether every route-making rank moves by the same step: then which ranks equal
            // their predecessors is the same in every repetition.
            let mut same_step: Option<u32> = None;
            let mut uniform = true;
            let mut step_seen = |s: u64| match same_step {
                None => same_step = Some(s as u32),
                Some(t) => uniform &= t == s as u32,
            };
            for (k, w) in pw.iter().enumerate() {
                let (a, s) = rank_of(first_base + k as u64);
                let len = w.len as u64;
                if !w.to_trainer {
                    self.tx[me] += n * len;
                    self.tx_wrs[me] += n;
                    self.listed_progression(a, s, n, len);
                    step_seen(s);
                } else {
                    for i in 0..if s == 0 { 1 } else { n } {
                        let rank = a.wrapping_add(s.wrapping_mul(i)) as usize;
                        let times = if s == 0 { n } else { 1 };
                        if rank == me {
                            self.gather_local += times * len;
                        } else {
                            self.tx[me] += times * len;
                            self.tx_wrs[me] += times;
                            if rank < nt {
                                self.grx[rank] += times * len;
                            }
                            self.gather += times * len;
                            self.gather_wrs += times;
                        }
                    }
                }
            }
            for cpy in cp {
                let (a, num) = (cpy.from as usize, cpy.num as usize);
                let Some(part) = pw.get(a..a + num) else {
                    continue;
                };
                if a as u64 >= nw || num == 0 || cpy.count == 0 {
                    continue;
                }
                let bytes: u64 = part.iter().map(|w| w.len as u64).sum();
                self.tx[me] += n * bytes * cpy.count as u64;
                self.tx_wrs[me] += n * num as u64 * cpy.count as u64;
                let (ra, s) = rank_of(first_base + a as u64);
                step_seen(s);
                let first = (ra as u32).wrapping_add(cpy.rank_offset);
                if s as u32 == 0 {
                    let (b, w) = (n * bytes, n * num as u64);
                    self.copied.add(nr, first, cpy.stride, cpy.count, b, w);
                } else {
                    for i in 0..n {
                        let f = first.wrapping_add((s as u32).wrapping_mul(i as u32));
                        self.copied
                            .add(nr, f, cpy.stride, cpy.count, bytes, num as u64);
                    }
                }
            }
            let routes_at = |i: u64| {
                task_routes(pw, cp, nw, |k| {
                    let (a, s) = rank_of(first_base + k as u64);
                    a.wrapping_add(s.wrapping_mul(i)) as u32
                })
            };
            self.routes += if uniform {
                n * routes_at(0)
            } else {
                (0..n).map(routes_at).sum::<u64>()
            };
            first_base += nw;
        }
        Ok((n * tv.period as u64, n * per_rep))
    }

    /// Adds `len` bytes in one write to ranks `a + i * s` (wrapping), `i < n`, those below
    /// the number of rollouts.
    pub(super) fn listed_progression(&mut self, a: u64, s: u64, n: u64, len: u64) {
        let nr = self.rx.len() as u64;
        let (lo, stride) = if s == 0 {
            (Some(a), 0)
        } else if (s as i64) > 0 {
            // Upward: no wrap when the last rank fits.
            let last = (n - 1).checked_mul(s).and_then(|d| a.checked_add(d));
            (last.map(|_| a), s)
        } else {
            let d = s.wrapping_neg();
            ((n - 1).checked_mul(d).and_then(|x| a.checked_sub(x)), d)
        };
        match lo {
            Some(lo) if stride == 0 => {
                if lo < nr {
                    self.rx[lo as usize] += n * len;
                    self.rx_wrs[lo as usize] += n;
                }
            }
            Some(lo) if lo >= nr => {}
            // Only the lowest rank can be a rollout.
            Some(lo) if stride >= nr => {
                self.rx[lo as usize] += len;
                self.rx_wrs[lo as usize] += 1;
            }
            Some(lo) => self
                .copied
                .add(nr as usize, lo as u32, stride as u32, n as u32, len, 1),
            // Ranks that wrap around: one by one.
            None => {
                for i in 0..n {
                    let rank = a.wrapping_add(s.wrapping_mul(i));
                    if rank < nr {
                        self.rx[rank as usize] += len;
                        self.rx_wrs[rank as usize] += 1;
                    }
                }
            }
        }
    }
}

/// The routes of one task of writes `pw` and copies `cp` (`nw` base records) whose write `k`
/// goes to rank `rank(k)`: what [`Counts::task`] counts.
pub(super) fn task_routes(
    pw: &[PatternWrite],
    cp: &[PatternCopy],
    nw: u64,
    rank: impl Fn(usize) -> u32,
) -> u64 {
    let mut routes = 0;
    let mut last: Option<u32> = None;
    for (k, w) in pw.iter().enumerate() {
        if !w.to_trainer {
            let r = rank(k);
            if last != Some(r) {
                routes += 1;
                last = Some(r);
            }
        }
    }
    for c in cp {
        let (a, n) = (c.from as usize, c.num as usize);
        if pw.get(a..a + n).is_none() || a as u64 >= nw || n == 0 || c.count == 0 {
            continue;
        }
        let first = rank(a).wrapping_add(c.rank_offset);
        let lastr = first.wrapping_add((c.count - 1).wrapping_mul(c.stride));
        if c.stride == 0 {
            routes += (last != Some(first)) as u64;
        } else {
            routes += c.count as u64 - (last == Some(first)) as u64;
        }
        last = Some(lastr);
    }
    routes
}

/// Bytes a task of pattern `p` reads (its region in the transform's input dtype).
pub(super) fn task_input_bytes(p: &TaskPattern) -> u64 {
    p.region.numel() * p.transform.input_dtype().size() as u64
}
