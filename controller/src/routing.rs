//! The job's routing table, from a [`WorldSpec`], and the production [`Planner`].
//!
//! The planner is pure and deterministic, so every process that knows the job can compute the
//! same table: the controller plans once the world is complete and hands each trainer its slice;
//! workers compute their own side of it at start-up to size and register their memory *before*
//! registering (registration is slow and must never sit on the sync path), and check the
//! controller's assignment against it.

use std::collections::BTreeMap;

use weightsync_common::protocol::{
    Assignment, Blob, PeerInfo, Registration, Role, WorkerId, WorldSpec,
};
use weightsync_common::DType;
use weightsync_schedules::{
    plan, CostModel, InferDType, InferSpec, InferenceLayout, Model, RoutingTable, Summary,
    TrainSpec, TrainingLayout,
};

use crate::planning::{PlanError, PlanOutput, Planner};

/// Everything the planner derives from a job.
#[derive(Debug, Clone)]
pub struct Job {
    /// Logical parameters.
    pub model: Model,
    /// Training layout.
    pub train: TrainingLayout,
    /// Inference layout.
    pub infer: InferenceLayout,
    /// The parsed inference spec.
    pub infer_spec: InferSpec,
    /// Cost model.
    pub cost: CostModel,
    /// The table.
    pub table: RoutingTable,
}

/// Builds the model and both layouts of a job (no planning).
pub fn layouts(
    world: &WorldSpec,
) -> Result<(Model, TrainingLayout, InferenceLayout, InferSpec), PlanError> {
    let e = |what: &str, err: weightsync_schedules::PlanError| PlanError(format!("{what}: {err}"));
    let tspec: TrainSpec = world.train.parse().map_err(|x| e("training layout", x))?;
    let model = if std::path::Path::new(&world.model).is_file() {
        let text = std::fs::read_to_string(&world.model)
            .map_err(|x| PlanError(format!("reading {}: {x}", world.model)))?;
        Model::from_config_json(&world.model, &text, tspec.experts).map_err(|x| e("model", x))?
    } else {
        Model::preset(&world.model, tspec.experts).map_err(|x| e("model", x))?
    };
    let mut ispec: InferSpec = world.infer.parse().map_err(|x| e("inference layout", x))?;
    ispec.dtype = match world.dtype {
        DType::F8E4M3 => InferDType::Fp8,
        DType::BF16 => InferDType::Bf16,
        other => {
            return Err(PlanError(format!(
                "inference dtype {other} is not supported (bf16 or fp8)"
            )))
        }
    };
    let train = TrainingLayout::build(&model, &tspec).map_err(|x| e("training layout", x))?;
    let infer = InferenceLayout::build(&model, &ispec).map_err(|x| e("inference layout", x))?;
    Ok((model, train, infer, ispec))
}

/// Plans a job.
pub fn job(world: &WorldSpec) -> Result<Job, PlanError> {
    let (model, train, infer, infer_spec) = layouts(world)?;
    let cost = CostModel::default();
    let table = plan(&model, &train, &infer, &cost).map_err(|x| PlanError(x.to_string()))?;
    Ok(Job {
        model,
        train,
        infer,
        infer_spec,
        cost,
        table,
    })
}

/// Number of trainers and rollouts a job has.
pub fn world_size(world: &WorldSpec) -> Result<(u32, u32), PlanError> {
    let (_, train, infer, _) = layouts(world)?;
    Ok((train.ranks, infer.ranks.len() as u32))
}

/// Plans with `weightsync_schedules` and checks registrations against the table.
#[derive(Debug, Default, Clone, Copy)]
pub struct SchedulesPlanner;

impl Planner for SchedulesPlanner {
    fn plan(
        &self,
        plan_id: u64,
        world: &WorldSpec,
        workers: &BTreeMap<WorkerId, Registration>,
    ) -> Result<PlanOutput, PlanError> {
        let job = job(world)?;
        let t = &job.table;
        if t.trainers.len() != workers.keys().filter(|w| w.role == Role::Trainer).count()
            || t.rollouts.len() != workers.keys().filter(|w| w.role == Role::Rollout).count()
        {
            return Err(PlanError(format!(
                "the table has {} trainers and {} rollouts but {} workers registered",
                t.trainers.len(),
                t.rollouts.len(),
                workers.len()
            )));
        }
        let mut assignments = BTreeMap::new();
        for (id, reg) in workers {
            let a = match id.role {
                Role::Trainer => {
                    let slice = t
                        .slice(id.rank)
                        .map_err(|e| PlanError(format!("{id}: {e}")))?;
                    let peers = workers
                        .iter()
                        .filter(|(w, _)| *w != id)
                        .map(|(w, r)| PeerInfo {
                            id: *w,
                            fabric_endpoint: r.fabric_endpoint.clone(),
                            regions: r.regions.clone(),
                        })
                        .collect();
                    Assignment::Trainer {
                        plan_id,
                        slice: Blob(
                            bincode::serialize(&slice).map_err(|e| PlanError(e.to_string()))?,
                        ),
                        peers,
                    }
                }
                Role::Rollout => {
                    let r = t.rollouts.get(id.rank as usize).ok_or_else(|| {
                        PlanError(format!("{id}: the table has no such inference rank"))
                    })?;
                    if reg.regions.len() != r.mr_bytes.len() {
                        return Err(PlanError(format!(
                            "{id} registered {} regions but its layout has {}",
                            reg.regions.len(),
                            r.mr_bytes.len()
                        )));
                    }
                    Assignment::Rollout {
                        plan_id,
                        expected: Blob(
                            bincode::serialize(r).map_err(|e| PlanError(e.to_string()))?,
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
