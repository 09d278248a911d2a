//! What a simulated sync reports: the predicted time beside the bound, per-NIC utilisation, the
//! critical path and what dominates it, and the per-stage timeline (the dashboard's format).

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use weightsync_common::protocol::Stage;

use crate::simulate::delta::DeltaModel;
use crate::simulate::engine::{NONE, OpId, Outcome, ResKind, SimPlan};

/// One span of the simulated timeline: the fields of a worker's timeline event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimEvent {
    /// Worker, e.g. `trainer-3`, `rollout-17`, `controller`.
    pub worker: String,
    /// First task of the piece (0 for whole-sync stages).
    pub task: u32,
    /// Stage.
    pub stage: Stage,
    /// Start, ns since the sync started.
    pub start_ns: u64,
    /// End, ns since the sync started.
    pub end_ns: u64,
    /// Bytes the span moved or produced.
    pub bytes: u64,
}

/// Load and utilisation of one NIC.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NicUse {
    /// Global NIC index (see `ClusterModel::nic_of`).
    pub nic: u32,
    /// Node.
    pub node: u32,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Work requests sent.
    pub tx_writes: u64,
    /// Work requests received.
    pub rx_writes: u64,
    /// Fraction of the sync the sending side was busy (bandwidth or message rate).
    pub tx_util: f64,
    /// Fraction of the sync the receiving side was busy.
    pub rx_util: f64,
}

/// Max and mean over the NICs that take part on one side.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SideSummary {
    /// NICs taking part.
    pub nics: u32,
    /// Most bytes on one NIC.
    pub max_bytes: u64,
    /// Mean bytes per NIC.
    pub mean_bytes: f64,
    /// Highest utilisation.
    pub max_util: f64,
    /// Mean utilisation.
    pub mean_util: f64,
}

/// One step of the critical path (consecutive ops of one lane, stage and limit merged).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriticalStep {
    /// Worker.
    pub worker: String,
    /// Stage.
    pub stage: Stage,
    /// First task.
    pub task: u32,
    /// Ops merged into this step.
    pub ops: u32,
    /// Start, seconds.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
    /// What limited it (a resource, or the stage's own rate / latency).
    pub limited_by: String,
    /// The class of that limit (for the breakdown).
    pub class: String,
}

/// Seconds of the critical path spent under one class of limit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CriticalShare {
    /// The class (`receiving NIC bandwidth`, `preparation`, ...).
    pub class: String,
    /// Seconds.
    pub seconds: f64,
    /// Fraction of the predicted time.
    pub share: f64,
}

/// Time spent in one stage, summed over workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageTotal {
    /// Stage.
    pub stage: Stage,
    /// Sum of span lengths, seconds.
    pub busy_s: f64,
    /// Longest total on one worker, seconds.
    pub max_worker_s: f64,
}

/// The result of simulating one sync.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimReport {
    /// What was simulated (`weightsync`, or a baseline's name).
    pub method: String,
    /// Training GPUs.
    pub trainers: u32,
    /// Inference GPUs.
    pub rollouts: u32,
    /// Predicted sync time, seconds.
    pub predicted_s: f64,
    /// Bound: the most loaded NIC's bytes over its bandwidth, seconds.
    pub bound_s: f64,
    /// The NIC that sets the bound.
    pub bound_nic: String,
    /// `predicted_s / bound_s`.
    pub ratio_to_bound: f64,
    /// Bytes that crossed NICs.
    pub network_bytes: u64,
    /// Work requests posted.
    pub writes: u64,
    /// Pipeline pieces (or buckets) simulated.
    pub pieces: u64,
    /// Operations simulated.
    pub ops: u64,
    /// Events processed.
    pub events: u64,
    /// Sending NICs.
    pub send: SideSummary,
    /// Receiving NICs.
    pub receive: SideSummary,
    /// Every NIC that took part.
    pub nics: Vec<NicUse>,
    /// Per stage totals.
    pub stages: Vec<StageTotal>,
    /// The critical path, in time order.
    pub critical_path: Vec<CriticalStep>,
    /// Critical-path time per class of limit, largest first.
    pub critical_breakdown: Vec<CriticalShare>,
    /// What dominates the critical path, in words.
    pub dominated_by: String,
    /// Every span (large: the dashboard / `--trace` draw it).
    #[serde(skip)]
    pub timeline: Vec<SimEvent>,
}

