//! Prometheus metrics (`GET /metrics`), in the OpenMetrics text format.
//!
//! Recorded when a sync ends, from its record: duration, bytes, failures and each worker's rate,
//! so a scrape never walks the history.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use crate::sync_record::{SyncRecord, SyncState};

/// Labels of per-worker series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabels {
    /// e.g. `trainer-0`.
    pub worker: String,
}

/// Labels of per-outcome series.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    /// committed or failed.
    pub outcome: String,
}

/// Labels of the delta policy's decisions.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `off`, `on`, `unavailable`, `measure`, `probe`, `delta_pays` or `full_pays` (see
    /// `coordinator`'s `delta_policy`).
    pub decision: String,
}

/// Labels of refused connections.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// Why: `preauth_cap` (too many unauthenticated connections), `auth` (no proof of the
    /// role's secret, or a frame before it), `timeout` (no proof in time), `role` (registered
    /// as another role than it proved), `registration` (the coordinator refused).
    pub reason: String,
}

/// The controller's metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    sync_duration: Family<OutcomeLabels, Histogram>,
    syncs: Family<OutcomeLabels, Counter>,
    bytes: Counter,
    worker_gbps: Family<WorkerLabels, Gauge<f64, AtomicU64>>,
    worker_bytes: Family<WorkerLabels, Counter>,
    delta: DeltaSeries,
    refused: Family<RefusedLabels, Counter>,
}

/// What committed delta syncs came to (see `crate::coordinator`'s `delta`).
#[derive(Debug, Default)]
struct DeltaSeries {
    /// Committed syncs that offered deltas.
    syncs: Counter,
    /// Bytes those syncs would have written to engines as full syncs.
    dense_bytes: Counter,
    /// Bytes they put on the wire for engines (encodings plus runs sent dense).
    wire_bytes: Counter,
    /// The last one's changed fraction, encode and apply seconds.
    changed_fraction: Gauge<f64, AtomicU64>,
    encode_seconds: Gauge<f64, AtomicU64>,
    apply_seconds: Gauge<f64, AtomicU64>,
    /// Ended syncs by the delta policy's decision at their start.
    decisions: Family<DecisionLabels, Counter>,
}

impl DeltaSeries {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "delta_syncs",
            "Committed syncs that sent deltas to some engines",
            self.syncs.clone(),
        );
        registry.register(
            "delta_dense_bytes",
            "Bytes delta syncs would have written to engines as full syncs",
            self.dense_bytes.clone(),
        );
        registry.register(
            "delta_wire_bytes",
            "Bytes delta syncs wrote for engines (encodings plus runs sent dense)",
            self.wire_bytes.clone(),
        );
        registry.register(
            "delta_changed_fraction",
            "Fraction of compared elements that changed, last delta sync",
            self.changed_fraction.clone(),
        );
        registry.register(
            "delta_encode_seconds",
            "Trainers' encode time summed, last delta sync",
            self.encode_seconds.clone(),
        );
        registry.register(
            "delta_apply_seconds",
            "The slowest engine's apply, last delta sync",
            self.apply_seconds.clone(),
        );
        registry.register(
            "delta_decisions",
            "Ended syncs by whether the delta policy offered deltas and why",
            self.decisions.clone(),
        );
    }

    fn record_decision(&self, s: &SyncRecord) {
        if let Some((kind, _)) = &s.delta_policy {
            self.decisions
                .get_or_create(&DecisionLabels {
                    decision: kind.label().into(),
                })
                .inc();
        }
    }

    fn record(&self, s: &SyncRecord) {
        let Some(d) = s.delta_view() else {
            return;
        };
        self.syncs.inc();
        self.dense_bytes.inc_by(d.dense_bytes);
        self.wire_bytes.inc_by(d.wire_bytes);
        self.changed_fraction.set(d.changed_fraction);
        self.encode_seconds.set(d.encode_ms / 1e3);
        self.apply_seconds.set(d.apply_ms / 1e3);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every series.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("weightsync");
        let sync_duration = Family::<OutcomeLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.01, 2.0, 14))
        });
        let syncs = Family::<OutcomeLabels, Counter>::default();
        let bytes = Counter::default();
        let worker_gbps = Family::<WorkerLabels, Gauge<f64, AtomicU64>>::default();
        let worker_bytes = Family::<WorkerLabels, Counter>::default();
        registry.register(
            "sync_duration_seconds",
            "Sync duration from trigger to commit or failure",
            sync_duration.clone(),
        );
        registry.register(
            "syncs",
            "Syncs ended, by outcome (failed syncs are the failures)",
            syncs.clone(),
        );
        registry.register(
            "sync_bytes",
            "Bytes written by trainers in committed syncs",
            bytes.clone(),
        );
        registry.register(
            "worker_throughput_gbps",
            "Each worker's rate in its last sync, GB/s",
            worker_gbps.clone(),
        );
        registry.register(
            "worker_bytes",
            "Bytes each worker wrote or received in committed syncs",
            worker_bytes.clone(),
        );
        let delta = DeltaSeries::default();
        delta.register(&mut registry);
        let refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "control_connections_refused",
            "Control connections refused before or at registration, by reason",
            refused.clone(),
        );
        Metrics {
            delta,
            refused,
            registry,
            sync_duration,
            syncs,
            bytes,
            worker_gbps,
            worker_bytes,
        }
    }

    /// Records an ended sync.
    pub fn record(&self, s: &SyncRecord) {
        let outcome = OutcomeLabels {
            outcome: match s.state {
                SyncState::Committed => "committed",
                _ => "failed",
            }
            .into(),
        };
        if let Some(ns) = s.ended_ns {
            self.sync_duration
                .get_or_create(&outcome)
                .observe(ns as f64 / 1e9);
        }
        self.syncs.get_or_create(&outcome).inc();
        self.delta.record_decision(s);
        if s.state == SyncState::Committed {
            self.delta.record(s);
            self.bytes.inc_by(s.bytes_written());
            for (w, lane) in &s.lanes {
                let labels = WorkerLabels {
                    worker: w.to_string(),
                };
                self.worker_bytes.get_or_create(&labels).inc_by(lane.bytes);
                if let Some(g) = crate::sync_record::lane_gbps(s, w) {
                    self.worker_gbps.get_or_create(&labels).set(g);
                }
            }
        }
    }

    /// Counts a control connection refused for `reason` (see [`RefusedLabels`]).
    pub fn refused(&self, reason: &str) {
        self.refused
            .get_or_create(&RefusedLabels {
                reason: reason.into(),
            })
            .inc();
    }

    /// How many control connections were refused for `reason`.
    pub fn refused_count(&self, reason: &str) -> u64 {
        self.refused
            .get_or_create(&RefusedLabels {
                reason: reason.into(),
            })
            .get()
    }

    /// The OpenMetrics text.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}
