//! The demo's independent check: every byte a rollout holds after a sync, recomputed from the
//! seed without any part of weightsync's path, and compared.
//!
//! Fast because it is streamed and parallel: each piece of the inference layout (one parameter's
//! box on this rank) is recomputed on its own rayon task and compared at once with the bytes
//! that landed where it belongs, so no copy of the rollout's memory is built (the first version
//! of this check assembled whole expected regions, then copied every tensor out to compare).
//! It counts the bytes it compared; a full check whose pieces leave part of a tensor uncovered is
//! a failure, not a pass.
//!
//! Or sampled ([`Coverage::Sample`]): one piece in `n` per version, a different one each version
//! (pieces `i` with `i % n == version % n`), so `n` consecutive versions compare every piece once;
//! the demo checks its last version in full. What was compared is always said: the bytes and
//! whether it was every byte.

use std::time::Instant;

use rayon::prelude::*;
use weightsync_agent::driver::{Accepted, DriverError, DriverInfo, Outcome, SyncDriver, SyncRef};
use weightsync_agent::rollout::RolloutDriver;
use weightsync_common::fabric::Fabric;
use weightsync_common::protocol::{
    Assignment, Failure, FailureKind, PeerInfo, RunChecksum, WorkerReport, WorldSpec,
};
use weightsync_schedules::job;
use weightsync_schedules::layout_infer::Piece;
use weightsync_schedules::{InferenceLayout, Model};
use weightsync_worker::RolloutWorker;

use crate::progress::{DemoEvent, ProgressFile};
use crate::weights::place_piece;

/// Why the check failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckError {
    /// A landed byte differs from its recomputation.
    #[error(
        "independent recomputation differs at byte {at} of {tensor} (landed {landed:#04x}, expected {expected:#04x})"
    )]
    Differs {
        /// The tensor holding the byte.
        tensor: String,
        /// Offset of the byte in the tensor.
        at: u64,
        /// What landed.
        landed: u8,
        /// What the seed says.
        expected: u8,
    },
    /// The rollout's memory could not be read.
    #[error("reading region {mr} at {offset}: {cause}")]
    Unreadable {
        /// Region index.
        mr: u16,
        /// Offset.
        offset: u64,
        /// Why.
        cause: String,
    },
    /// The pieces cover fewer bytes than the tensors hold: part was never compared.
    #[error("the layout's pieces cover {compared} of the {held} bytes the tensors hold")]
    Uncovered {
        /// Bytes compared.
        compared: u64,
        /// Bytes held.
        held: u64,
    },
    /// The job could not be laid out.
    #[error("laying out the job for the check: {0}")]
    Layout(String),
}

impl CheckError {
    /// The tensor to blame, when one is.
    pub fn tensor(&self) -> Option<&str> {
        match self {
            CheckError::Differs { tensor, .. } => Some(tensor),
            _ => None,
        }
    }

    fn into_driver_error(self) -> DriverError {
        let kind = match &self {
            CheckError::Differs { .. } | CheckError::Uncovered { .. } => FailureKind::Checksum,
            CheckError::Unreadable { .. } => FailureKind::Other,
            CheckError::Layout(_) => FailureKind::Layout,
        };
        DriverError {
            kind,
            tensor: self.tensor().map(str::to_string),
            cause: self.to_string(),
        }
    }
}

/// How much of a version a check compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    /// Every byte.
    Every,
    /// One piece in `n`, rotating with the version.
    Sample {
        /// The sampling period (1 is every byte).
        n: u32,
    },
}

impl Coverage {
    /// Whether piece `i` is compared for `version`.
    fn takes(self, i: usize, version: u64) -> bool {
        match self {
            Coverage::Every | Coverage::Sample { n: 0 | 1 } => true,
            Coverage::Sample { n } => i as u64 % u64::from(n) == version % u64::from(n),
        }
    }

    /// Whether it compares every byte.
    pub fn is_every(self) -> bool {
        matches!(self, Coverage::Every | Coverage::Sample { n: 0 | 1 })
    }
}

/// A check that passed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Checked {
    /// Bytes compared.
    pub bytes: u64,
    /// Whether that was every byte the rollout holds.
    pub every_byte: bool,
    /// Seconds it took.
    pub seconds: f64,
}

/// What an inference rank must hold, recomputable for any version.
#[derive(Debug)]
pub struct DemoCheck {
    model: Model,
    infer: InferenceLayout,
    rank: u32,
    seed: u64,
}