fn to_ns(s: f64) -> u64 {
    (s * 1e9).round().max(0.0) as u64
}

fn limit_of(plan: &SimPlan, out: &Outcome, o: OpId) -> (String, String) {
    let op = &plan.ops[o as usize];
    let b = out.bind[o as usize];
    if op.work > 0.0 && b != NONE {
        let k: ResKind = plan.resources[b as usize];
        return (k.name(), k.class().to_string());
    }
    let class = match op.stage {
        Stage::H2d => "H2D copy",
        Stage::Prepare => "preparation",
        Stage::Barrier => "barrier latency",
        Stage::Arm => "sync start latency",
        Stage::GatherWait => "gather wait",
        Stage::Land => "engine reload",
        _ if op.work > 0.0 => "fair share (no single bottleneck)",
        _ => "latency",
    };
    (class.to_string(), class.to_string())
}

/// A simulated delta sync (`weightsync simulate --changed F`): the sync, and what its deltas
/// came to. Its `sync.bound_s` is the *delta bound*: the most loaded NIC's bytes of this sync
/// (encodings, dense runs, gathers) over its bandwidth; the full-transfer bound is the full
/// sync's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeltaReport {
    /// What it was simulated with.
    pub model: DeltaModel,
    /// The delta sync.
    pub sync: SimReport,
    /// Bytes a full sync writes to rollouts.
    pub dense_bytes: u64,
    /// Bytes this sync writes to rollouts: encodings, and the runs that go dense.
    pub wire_bytes: u64,
    /// `wire_bytes / dense_bytes`.
    pub wire_fraction: f64,
    /// Writes to rollouts sent as deltas.
    pub delta_writes: u64,
    /// Writes to rollouts sent dense (runs too dense, copies without a base).
    pub dense_writes: u64,
    /// Memory traffic of every trainer's encode, bytes.
    pub encode_bytes: u64,
    /// The busiest trainer's encode alone, seconds (it overlaps its writes).
    pub max_encode_s: f64,
    /// Memory traffic of every rollout's apply, bytes.
    pub apply_bytes: u64,
    /// The busiest rollout's apply, seconds (after its last write landed).
    pub max_apply_s: f64,
}

/// Builds the report of a finished run. `last` is the op that ends the sync.
#[allow(clippy::too_many_arguments)]
pub(crate) fn build(
    method: &str,
    plan: &SimPlan,
    out: &Outcome,
    last: OpId,
    trainers: u32,
    rollouts: u32,
    pieces: u64,
    nic_bytes_per_s: f64,
) -> SimReport {
    let makespan = out.makespan.max(f64::MIN_POSITIVE);
    let n = nic_totals(plan, out, makespan);
    let send = side_summary(&n.nics, &|u: &NicUse| (u.tx_bytes, u.tx_util));
    let receive = side_summary(&n.nics, &|u: &NicUse| (u.rx_bytes, u.rx_util));
    let bound_s = n.bound_bytes / nic_bytes_per_s;
    let (timeline, stages) = timeline(plan, out);
    let (critical_path, critical_breakdown) = critical_path(plan, out, last, makespan);
    let dominated_by = critical_breakdown.first().map_or_else(
        || "nothing (empty sync)".to_string(),
        |c| {
            format!(
                "{} ({:.0}% of the critical path, {:.3} s)",
                c.class,
                c.share * 100.0,
                c.seconds
            )
        },
    );
    SimReport {
        method: method.to_string(),
        trainers,
        rollouts,
        predicted_s: out.makespan,
        bound_s,
        bound_nic: n.bound_nic,
        ratio_to_bound: if bound_s > 0.0 {
            out.makespan / bound_s
        } else {
            0.0
        },
        network_bytes: n.network_bytes.round() as u64,
        writes: n.writes.round() as u64,
        pieces,
        ops: plan.ops.len() as u64,
        events: out.events,
        send,
        receive,
        nics: n.nics,
        stages,
        critical_path,
        critical_breakdown,
        dominated_by,
        timeline,
    }
}

/// Every NIC's load and utilisation, and the totals the report draws from them.
struct NicTotals {
    nics: Vec<NicUse>,
    /// The most bytes one NIC sends or receives, and which NIC and side that is.
    bound_bytes: f64,
    bound_nic: String,
    /// Bytes and work requests sent over all NICs.
    network_bytes: f64,
    writes: f64,
}

