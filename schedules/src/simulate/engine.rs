//! The discrete-event engine: operations with dependencies, staging pools, fixed latencies and
//! fluid flows over shared resources.
//!
//! Why fluid flows rather than packets: a Kimi-K2 sync moves terabytes in millions of writes; what
//! decides its length is how NICs are shared between the transfers active at each instant, not
//! the fate of any one packet. So an operation here is "this much work over these resources":
//! between two events every active flow runs at a constant rate, the rates are max-min fair
//! (progressive filling: raise every flow's rate together until a resource is full, freeze the
//! flows on it, repeat), and the next event is the earliest flow completion or latency expiry.
//! Cost per event is linear in the active flows' resource uses, and there are only a few events
//! per pipeline piece, so a 256-to-128 GPU sync simulates in about a second.
//!
//! Every resource has capacity 1 (one second of its time per second); a flow's *weight* on a
//! resource is the seconds of that resource one unit of the flow's work takes. A NIC receiving
//! `b` of a transfer's `B` bytes in `w` writes gets weight `max(b / bw, w * per_wr) / B`, so the
//! cost model's per-NIC `max(bytes / bandwidth, work requests * per-request cost)` holds for every
//! flow by construction.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, BinaryHeap};

use weightsync_common::protocol::Stage;

use crate::simulate::SimError;

/// Index of an operation in a [`SimPlan`].
pub(crate) type OpId = u32;
/// Index of a resource in a [`SimPlan`].
pub(crate) type ResId = u32;
/// No operation / no resource.
pub(crate) const NONE: u32 = u32::MAX;

/// What a resource is (for utilisation and for naming what limited the critical path).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum ResKind {
    /// Sending side of a NIC.
    NicTx(u32),
    /// Receiving side of a NIC.
    NicRx(u32),
    /// A node's host CPU (shared by every stage when modelled).
    Host(u32),
    /// A GPU's copy engine (H2D).
    H2d(u32),
    /// A GPU's preparation (kernels).
    Prep(u32),
    /// A receiving GPU's memory, applying a delta sync's changes.
    Apply(u32),
}

impl ResKind {
    /// Human name.
    pub(crate) fn name(self) -> String {
        match self {
            ResKind::NicTx(n) => format!("nic {n} send"),
            ResKind::NicRx(n) => format!("nic {n} receive"),
            ResKind::Host(n) => format!("node {n} host cpu"),
            ResKind::H2d(g) => format!("gpu {g} h2d"),
            ResKind::Prep(g) => format!("gpu {g} prepare"),
            ResKind::Apply(g) => format!("gpu {g} delta apply"),
        }
    }

    /// The class a critical-path step limited by this resource belongs to.
    pub(crate) fn class(self) -> &'static str {
        match self {
            ResKind::NicTx(_) => "sending NIC bandwidth",
            ResKind::NicRx(_) => "receiving NIC bandwidth",
            ResKind::Host(_) => "host CPU",
            ResKind::H2d(_) => "H2D copy",
            ResKind::Prep(_) => "preparation",
            ResKind::Apply(_) => "delta apply",
        }
    }
}

/// One operation: wait for its dependencies (and its staging), then a fixed latency, then a flow.
#[derive(Debug, Clone)]
pub(crate) struct Op {
    /// Timeline lane (worker).
    pub lane: u32,
    /// Stage drawn on the timeline.
    pub stage: Stage,
    /// Task index drawn on the timeline (first task of a piece).
    pub task: u32,
    /// Bytes drawn on the timeline.
    pub bytes: u64,
    /// Fixed time before the flow (a latency, or a stage with no shared resource).
    pub latency_s: f64,
    /// Work units of the flow (0: latency only).
    pub work: f64,
    /// Range of this op's resource uses in [`SimPlan::uses`].
    uses: (u32, u32),
    /// Staging taken from a pool before starting: (pool, bytes).
    pub acquire: Option<(u32, u64)>,
    /// Staging given back to a pool on completion: (pool, bytes).
    pub release: Option<(u32, u64)>,
}