impl DemoCheck {
    /// The check of inference rank `rank` of `world`, weights from `seed`.
    pub fn new(world: &WorldSpec, rank: u32, seed: u64) -> Result<DemoCheck, CheckError> {
        let layout = |e: &dyn std::fmt::Display| CheckError::Layout(e.to_string());
        let config = world.read_model_config().map_err(|e| layout(&e))?;
        let (model, infer) =
            job::inference_layout(world, config.as_deref()).map_err(|e| layout(&e))?;
        Ok(DemoCheck {
            model,
            infer,
            rank,
            seed,
        })
    }

    /// Compares the bytes `worker` holds (all, or a sample) with `version`'s recomputation.
    pub fn check(
        &self,
        worker: &RolloutWorker<Fabric>,
        version: u64,
        coverage: Coverage,
    ) -> Result<Checked, CheckError> {
        let start = Instant::now();
        let Some(r) = self.infer.ranks.get(self.rank as usize) else {
            return Err(CheckError::Layout(format!(
                "the layout has no inference rank {}",
                self.rank
            )));
        };
        let pieces: Vec<&Piece> = self
            .infer
            .pieces
            .iter()
            .filter(|p| p.rank == self.rank)
            .enumerate()
            .filter(|(i, _)| coverage.takes(*i, version))
            .map(|(_, p)| p)
            .collect();
        let compared = pieces
            .par_iter()
            .map(|p| {
                let mut n = 0u64;
                let mut landed = Vec::new();
                for run in place_piece(&self.model, r, p, self.seed, version) {
                    landed.resize(run.bytes.len(), 0);
                    let region = worker
                        .region(run.mr)
                        .ok_or_else(|| CheckError::Unreadable {
                            mr: run.mr,
                            offset: run.offset,
                            cause: "no such region".into(),
                        })?;
                    region.read_at(run.offset, &mut landed).map_err(|e| {
                        CheckError::Unreadable {
                            mr: run.mr,
                            offset: run.offset,
                            cause: e.to_string(),
                        }
                    })?;
                    if landed != run.bytes {
                        let i = landed.iter().zip(&run.bytes).position(|(a, b)| a != b);
                        let i = i.unwrap_or(0);
                        return Err(differs(
                            worker,
                            run.mr,
                            run.offset + i as u64,
                            landed[i],
                            run.bytes[i],
                        ));
                    }
                    n += run.bytes.len() as u64;
                }
                Ok(n)
            })
            .try_reduce(|| 0, |a, b| Ok(a + b))?;
        let held: u64 = worker.layout().iter().map(|t| t.len).sum();
        let every_byte = coverage.is_every();
        if every_byte && compared < held {
            return Err(CheckError::Uncovered { compared, held });
        }
        Ok(Checked {
            bytes: compared,
            every_byte,
            seconds: start.elapsed().as_secs_f64(),
        })
    }
}

/// The failure for byte `offset` of region `mr`, named by the tensor that holds it.
fn differs(
    worker: &RolloutWorker<Fabric>,
    mr: u16,
    offset: u64,
    landed: u8,
    expected: u8,
) -> CheckError {
    let tensor = worker
        .layout()
        .iter()
        .find(|t| t.mr == mr && (t.offset..t.offset + t.len).contains(&offset));
    CheckError::Differs {
        tensor: tensor.map_or_else(|| format!("region {mr}"), |t| t.name.clone()),
        at: tensor.map_or(offset, |t| offset - t.offset),
        landed,
        expected,
    }
}

/// When the wrapped rollout runs its check.
#[derive(Debug, Clone)]
pub enum CheckWhen {
    /// Before answering `Verified`: a version that differs is never committed (its time is
    /// then part of the sync's).
    BeforeCommit,
    /// Right after the commit, outside the sync, the outcome appended to a progress file (the
    /// demo's way: the sync is timed alone and the check reported on its own line).
    AfterCommit(ProgressFile),
}

/// How much of each version the wrapped rollout compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckPlan {
    /// Each version's coverage...
    pub coverage: Coverage,
    /// ...except this version's, compared in full (the demo's last).
    pub full_at: Option<u64>,
}

impl CheckPlan {
    /// Every byte of every version.
    pub const EVERY: CheckPlan = CheckPlan {
        coverage: Coverage::Every,
        full_at: None,
    };