fn nic_totals(plan: &SimPlan, out: &Outcome, makespan: f64) -> NicTotals {
    let mut nics = Vec::with_capacity(plan.nics.len());
    let mut res_of = std::collections::BTreeMap::new();
    for (i, k) in plan.resources.iter().enumerate() {
        res_of.insert(*k, i);
    }
    let busy = |k: ResKind| res_of.get(&k).map_or(0.0, |&i| out.busy[i] / makespan);
    let mut bound_bytes = 0.0;
    let mut bound_nic = String::from("none");
    let mut network_bytes = 0.0;
    let mut writes = 0.0;
    for (&nic, l) in &plan.nics {
        network_bytes += l.tx_bytes;
        writes += l.tx_wrs;
        for (b, side) in [(l.tx_bytes, "send"), (l.rx_bytes, "receive")] {
            if b > bound_bytes {
                bound_bytes = b;
                bound_nic = format!("nic {nic} {side}");
            }
        }
        nics.push(NicUse {
            nic,
            node: l.node,
            tx_bytes: l.tx_bytes.round() as u64,
            rx_bytes: l.rx_bytes.round() as u64,
            tx_writes: l.tx_wrs.round() as u64,
            rx_writes: l.rx_wrs.round() as u64,
            tx_util: busy(ResKind::NicTx(nic)),
            rx_util: busy(ResKind::NicRx(nic)),
        });
    }
    NicTotals {
        nics,
        bound_bytes,
        bound_nic,
        network_bytes,
        writes,
    }
}

/// Max and mean of `(bytes, utilisation)` picked from each NIC, over the NICs with bytes.
fn side_summary(nics: &[NicUse], pick: &dyn Fn(&NicUse) -> (u64, f64)) -> SideSummary {
    let v: Vec<(u64, f64)> = nics.iter().map(pick).filter(|&(b, _)| b > 0).collect();
    let n = v.len().max(1) as f64;
    SideSummary {
        nics: v.len() as u32,
        max_bytes: v.iter().map(|x| x.0).max().unwrap_or(0),
        mean_bytes: v.iter().map(|x| x.0 as f64).sum::<f64>() / n,
        max_util: v.iter().map(|x| x.1).fold(0.0, f64::max),
        mean_util: v.iter().map(|x| x.1).sum::<f64>() / n,
    }
}

/// Every op as a span (gather waits that did not wait left out), one land span per rollout
/// (first to last write into it), in start order; and the time per stage.
fn timeline(plan: &SimPlan, out: &Outcome) -> (Vec<SimEvent>, Vec<StageTotal>) {
    let mut timeline = Vec::with_capacity(plan.ops.len());
    let mut per_stage: std::collections::BTreeMap<(Stage, u32), f64> = Default::default();
    for (i, op) in plan.ops.iter().enumerate() {
        let (s, e) = (out.start[i], out.end[i]);
        if op.stage == Stage::GatherWait && e <= s {
            continue;
        }
        *per_stage.entry((op.stage, op.lane)).or_default() += e - s;
        timeline.push(SimEvent {
            worker: plan.lanes[op.lane as usize].clone(),
            task: op.task,
            stage: op.stage,
            start_ns: to_ns(s),
            end_ns: to_ns(e),
            bytes: op.bytes,
        });
    }
    // Receivers: one land span per rollout, first to last write into it.
    let mut land = vec![(f64::INFINITY, 0.0f64); plan.lanes.len()];
    for &(o, lane) in &plan.lands {
        let e = &mut land[lane as usize];
        e.0 = e.0.min(out.start[o as usize]);
        e.1 = e.1.max(out.end[o as usize]);
    }
    for (lane, &(s, e)) in land.iter().enumerate() {
        if !s.is_finite() {
            continue;
        }
        timeline.push(SimEvent {
            worker: plan.lanes[lane].clone(),
            task: 0,
            stage: Stage::Land,
            start_ns: to_ns(s),
            end_ns: to_ns(e),
            bytes: 0,
        });
    }
    timeline.sort_by(|a, b| (a.start_ns, &a.worker).cmp(&(b.start_ns, &b.worker)));
    let mut stages: std::collections::BTreeMap<Stage, (f64, f64)> = Default::default();
    for ((stage, _), t) in per_stage {
        let e = stages.entry(stage).or_default();
        e.0 += t;
        e.1 = e.1.max(t);
    }
    let stages = stages
        .into_iter()
        .map(|(stage, (busy_s, max_worker_s))| StageTotal {
            stage,
            busy_s,
            max_worker_s,
        })
        .collect();
    (timeline, stages)
}

