//! Trainer and rollout workers whose lanes to each rollout pass through a [`LaneProxy`].
//!
//! The same workers as a real deployment (each with its own TCP fabric, listener and immediate
//! counter), driven the way the controller drives them: arm every rollout, run every trainer,
//! wait until every rollout landed, verify the trainers' checksums against what landed. The only
//! difference is that the descriptors trainers get for rollout `r` name the address of proxy `r`
//! instead of the rollout's own endpoint, so a test can cut or stall that rollout's lanes from
//! the outside, at any byte, without a hook in the fabric or the worker.
//!
//! [`ProxiedCluster::sync`] answers one question per sync: was it reported landed *and* did it
//! verify? A fault test asserts that a sync it sabotaged is never `Committed`, and that the next
//! one is.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::task::JoinSet;
use weightsync_common::fabric::{Endpoint, Fabric, FabricBackend, FabricConfig};
use weightsync_schedules::table::RoutingTable;
use weightsync_schedules::{CostModel, ExpertForm, InferenceLayout, Model, TrainingLayout, plan};
use weightsync_worker::RolloutWorker;
use weightsync_worker::WorkerError;
use weightsync_worker::{Destinations, SyncId, TrainerWorker};

use crate::loopback::start_trainers;
use crate::proxy::LaneProxy;

/// Job token of the cluster's fabrics.
pub const JOB_TOKEN: &str = "weightsync-fault-suite";

/// A two-layer Qwen3 with small dimensions (a few MiB of bf16 weights; every tp=2 shard is a whole
/// number of 128x128 fp8 blocks): quick to plan and move.
pub const TINY_MODEL: &str = r#"{
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128,
  "vocab_size": 1024, "tie_word_embeddings": false
}"#;

/// Plans [`TINY_MODEL`] for a training and an inference layout string.
pub fn tiny_table(train: &str, infer: &str) -> RoutingTable {
    let model = Model::from_config_json("tiny", TINY_MODEL, ExpertForm::default())
        .expect("the tiny model config parses");
    let t = TrainingLayout::build(&model, &train.parse().expect("training layout"))
        .expect("training layout builds");
    let i = InferenceLayout::build(&model, &infer.parse().expect("inference layout"))
        .expect("inference layout builds");
    plan(&model, &t, &i, &CostModel::default()).expect("the tiny model plans")
}

/// How one sync ended.
#[derive(Debug)]
pub enum SyncOutcome {
    /// Every rollout landed every expected write and every checksum matched.
    Committed,
    /// A trainer failed (its error).
    TrainerFailed(String),
    /// A rollout did not land (its error).
    NotLanded(String),
    /// Everything landed but a checksum did not match (the error names the tensor).
    VerifyFailed(String),
}

impl SyncOutcome {
    /// Whether the sync committed.
    pub fn committed(&self) -> bool {
        matches!(self, SyncOutcome::Committed)
    }
}

/// Workers of one routing table with a proxy in front of every rollout.
#[derive(Debug)]
pub struct ProxiedCluster {
    /// Trainers by training rank.
    pub trainers: Vec<Arc<TrainerWorker<Fabric>>>,
    /// Their sources (rewrite between syncs to change the weights).
    pub sources: Vec<Arc<RwLock<Vec<u8>>>>,
    /// Rollouts by global inference rank.
    pub rollouts: Vec<Arc<RolloutWorker<Fabric>>>,
    /// Proxy `r` stands in front of rollout `r`.
    pub proxies: Vec<LaneProxy>,
    /// Another fabric of the job, for raw (stale, forged) writes.
    pub probe: Fabric,
}