    fn coverage(self, version: u64) -> Coverage {
        if self.full_at == Some(version) {
            Coverage::Every
        } else {
            self.coverage
        }
    }
}

/// The production rollout driver with the demo's independent check around it.
#[derive(Debug)]
pub struct CheckedRollout {
    inner: RolloutDriver,
    check: DemoCheck,
    when: CheckWhen,
    plan: CheckPlan,
    name: String,
}

impl CheckedRollout {
    /// Wraps `inner` (inference rank `rank` of `world`), weights from `seed`.
    pub fn new(
        inner: RolloutDriver,
        world: &WorldSpec,
        rank: u32,
        seed: u64,
        when: CheckWhen,
        plan: CheckPlan,
    ) -> Result<CheckedRollout, CheckError> {
        Ok(CheckedRollout {
            check: DemoCheck::new(world, rank, seed)?,
            inner,
            when,
            plan,
            name: format!("rollout-{rank}"),
        })
    }

    /// Runs the check on this thread (a worker thread of the runtime, handed off).
    fn run_check(&self, version: u64) -> Result<Checked, CheckError> {
        let coverage = self.plan.coverage(version);
        tokio::task::block_in_place(|| self.check.check(self.inner.worker(), version, coverage))
    }
}

impl SyncDriver for CheckedRollout {
    fn info(&self) -> DriverInfo {
        self.inner.info()
    }

    async fn assign(&mut self, a: Assignment) -> Result<Accepted, DriverError> {
        self.inner.assign(a).await
    }

    async fn peers(&mut self, plan_id: u64, peers: Vec<PeerInfo>) -> Result<(), DriverError> {
        self.inner.peers(plan_id, peers).await
    }

    async fn prepare(&mut self, sync: SyncRef) -> Result<WorkerReport, DriverError> {
        self.inner.prepare(sync).await
    }

    async fn run(&mut self, sync: SyncRef) -> Result<(Option<bool>, WorkerReport), DriverError> {
        self.inner.run(sync).await
    }

    async fn verify(
        &mut self,
        sync: SyncRef,
        checksums: Vec<RunChecksum>,
    ) -> Result<WorkerReport, DriverError> {
        let report = self.inner.verify(sync, checksums).await?;
        if matches!(self.when, CheckWhen::BeforeCommit) {
            let c = self
                .run_check(sync.version)
                .map_err(CheckError::into_driver_error)?;
            tracing::info!(
                "{}: version {}: {} bytes ({}) equal their recomputation from the seed ({:.3} s)",
                self.name,
                sync.version,
                c.bytes,
                if c.every_byte {
                    "every byte"
                } else {
                    "a sample"
                },
                c.seconds
            );
        }
        Ok(report)
    }

    fn aborted_because(&mut self, sync: SyncRef, reason: &str, failure: Option<&Failure>) {
        self.inner.aborted_because(sync, reason, failure);
    }

    async fn finish(&mut self, sync: SyncRef, outcome: Outcome) {
        self.inner.finish(sync, outcome).await;
        let CheckWhen::AfterCommit(progress) = &self.when else {
            return;
        };
        if outcome != Outcome::Committed {
            return;
        }
        let start = Instant::now();
        let result = self.run_check(sync.version);
        let (bytes, every_byte, failure) = match result {
            Ok(c) => (c.bytes, c.every_byte, None),
            Err(e) => {
                tracing::error!("{}: version {}: {e}", self.name, sync.version);
                (0, false, Some(e.to_string()))
            }
        };
        progress.append(&DemoEvent::Checked {
            worker: self.name.clone(),
            version: sync.version,
            bytes,
            every_byte,
            seconds: start.elapsed().as_secs_f64(),
            failure,
        });
    }

    async fn drain(&mut self) {
        self.inner.drain().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn n_consecutive_versions_of_a_sample_cover_every_piece_once() {
        let c = Coverage::Sample { n: 4 };
        for i in 0..13 {
            let takers = (7..11).filter(|&v| c.takes(i, v)).count();
            assert_eq!(takers, 1, "piece {i}");
        }
        assert!(!c.is_every());
        assert!(Coverage::Sample { n: 1 }.is_every() && Coverage::Every.takes(5, 2));
        let plan = CheckPlan {
            coverage: c,
            full_at: Some(3),
        };
        assert_eq!(plan.coverage(3), Coverage::Every);
        assert_eq!(plan.coverage(2), c);
    }
}
