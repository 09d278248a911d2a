//! The production [`Planner`]: the job's routing table from `weightsync_schedules`, cut into one
//! assignment per worker, and the registrations checked against it. A trainer gets its compact
//! slice ([`weightsync_schedules::TrainerSlice`]) and expands it itself: the controller never
//! holds every trainer's explicit writes.

use std::collections::BTreeMap;

use weightsync_common::protocol::{
    Assignment, Blob, Registration, WorkerId, WorkerRole, WorldSpec,
};
use weightsync_schedules::job::plan_job;
use weightsync_schedules::Summary;

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
        let job = plan_job(world, text.as_deref()).map_err(|e| AssignmentError(e.to_string()))?;
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