/// The chain of gating ops that ends in `last`, consecutive ops of one lane, stage and limit
/// merged into steps; and its time per class of limit, largest first.
fn critical_path(
    plan: &SimPlan,
    out: &Outcome,
    last: OpId,
    makespan: f64,
) -> (Vec<CriticalStep>, Vec<CriticalShare>) {
    let mut chain = Vec::new();
    let mut o = last;
    while o != NONE {
        chain.push(o);
        o = out.gate[o as usize];
    }
    chain.reverse();
    let mut critical_path: Vec<CriticalStep> = Vec::new();
    let mut shares: std::collections::BTreeMap<String, f64> = Default::default();
    for o in chain {
        let op = &plan.ops[o as usize];
        let (limited_by, class) = limit_of(plan, out, o);
        let (s, e) = (out.start[o as usize], out.end[o as usize]);
        *shares.entry(class.clone()).or_default() += e - s;
        if e <= s && op.stage == Stage::GatherWait {
            continue; // a wait that did not wait
        }
        let worker = &plan.lanes[op.lane as usize];
        match critical_path.last_mut() {
            Some(step)
                if step.worker == *worker
                    && step.stage == op.stage
                    && step.limited_by == limited_by =>
            {
                step.end_s = e;
                step.ops += 1;
            }
            _ => critical_path.push(CriticalStep {
                worker: worker.clone(),
                stage: op.stage,
                task: op.task,
                ops: 1,
                start_s: s,
                end_s: e,
                limited_by,
                class,
            }),
        }
    }
    let mut critical_breakdown: Vec<CriticalShare> = shares
        .into_iter()
        .filter(|(_, s)| *s > 0.0)
        .map(|(class, seconds)| CriticalShare {
            class,
            seconds,
            share: seconds / makespan,
        })
        .collect();
    critical_breakdown.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    (critical_path, critical_breakdown)
}

impl SimReport {
    /// The timeline as a Chrome trace (Perfetto, chrome://tracing), in the same shape as the
    /// controller's `/syncs/{id}/trace`: one thread per worker, one complete event per span.
    pub fn chrome_trace(&self) -> Value {
        let mut lanes: Vec<&str> = self.timeline.iter().map(|e| e.worker.as_str()).collect();
        lanes.sort_unstable();
        lanes.dedup();
        let critical: std::collections::BTreeSet<&str> = self
            .critical_path
            .iter()
            .map(|s| s.worker.as_str())
            .collect();
        let mut events = vec![json!({
            "name": "process_name", "ph": "M", "pid": 1,
            "args": {"name": format!("simulated sync ({})", self.method)},
        })];
        for (i, lane) in lanes.iter().enumerate() {
            let crit = critical.contains(lane);
            events.push(json!({
                "name": "thread_name", "ph": "M", "pid": 1, "tid": i + 1,
                "args": {"name": format!("{lane}{}", if crit { " (critical)" } else { "" })},
            }));
        }
        for e in &self.timeline {
            let tid = lanes.binary_search(&e.worker.as_str()).unwrap_or(0) + 1;
            let dur_ns = e.end_ns.saturating_sub(e.start_ns);
            let gbps = (dur_ns > 0 && e.bytes > 0).then(|| e.bytes as f64 / dur_ns as f64);
            events.push(json!({
                "name": e.stage.name(), "cat": e.stage.name(), "ph": "X", "pid": 1, "tid": tid,
                "ts": e.start_ns as f64 / 1e3, "dur": dur_ns as f64 / 1e3,
                "args": {"task": e.task, "bytes": e.bytes, "gbps": gbps,
                         "critical": critical.contains(e.worker.as_str())},
            }));
        }
        json!({
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "method": self.method, "predicted_s": self.predicted_s, "bound_s": self.bound_s,
                "bytes": self.network_bytes, "simulated": true,
            },
        })
    }
}
