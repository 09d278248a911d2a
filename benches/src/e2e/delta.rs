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
    /// The slowest engine's verification after a delta sync (after its apply), seconds,
    /// median sync (0: not verifying).
    pub verify_s: f64,
    /// The same after a full sync.
    pub full_verify_s: f64,
    /// Source-to-staging copies of a delta sync, summed over pieces and trainers, seconds.
    pub h2d_s: f64,
    /// The prepare stage of a delta sync (casts, hashing, comparing and encoding, base
    /// updates), summed over pieces and trainers, seconds.
    pub prepare_s: f64,
    /// The same two stages in a full sync.
    pub full_h2d_s: f64,
    /// See `full_h2d_s`.
    pub full_prepare_s: f64,
    /// The slowest trainer's part of a delta sync (its writes acknowledged), seconds.
    pub trainer_s: f64,
    /// From the start of a delta sync until every trainer finished and every engine landed,
    /// seconds; the rest of `delta_s` is the engines' apply and verification.
    pub landed_s: f64,
    /// The same for a full sync.
    pub full_landed_s: f64,
    /// Source bytes the trainers copied into staging in a delta sync (tasks that are not
    /// compared where their source holds them, and runs that went dense from a plain source).
    pub staged_bytes: u64,
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
    /// What moving the full sync's bytes costs on this machine at best, measured in this run.
    pub floor: Floor,
}

/// The memory and loopback rates a sync's time is held against (see [`Floor::measure`]).
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    /// Bytes measured: what a full sync lands in engines.
    pub bytes: u64,
    /// One memcpy pass over `bytes` (out of and into buffers larger than the caches), one
    /// thread, seconds.
    pub memcpy_s: f64,
    /// The same on every core at once, seconds.
    pub memcpy_all_cores_s: f64,
    /// One read pass over `bytes` hashed with xxh3, one thread, seconds.
    pub hash_s: f64,
    /// `bytes` over one loopback TCP stream (cache-hot buffers), seconds.
    pub tcp_one_stream_s: f64,
    /// The sync's bytes over one loopback TCP stream per (trainer, engine) pair, all at once,
    /// seconds.
    pub tcp_pairs_s: f64,
}

/// Buffers the memory rates are measured with: larger than any cache here.
const FLOOR_BUFFER: usize = 256 << 20;

impl Floor {
    /// Measures the rates over `bytes` (in passes over [`FLOOR_BUFFER`]s) and the table's pairs.
    pub fn measure(table: &RoutingTable, bytes: u64) -> Result<Floor, E2eError> {
        use rayon::prelude::*;
        let src: Vec<u8> = (0..FLOOR_BUFFER)
            .map(|i| (i * 31 + (i >> 9)) as u8)
            .collect();
        let mut dst = vec![0u8; FLOOR_BUFFER];
        dst.copy_from_slice(&src);
        let passes = |f: &mut dyn FnMut(usize)| {
            let t = std::time::Instant::now();
            let mut left = bytes as usize;
            while left > 0 {
                let n = left.min(FLOOR_BUFFER);
                f(n);
                left -= n;
            }
            t.elapsed().as_secs_f64()
        };
        let memcpy_s = passes(&mut |n| dst[..n].copy_from_slice(&src[..n]));
        let memcpy_all_cores_s = passes(&mut |n| {
            dst[..n]
                .par_chunks_mut(1 << 20)
                .zip(src[..n].par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s))
        });
        let mut sink = 0u64;
        let hash_s = passes(&mut |n| sink ^= xxhash_rust::xxh3::xxh3_64(&src[..n]));
        std::hint::black_box(sink);
        let tcp_one_stream_s = super::tcp_limit::run(&[(0, 0, bytes)])?;
        let tcp_pairs_s = super::tcp_limit::run(&super::tcp_limit::pair_bytes(table)?)?;
        Ok(Floor {
            bytes,
            memcpy_s,
            memcpy_all_cores_s,
            hash_s,
            tcp_one_stream_s,
            tcp_pairs_s,
        })
    }
}

