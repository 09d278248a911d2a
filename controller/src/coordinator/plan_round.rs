//! The plan round: asking for a plan when the world is complete, taking its result (dropping
//! one that a membership change superseded), handing out assignments, collecting every worker's
//! `Ready`, and sending trainers their `Peers`. A plan is in force once every worker of it is
//! ready; only then may a sync start.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use weightsync_common::protocol::{
    Blob, PeerInfo, Registration, TensorMeta, ToWorker, WorkerId, WorkerRole, WorldSpec,
};

use super::{ConnId, Coordinator, Effects, Now};
use crate::planning::{AssignmentError, PlanOutput};

/// What the service must plan, off the coordinator's lock: the job and every registration.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// Its id; the result must be handed back with it.
    pub plan_id: u64,
    /// The job.
    pub world: WorldSpec,
    /// Every registered worker (the world is complete).
    pub workers: BTreeMap<WorkerId, Registration>,
}

/// The newest plan: in force once every worker is ready for it.
#[derive(Debug, Clone, Serialize)]
pub struct PlanRecord {
    /// Plan id (increments on every re-plan).
    pub id: u64,
    /// When it was made, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// Why it was made (first plan, or which membership change).
    pub reason: String,
    /// Planner's summary.
    pub summary: serde_json::Value,
    /// Workers it covers.
    pub members: Vec<String>,
    /// Workers that have not yet answered its assignment with `Ready` (empty: in force).
    pub awaiting_ready: Vec<String>,
    #[serde(skip)]
    conns: BTreeMap<WorkerId, ConnId>,
    #[serde(skip)]
    waiting: BTreeSet<WorkerId>,
    /// Trainers' regions from their `Ready` (their gather arenas).
    #[serde(skip)]
    pub(super) ready_regions: BTreeMap<WorkerId, Vec<Blob>>,
}

impl PlanRecord {
    /// The connection a worker had when the plan was made.
    pub(super) fn conn_of(&self, w: &WorkerId) -> Option<ConnId> {
        self.conns.get(w).copied()
    }

    /// Whether every worker answered its assignment.
    pub fn in_force(&self) -> bool {
        self.waiting.is_empty()
    }
}

impl Coordinator {
    /// Asks for a new plan of the current (complete) membership.
    pub(super) fn request_plan(&mut self, reason: String, now: Now) -> Effects {
        let plan_id = self.next_plan_id;
        self.next_plan_id += 1;
        self.note(format!("planning plan {plan_id} ({reason})"), now);
        self.planning = Some((plan_id, reason));
        Effects {
            plan: Some(PlanRequest {
                plan_id,
                world: self.cfg.world.clone(),
                workers: self
                    .members
                    .iter()
                    .map(|(w, m)| (*w, m.reg.clone()))
                    .collect(),
            }),
            ..Effects::default()
        }
    }

    /// The planner's answer for plan `plan_id`. A result for any plan but the one asked for
    /// last (membership changed meanwhile) is dropped; otherwise every worker gets its
    /// assignment, and the plan waits for their `Ready`.
    pub fn planned(
        &mut self,
        plan_id: u64,
        result: Result<PlanOutput, AssignmentError>,
        now: Now,
    ) -> Effects {
        let mut fx = Effects::default();
        let reason = match self.planning.take() {
            Some((id, reason)) if id == plan_id => reason,
            other => {
                self.planning = other;
                self.note(
                    format!("plan {plan_id} dropped: a membership change superseded it"),
                    now,
                );
                return fx;
            }
        };
        let out = match result {
            Ok(out) => out,
            Err(e) => {
                self.plan = None;
                let reason = e.to_string();
                self.plan_error = Some(reason.clone());
                self.note(format!("plan {plan_id} failed: {e}"), now);
                // Every worker hears why (a declared model's mismatch names the tensor), and
                // the versions pushed meanwhile end now rather than wait for a plan.
                let all: Vec<WorkerId> = self.members.keys().copied().collect();
                self.send_to(&mut fx, all, |_| ToWorker::PlanFailed {
                    plan_id,
                    reason: reason.clone(),
                });
                fx.merge(self.abort_pushed_without_plan());
                return fx;
            }
        };
        if let Some(w) = self
            .members
            .keys()
            .find(|w| !out.assignments.contains_key(w))
        {
            let msg = format!("planner produced no assignment for {w}");
            self.plan = None;
            self.plan_error = Some(msg.clone());
            self.note(msg, now);
            return fx;
        }
        // Moved, not cloned: a large job's slices add up to gigabytes.
        let mut assignments = out.assignments;
        for (w, m) in &self.members {
            if let Some(mut a) = assignments.remove(w) {
                a.set_delta(self.prepares_deltas());
                fx.send.push((m.conn, ToWorker::Assign(a)));
            }
        }
        self.note(
            format!("plan {plan_id}: {reason}; waiting for every worker's Ready"),
            now,
        );
        self.plan_error = None;
        self.plan = Some(PlanRecord {
            id: plan_id,
            created_unix_ms: now.unix_ms,
            reason,
            summary: out.summary,
            members: self.members.keys().map(ToString::to_string).collect(),
            awaiting_ready: self.members.keys().map(ToString::to_string).collect(),
            conns: self.members.iter().map(|(w, m)| (*w, m.conn)).collect(),
            waiting: self.members.keys().copied().collect(),
            ready_regions: BTreeMap::new(),
        });
        fx
    }