/// Bytes and writes a NIC sends and receives in a plan.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct NicLoad {
    /// Bytes sent.
    pub tx_bytes: f64,
    /// Bytes received.
    pub rx_bytes: f64,
    /// Work requests sent.
    pub tx_wrs: f64,
    /// Work requests received.
    pub rx_wrs: f64,
    /// Node of the NIC.
    pub node: u32,
}

/// One hop of a transfer: bytes from one NIC into another (a loopback through one NIC when
/// `from == to`), or a local copy on one GPU (`local`), which costs no NIC.
#[derive(Debug, Clone)]
pub(crate) struct Hop {
    /// Same GPU: no NIC involved.
    pub local: bool,
    /// Sending NICs (the bytes stripe evenly over them).
    pub from: std::ops::Range<u32>,
    /// Receiving NICs (likewise).
    pub to: std::ops::Range<u32>,
    /// Node of the receiving NIC.
    pub to_node: u32,
    /// Bytes.
    pub bytes: f64,
    /// Work requests.
    pub wrs: f64,
}

/// A whole simulated sync: lanes, resources, staging pools and operations.
#[derive(Debug, Clone, Default)]
pub(crate) struct SimPlan {
    /// Timeline lanes (worker names).
    pub lanes: Vec<String>,
    /// Resources.
    pub resources: Vec<ResKind>,
    res_index: BTreeMap<ResKind, ResId>,
    /// Staging pools' capacities, bytes.
    pub pools: Vec<u64>,
    /// Operations.
    pub ops: Vec<Op>,
    /// Resource uses of every op: (resource, weight per unit of work).
    pub uses: Vec<(ResId, f64)>,
    /// Dependencies: (before, after).
    pub edges: Vec<(OpId, OpId)>,
    /// Per NIC, its load.
    pub nics: BTreeMap<u32, NicLoad>,
    /// Ops that land bytes on a lane (for the receivers' timeline): (op, lane).
    pub lands: Vec<(OpId, u32)>,
}

impl SimPlan {
    /// Adds a timeline lane.
    pub(crate) fn lane(&mut self, name: String) -> u32 {
        self.lanes.push(name);
        (self.lanes.len() - 1) as u32
    }

    /// The resource of this kind (created on first use).
    pub(crate) fn resource(&mut self, kind: ResKind) -> ResId {
        if let Some(&r) = self.res_index.get(&kind) {
            return r;
        }
        self.resources.push(kind);
        let r = (self.resources.len() - 1) as ResId;
        self.res_index.insert(kind, r);
        r
    }

    /// Adds a staging pool of `bytes`.
    pub(crate) fn pool(&mut self, bytes: u64) -> u32 {
        self.pools.push(bytes);
        (self.pools.len() - 1) as u32
    }