impl ProxiedCluster {
    /// Builds every worker of `table` with fabrics configured by `config` (its `listen` is
    /// ignored: loopback, any port; and same-host pulls are off, since each proxy stands for the
    /// network between two hosts, which every byte must cross).
    pub async fn start(
        table: &RoutingTable,
        watermark: u64,
        config: &FabricConfig,
    ) -> Result<ProxiedCluster, WorkerError> {
        let fabric = |c: &FabricConfig| {
            let c = FabricConfig {
                listen: "127.0.0.1:0".into(),
                same_host: false,
                ..c.clone()
            };
            async move {
                Fabric::start(&c)
                    .await
                    .map_err(|e| WorkerError::fabric("starting a fabric", e))
            }
        };
        let mut rollouts = Vec::new();
        let mut proxies = Vec::new();
        let mut dsts = Destinations::default();
        for p in table.rollout_plans() {
            let f = fabric(config).await?;
            let target =
                f.endpoint().as_str().parse().map_err(|e| {
                    WorkerError::Protocol(format!("endpoint is not an address: {e}"))
                })?;
            let proxy = LaneProxy::loopback(target)
                .map_err(|e| WorkerError::Protocol(format!("starting a proxy: {e}")))?;
            let r = RolloutWorker::new(f, format!("rollout-{}", p.rank), p.clone())?;
            let via_proxy = r
                .descriptors()
                .into_iter()
                .map(|mut d| {
                    d.endpoint = Endpoint::from(proxy.addr());
                    d
                })
                .collect();
            dsts.rollouts.insert(p.rank, via_proxy);
            rollouts.push(Arc::new(r));
            proxies.push(proxy);
        }
        let (trainers, sources) = start_trainers(table, watermark, dsts, || fabric(config)).await?;
        Ok(ProxiedCluster {
            trainers,
            sources,
            rollouts,
            proxies,
            probe: fabric(config).await?,
        })
    }

    /// Fills every source with bytes that depend on `version` (so each version differs).
    pub fn fill_sources(&self, version: u64) {
        for (rank, s) in self.sources.iter().enumerate() {
            let mut s = s.write().unwrap_or_else(|e| e.into_inner());
            let mut x = (version.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ rank as u64) | 1;
            for b in s.iter_mut() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Keep bf16 values finite: clear the top exponent bit of every high byte.
                *b = (x as u8) & 0xBF;
            }
        }
    }

    /// Arms every rollout for `sync`.
    pub fn arm(&self, sync: SyncId) -> Result<(), WorkerError> {
        for r in &self.rollouts {
            r.arm(sync)?;
        }
        Ok(())
    }

    /// One sync: arm, write, land (within `timeout`), verify. A failure aborts every rollout.
    pub async fn sync(&self, sync: SyncId, timeout: Duration) -> SyncOutcome {
        if let Err(e) = self.arm(sync) {
            return SyncOutcome::NotLanded(format!("arming: {e}"));
        }
        self.write_land_verify(sync, timeout, |_| {}).await
    }

    /// The part of [`sync`](Self::sync) after arming. `before_verify` runs once everything
    /// landed and before checksums are compared (a test's chance to sneak a stale write in).
    pub async fn write_land_verify(
        &self,
        sync: SyncId,
        timeout: Duration,
        before_verify: impl FnOnce(&ProxiedCluster),
    ) -> SyncOutcome {
        let mut jobs = JoinSet::new();
        for t in &self.trainers {
            let t = t.clone();
            jobs.spawn(async move { tokio::time::timeout(timeout, t.run_sync(sync)).await });
        }
        let mut sums = Vec::new();
        let mut failure = None;
        while let Some(done) = jobs.join_next().await {
            match done {
                Ok(Ok(Ok(report))) => sums.extend(report.checksums),
                Ok(Ok(Err(e))) => {
                    failure.get_or_insert(e.to_string());
                }
                Ok(Err(_)) => {
                    failure.get_or_insert(format!("trainer hung for {timeout:?}"));
                }
                Err(e) => {
                    failure.get_or_insert(format!("trainer task: {e}"));
                }
            }
        }
        if let Some(f) = failure {
            self.abort_all();
            return SyncOutcome::TrainerFailed(f);
        }
        for r in &self.rollouts {
            if let Err(e) = r.await_landed(timeout).await {
                self.abort_all();
                return SyncOutcome::NotLanded(e.to_string());
            }
        }
        before_verify(self);
        for r in &self.rollouts {
            if let Err(e) = r.verify(&sums) {
                return SyncOutcome::VerifyFailed(e.to_string());
            }
        }
        SyncOutcome::Committed
    }

    /// Aborts every rollout's armed sync (retiring its immediates).
    pub fn abort_all(&self) {
        for r in &self.rollouts {
            r.abort();
        }
    }
}
