//! One trainer's slice of the table, and the explicit plan it expands to.
//!
//! The controller plans and ships the compact form: [`RoutingTable::slice`] gives a trainer
//! exactly its part ([`TrainerSlice`]: its compact routes, with the names of its parameters and
//! mesh groups), and the trainer expands it into the [`TrainerPlan`] its pipeline executes
//! ([`TrainerSlice::expand`]). A slice decoded from bytes is not trusted: expansion checks every
//! index, counts what it would allocate before allocating it and refuses more than its
//! [`ExpandLimits`], and never panics, so a hostile slice costs at most the limits.
//!
//! [`RoutingTable::from_plans`] goes the other way (a table from explicit plans), for tables
//! written by hand in tests and benches.

use serde::{Deserialize, Serialize};

use crate::compact::{BASE_FIELDS, TASK_FIELDS, TaskPattern, TrainerRoutes};
use crate::error::PlanError;
use crate::packed::Packed;
use crate::table::{
    CompactTrainer, GROUP_FIELDS, MeshGroup, ParamRef, RolloutEntry, RolloutPlan, RoutingTable,
    Source, Task, TrainerPlan, Write, WriteTarget,
};

/// A trainer's part of the table: [`RoutingTable::slice`].
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrainerSlice {
    /// Training rank.
    pub rank: u32,
    /// Inference ranks in the table (every rollout rank a write names is below this).
    pub rollout_ranks: u32,
    /// Parameters the routes refer to (records number them by position).
    pub params: Vec<ParamRef>,
    /// Mesh groups in execution order (they tile the tasks).
    pub groups: Vec<MeshGroup>,
    /// Size the source arena must have.
    pub source_arena_bytes: u64,
    /// Size of the gather arena.
    pub gather_arena_bytes: u64,
    /// Shards and tasks, compact.
    pub routes: TrainerRoutes,
}

/// The most an expansion may produce. The defaults are far beyond any plan the planner makes
/// for one trainer (Kimi-K2 over 128 inference ranks: 62,640 writes on the busiest one) and
/// keep a hostile slice's expansion to a few gigabytes at most; fuzzing uses smaller ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpandLimits {
    /// Most tasks (and shards).
    pub tasks: u64,
    /// Most writes, copies included.
    pub writes: u64,
}

impl Default for ExpandLimits {
    fn default() -> ExpandLimits {
        ExpandLimits {
            tasks: 1 << 22,
            writes: 1 << 26,
        }
    }
}

impl TrainerSlice {
    /// Serialise with bincode (what the controller ships to the trainer).
    pub fn to_bincode(&self) -> Vec<u8> {
        bincode::serialize(self).expect("a slice always serialises")
    }

    /// Deserialise from bincode. Not trusted: [`TrainerSlice::expand`] checks it.
    pub fn from_bincode(bytes: &[u8]) -> Result<TrainerSlice, PlanError> {
        bincode::deserialize(bytes).map_err(|e| PlanError::Decode(e.to_string()))
    }

    /// The explicit plan (every write listed, no copies), within the default limits.
    pub fn expand(&self) -> Result<TrainerPlan, PlanError> {
        self.expand_within(&ExpandLimits::default())
    }

