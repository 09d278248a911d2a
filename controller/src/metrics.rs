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
    refused: Family<RefusedLabels, Counter>,
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
        let refused = Family::<RefusedLabels, Counter>::default();
        registry.register(
            "control_connections_refused",
            "Control connections refused before or at registration, by reason",
            refused.clone(),
        );
        Metrics {
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
        if s.state == SyncState::Committed {
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