    /// Adds an operation using `uses` (resource, weight per unit of work).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn op(
        &mut self,
        lane: u32,
        stage: Stage,
        task: u32,
        bytes: u64,
        latency_s: f64,
        work: f64,
        uses: &[(ResId, f64)],
    ) -> OpId {
        let a = self.uses.len() as u32;
        self.uses
            .extend(uses.iter().copied().filter(|&(_, w)| w > 0.0));
        let b = self.uses.len() as u32;
        self.ops.push(Op {
            lane,
            stage,
            task,
            bytes,
            latency_s,
            work,
            uses: (a, b),
            acquire: None,
            release: None,
        });
        (self.ops.len() - 1) as OpId
    }

    /// `after` starts only once `before` completed.
    pub(crate) fn after(&mut self, before: OpId, after: OpId) {
        if before != NONE {
            self.edges.push((before, after));
        }
    }

    /// The resource uses of an op.
    pub(crate) fn uses_of(&self, op: OpId) -> &[(ResId, f64)] {
        let (a, b) = self.ops[op as usize].uses;
        &self.uses[a as usize..b as usize]
    }

    /// A transfer over `hops` as one flow whose work is `total` bytes: every NIC involved is
    /// charged `max(bytes / bw, wrs * per_wr)` for its share, summed over the hops it takes part
    /// in; a `local` hop (same GPU) costs no NIC. `host` adds host-CPU seconds per byte and
    /// per work request that crosses a NIC, on the sending node (`(node, s_per_byte,
    /// s_per_write)`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn transfer(
        &mut self,
        lane: u32,
        stage: Stage,
        task: u32,
        hops: &[Hop],
        from_node: u32,
        nic_bytes_per_s: f64,
        per_wr_s: f64,
        host: Option<(u32, f64, f64)>,
    ) -> OpId {
        // Per NIC and direction: (bytes, wrs).
        let mut tx: BTreeMap<u32, (f64, f64)> = BTreeMap::new();
        let mut rx: BTreeMap<u32, (f64, f64, u32)> = BTreeMap::new();
        let mut total = 0.0;
        let mut net_bytes = 0.0;
        let mut net_wrs = 0.0;
        for h in hops {
            total += h.bytes;
            if h.local {
                continue;
            }
            net_bytes += h.bytes;
            net_wrs += h.wrs;
            let share = 1.0 / h.from.len().max(1) as f64;
            for nic in h.from.clone() {
                let t = tx.entry(nic).or_default();
                t.0 += h.bytes * share;
                t.1 += h.wrs * share;
            }
            let share = 1.0 / h.to.len().max(1) as f64;
            for nic in h.to.clone() {
                let r = rx.entry(nic).or_insert((0.0, 0.0, h.to_node));
                r.0 += h.bytes * share;
                r.1 += h.wrs * share;
            }
        }
        let mut uses = Vec::with_capacity(tx.len() + rx.len() + 1);
        if total > 0.0 {
            for (&nic, &(b, w)) in &tx {
                let load = self.nics.entry(nic).or_default();
                load.tx_bytes += b;
                load.tx_wrs += w;
                load.node = from_node;
                let r = self.resource(ResKind::NicTx(nic));
                uses.push((r, (b / nic_bytes_per_s).max(w * per_wr_s) / total));
            }
            for (&nic, &(b, w, node)) in &rx {
                let load = self.nics.entry(nic).or_default();
                load.rx_bytes += b;
                load.rx_wrs += w;
                load.node = node;
                let r = self.resource(ResKind::NicRx(nic));
                uses.push((r, (b / nic_bytes_per_s).max(w * per_wr_s) / total));
            }
            if let Some((node, s_per_byte, s_per_write)) = host {
                let r = self.resource(ResKind::Host(node));
                uses.push((r, (s_per_byte * net_bytes + s_per_write * net_wrs) / total));
            }
        }
        self.op(lane, stage, task, total as u64, 0.0, total, &uses)
    }
}

/// When each op ran and what limited it.
#[derive(Debug, Clone)]
pub(crate) struct Outcome {
    /// Start (dependencies met and staging granted), seconds.
    pub start: Vec<f64>,
    /// End, seconds.
    pub end: Vec<f64>,
    /// The op whose completion let this op start (`NONE` for ops ready at time 0).
    pub gate: Vec<OpId>,
    /// The resource that limited this op's flow for the longest time (`NONE`: no flow, or none).
    pub bind: Vec<ResId>,
    /// Per resource, the integral of its use over time (busy seconds).
    pub busy: Vec<f64>,
    /// When the last op ended.
    pub makespan: f64,
    /// Events processed (for the report).
    pub events: u64,
}

/// A time on the event queue (total order over finite floats).
#[derive(Debug, Clone, Copy, PartialEq)]
struct At(f64, OpId);

impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for At {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0).then(self.1.cmp(&other.1))
    }
}

/// Rounds of progressive filling per rate computation; flows still unfrozen after that keep
/// their (feasible, slightly low) rate. Symmetric syncs converge in a few rounds.
const MAX_FILL_ROUNDS: usize = 8;

/// Relative band within which resources saturate in the same round of progressive filling.
const FILL_BAND: f64 = 0.05;

