//! Turning a complete world into assignments.
//!
//! The coordinator does not know the routing table's types: the service asks a [`Planner`] for
//! one [`Assignment`] per registered worker and a JSON summary for `GET /v1/plan`, on a thread
//! of its own (planning a large job takes seconds), and hands the answer to the coordinator. The production
//! planner ([`crate::routing::SchedulesPlanner`]) runs `weightsync_schedules`; [`NullPlanner`]
//! assigns empty work and exists so the control protocol can be tested without a model.

use std::collections::BTreeMap;

use weightsync_common::protocol::{
    Assignment, Blob, Registration, WorkerId, WorkerRole, WorldSpec,
};

/// Why the world could not be given its assignments: the job did not plan, or the
/// registrations contradict the table (named here, unlike `weightsync_schedules::PlanError`,
/// which is only the planner's part of it).
#[derive(Debug, Clone, thiserror::Error)]
#[error("planning failed: {0}")]
pub struct AssignmentError(pub String);

/// The planner's answer for one complete world.
#[derive(Debug, Clone)]
pub struct PlanOutput {
    /// Summary shown by `GET /v1/plan` (must not contain rkeys or tokens).
    pub summary: serde_json::Value,
    /// One assignment per registered worker.
    pub assignments: BTreeMap<WorkerId, Assignment>,
}

/// Plans a complete world.
pub trait Planner: Send + Sync + std::fmt::Debug {
    /// Plans once for the registered workers (all of them present).
    fn plan(
        &self,
        plan_id: u64,
        world: &WorldSpec,
        workers: &BTreeMap<WorkerId, Registration>,
    ) -> Result<PlanOutput, AssignmentError>;
}

/// Assigns every trainer an empty slice and every rollout zero expected writes.
///
/// Only for exercising the control protocol (tests, dry runs): with it a sync moves no bytes.
#[derive(Debug, Default, Clone, Copy)]
pub struct NullPlanner;

impl Planner for NullPlanner {
    fn plan(
        &self,
        plan_id: u64,
        _world: &WorldSpec,
        workers: &BTreeMap<WorkerId, Registration>,
    ) -> Result<PlanOutput, AssignmentError> {
        let assignments = workers
            .keys()
            .map(|id| {
                let a = match id.role {
                    WorkerRole::Trainer => Assignment::Trainer {
                        plan_id,
                        slice: Blob::default(),
                        delta: false,
                    },
                    WorkerRole::Rollout => Assignment::Rollout {
                        plan_id,
                        expected: Blob::default(),
                        expected_writes: 0,
                        expected_bytes: 0,
                        delta: false,
                    },
                };
                (*id, a)
            })
            .collect();
        Ok(PlanOutput {
            summary: serde_json::json!({ "planner": "null", "workers": workers.len() }),
            assignments,
        })
    }
}
