//! The production [`Planner`]: the job's routing table from `weightsync_schedules`, cut into one
//! assignment per worker, and the registrations checked against it. A trainer gets its compact
//! slice ([`weightsync_schedules::TrainerSlice`]) and expands it itself: the controller never
//! holds every trainer's explicit writes.
//!
//! A declared model (an architecture the planner does not know, see
//! `weightsync_schedules::declared`) is planned from the registrations themselves: every
//! trainer's declared shards and every engine's declared tensors and skip list. A disagreement
//! between them fails the plan with an error naming the tensor and both ranks, which
//! `GET /v1/plan` shows and every worker is told (`PlanFailed`).

use std::collections::BTreeMap;

use weightsync_common::protocol::{
    Assignment, Blob, Registration, TensorMeta, WorkerId, WorkerRole, WorldSpec,
};
use weightsync_schedules::Summary;
use weightsync_schedules::declared::EngineDeclaration;
use weightsync_schedules::job::{Job, is_declared, plan_declared_job, plan_job};

use crate::planning::{AssignmentError, PlanOutput, Planner};

/// Plans with `weightsync_schedules` and checks registrations against the table.
#[derive(Debug, Default, Clone, Copy)]
pub struct SchedulesPlanner;

impl Planner for SchedulesPlanner {
    fn plan(
        &self,
        plan_id: u64,
        world: &WorldSpec,
        workers: &BTreeMap<WorkerId, Registration>,
    ) -> Result<PlanOutput, AssignmentError> {
        let text = world
            .read_model_config()
            .map_err(|e| AssignmentError(e.to_string()))?;
        let job = if is_declared(world, text.as_deref()) {
            plan_declared(world, workers)?
        } else {
            plan_job(world, text.as_deref()).map_err(|e| AssignmentError(e.to_string()))?
        };
        let t = &job.table;
        if t.trainers.len()
            != workers
                .keys()
                .filter(|w| w.role == WorkerRole::Trainer)
                .count()
            || t.rollouts.len()
                != workers
                    .keys()
                    .filter(|w| w.role == WorkerRole::Rollout)
                    .count()
        {
            return Err(AssignmentError(format!(
                "the table has {} trainers and {} rollouts but {} workers registered",
                t.trainers.len(),
                t.rollouts.len(),
                workers.len()
            )));
        }
        let mut assignments = BTreeMap::new();
        for (id, reg) in workers {
            let a = match id.role {
                WorkerRole::Trainer => {
                    let slice = t
                        .slice(id.rank)
                        .map_err(|e| AssignmentError(format!("{id}: {e}")))?;
                    Assignment::Trainer {
                        plan_id,
                        slice: Blob(slice.to_bincode()),
                        delta: false,
                    }
                }
                WorkerRole::Rollout => {
                    let r = t.rollout(id.rank).ok_or_else(|| {
                        AssignmentError(format!("{id}: the table has no such inference rank"))
                    })?;
                    // A rollout over an engine's own tensors has its own regions and says where
                    // each planned tensor is (its placement, checked by the trainers).
                    if reg.placement.is_none() && reg.regions.len() != r.mr_bytes.len() {
                        return Err(AssignmentError(format!(
                            "{id} registered {} regions but its layout has {}",
                            reg.regions.len(),
                            r.mr_bytes.len()
                        )));
                    }
                    Assignment::Rollout {
                        plan_id,
                        expected: Blob(
                            bincode::serialize(&r).map_err(|e| AssignmentError(e.to_string()))?,
                        ),
                        expected_writes: r.expect.iter().map(|e| e.writes).sum(),
                        expected_bytes: r.tensors.iter().map(|t| t.len).sum(),
                        delta: false,
                    }
                }
            };
            assignments.insert(*id, a);
        }
        let summary = Summary::of(t, &job.cost);
        let summary = serde_json::to_value(&summary).unwrap_or_else(
            |e| serde_json::json!({ "error": format!("summary not serialisable: {e}") }),
        );
        Ok(PlanOutput {
            summary,
            assignments,
        })
    }
}

/// Plans a declared model from the registrations: trainer `r`'s declared shards and rollout
/// `i`'s declared tensors and skip list (a rank that did not register declares nothing, which
/// the planner then names).
fn plan_declared(
    world: &WorldSpec,
    workers: &BTreeMap<WorkerId, Registration>,
) -> Result<Job, AssignmentError> {
    let (trainers, rollouts) = weightsync_schedules::job::declared_world(world)
        .map_err(|e| AssignmentError(e.to_string()))?;
    let reg = |id: WorkerId| workers.get(&id);
    let none: &[TensorMeta] = &[];
    let t: Vec<&[TensorMeta]> = (0..trainers)
        .map(|r| reg(WorkerId::trainer(r)).map_or(none, |g| g.tensors.as_slice()))
        .collect();
    let e: Vec<EngineDeclaration> = (0..rollouts)
        .map(|r| match reg(WorkerId::rollout(r)) {
            Some(g) => EngineDeclaration {
                tensors: &g.tensors,
                skip: &g.skip,
            },
            None => EngineDeclaration {
                tensors: none,
                skip: &[],
            },
        })
        .collect();
    plan_declared_job(world, &t, &e).map_err(|e| AssignmentError(e.to_string()))
}