    /// The explicit plan within `limits`. Errors name the first task (in execution order) that
    /// is wrong, or what exceeds the limits.
    pub fn expand_within(&self, limits: &ExpandLimits) -> Result<TrainerPlan, PlanError> {
        let r = &self.routes;
        let bad = |task: u64, reason: String| PlanError::BadTable {
            rank: self.rank,
            task: task.min(u32::MAX as u64) as u32,
            reason,
        };
        let ntasks = self.check_sizes(limits, &bad)?;
        let nwrites = self.count_writes(limits, &bad)?;
        let units = self.group_units(ntasks, &bad)?;
        let shards = r.local_shards().map_err(|e| bad(0, format!("its {e}")))?;
        let mut tasks = Vec::with_capacity(ntasks as usize);
        let mut writes = Vec::with_capacity(nwrites as usize);
        let mut cursor = r.cursor();
        let mut i = 0u64;
        while let Some(t) = cursor.next() {
            let unit = units[i as usize];
            let p = usize::try_from(t.pattern)
                .ok()
                .and_then(|k| r.patterns.get(k))
                .ok_or_else(|| bad(i, format!("it names pattern {}", t.pattern)))?;
            let param = u32::try_from(t.param)
                .ok()
                .filter(|&k| (k as usize) < self.params.len())
                .ok_or_else(|| bad(i, format!("parameter {} of {}", t.param, self.params.len())))?;
            let source = if p.gather {
                Source::Gather { offset: t.source }
            } else {
                let shard = u32::try_from(t.source)
                    .ok()
                    .filter(|&k| (k as usize) < shards.len())
                    .ok_or_else(|| bad(i, format!("shard {} of {}", t.source, shards.len())))?;
                Source::Shard { shard }
            };
            let first_write = writes.len() as u32;
            self.push_writes(p, t.bases, unit, &mut writes)
                .map_err(|reason| bad(i, reason))?;
            tasks.push(Task {
                param,
                region: p.region,
                source,
                transform: p.transform,
                first_write,
                num_writes: writes.len() as u32 - first_write,
                first_copy: 0,
                num_copies: 0,
            });
            i += 1;
        }
        if i != ntasks || writes.len() as u64 != nwrites {
            return Err(bad(i, "its packed lists end early".into()));
        }
        Ok(TrainerPlan {
            rank: self.rank,
            params: self.params.clone(),
            shards,
            source_arena_bytes: self.source_arena_bytes,
            gather_arena_bytes: self.gather_arena_bytes,
            groups: self.groups.clone(),
            tasks,
            writes,
            copies: Vec::new(),
        })
    }

    /// Checks the packed lists' fields and their lengths against `limits`; the number of tasks.
    fn check_sizes(
        &self,
        limits: &ExpandLimits,
        bad: &dyn Fn(u64, String) -> PlanError,
    ) -> Result<u64, PlanError> {
        let r = &self.routes;
        for (packed, width, what) in [
            (&r.tasks, TASK_FIELDS, "tasks"),
            (&r.bases, BASE_FIELDS, "bases"),
            (&r.shards, crate::compact::SHARD_FIELDS, "shards"),
        ] {
            packed
                .check(width)
                .map_err(|e| bad(0, format!("its packed {what}: {e}")))?;
        }
        for (n, what) in [(r.tasks.len(), "tasks"), (r.shards.len(), "shards")] {
            if n > limits.tasks {
                return Err(PlanError::TooLarge(format!(
                    "the slice of training rank {} would expand to {n} {what} (at most {})",
                    self.rank, limits.tasks
                )));
            }
        }
        Ok(r.tasks.len())
    }

    /// Appends the explicit writes of a task of pattern `p` whose writes land at `bases`, in
    /// group `unit`: its pattern's writes, then each copy's; else why not.
    fn push_writes(
        &self,
        p: &TaskPattern,
        bases: &[[u64; BASE_FIELDS]],
        unit: u16,
        writes: &mut Vec<Write>,
    ) -> Result<(), String> {
        let pw = self.routes.pattern_writes(p);
        if pw.len() != p.num_writes as usize || bases.len() != pw.len() {
            return Err("its writes lie beyond the plan's".into());
        }
        let first_write = writes.len();
        for (w, b) in pw.iter().zip(bases) {
            let w = crate::compact::write_of(w, b, unit)
                .ok_or_else(|| format!("a write goes to rank {}", b[0]))?;
            if let WriteTarget::Rollout(rk) = w.dst
                && rk >= self.rollout_ranks
            {
                return Err(self.no_rollout(rk));
            }
            writes.push(w);
        }
        for c in self.routes.pattern_copies(p) {
            let (a, n) = (c.from as usize, c.num as usize);
            if a + n > pw.len() {
                return Err(format!(
                    "a copy repeats writes {a}..{} of a task with {}",
                    a + n,
                    pw.len()
                ));
            }
            let start = first_write + a;
            let base = bases.get(a).map_or(0, |b| b[0] as u32);
            for rk in c.ranks(base) {
                if rk >= self.rollout_ranks {
                    return Err(self.no_rollout(rk));
                }
                for k in start..start + n {
                    let w = writes[k];
                    writes.push(Write {
                        dst: WriteTarget::Rollout(rk),
                        ..w
                    });
                }
            }
        }
        Ok(())
    }

    fn no_rollout(&self, rank: u32) -> String {
        format!(
            "a write reaches rollout rank {rank} of {}",
            self.rollout_ranks
        )
    }