impl DeltaReport {
    /// Human-readable summary.
    pub fn human(&self) -> String {
        let mut s = format!(
            "e2e delta: {}, median of {} syncs each, full and delta alternating\n",
            self.setup.label(),
            self.syncs
        );
        s += "  path     changed  measured   full s  delta s  speedup  wire/full  encode s  apply s  verify s (full)  h2d s (full)  prepare s (full)\n";
        for r in &self.rows {
            s += &format!(
                "  {:<8} {:>7.3}  {:>8.4}  {:>7.3}  {:>7.3}  {:>7.2}  {:>9.4}  {:>8.3}  {:>7.3}  {:>6.3} ({:.3})  {:>5.3} ({:.3})  {:>7.3} ({:.3})\n",
                r.path,
                r.changed,
                r.measured_changed,
                r.full_s,
                r.delta_s,
                r.speedup,
                r.wire_fraction,
                r.encode_s,
                r.apply_s,
                r.verify_s,
                r.full_verify_s,
                r.h2d_s,
                r.full_h2d_s,
                r.prepare_s,
                r.full_prepare_s,
            );
        }
        let f = &self.floor;
        s += &format!(
            "  floor over the full sync's {:.2} GB: memcpy {:.3} s (all cores {:.3} s), xxh3 {:.3} s, \
             one TCP stream {:.3} s, TCP per pair at once {:.3} s\n",
            f.bytes as f64 / 1e9,
            f.memcpy_s,
            f.memcpy_all_cores_s,
            f.hash_s,
            f.tcp_one_stream_s,
            f.tcp_pairs_s
        );
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
            full.verify_engines = true;
            delta.verify_engines = true;
            // Warm-up: lanes connect, pages fault in; the delta cluster's first sync is full.
            full.sync().await?;
            delta.sync().await?;
            let mut out = Vec::new();
            let mut seed = 1u64;
            for &f in changed {
                let (mut fs, mut ds, mut per, mut per_full) =
                    (Vec::new(), Vec::new(), Vec::new(), Vec::new());
                for _ in 0..cfg.syncs {
                    seed += 1;
                    delta.change(f, seed)?;
                    let d = delta.sync().await?;
                    let full_t = full.sync().await?;
                    fs.push(full_t.seconds);
                    ds.push(d.seconds);
                    per.push(d);
                    per_full.push(full_t);
                }
                per.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
                per_full.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
                let mid = &per[per.len() / 2];
                let mid_full = &per_full[per_full.len() / 2];
                let busy = |s: &super::SyncTime| {
                    s.trainers.iter().fold((0.0, 0.0), |(h, p), t| {
                        (h + t.h2d_busy_s, p + t.prepare_busy_s)
                    })
                };
                let ((h2d_s, prepare_s), (full_h2d_s, full_prepare_s)) =
                    (busy(mid), busy(mid_full));
                let trainer_s = mid.trainers.iter().map(|t| t.wall_s).fold(0.0, f64::max);
                let staged_bytes = mid.trainers.iter().map(|t| t.staged_bytes).sum();
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
                    verify_s: mid.rollout_verify_ns as f64 / 1e9,
                    full_verify_s: mid_full.rollout_verify_ns as f64 / 1e9,
                    h2d_s,
                    prepare_s,
                    full_h2d_s,
                    full_prepare_s,
                    trainer_s,
                    landed_s: mid.landed_s,
                    full_landed_s: mid_full.landed_s,
                    staged_bytes,
                    all_full_s: fs,
                    all_delta_s: ds,
                });
            }
            Ok::<_, E2eError>(out)
        })?);
    }
    let floor = Floor::measure(table, super::loopback::landed_bytes(table))?;
    Ok(DeltaReport {
        floor,
        bench: "e2e-delta",
        setup: cfg.setup.clone(),
        syncs: cfg.syncs,
        inbox_fraction: INBOX_FRACTION,
        rows,
    })
}
