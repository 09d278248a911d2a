//! Which engines take deltas: the controller's half of the delta chain.
//!
//! A delta for version N applies only on top of the version the engine holds, and that version
//! must be one this controller committed on it: the coordinator keeps, per engine, the last
//! version committed with it taking part ([`Coordinator::engine_bases`]), and drops it when the
//! engine leaves or registers again (a restarted engine holds nothing certain), when a sync it
//! took part in fails (its destination may be half rewritten), and when the plan changes (the
//! trainers' bases are rebuilt). `Start` offers deltas only to engines whose base is the last
//! committed version (the one every trainer's bases hold after it succeeded), that registered a
//! delta inbox, and only when verification is on (a delta is checked like a full write, over
//! every byte of the destination) and the job's [`DeltaMode`] lets it
//! ([`Coordinator::set_delta_mode`], `weightsync controller --delta=auto|on|off`): `off` keeps
//! every sync full (trainers keep no bases and rollouts register no inbox: the plan's
//! assignments say which), `on` offers deltas wherever engines can take them, and `auto` (the
//! default) wherever they can and measurements say they pay ([`super::delta_policy`]). Every
//! other engine gets dense writes, and after a successful sync it holds a base again.
//!
//! This is the controller's view; each side checks it too (a trainer whose bases hold another
//! version writes dense; a receiver refuses a delta whose base is not what it holds), so a
//! mistake here fails a sync, never leaves wrong weights.

use std::collections::BTreeSet;

use weightsync_common::protocol::{DeltaBase, WorkerId, WorkerRole};

use super::Coordinator;
use super::delta_policy::{Decision, DeltaMode, DeltaPolicy, SyncKind};
use crate::sync_record::SyncRecord;

impl Coordinator {
    /// Whether syncs send deltas: `auto` (the default), `on` or `off`. Set before the first
    /// plan: the plan's assignments tell trainers to keep bases and rollouts to register
    /// inboxes (not under `off`).
    pub fn set_delta_mode(&mut self, mode: DeltaMode) {
        self.delta_policy = DeltaPolicy::new(mode);
    }

    /// The job's delta mode.
    pub fn delta_mode(&self) -> DeltaMode {
        self.delta_policy.mode()
    }

    /// Whether the plan's workers prepare for deltas (trainers keep bases, rollouts register
    /// inboxes): not under `off`, and only with verification on.
    pub(super) fn prepares_deltas(&self) -> bool {
        self.delta_mode().keeps_bases() && self.cfg.world.verify
    }

    /// The version each engine holds, as far as this controller knows (see the module docs).
    pub fn engine_bases(&self) -> &std::collections::BTreeMap<WorkerId, (u64, u64)> {
        &self.engine_bases
    }

    /// Whether rollout `w` registered a delta inbox under the plan in force.
    fn has_inbox(&self, w: &WorkerId) -> bool {
        self.plan
            .as_ref()
            .and_then(|p| p.ready_regions.get(w))
            .is_some_and(|r| !r.is_empty())
    }

    /// The deltas a sync of `members` in run `run` sends (`None`: a full sync), and the
    /// decision behind them (see [`super::delta_policy`]).
    pub(super) fn delta_offer(
        &self,
        run: u64,
        members: &BTreeSet<WorkerId>,
    ) -> (Option<DeltaBase>, Decision) {
        let eligible = self.delta_base(run, members);
        let why_not = match &eligible {
            Ok(_) => None,
            Err(why) => Some(*why),
        };
        let plan_id = self.plan.as_ref().map_or(0, |p| p.id);
        let decision = self.delta_policy.decide(plan_id, why_not);
        let offer = eligible.ok().filter(|_| decision.deltas);
        (offer, decision)
    }

    /// The deltas a sync of `members` in run `run` could send, or why it can send none: only
    /// on top of the same run's last committed version.
    fn delta_base(
        &self,
        run: u64,
        members: &BTreeSet<WorkerId>,
    ) -> Result<DeltaBase, &'static str> {
        if !self.delta_mode().keeps_bases() {
            return Err("off");
        }
        if !self.cfg.world.verify {
            return Err("deltas need verification on");
        }
        let base = self
            .latest_committed
            .filter(|(r, _)| *r == run)
            .ok_or("nothing committed in this run yet")?;
        let rollouts: BTreeSet<u32> = members
            .iter()
            .filter(|w| w.role == WorkerRole::Rollout)
            .filter(|w| self.engine_bases.get(w) == Some(&base) && self.has_inbox(w))
            .map(|w| w.rank)
            .collect();
        if rollouts.is_empty() {
            return Err("no engine holds the last committed version with a delta inbox");
        }
        Ok(DeltaBase {
            base_version: base.1,
            rollouts,
        })
    }

    /// A committed sync's cost as the policy takes it: its plan, its kind, and `Start` to
    /// commit in ns.
    pub(super) fn delta_sample(s: &SyncRecord) -> Option<(u64, SyncKind, u64)> {
        let (start, end) = (s.start_sent_ns?, s.ended_ns?);
        let engines = s
            .members
            .iter()
            .filter(|w| w.role == WorkerRole::Rollout)
            .count();
        let kind = match &s.delta_base {
            None => SyncKind::Full,
            Some(d) if d.rollouts.len() == engines => SyncKind::Delta,
            Some(_) => SyncKind::Mixed,
        };
        Some((s.plan_id, kind, end.saturating_sub(start)))
    }

    /// A committed sync cost `sample` ([`Coordinator::delta_sample`]).
    pub(super) fn delta_measured(&mut self, sample: Option<(u64, SyncKind, u64)>) {
        if let Some((plan_id, kind, ns)) = sample {
            self.delta_policy.measured(plan_id, kind, ns);
        }
    }

    /// `(run, version)` was committed on the rollouts among `members`.
    pub(super) fn engines_hold(&mut self, version: (u64, u64), members: &BTreeSet<WorkerId>) {
        for w in members.iter().filter(|w| w.role == WorkerRole::Rollout) {
            self.engine_bases.insert(*w, version);
        }
    }

    /// The rollouts among `workers` hold nothing certain (a failed sync, a departure).
    pub(super) fn engines_lost<'a>(&mut self, workers: impl IntoIterator<Item = &'a WorkerId>) {
        for w in workers {
            self.engine_bases.remove(w);
        }
    }
}