    /// Writes the expansion will hold (copies included), checked against `limits` and against
    /// the bases the tasks take, before anything is allocated.
    fn count_writes(
        &self,
        limits: &ExpandLimits,
        bad: &dyn Fn(u64, String) -> PlanError,
    ) -> Result<u64, PlanError> {
        let r = &self.routes;
        // Per pattern: bases it takes, writes it stands for (saturating).
        let per: Vec<(u64, u64)> = r
            .patterns
            .iter()
            .map(|p| {
                let copies = r
                    .pattern_copies(p)
                    .iter()
                    .fold(0u64, |n, c| n.saturating_add(c.num as u64 * c.count as u64));
                (
                    p.num_writes as u64,
                    copies.saturating_add(p.num_writes as u64),
                )
            })
            .collect();
        let (mut bases, mut writes) = (0u64, 0u64);
        for (i, [p, ..]) in r.tasks.iter::<TASK_FIELDS>().enumerate() {
            let &(b, w) = usize::try_from(p)
                .ok()
                .and_then(|k| per.get(k))
                .ok_or_else(|| bad(i as u64, format!("it names pattern {p}")))?;
            bases = bases.saturating_add(b);
            writes = writes.saturating_add(w);
            if writes > limits.writes {
                return Err(PlanError::TooLarge(format!(
                    "the slice of training rank {} would expand to more than {} writes",
                    self.rank, limits.writes
                )));
            }
        }
        if bases != r.bases.len() {
            return Err(bad(
                0,
                format!("its tasks take {bases} bases, it has {}", r.bases.len()),
            ));
        }
        Ok(writes)
    }

    /// Per task, the immediate unit of its writes to trainers (its group's id), after checking
    /// that the groups tile the `ntasks` tasks in order.
    fn group_units(
        &self,
        ntasks: u64,
        bad: &dyn Fn(u64, String) -> PlanError,
    ) -> Result<Vec<u16>, PlanError> {
        let mut units = Vec::with_capacity(ntasks as usize);
        for g in &self.groups {
            if g.first_task as usize != units.len()
                || g.gather_sends as u64 + g.local_tasks as u64 > g.num_tasks as u64
                || units.len() as u64 + g.num_tasks as u64 > ntasks
            {
                return Err(bad(
                    units.len() as u64,
                    format!(
                        "group {} ({} tasks from {}) does not follow the one before",
                        g.id, g.num_tasks, g.first_task
                    ),
                ));
            }
            units.resize(units.len() + g.num_tasks as usize, g.id);
        }
        if units.len() as u64 != ntasks {
            return Err(bad(
                units.len() as u64,
                format!("the groups cover {} of {ntasks} tasks", units.len()),
            ));
        }
        Ok(units)
    }
}

