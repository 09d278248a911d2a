//! A whole sync cluster in one process over the loopback TCP fabric: one fabric (one listener,
//! one immediate counter) per trainer and per rollout rank, exactly as separate processes would
//! have, driven the way the controller drives them (arm every rollout, run every trainer, wait
//! until every rollout landed, verify). Tests use it to check bytes end to end and to inject
//! faults between the steps.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::task::JoinSet;
use weightsync_common::fabric::{Fabric, FabricConfig};
use weightsync_common::protocol::RunChecksum;
use weightsync_schedules::table::RoutingTable;
use weightsync_worker::RolloutWorker;
use weightsync_worker::WorkerError;
use weightsync_worker::{Destinations, SyncId, SyncReport, TrainerConfig, TrainerWorker};

/// The job token every fabric of a loopback cluster shares.
pub const JOB_TOKEN: &str = "weightsync-loopback-test";

/// Trainer and rollout workers of one routing table, each with its own TCP fabric.
#[derive(Debug)]
pub struct LoopbackCluster {
    /// Trainers by training rank.
    pub trainers: Vec<Arc<TrainerWorker<Fabric>>>,
    /// Their source arenas (rewrite them between syncs to change the weights).
    pub sources: Vec<Arc<RwLock<Vec<u8>>>>,
    /// Rollout receivers by global inference rank.
    pub rollouts: Vec<Arc<RolloutWorker<Fabric>>>,
    /// One more fabric of the job, for tests that write into destinations themselves.
    pub probe: Fabric,
}

/// What one sync of the cluster did.
#[derive(Debug)]
pub struct ClusterSync {
    /// Each trainer's report.
    pub trainers: Vec<SyncReport>,
}

impl ClusterSync {
    /// Every trainer's checksums.
    pub fn checksums(&self) -> Vec<RunChecksum> {
        self.trainers
            .iter()
            .flat_map(|r| r.checksums.iter().copied())
            .collect()
    }
}

async fn fabric(lanes: usize) -> Result<Fabric, WorkerError> {
    Fabric::start(&FabricConfig::loopback(JOB_TOKEN, lanes))
        .await
        .map_err(|e| WorkerError::fabric("starting a loopback fabric", e))
}

/// Source memory of a trainer in these harnesses: zeroed, sized as its plan says.
pub type SharedSource = Arc<RwLock<Vec<u8>>>;

/// Starts one trainer per plan of `table` on a fabric from `fabric`, with a zeroed source each,
/// and hands every one the destinations: `dsts` (the rollouts') plus the trainers' own gather
/// arenas.
pub(crate) async fn start_trainers<Fut>(
    table: &RoutingTable,
    watermark: u64,
    mut dsts: Destinations,
    mut fabric: impl FnMut() -> Fut,
) -> Result<(Vec<Arc<TrainerWorker<Fabric>>>, Vec<SharedSource>), WorkerError>
where
    Fut: std::future::Future<Output = Result<Fabric, WorkerError>>,
{
    let mut trainers = Vec::new();
    let mut sources = Vec::new();
    for rank in 0..table.trainers.len() as u32 {
        // What a trainer is sent: its compact slice, which it expands itself.
        let plan = table
            .trainer_plan(rank)
            .map_err(|e| WorkerError::Protocol(format!("training rank {rank}'s slice: {e}")))?;
        let source = Arc::new(RwLock::new(vec![0u8; plan.source_arena_bytes as usize]));
        let config = TrainerConfig::new(format!("trainer-{}", plan.rank), watermark);
        let t = TrainerWorker::new(fabric().await?, source.clone(), plan, config)?;
        if let Some(d) = t.gather_descriptor() {
            dsts.trainers.insert(rank, d);
        }
        trainers.push(t);
        sources.push(source);
    }
    let mut ready = Vec::new();
    for mut t in trainers {
        t.set_destinations(&dsts)?;
        ready.push(Arc::new(t));
    }
    Ok((ready, sources))
}

impl LoopbackCluster {
    /// Builds every worker of `table`: rollouts allocate and register their arenas, trainers
    /// their staging (of `watermark` bytes) and gather arenas, then every trainer learns every
    /// destination's descriptors. Sources start zeroed, sized as the plans say.
    pub async fn start(
        table: &RoutingTable,
        watermark: u64,
        lanes: usize,
    ) -> Result<LoopbackCluster, WorkerError> {
        let mut rollouts = Vec::new();
        let mut dsts = Destinations::default();
        for plan in table.rollout_plans() {
            let rank = plan.rank;
            let r = RolloutWorker::new(fabric(lanes).await?, format!("rollout-{rank}"), plan)?;
            dsts.rollouts.insert(rank, r.descriptors());
            rollouts.push(Arc::new(r));
        }
        let (trainers, sources) = start_trainers(table, watermark, dsts, || fabric(lanes)).await?;
        Ok(LoopbackCluster {
            trainers,
            sources,
            rollouts,
            probe: fabric(lanes).await?,
        })
    }

    /// Arms every rollout, runs every trainer concurrently and waits until every rollout
    /// landed. Does not verify (see [`verify`](Self::verify)). On a trainer failure every rollout
    /// is aborted and the first error returned.
    pub async fn sync(&self, sync: SyncId, timeout: Duration) -> Result<ClusterSync, WorkerError> {
        for r in &self.rollouts {
            r.arm(sync)?;
        }
        let mut jobs = JoinSet::new();
        for (i, t) in self.trainers.iter().enumerate() {
            let t = t.clone();
            jobs.spawn(async move { (i, t.run_sync(sync).await) });
        }
        let mut reports: Vec<Option<SyncReport>> = (0..self.trainers.len()).map(|_| None).collect();
        let mut first_err = None;
        while let Some(done) = jobs.join_next().await {
            match done {
                Ok((i, Ok(r))) => reports[i] = Some(r),
                Ok((_, Err(e))) => {
                    first_err.get_or_insert(e);
                }
                Err(e) => {
                    first_err.get_or_insert(WorkerError::Stage {
                        stage: "trainer",
                        detail: e.to_string(),
                    });
                }
            }
        }
        if let Some(e) = first_err {
            for r in &self.rollouts {
                r.abort();
            }
            return Err(e);
        }
        for r in &self.rollouts {
            r.await_landed(timeout).await?;
        }
        Ok(ClusterSync {
            trainers: reports.into_iter().flatten().collect(),
        })
    }

    /// Verifies every rollout against the trainers' checksums.
    pub fn verify(&self, sync: &ClusterSync) -> Result<(), WorkerError> {
        let sums = sync.checksums();
        for r in &self.rollouts {
            r.verify(&sums)?;
        }
        Ok(())
    }
}