struct Engine<'p> {
    plan: &'p SimPlan,
    succ_start: Vec<u32>,
    succ: Vec<OpId>,
    pending: Vec<u32>,
    now: f64,
    out: Outcome,
    pool_used: Vec<u64>,
    pool_wait: Vec<BinaryHeap<Reverse<OpId>>>,
    delayed: BinaryHeap<Reverse<At>>,
    active: Vec<OpId>,
    rem: Vec<f64>,
    rate: Vec<f64>,
    bind_cur: Vec<ResId>,
    bind_cur_t: Vec<f64>,
    bind_best_t: Vec<f64>,
    completing: Vec<OpId>,
    done: usize,
    dirty: bool,
    // Scratch for rate computation.
    cap: Vec<f64>,
    load: Vec<f64>,
    stamp: Vec<u64>,
    epoch: u64,
    sat: Vec<u64>,
    sat_round: u64,
    residual: Vec<f64>,
    changed: usize,
}

/// Runs the plan to completion.
pub(crate) fn run(plan: &SimPlan) -> Result<Outcome, SimError> {
    let n = plan.ops.len();
    let mut count = vec![0u32; n + 1];
    let mut pending = vec![0u32; n];
    for &(a, b) in &plan.edges {
        count[a as usize + 1] += 1;
        pending[b as usize] += 1;
    }
    for i in 0..n {
        count[i + 1] += count[i];
    }
    let mut fill = count.clone();
    let mut succ = vec![0; plan.edges.len()];
    for &(a, b) in &plan.edges {
        succ[fill[a as usize] as usize] = b;
        fill[a as usize] += 1;
    }
    let nr = plan.resources.len();
    let mut e = Engine {
        plan,
        succ_start: count,
        succ,
        pending,
        now: 0.0,
        out: Outcome {
            start: vec![f64::NAN; n],
            end: vec![f64::NAN; n],
            gate: vec![NONE; n],
            bind: vec![NONE; n],
            busy: vec![0.0; nr],
            makespan: 0.0,
            events: 0,
        },
        pool_used: vec![0; plan.pools.len()],
        pool_wait: (0..plan.pools.len()).map(|_| BinaryHeap::new()).collect(),
        delayed: BinaryHeap::new(),
        active: Vec::new(),
        rem: vec![0.0; n],
        rate: vec![0.0; n],
        bind_cur: vec![NONE; n],
        bind_cur_t: vec![0.0; n],
        bind_best_t: vec![0.0; n],
        completing: Vec::new(),
        done: 0,
        dirty: true,
        cap: vec![0.0; nr],
        load: vec![0.0; nr],
        stamp: vec![0; nr],
        epoch: 0,
        sat: vec![0; nr],
        sat_round: 0,
        residual: vec![1.0; nr],
        changed: 0,
    };
    for o in 0..n as OpId {
        if e.pending[o as usize] == 0 {
            e.ready(o);
        }
    }
    e.drain_completions();
    while e.done < n {
        e.step()?;
        e.drain_completions();
    }
    e.out.makespan = e.out.end.iter().copied().fold(0.0, f64::max);
    Ok(e.out)
}

