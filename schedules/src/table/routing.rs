//! The whole routing table as the planner stores it: every trainer's part compact, every
//! rollout layout once.
//!
//! Why apart from the contract (`table/mod.rs`): a worker executes one expanded
//! [`TrainerPlan`](super::TrainerPlan) or holds one [`RolloutPlan`]; the table itself is
//! storage, sized for the controller (the tasks as [`TrainerRoutes`] shapes, identical rollout
//! layouts interned by [`RolloutLayouts`]), and is cut into those plans by
//! [`RoutingTable::slice`] and [`RoutingTable::rollout`].

use serde::{Deserialize, Serialize};

use super::{DstTensor, ParamRef, RolloutPlan, UnitExpect, WriteTarget};
use crate::compact::TrainerRoutes;
use crate::error::PlanError;
use crate::packed::Packed;

/// One trainer's part of a [`RoutingTable`], compact: what [`RoutingTable::slice`] hands out
/// (with the names of its parameters and groups) and [`crate::slice::TrainerSlice::expand`]
/// turns into the [`TrainerPlan`](super::TrainerPlan) a worker executes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CompactTrainer {
    /// Training rank.
    pub rank: u32,
    /// Size the source arena must have.
    pub source_arena_bytes: u64,
    /// Size of the gather arena; 0 when no gathers land here.
    pub gather_arena_bytes: u64,
    /// Model indices of the parameters the plan refers to, in the order its records number them
    /// (sorted), packed (1 field).
    pub params: Packed,
    /// Mesh groups in execution order, each `[id, tasks, gather sends, local tasks, gather
    /// writes expected]`, packed ([`GROUP_FIELDS`] fields); names in
    /// [`RoutingTable::group_names`], first tasks implied (groups tile the tasks).
    pub groups: Packed,
    /// Shards and tasks.
    pub routes: TrainerRoutes,
}

/// Fields of a mesh group record in [`CompactTrainer::groups`].
pub const GROUP_FIELDS: usize = 5;

/// The tensors and region sizes of a rollout rank, stored once for every rank laid out alike
/// (every engine holds the same tensors).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RolloutLayout {
    /// Size in bytes of each MR (index = MR id).
    pub mr_bytes: Vec<u64>,
    /// Destination tensors, sorted by (mr, offset).
    pub tensors: Vec<DstTensor>,
}

/// A rollout rank in a [`RoutingTable`]: who it is, its layout and what to expect.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RolloutEntry {
    /// Global inference rank.
    pub rank: u32,
    /// Engine (dp replica) index.
    pub engine: u32,
    /// Rank within the engine.
    pub local_rank: u32,
    /// Index in [`RoutingTable::rollout_layouts`].
    pub layout: u32,
    /// Writes to expect per unit per sync.
    pub expect: Vec<UnitExpect>,
}

/// The planner's output: every trainer's part, compact, and every rollout's layout and
/// expectations. [`RoutingTable::slice`] and [`RoutingTable::rollout`] give one worker its part.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RoutingTable {
    /// Model name.
    pub model: String,
    /// Number of logical parameters (tensors) in the model.
    pub num_params: u64,
    /// Number of parameter elements in the model.
    pub num_elements: u64,
    /// The parameters trainers refer to, by model index (`params[i].id == i`): names and shapes
    /// are stored once here, not per trainer.
    pub params: Vec<ParamRef>,
    /// Mesh group names, by group id.
    pub group_names: Vec<String>,
    /// Per training rank, indexed by rank.
    pub trainers: Vec<CompactTrainer>,
    /// The distinct rollout layouts.
    pub rollout_layouts: Vec<RolloutLayout>,
    /// Per inference rank, indexed by global inference rank.
    pub rollouts: Vec<RolloutEntry>,
}

/// Rollout layouts, each stored once: what [`RoutingTable::rollout_layouts`] is built from.
#[derive(Debug, Default)]
pub(crate) struct RolloutLayouts {
    layouts: Vec<RolloutLayout>,
    /// Layout indices by the hash of their content.
    by_hash: rustc_hash::FxHashMap<u64, smallvec::SmallVec<[u32; 1]>>,
}

impl RolloutLayouts {
    /// The index of the layout `(mr_bytes, tensors)`, added if new.
    pub(crate) fn intern(&mut self, mr_bytes: &[u64], tensors: &[DstTensor]) -> u32 {
        use std::hash::{Hash, Hasher};
        // FxHash: deterministic, and only used to find equal layouts (compared in full).
        let mut h = rustc_hash::FxHasher::default();
        mr_bytes.hash(&mut h);
        tensors.hash(&mut h);
        let ids = self.by_hash.entry(h.finish()).or_default();
        let layouts = &mut self.layouts;
        if let Some(&id) = ids.iter().find(|&&id| {
            let l = &layouts[id as usize];
            l.mr_bytes == mr_bytes && l.tensors == tensors
        }) {
            return id;
        }
        let id = layouts.len() as u32;
        layouts.push(RolloutLayout {
            mr_bytes: mr_bytes.to_vec(),
            tensors: tensors.to_vec(),
        });
        ids.push(id);
        id
    }

    /// The layouts, by index.
    pub(crate) fn into_layouts(self) -> Vec<RolloutLayout> {
        self.layouts
    }
}

impl RoutingTable {
    /// The whole plan of inference rank `rank` (its layout's tensors copied out), or `None`
    /// when there is no such rank or its layout is missing.
    pub fn rollout(&self, rank: u32) -> Option<RolloutPlan> {
        let e = self.rollouts.get(rank as usize)?;
        let l = self.rollout_layouts.get(e.layout as usize)?;
        Some(RolloutPlan {
            rank: e.rank,
            engine: e.engine,
            local_rank: e.local_rank,
            mr_bytes: l.mr_bytes.clone(),
            tensors: l.tensors.clone(),
            expect: e.expect.clone(),
        })
    }

    /// Every rollout's plan, in rank order (see [`RoutingTable::rollout`]; entries with a
    /// missing layout are left out).
    pub fn rollout_plans(&self) -> impl Iterator<Item = RolloutPlan> + '_ {
        (0..self.rollouts.len() as u32).filter_map(|r| self.rollout(r))
    }

    /// The layout of inference rank `rank`.
    pub fn rollout_layout(&self, rank: u32) -> Option<&RolloutLayout> {
        let e = self.rollouts.get(rank as usize)?;
        self.rollout_layouts.get(e.layout as usize)
    }

    /// Serialise with bincode (deterministic: same table, same bytes).
    pub fn to_bincode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("a RoutingTable always serialises")
    }

    /// Deserialise from bincode.
    pub fn from_bincode(bytes: &[u8]) -> Result<RoutingTable, PlanError> {
        bincode::deserialize(bytes).map_err(|e| PlanError::Decode(e.to_string()))
    }

    /// Writes expected by an endpoint on a unit per sync (0 if none).
    pub fn expected_writes(&self, dst: WriteTarget, unit: u16) -> u64 {
        match dst {
            WriteTarget::Rollout(r) => self
                .rollouts
                .get(r as usize)
                .and_then(|p| p.expect.iter().find(|e| e.unit == unit))
                .map_or(0, |e| e.writes),
            WriteTarget::Trainer(t) => self
                .trainers
                .get(t as usize)
                .and_then(|p| {
                    p.groups
                        .iter::<GROUP_FIELDS>()
                        .find(|g| g[0] == unit as u64)
                })
                .map_or(0, |g| g[4]),
        }
    }
}
