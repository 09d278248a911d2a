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
//! every byte of the destination) and the job opted in ([`Coordinator::allow_delta_syncs`],
//! `weightsync controller --delta`; off by default, when trainers keep no bases and rollouts
//! register no inbox: the plan's assignments say which). Every other engine gets dense writes,
//! and after a successful sync it holds a base again.
//!
//! This is the controller's view; each side checks it too (a trainer whose bases hold another
//! version writes dense; a receiver refuses a delta whose base is not what it holds), so a
//! mistake here fails a sync, never leaves wrong weights.

use std::collections::BTreeSet;

use weightsync_common::protocol::{DeltaBase, WorkerId, WorkerRole};

use super::Coordinator;

impl Coordinator {
    /// Lets syncs send deltas where the engines hold a base (`true`), or keeps every sync full
    /// (`false`, the default). Set before the first plan: the plan's assignments tell trainers
    /// to keep bases and rollouts to register inboxes.
    pub fn allow_delta_syncs(&mut self, on: bool) {
        self.delta_syncs = on;
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

    /// The deltas a sync of `members` in run `run` may send (`None`: a full sync): only on top
    /// of the same run's last committed version.
    pub(super) fn delta_base(&self, run: u64, members: &BTreeSet<WorkerId>) -> Option<DeltaBase> {
        if !self.delta_syncs || !self.cfg.world.verify {
            return None;
        }
        let base = self.latest_committed.filter(|(r, _)| *r == run)?;
        let rollouts: BTreeSet<u32> = members
            .iter()
            .filter(|w| w.role == WorkerRole::Rollout)
            .filter(|w| self.engine_bases.get(w) == Some(&base) && self.has_inbox(w))
            .map(|w| w.rank)
            .collect();
        (!rollouts.is_empty()).then_some(DeltaBase {
            base_version: base.1,
            rollouts,
        })
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
