//! `weightsync bench e2e --changed F,...`: delta syncs beside full syncs of the same table, in
//! the same run, over sockets (as between hosts) and over same-host pulls.
//!
//! Two loopback deployments of one table run side by side: the full one as `bench e2e` runs it
//! (registered sources, same-dtype copies written straight from them), and one with deltas
//! (sources registered too, trainers keep bases of every task, engines register an inbox): a
//! task that went dense is written straight from its source there as in the full one. Before
//! each delta sync the bench changes the requested fraction of every trainer's bf16 weights (the
//! lowest mantissa bit of elements drawn at random, each with that probability), then times a delta sync and a full sync,
//! alternating; the medians and their ratio are reported per fraction and per path, with what
//! the deltas came to (bytes on the wire against a full sync's, the changed fraction the
//! trainers measured, encode and apply time). A delta sync counts as landed once every engine
//! applied its deltas. With a bf16 engine the changed fraction is exactly the engines'.

use serde::Serialize;

use super::{Config, E2eError, LoopbackCluster, WorkerOptions, runtime};
use weightsync_schedules::RoutingTable;

/// Fraction of an engine's bytes its inbox holds: runs whose encoding is larger go dense.
pub const INBOX_FRACTION: f64 = 0.25;

/// One changed fraction on one path.
#[derive(Debug, Clone, Serialize)]
pub struct DeltaRow {
    /// `sockets` or `pulls`.
    pub path: &'static str,
    /// The fraction of weights changed before each delta sync.
    pub changed: f64,
    /// The fraction of engine elements the trainers found changed (median sync).
    pub measured_changed: f64,
    /// Median seconds of a full sync.
    pub full_s: f64,
    /// Median seconds of a delta sync (applied on every engine).
    pub delta_s: f64,
    /// `full_s / delta_s`.
    pub speedup: f64,
    /// Bytes a full sync writes to engines.
    pub dense_bytes: u64,
    /// Bytes the delta sync wrote for engines (encodings plus runs sent dense), median sync.
    pub wire_bytes: u64,
    /// `wire_bytes / dense_bytes`.
    pub wire_fraction: f64,
    /// Encode seconds summed over trainers, median sync.
    pub encode_s: f64,
    /// The slowest engine's apply, seconds, median sync.
    pub apply_s: f64,
    /// Every timed full sync, seconds.
    pub all_full_s: Vec<f64>,
    /// Every timed delta sync, seconds.
    pub all_delta_s: Vec<f64>,
}

/// The `--json` object.
#[derive(Debug, Clone, Serialize)]
pub struct DeltaReport {
    /// Always "e2e-delta".
    pub bench: &'static str,
    /// The configuration.
    pub setup: super::Setup,
    /// Timed syncs of each kind per row.
    pub syncs: usize,
    /// Inbox fraction of every engine.
    pub inbox_fraction: f64,
    /// One row per path and fraction.
    pub rows: Vec<DeltaRow>,
}

impl DeltaReport {
    /// Human-readable summary.
    pub fn human(&self) -> String {
        let mut s = format!(
            "e2e delta: {}, median of {} syncs each, full and delta alternating\n",
            self.setup.label(),
            self.syncs
        );
        s += "  path     changed  measured   full s  delta s  speedup  wire/full  encode s  apply s\n";
        for r in &self.rows {
            s += &format!(
                "  {:<8} {:>7.3}  {:>8.4}  {:>7.3}  {:>7.3}  {:>7.2}  {:>9.4}  {:>8.3}  {:>7.3}\n",
                r.path,
                r.changed,
                r.measured_changed,
                r.full_s,
                r.delta_s,
                r.speedup,
                r.wire_fraction,
                r.encode_s,
                r.apply_s
            );
        }
        s
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the delta bench for each fraction in `changed` (see the module docs).
pub fn run(cfg: &Config, changed: &[f64]) -> Result<DeltaReport, E2eError> {
    if cfg.syncs == 0 || changed.is_empty() {
        return Err(E2eError::Options(
            "syncs and at least one changed fraction are needed".into(),
        ));
    }
    if let Some(bad) = changed.iter().find(|f| !(0.0..=1.0).contains(*f)) {
        return Err(E2eError::Options(format!(
            "changed fraction {bad} is not in [0, 1]"
        )));
    }
    let table = cfg
        .setup
        .plan(&weightsync_schedules::CostModel::default())?;
    run_table(&table, cfg, changed)
}

/// [`run`] on an already planned table.
pub fn run_table(
    table: &RoutingTable,
    cfg: &Config,
    changed: &[f64],
) -> Result<DeltaReport, E2eError> {
    cfg.workers.check()?;
    let rt = runtime()?;
    let mut rows = Vec::new();
    for (path, sockets_only) in [("sockets", true), ("pulls", false)] {
        let full_opts = WorkerOptions {
            sockets_only,
            delta_inbox: None,
            ..cfg.workers.clone()
        };
        let delta_opts = WorkerOptions {
            sockets_only,
            delta_inbox: Some(INBOX_FRACTION),
            ..cfg.workers.clone()
        };
        rows.extend(rt.block_on(async {
            let mut full = LoopbackCluster::start(table, &full_opts).await?;
            let mut delta = LoopbackCluster::start(table, &delta_opts).await?;
            // Warm-up: lanes connect, pages fault in; the delta cluster's first sync is full.
            full.sync().await?;
            delta.sync().await?;
            let mut out = Vec::new();
            let mut seed = 1u64;
            for &f in changed {
                let (mut fs, mut ds, mut per) = (Vec::new(), Vec::new(), Vec::new());
                for _ in 0..cfg.syncs {
                    seed += 1;
                    delta.change(f, seed)?;
                    let d = delta.sync().await?;
                    let full_t = full.sync().await?;
                    fs.push(full_t.seconds);
                    ds.push(d.seconds);
                    per.push(d);
                }
                per.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
                let mid = &per[per.len() / 2];
                let fig = mid.delta;
                let (full_s, delta_s) = (median(fs.clone()), median(ds.clone()));
                out.push(DeltaRow {
                    path,
                    changed: f,
                    measured_changed: fig.changed as f64 / fig.elements.max(1) as f64,
                    full_s,
                    delta_s,
                    speedup: full_s / delta_s,
                    dense_bytes: fig.dense_bytes,
                    wire_bytes: fig.wire_bytes(),
                    wire_fraction: fig.wire_bytes() as f64 / fig.dense_bytes.max(1) as f64,
                    encode_s: fig.codec_ns as f64 / 1e9,
                    apply_s: mid.rollout_apply_ns as f64 / 1e9,
                    all_full_s: fs,
                    all_delta_s: ds,
                });
            }
            Ok::<_, E2eError>(out)
        })?);
    }
    Ok(DeltaReport {
        bench: "e2e-delta",
        setup: cfg.setup.clone(),
        syncs: cfg.syncs,
        inbox_fraction: INBOX_FRACTION,
        rows,
    })
}