impl Engine<'_> {
    /// Dependencies met: take staging if needed, then start.
    fn ready(&mut self, o: OpId) {
        match self.plan.ops[o as usize].acquire {
            Some((pool, _)) => {
                self.pool_wait[pool as usize].push(Reverse(o));
                self.grant(pool, NONE);
            }
            None => self.start(o),
        }
    }

    /// Starts waiting ops of `pool` in op order while their staging fits (FIFO: the head
    /// blocks the rest, as the worker's watermark does).
    fn grant(&mut self, pool: u32, releaser: OpId) {
        let cap = self.plan.pools[pool as usize];
        while let Some(&Reverse(o)) = self.pool_wait[pool as usize].peek() {
            let want = self.plan.ops[o as usize]
                .acquire
                .map_or(0, |(_, b)| b)
                .min(cap);
            if self.pool_used[pool as usize] + want > cap {
                break;
            }
            self.pool_wait[pool as usize].pop();
            self.pool_used[pool as usize] += want;
            if releaser != NONE {
                self.out.gate[o as usize] = releaser;
            }
            self.start(o);
        }
    }

    fn start(&mut self, o: OpId) {
        self.out.start[o as usize] = self.now;
        let op = &self.plan.ops[o as usize];
        if op.latency_s > 0.0 {
            self.delayed.push(Reverse(At(self.now + op.latency_s, o)));
        } else {
            self.begin_flow(o);
        }
    }

    fn begin_flow(&mut self, o: OpId) {
        let op = &self.plan.ops[o as usize];
        if op.work > 0.0 && op.uses.1 > op.uses.0 {
            self.rem[o as usize] = op.work;
            self.active.push(o);
            self.changed += 1;
            if self.dirty || self.changed >= self.change_budget() {
                self.dirty = true;
                self.rate[o as usize] = 0.0;
            } else {
                // Provisional rate: what its resources have left until the next full
                // recomputation.
                let mut x = f64::INFINITY;
                let mut bind = NONE;
                for &(r, w) in self.plan.uses_of(o) {
                    let v = self.residual[r as usize].max(0.0) / w;
                    if v < x {
                        x = v;
                        bind = r;
                    }
                }
                let x = if x.is_finite() { x } else { 0.0 };
                for &(r, w) in self.plan.uses_of(o) {
                    self.residual[r as usize] -= w * x;
                }
                self.rate[o as usize] = x;
                self.bind_cur[o as usize] = bind;
            }
        } else {
            self.completing.push(o);
        }
    }

    fn drain_completions(&mut self) {
        while let Some(o) = self.completing.pop() {
            self.complete(o);
        }
    }

    fn complete(&mut self, o: OpId) {
        let i = o as usize;
        self.out.end[i] = self.now;
        self.done += 1;
        if self.bind_cur_t[i] > self.bind_best_t[i] || self.out.bind[i] == NONE {
            self.out.bind[i] = self.bind_cur[i];
        }
        if let Some((pool, bytes)) = self.plan.ops[i].release {
            let cap = self.plan.pools[pool as usize];
            let p = &mut self.pool_used[pool as usize];
            *p = p.saturating_sub(bytes.min(cap));
            self.grant(pool, o);
        }
        let (a, b) = (self.succ_start[i] as usize, self.succ_start[i + 1] as usize);
        for k in a..b {
            let s = self.succ[k];
            self.pending[s as usize] -= 1;
            if self.pending[s as usize] == 0 {
                self.out.gate[s as usize] = o;
                self.ready(s);
            }
        }
    }

    /// Max-min fair rates of the active flows by progressive filling.
    fn compute_rates(&mut self) {
        self.changed = 0;
        self.residual.iter_mut().for_each(|r| *r = 1.0);
        self.epoch += 1;
        let mut touched: Vec<ResId> = Vec::new();
        for &o in &self.active {
            self.rate[o as usize] = 0.0;
            for &(r, _) in self.plan.uses_of(o) {
                if self.stamp[r as usize] != self.epoch {
                    self.stamp[r as usize] = self.epoch;
                    self.cap[r as usize] = 1.0;
                    touched.push(r);
                }
            }
        }
        let mut unfrozen = self.active.clone();
        let mut round = self.sat_round;
        for _ in 0..MAX_FILL_ROUNDS {
            for &r in &touched {
                self.load[r as usize] = 0.0;
            }
            for &o in &unfrozen {
                for &(r, w) in self.plan.uses_of(o) {
                    self.load[r as usize] += w;
                }
            }
            let mut inc = f64::INFINITY;
            for &r in &touched {
                let l = self.load[r as usize];
                if l > 0.0 {
                    inc = inc.min(self.cap[r as usize].max(0.0) / l);
                }
            }
            if !inc.is_finite() {
                break;
            }
            for &o in &unfrozen {
                self.rate[o as usize] += inc;
            }
            // Resources whose fill level is within FILL_BAND of the fullest one saturate in this
            // round too (they keep a sliver of unused capacity): rounds stay few when many NICs
            // are almost equally loaded, at a cost below FILL_BAND of their rate.
            round += 1;
            let band = inc * (1.0 + FILL_BAND);
            for &r in &touched {
                let l = self.load[r as usize];
                if l > 0.0 && self.cap[r as usize].max(0.0) / l <= band {
                    self.sat[r as usize] = round;
                }
                self.cap[r as usize] -= inc * l;
            }
            let sat = &self.sat;
            let plan = self.plan;
            let bind_cur = &mut self.bind_cur;
            let bind_cur_t = &mut self.bind_cur_t;
            let bind_best_t = &mut self.bind_best_t;
            let bind_out = &mut self.out.bind;
            unfrozen.retain(|&o| {
                let hit = plan
                    .uses_of(o)
                    .iter()
                    .find(|&&(r, _)| sat[r as usize] == round)
                    .map(|&(r, _)| r);
                match hit {
                    Some(r) => {
                        let i = o as usize;
                        if bind_cur[i] != r {
                            if bind_cur_t[i] > bind_best_t[i] {
                                bind_best_t[i] = bind_cur_t[i];
                                bind_out[i] = bind_cur[i];
                            }
                            bind_cur[i] = r;
                            bind_cur_t[i] = 0.0;
                        }
                        false
                    }
                    None => true,
                }
            });
            if unfrozen.is_empty() {
                break;
            }
        }
        self.sat_round = round;
        for &r in &touched {
            self.residual[r as usize] = self.cap[r as usize];
        }
    }

    /// Flow starts and ends tolerated between full recomputations: about 3% of the active
    /// flows (capacity a finished flow frees stays idle meanwhile, so the error is a small
    /// pessimism); 0 with few flows, where every change recomputes exactly.
    fn change_budget(&self) -> usize {
        (self.active.len() / 32).max(1)
    }

    fn step(&mut self) -> Result<(), SimError> {
        if self.dirty {
            self.compute_rates();
            self.dirty = false;
        }
        let mut t_next = self.next_event();
        if !t_next.is_finite() && !self.active.is_empty() {
            // Only flows waiting for a provisional share: share out exactly.
            self.compute_rates();
            t_next = self.next_event();
        }
        if !t_next.is_finite() {
            let waiting: Vec<String> = (0..self.plan.ops.len())
                .filter(|&i| self.out.end[i].is_nan())
                .take(3)
                .map(|i| {
                    let op = &self.plan.ops[i];
                    format!(
                        "{} {} of task {}",
                        self.plan.lanes[op.lane as usize],
                        op.stage.name(),
                        op.task
                    )
                })
                .collect();
            return Err(SimError::Stuck {
                at_s: self.now,
                left: self.plan.ops.len() - self.done,
                examples: waiting.join(", "),
            });
        }
        self.out.events += 1;
        let dt = t_next - self.now;
        let eps = 1e-12 * t_next.max(1e-9);
        for (r, busy) in self.out.busy.iter_mut().enumerate() {
            let used = 1.0 - self.residual[r];
            if used > 0.0 {
                *busy += used.min(1.0) * dt;
            }
        }
        let mut finished = Vec::new();
        for &o in &self.active {
            let i = o as usize;
            let r = self.rate[i];
            if r > 0.0 && self.now + self.rem[i] / r <= t_next + eps {
                self.rem[i] = 0.0;
                finished.push(o);
            } else {
                self.rem[i] -= r * dt;
            }
            self.bind_cur_t[i] += dt;
        }
        self.now = t_next;
        if !finished.is_empty() {
            self.active.retain(|&o| self.rem[o as usize] > 0.0);
            for &o in &finished {
                let x = self.rate[o as usize];
                for &(r, w) in self.plan.uses_of(o) {
                    self.residual[r as usize] += w * x;
                }
            }
            self.changed += finished.len();
            if self.changed >= self.change_budget() {
                self.dirty = true;
            }
            self.completing.extend(finished.iter().rev());
        }
        while let Some(&Reverse(At(t, o))) = self.delayed.peek() {
            if t > self.now + eps {
                break;
            }
            self.delayed.pop();
            self.begin_flow(o);
        }
        Ok(())
    }

    /// The time of the next flow completion or latency expiry.
    fn next_event(&self) -> f64 {
        let mut t_next = f64::INFINITY;
        for &o in &self.active {
            let r = self.rate[o as usize];
            if r > 0.0 {
                t_next = t_next.min(self.now + self.rem[o as usize] / r);
            }
        }
        if let Some(Reverse(At(t, _))) = self.delayed.peek() {
            t_next = t_next.min(*t);
        }
        t_next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(p: &mut SimPlan, lane: u32, work: f64, uses: &[(ResId, f64)]) -> OpId {
        p.op(lane, Stage::Write, 0, work as u64, 0.0, work, uses)
    }

    #[test]
    fn two_flows_share_a_resource_fairly() {
        let mut p = SimPlan::default();
        let l = p.lane("a".into());
        let r = p.resource(ResKind::NicRx(0));
        // 1 s of work each alone; together 2 s.
        let a = flow(&mut p, l, 100.0, &[(r, 0.01)]);
        let b = flow(&mut p, l, 100.0, &[(r, 0.01)]);
        let out = run(&p).unwrap();
        assert!((out.end[a as usize] - 2.0).abs() < 1e-9);
        assert!((out.end[b as usize] - 2.0).abs() < 1e-9);
        assert!((out.busy[r as usize] - 2.0).abs() < 1e-9);
        assert_eq!(out.bind[a as usize], r);
    }

    #[test]
    fn max_min_gives_spare_capacity_to_the_unconstrained_flow() {
        let mut p = SimPlan::default();
        let l = p.lane("a".into());
        let shared = p.resource(ResKind::NicRx(0));
        let slow = p.resource(ResKind::NicTx(1));
        // Flow a is limited to 0.25 of `shared` by `slow` (weight 4x on slow); b takes the rest.
        let a = flow(&mut p, l, 1.0, &[(shared, 1.0), (slow, 4.0)]);
        let b = flow(&mut p, l, 3.0, &[(shared, 1.0)]);
        let out = run(&p).unwrap();
        // a: rate 0.25 -> 4 s. b: rate 0.75 until 4 s -> 3 units exactly at 4 s.
        assert!(
            (out.end[a as usize] - 4.0).abs() < 1e-9,
            "{}",
            out.end[a as usize]
        );
        assert!(
            (out.end[b as usize] - 4.0).abs() < 1e-9,
            "{}",
            out.end[b as usize]
        );
    }

    #[test]
    fn dependencies_latencies_and_pools_order_ops() {
        let mut p = SimPlan::default();
        let l = p.lane("a".into());
        let pool = p.pool(10);
        let a = p.op(l, Stage::H2d, 0, 0, 1.0, 0.0, &[]);
        let b = p.op(l, Stage::H2d, 1, 0, 1.0, 0.0, &[]);
        let c = p.op(l, Stage::Write, 2, 0, 0.5, 0.0, &[]);
        p.ops[a as usize].acquire = Some((pool, 8));
        p.ops[a as usize].release = Some((pool, 8));
        p.ops[b as usize].acquire = Some((pool, 8));
        p.after(b, c);
        let out = run(&p).unwrap();
        // b waits for a's staging, c for b.
        assert_eq!(out.start[b as usize], 1.0);
        assert_eq!(out.gate[b as usize], a);
        assert_eq!(out.end[c as usize], 2.5);
        assert_eq!(out.gate[c as usize], b);
        assert_eq!(out.makespan, 2.5);
    }

    #[test]
    fn a_cycle_is_reported_not_hung() {
        let mut p = SimPlan::default();
        let l = p.lane("trainer-0".into());
        let a = p.op(l, Stage::H2d, 0, 0, 1.0, 0.0, &[]);
        let b = p.op(l, Stage::Prepare, 1, 0, 1.0, 0.0, &[]);
        let c = p.op(l, Stage::Write, 2, 0, 1.0, 0.0, &[]);
        p.after(b, c);
        p.after(c, b);
        let _ = a;
        let e = run(&p).unwrap_err();
        assert!(e.to_string().contains("trainer-0"), "{e}");
    }
}