impl RoutingTable {
    /// Trainer `trainer_rank`'s slice: its compact routes, with the names of its parameters and
    /// groups. Records naming a parameter or group the table does not have are an error.
    pub fn slice(&self, trainer_rank: u32) -> Result<TrainerSlice, PlanError> {
        let t = self
            .trainers
            .get(trainer_rank as usize)
            .ok_or(PlanError::NoSuchRank {
                side: "training",
                rank: trainer_rank,
                ranks: self.trainers.len() as u32,
            })?;
        let bad = |reason: String| PlanError::BadTable {
            rank: trainer_rank,
            task: 0,
            reason,
        };
        for (p, w, what) in [
            (&t.params, 1, "parameters"),
            (&t.groups, GROUP_FIELDS, "groups"),
        ] {
            p.check(w)
                .map_err(|e| bad(format!("its packed {what}: {e}")))?;
            if p.len() > 1 << 24 {
                return Err(bad(format!("{} {what}", p.len())));
            }
        }
        let params = t
            .params
            .iter::<1>()
            .map(|[id]| {
                usize::try_from(id)
                    .ok()
                    .and_then(|k| self.params.get(k))
                    .cloned()
                    .ok_or_else(|| bad(format!("parameter {id} of {}", self.params.len())))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut groups = Vec::with_capacity(t.groups.len() as usize);
        let mut first_task = 0u32;
        for [id, num, sends, local, expect] in t.groups.iter::<GROUP_FIELDS>() {
            let name = usize::try_from(id)
                .ok()
                .and_then(|k| self.group_names.get(k))
                .ok_or_else(|| bad(format!("group {id} of {}", self.group_names.len())))?;
            let small = |x: u64| u32::try_from(x).map_err(|_| bad(format!("a group of {x}")));
            let num_tasks = small(num)?;
            groups.push(MeshGroup {
                id: id as u16,
                name: name.clone(),
                first_task,
                num_tasks,
                gather_sends: small(sends)?,
                local_tasks: small(local)?,
                gather_expect: small(expect)?,
            });
            first_task = first_task.saturating_add(num_tasks);
        }
        Ok(TrainerSlice {
            rank: t.rank,
            rollout_ranks: self.rollouts.len() as u32,
            params,
            groups,
            source_arena_bytes: t.source_arena_bytes,
            gather_arena_bytes: t.gather_arena_bytes,
            routes: t.routes.clone(),
        })
    }

    /// Trainer `trainer_rank`'s explicit plan: its slice, expanded.
    pub fn trainer_plan(&self, trainer_rank: u32) -> Result<TrainerPlan, PlanError> {
        self.slice(trainer_rank)?.expand()
    }

    /// Every trainer's explicit plan, in rank order (tests, benches and tools that look at the
    /// whole table's writes; a worker expands only its own slice).
    pub fn trainer_plans(&self) -> Result<Vec<TrainerPlan>, PlanError> {
        (0..self.trainers.len() as u32)
            .map(|r| self.trainer_plan(r))
            .collect()
    }

    /// A table from explicit plans (tables written by hand: tests, benches). Trainers must be
    /// listed by rank, rollouts too; write copies are expanded; writes must carry the units the
    /// compact form implies (see [`crate::compact`]).
    pub fn from_plans(
        model: &str,
        num_params: u64,
        num_elements: u64,
        trainers: &[TrainerPlan],
        rollouts: &[RolloutPlan],
    ) -> Result<RoutingTable, PlanError> {
        let mut params: Vec<ParamRef> = Vec::new();
        let mut group_names: Vec<String> = Vec::new();
        let mut compact = Vec::with_capacity(trainers.len());
        for (i, t) in trainers.iter().enumerate() {
            if t.rank as usize != i {
                return Err(PlanError::BadTable {
                    rank: t.rank,
                    task: 0,
                    reason: format!("listed at index {i}"),
                });
            }
            let mut ids: Vec<[u64; 1]> = Vec::with_capacity(t.params.len());
            for p in &t.params {
                let k = p.id as usize;
                if params.len() <= k {
                    params.resize(
                        k + 1,
                        ParamRef {
                            id: 0,
                            name: "".into(),
                            shape: Default::default(),
                        },
                    );
                }
                params[k] = p.clone();
                ids.push([p.id as u64]);
            }
            let mut groups: Vec<[u64; GROUP_FIELDS]> = Vec::new();
            for g in &t.groups {
                let k = g.id as usize;
                if group_names.len() <= k {
                    group_names.resize(k + 1, String::new());
                }
                group_names[k] = g.name.clone();
                groups.push([
                    g.id as u64,
                    g.num_tasks as u64,
                    g.gather_sends as u64,
                    g.local_tasks as u64,
                    g.gather_expect as u64,
                ]);
            }
            compact.push(CompactTrainer {
                rank: t.rank,
                source_arena_bytes: t.source_arena_bytes,
                gather_arena_bytes: t.gather_arena_bytes,
                params: Packed::of(&ids),
                groups: Packed::of(&groups),
                routes: TrainerRoutes::from_plan(t)?,
            });
        }
        for (i, p) in params.iter_mut().enumerate() {
            p.id = i as u32;
        }
        let mut layouts = crate::table::RolloutLayouts::default();
        let mut entries = Vec::with_capacity(rollouts.len());
        for (i, r) in rollouts.iter().enumerate() {
            if r.rank as usize != i {
                return Err(PlanError::BadInferenceLayout {
                    rank: r.rank,
                    reason: format!("listed at index {i}"),
                });
            }
            entries.push(RolloutEntry {
                rank: r.rank,
                engine: r.engine,
                local_rank: r.local_rank,
                layout: layouts.intern(&r.mr_bytes, &r.tensors),
                expect: r.expect.clone(),
            });
        }
        Ok(RoutingTable {
            model: model.to_string(),
            num_params,
            num_elements,
            params,
            group_names,
            trainers: compact,
            rollout_layouts: layouts.into_layouts(),
            rollouts: entries,
        })
    }
}