    /// `Ready` from `id` for plan `plan_id`: it built what its assignment needs and registered
    /// `regions` (a trainer's gather arena). The last one puts the plan in force: trainers get
    /// their peers.
    pub(super) fn on_ready(
        &mut self,
        id: WorkerId,
        plan_id: u64,
        regions: Vec<Blob>,
        tensors: Vec<TensorMeta>,
        now: Now,
    ) -> Effects {
        let Some(p) = self.plan.as_mut().filter(|p| p.id == plan_id) else {
            return Effects::default();
        };
        if !p.waiting.remove(&id) {
            return Effects::default();
        }
        p.awaiting_ready.retain(|w| *w != id.to_string());
        p.ready_regions.insert(id, regions);
        if !tensors.is_empty()
            && let Some(m) = self.members.get_mut(&id)
        {
            m.reg.tensors = tensors;
        }
        if !p.in_force() {
            return Effects::default();
        }
        let fx = self.send_peers(plan_id);
        self.note(
            format!("plan {plan_id} in force: every worker is ready, trainers have their peers"),
            now,
        );
        fx
    }

    /// `Peers` to every trainer: every other worker's endpoint and regions (rollouts' from their
    /// registration, trainers' from their `Ready`).
    fn send_peers(&self, plan_id: u64) -> Effects {
        let mut fx = Effects::default();
        let Some(p) = &self.plan else {
            return fx;
        };
        let regions_of = |w: &WorkerId, reg: &Registration| match w.role {
            WorkerRole::Rollout => reg.regions.clone(),
            WorkerRole::Trainer => p.ready_regions.get(w).cloned().unwrap_or_default(),
        };
        let all: Vec<PeerInfo> = self
            .members
            .iter()
            .map(|(w, m)| PeerInfo {
                id: *w,
                fabric_endpoint: m.reg.fabric_endpoint.clone(),
                regions: regions_of(w, &m.reg),
                placement: m.reg.placement.clone(),
                // A rollout's `Ready` carries its delta inbox, if it takes deltas.
                inbox: match w.role {
                    WorkerRole::Rollout => p.ready_regions.get(w).and_then(|r| r.first()).cloned(),
                    WorkerRole::Trainer => None,
                },
            })
            .collect();
        let trainers = self
            .members
            .keys()
            .copied()
            .filter(|w| w.role == WorkerRole::Trainer);
        self.send_to(&mut fx, trainers, |me| ToWorker::Peers {
            plan_id,
            peers: all.iter().filter(|p| p.id != me).cloned().collect(),
        });
        fx
    }

    /// A worker could not follow plan `plan_id` (its assignment or its peers were refused):
    /// the plan cannot come into force; the trigger says why.
    pub(super) fn plan_refused(&mut self, id: WorkerId, cause: &str, now: Now) {
        let Some(plan_id) = self.plan.as_ref().map(|p| p.id) else {
            self.note(format!("{id} reported: {cause}"), now);
            return;
        };
        let msg = format!("{id} could not follow plan {plan_id}: {cause}");
        self.plan_error = Some(msg.clone());
        self.note(msg, now);
    }

    /// Whether the current (complete) membership's plan failed: no plan will come until the
    /// membership changes.
    pub(super) fn plan_failed(&self) -> bool {
        self.plan.is_none()
            && self.planning.is_none()
            && self.plan_error.is_some()
            && self.world_complete()
    }

    /// Ends every pushed version with an `Abort` of sync 0 naming the plan's failure (none can
    /// be synced until the membership changes and a plan succeeds).
    pub(super) fn abort_pushed_without_plan(&mut self) -> Effects {
        let mut fx = Effects::default();
        let reason = self.plan_error.clone().unwrap_or_default();
        for (version, by) in std::mem::take(&mut self.pushed) {
            self.send_to(&mut fx, by.into_keys(), |_| ToWorker::Abort {
                sync_id: 0,
                version,
                reason: format!("pushed version {version} cannot be synced: {reason}"),
                failure: None,
            });
        }
        fx
    }

    /// Whether a plan is in force for the current membership.
    pub(super) fn plan_valid(&self) -> bool {
        match &self.plan {
            Some(p) => {
                p.in_force()
                    && self.planning.is_none()
                    && self.world_complete()
                    && self
                        .members
                        .iter()
                        .all(|(w, m)| p.conn_of(w) == Some(m.conn))
            }
            None => false,
        }
    }

    /// Why no sync can start now (the world is complete or not), for a refused trigger.
    pub(super) fn not_ready_reason(&self) -> String {
        if !self.world_complete() {
            return format!(
                "{} of {} workers registered; missing {}",
                self.members.len(),
                self.cfg.trainers + self.cfg.rollouts,
                self.missing_workers().join(", ")
            );
        }
        if let Some((id, _)) = &self.planning {
            return format!("plan {id} for the current membership is being computed");
        }
        if let Some(e) = &self.plan_error {
            return e.clone();
        }
        match &self.plan {
            Some(p) if !p.in_force() => format!(
                "plan {} is not in force yet: waiting for {} to accept it",
                p.id,
                p.awaiting_ready.join(", ")
            ),
            _ => "no plan for the current membership".into(),
        }
    }

    /// The plan in force: every worker accepted it (`None` while it is being made or accepted).
    pub fn plan(&self) -> Option<&PlanRecord> {
        self.plan.as_ref().filter(|p| p.in_force())
    }

    /// Whether the current membership has a plan in force: every worker is registered, no
    /// re-plan is being computed, and every worker accepted the newest plan (a sync may start).
    pub fn plan_ready(&self) -> bool {
        self.plan_valid()
    }

    /// The newest plan, in force or still waiting for workers to accept it.
    pub fn latest_plan(&self) -> Option<&PlanRecord> {
        self.plan.as_ref()
    }

    /// The id of the plan being computed, if one is.
    pub fn planning(&self) -> Option<u64> {
        self.planning.as_ref().map(|(id, _)| *id)
    }

    /// Why the last planning attempt (or a worker's acceptance of its plan) failed.
    pub fn plan_error(&self) -> Option<&str> {
        self.plan_error.as_deref()
    }
}
