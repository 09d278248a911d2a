//! Step 5, emission (pass 3, [`Planner::emit`]): the tasks and writes of every trainer, appended
//! to its plan directly in execution order. Per mesh group: the gather sends (each part of a
//! gather region written into its owner's gather arena), then the tasks reading local shards,
//! then the tasks reading the gather arena; each task's writes as maximal contiguous runs to
//! its listed targets, and [`WriteCopies`] for the targets laid out alike (see `targets`).
//!
//! Its own file because it is the only step that writes the table: the others decide, this one
//! spells the decisions out in the format workers execute ([`crate::table`]).

use rayon::prelude::*;
use weightsync_common::{DType, Fp8Recipe};

use super::place::{dst_box, scale_box};
use super::shapes::{Cursor, GatherKey, KnownShapes, ShapeMemo, ShapeWrite};
use super::targets::{ListedDst, TargetPlan};
use super::{Assign, Planner, RegionBox};
use crate::compact::{RoutesBuilder, TaskWrite};
use crate::error::PlanError;
use crate::layout_infer::InferRank;
use crate::layout_train::{ShardSpec, TrainingLayout, align_up};
use crate::model::Model;
use crate::packed::Packed;
use crate::runs::for_each_run;
use crate::table::{
    CompactTrainer, GROUP_FIELDS, LocalShard, MAX_WRITE_BYTES, ParamRef, RolloutEntry,
    RolloutLayouts, RoutingTable, Source, TRAINER_GATHER_MR, TensorBox, Transform, UnitExpect,
};

/// A trainer's part under construction.
struct TrainerBuilder {
    rank: u32,
    /// Model indices of its params, sorted.
    params: Vec<u32>,
    source_arena_bytes: u64,
    gather_arena_bytes: u64,
    /// Its mesh groups so far (see [`CompactTrainer::groups`]), in 32 bits while emission
    /// runs (thousands of trainers keep a record per group; counts past `u32` are refused
    /// with the trainer's total, [`trainer_parts`]).
    groups: Vec<[u32; GROUP_FIELDS]>,
    routes: RoutesBuilder,
    /// Its pattern of each shape it has sent a task of.
    known: KnownShapes,
    /// Gather writes into this trainer in the current group.
    gather_expect: u32,
}

/// What every part of emission reads: the shard lookups and the order params and gather
/// regions are emitted in.
struct EmissionPlan {
    /// Shard position -> index in its rank's shards.
    shard_local: Vec<u32>,
    /// Shard position -> index of its param in its rank's params.
    shard_param: Vec<u32>,
    /// Params in (mesh group, id) order, and per mesh group where its params start there
    /// (`ngroups + 1` entries).
    by_group: Vec<u32>,
    group_first: Vec<usize>,
    /// Gather regions by mesh group, in region (so param) order.
    group_gathers: Vec<Vec<u32>>,
}

/// What a part of emission built: its trainers, and the writes each rollout receives from them.
type PartEmitted = (Vec<TrainerBuilder>, Vec<u64>);

/// One part of emission: the trainers `part`, `part + parts`, ... (see [`Planner::emit`]).
struct Emission<'e> {
    plan: &'e EmissionPlan,
    part: usize,
    parts: usize,
    /// This part's trainers, in rank order: rank `part + i * parts` at `i`.
    builders: Vec<TrainerBuilder>,
    /// Per trainer (every one, as every part allocates every gather region): the end of its
    /// gather arena so far.
    gather_arena: Vec<u64>,
    /// Writes each rollout rank receives per sync from this part's trainers.
    rollout_writes: Vec<u64>,
    /// The target plan of the dgroup last emitted (tasks of a dgroup come together), and its
    /// class in `shapes`.
    targets: TargetPlan,
    class: u32,
    /// The task shapes met so far, with their writes, and where the next task's and the next
    /// gather send's shapes are guessed to be.
    shapes: ShapeMemo,
    task_cursor: Cursor,
    gather_cursor: Cursor,
    /// Per trainer of this part, where the current mesh group's three classes of tasks start.
    starts: Vec<[u64; 3]>,
    /// The current task's writes and copies (scratch).
    writes: Vec<TaskWrite>,
    copies: Vec<(u32, u32, u32, u32, u32)>,
}

impl Emission<'_> {
    /// Where trainer `rank` is in `builders`, if this part builds it.
    #[inline]
    fn local(&self, rank: u32) -> Option<usize> {
        let r = rank as usize;
        (r % self.parts == self.part).then_some(r / self.parts)
    }

    /// Records where task class `class` of the current group starts on every trainer.
    fn mark_class_start(&mut self, class: usize) {
        for (r, b) in self.builders.iter().enumerate() {
            self.starts[r][class] = b.routes.num_tasks;
        }
    }

    /// Closes mesh group `id` on every trainer: its group record; packs its tasks. A trainer
    /// with no task in the group (another pipeline stage's) forgets its shapes: at 16 stages
    /// most trainers are idle in most groups, and what it forgets it finds again by content
    /// (the same patterns) should it get tasks later.
    fn close_group(&mut self, id: u16) {
        for (r, b) in self.builders.iter_mut().enumerate() {
            let end = b.routes.num_tasks;
            let [s0, s1, s2] = self.starts[r];
            if end == s0 {
                b.known = KnownShapes::default();
            }
            let small = |n: u64| n.min(u32::MAX as u64) as u32;
            b.groups.push([
                id as u32,
                small(end - s0),
                small(s1 - s0),
                small(s2 - s1),
                b.gather_expect,
            ]);
            b.gather_expect = 0;
            b.routes.flush();
        }
    }
}

impl Planner<'_> {
    /// Pass 3: tasks and writes, appended to each trainer's plan directly in execution order:
    /// per mesh group, gather sends, then local tasks, then gather-sourced tasks.
    ///
    /// In parallel: trainers are dealt into as many parts as rayon has threads (rank `r` to
    /// part `r % parts`), and each part walks every mesh group, region and gather region in
    /// the same order, building only its own trainers' tasks. A trainer's tasks, patterns and
    /// runs depend only on the tasks it is given, in order, so each comes out as if emitted
    /// alone; what all trainers share is summed (the writes each rollout receives) or worked
    /// out the same way by every part (where each gather region lies in its owner's arena).
    /// The table is the same whatever the number of threads.
    pub(super) fn emit(
        &self,
        start: EmissionStart,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<RoutingTable, PlanError> {
        let model = self.model;
        let np = model.params.len();
        let ngroups = model.num_mesh_groups();
        let nt = self.train.ranks as usize;
        let parts = rayon::current_num_threads().clamp(1, nt.max(1));
        let EmissionStart { builders, by_index } = start;
        let plan = self.emission_plan(&by_index);
        drop(by_index);
        let mut dealt: Vec<Vec<TrainerBuilder>> = (0..parts)
            .map(|_| Vec::with_capacity(nt.div_ceil(parts)))
            .collect();
        for (r, b) in builders.into_iter().enumerate() {
            dealt[r % parts].push(b);
        }
        let mut dealt = dealt.into_iter();
        let first = dealt.next().unwrap_or_default();
        let mut others: Vec<(Vec<TrainerBuilder>, Option<PartEmitted>)> =
            dealt.map(|b| (b, None)).collect();
        let mut mine = None;
        rayon::in_place_scope(|s| {
            for (k, (builders, slot)) in others.iter_mut().enumerate() {
                let (plan, builders) = (&plan, std::mem::take(builders));
                s.spawn(move |_| {
                    *slot = Some(self.emit_part(plan, k + 1, parts, builders, &mut |_, _| {}));
                });
            }
            mine = Some(self.emit_part(&plan, 0, parts, first, progress));
        });
        drop(plan);
        let mut done: Vec<PartEmitted> = mine.into_iter().collect();
        done.extend(others.into_iter().filter_map(|(_, e)| e));
        // Every rollout's writes from every part; every trainer back in rank order.
        let mut rollout_writes = vec![0u64; self.infer.ranks.len()];
        let mut by_part: Vec<std::vec::IntoIter<TrainerBuilder>> = Vec::with_capacity(parts);
        for (builders, writes) in done {
            for (sum, w) in rollout_writes.iter_mut().zip(&writes) {
                *sum += w;
            }
            by_part.push(builders.into_iter());
        }
        let builders: Vec<TrainerBuilder> =
            (0..nt).filter_map(|r| by_part[r % parts].next()).collect();
        let (rollout_layouts, rollouts) = self.rollout_entries(&rollout_writes);
        let trainers = trainer_parts(builders)?;
        progress(2 * np as u64, 2 * np as u64);
        Ok(RoutingTable {
            model: model.name.clone(),
            num_params: np as u64,
            num_elements: model.num_elements(),
            params: model
                .params
                .iter()
                .enumerate()
                .map(|(i, p)| ParamRef {
                    id: i as u32,
                    name: p.name.clone(),
                    shape: p.shape,
                })
                .collect(),
            group_names: (0..ngroups).map(|g| model.mesh_group_name(g)).collect(),
            trainers,
            rollout_layouts,
            rollouts,
        })
    }

    /// Emits every mesh group for the trainers of part `part` of `parts` (`builders`, in rank
    /// order); returns them with what they send to each rollout. Only part 0 reports progress.
    fn emit_part(
        &self,
        plan: &EmissionPlan,
        part: usize,
        parts: usize,
        builders: Vec<TrainerBuilder>,
        progress: &mut dyn FnMut(u64, u64),
    ) -> PartEmitted {
        let np = self.model.params.len();
        let mut out = Emission {
            plan,
            part,
            parts,
            starts: vec![[0u64; 3]; builders.len()],
            builders,
            gather_arena: vec![0u64; self.train.ranks as usize],
            rollout_writes: vec![0u64; self.infer.ranks.len()],
            targets: TargetPlan::none(),
            class: 0,
            shapes: ShapeMemo::default(),
            task_cursor: Cursor::default(),
            gather_cursor: Cursor::default(),
            writes: Vec::new(),
            copies: Vec::new(),
        };
        let mut gather_offs: Vec<u64> = Vec::new();
        for (g, gathers) in plan.group_gathers.iter().enumerate() {
            let (g0, gi) = (plan.group_first[g], plan.group_first[g + 1]);
            if gi / 4096 != g0 / 4096 {
                progress((np + gi) as u64, 2 * np as u64);
            }
            let params = &plan.by_group[g0..gi];
            self.emit_group(&mut out, g as u16, params, gathers, &mut gather_offs);
        }
        out.targets.flush(&mut out.rollout_writes);
        // The shapes are only needed while tasks are added: freed before the table is finished.
        out.shapes = ShapeMemo::default();
        for b in &mut out.builders {
            b.known = KnownShapes::default();
            b.gather_arena_bytes = out.gather_arena[b.rank as usize];
        }
        (out.builders, out.rollout_writes)
    }

    /// What every part of emission reads (`by_index`: [`EmissionStart::by_index`]).
    fn emission_plan(&self, by_index: &[u32]) -> EmissionPlan {
        let model = self.model;
        let np = model.params.len();
        let ngroups = model.num_mesh_groups() as usize;
        // Shard position -> (index in its rank's shard list, index of its param in the rank's
        // params): looked up once per task, so dense arrays in position order.
        let mut first_shard = vec![0u32; self.train.ranks as usize];
        for (i, s) in self.train.shards.iter().enumerate().rev() {
            first_shard[s.rank as usize] = i as u32;
        }
        let (shard_local, shard_param) = self
            .shard_order
            .iter()
            .zip(&self.shards)
            .map(|(&g, sh)| (g - first_shard[sh.rank as usize], by_index[g as usize]))
            .unzip();
        let group_of = |p: u32| model.mesh_group(model.params[p as usize].role) as usize;
        let mut by_group: Vec<u32> = (0..np as u32).collect();
        by_group.sort_by_key(|&p| (group_of(p), p));
        let mut group_first = vec![0usize; ngroups + 1];
        for &p in &by_group {
            group_first[group_of(p) + 1] += 1;
        }
        for g in 0..ngroups {
            group_first[g + 1] += group_first[g];
        }
        let mut group_gathers: Vec<Vec<u32>> = vec![Vec::new(); ngroups];
        for &ri in &self.gathers {
            let pid = self.dgroup_param(self.regions[ri as usize].dgroup);
            group_gathers[group_of(pid as u32)].push(ri);
        }
        EmissionPlan {
            shard_local,
            shard_param,
            by_group,
            group_first,
            group_gathers,
        }
    }
}

/// What emission starts from that only the training layout decides: built while sources are
/// chosen (`assign` is sequential, which leaves the other threads free; [`plan`](super::plan)).
pub(super) struct EmissionStart {
    /// Every trainer's empty part, with its params and shards.
    builders: Vec<TrainerBuilder>,
    /// Per shard (layout order), the index of its param in its rank's params.
    by_index: Vec<u32>,
}

impl EmissionStart {
    /// Per trainer, its part with its params and shards (`train.shards` is sorted by rank,
    /// offset); and per shard the index of its param in its rank's params.
    pub(super) fn new(model: &Model, train: &TrainingLayout) -> EmissionStart {
        let nt = train.ranks as usize;
        let mut rank_first = vec![0usize; nt + 1];
        for s in &train.shards {
            rank_first[s.rank as usize + 1] += 1;
        }
        for r in 0..nt {
            rank_first[r + 1] += rank_first[r];
        }
        // Per rank in parallel (each writes its own part of `by_index`).
        let mut by_index = vec![0u32; train.shards.len()];
        let mut parts: Vec<&mut [u32]> = Vec::with_capacity(nt);
        let mut rest = by_index.as_mut_slice();
        for r in 0..nt {
            let (mine, after) = rest.split_at_mut(rank_first[r + 1] - rank_first[r]);
            parts.push(mine);
            rest = after;
        }
        let builders = parts
            .into_par_iter()
            .enumerate()
            .map(|(r, by_index)| {
                let shards = &train.shards[rank_first[r]..rank_first[r + 1]];
                let mut pids: Vec<u32> = shards.iter().map(|s| s.param).collect();
                if !pids.is_sorted() {
                    pids.sort_unstable();
                }
                pids.dedup();
                let local: Vec<LocalShard> = shards
                    .iter()
                    .map(|s| LocalShard {
                        param: pids.partition_point(|&p| p < s.param) as u32,
                        global: s.global,
                        dtype: s.dtype,
                        offset: s.offset,
                    })
                    .collect();
                for (x, l) in by_index.iter_mut().zip(&local) {
                    *x = l.param;
                }
                TrainerBuilder {
                    rank: r as u32,
                    params: pids,
                    source_arena_bytes: arena_end(shards),
                    gather_arena_bytes: 0,
                    groups: Vec::with_capacity(model.num_mesh_groups() as usize),
                    routes: RoutesBuilder::new(&local),
                    known: KnownShapes::default(),
                    gather_expect: 0,
                }
            })
            .collect();
        EmissionStart { builders, by_index }
    }
}

impl Planner<'_> {
    /// Emits mesh group `g` on every trainer: gather sends of `gathers` (its gather regions),
    /// tasks of `params` reading local shards, tasks reading the gather arena. `gather_offs`
    /// is scratch.
    fn emit_group(
        &self,
        out: &mut Emission,
        g: u16,
        params: &[u32],
        gathers: &[u32],
        gather_offs: &mut Vec<u64>,
    ) {
        out.mark_class_start(0);
        // Class 0: gather sends (and the owners' arena space).
        gather_offs.clear();
        for &ri in gathers {
            if let Assign::Gather {
                owner_shard,
                first,
                n,
            } = self.assign[ri as usize]
            {
                let reg = &self.regions[ri as usize];
                gather_offs.push(self.emit_gather_sends(
                    out,
                    reg,
                    owner_shard,
                    &self.gather_parts[first as usize..(first + n) as usize],
                    g,
                ));
            }
        }
        out.mark_class_start(1);
        // Class 1: tasks reading local shards.
        for &pid in params {
            let (regions, moved_by) = self.param_regions(pid as usize);
            for ri in regions {
                let reg = &self.regions[ri as usize];
                if let Some((dgroup_shift, shard_shift)) = moved_by {
                    // A repeat: the regions of an earlier param, every one from one shard.
                    debug_assert!(matches!(self.assign[ri as usize], Assign::Shard(_)));
                    if let Assign::Shard(s) = self.assign[ri as usize] {
                        let moved = RegionBox {
                            dgroup: reg.dgroup + dgroup_shift,
                            bx: reg.bx,
                        };
                        self.emit_task(out, &moved, &moved.bx, s + shard_shift, None);
                    }
                    continue;
                }
                match self.assign[ri as usize] {
                    Assign::Shard(s) => self.emit_task(out, reg, &reg.bx, s, None),
                    Assign::Split { first, n } => {
                        for &(sub, s) in &self.splits[first as usize..(first + n) as usize] {
                            self.emit_task(out, reg, &sub, s, None);
                        }
                    }
                    Assign::Gather { .. } => {}
                }
            }
        }
        out.mark_class_start(2);
        // Class 2: tasks reading the gather arena.
        for (&ri, &off) in gathers.iter().zip(gather_offs.iter()) {
            if let Assign::Gather { owner_shard, .. } = self.assign[ri as usize] {
                let reg = &self.regions[ri as usize];
                self.emit_task(out, reg, &reg.bx, owner_shard, Some(off));
            }
        }
        out.close_group(g);
    }

    /// Emits the Copy tasks that assemble gather region `reg` in its owner's gather arena;
    /// returns the region's offset there.
    fn emit_gather_sends(
        &self,
        out: &mut Emission,
        reg: &RegionBox,
        owner_shard: u32,
        parts: &[(TensorBox, u32)],
        g: u16,
    ) -> u64 {
        let owner = self.shard(owner_shard);
        let elem = owner.dtype.size() as u64;
        // Every part allocates every region, so all agree where each lies.
        let goff = out.gather_arena[owner.rank as usize];
        out.gather_arena[owner.rank as usize] = align_up(goff + reg.bx.numel() * elem);
        let owner_local = out.local(owner.rank);
        let shape = reg.bx.shape();
        let mut received = 0;
        for &(part, s) in parts {
            let sh = self.shard(s);
            let sender_local = out.local(sh.rank);
            if sender_local.is_none() && owner_local.is_none() {
                continue;
            }
            let key = GatherKey {
                part,
                region: reg.bx,
                owner: owner.dtype,
                sender: sh.dtype,
            };
            let id = out
                .shapes
                .gather_shape(key, &mut out.gather_cursor, |writes, _| {
                    let rel = part.relative_to(&reg.bx);
                    for_each_run(&rel, &shape, elem, |so, d, len| {
                        push_split(writes, 0, false, TRAINER_GATHER_MR, so, d, len);
                    });
                });
            let ws = out.shapes.writes(id);
            received += ws.len() as u32;
            let Some(bi) = sender_local else {
                continue;
            };
            let shard = out.plan.shard_local[s as usize];
            let param = out.plan.shard_param[s as usize];
            let b = &mut out.builders[bi];
            let base = |w: &ShapeWrite| [owner.rank as u64, goff + w.dst];
            match b.known.get(&id) {
                Some(&pattern) => {
                    b.routes
                        .push_known(pattern, param, shard as u64, ws.iter().map(base))
                }
                None => {
                    out.writes.clear();
                    out.writes.extend(ws.iter().map(|w| TaskWrite {
                        to_trainer: true,
                        rank: owner.rank,
                        mr: w.mr,
                        len: w.len,
                        src_offset: w.src_offset,
                        dst_offset: goff + w.dst,
                    }));
                    let pattern = b.routes.push_task(
                        param,
                        part,
                        Source::Shard { shard },
                        Transform::Copy { dtype: sh.dtype },
                        &out.writes,
                        &[],
                    );
                    b.known.insert(id, pattern);
                }
            }
        }
        debug_assert!(g < self.model.num_mesh_groups());
        if let Some(oi) = owner_local {
            out.builders[oi].gather_expect += received;
        }
        goff
    }

    /// Emits the task that prepares box `bx` of region `reg` (from shard `s`, or from the
    /// gather arena at `gather` on `s`'s rank) and writes it to every target of its group.
    /// Its writes are cut once per shape ([`ShapeMemo`]), and a trainer's pattern for the shape
    /// found by content once.
    fn emit_task(
        &self,
        out: &mut Emission,
        reg: &RegionBox,
        bx: &TensorBox,
        s: u32,
        gather: Option<u64>,
    ) {
        let sh = self.shard(s);
        // Another part's trainer: that part emits it (and counts its writes).
        let Some(bi) = out.local(sh.rank) else {
            return;
        };
        if out.targets.dgroup != reg.dgroup {
            self.target_plan(reg.dgroup, &mut out.targets, &mut out.rollout_writes);
            out.class = out.shapes.class_of(&out.targets);
            out.task_cursor = Cursor::default();
        }
        let dg = &self.dgroups[reg.dgroup as usize];
        let transform = transform_for(dg.fp8.then_some(self.infer.fp8_recipe), sh.dtype, dg.dtype);
        let TargetPlan { listed, copies, .. } = &mut out.targets;
        let id = out.shapes.task_shape(
            out.class,
            *bx,
            transform,
            gather.is_some(),
            &mut out.task_cursor,
            |writes, counts| cut_task(listed, bx, writes, counts),
        );
        for (l, &(from, n)) in listed.iter_mut().zip(out.shapes.listed(id)) {
            out.rollout_writes[l.piece.rank as usize] += n as u64;
            l.task_writes = (from, n);
        }
        for c in copies.iter_mut() {
            // Counted toward each rank when the dgroup's tasks are done (TargetPlan::flush).
            c.writes += listed[c.base as usize].task_writes.1 as u64;
        }
        let (src, source) = match gather {
            Some(offset) => (offset, Source::Gather { offset }),
            None => {
                let shard = out.plan.shard_local[s as usize];
                (shard as u64, Source::Shard { shard })
            }
        };
        let param = out.plan.shard_param[s as usize];
        let ws = out.shapes.writes(id);
        let at = |w: &ShapeWrite| {
            let l = &listed[w.listed as usize];
            let tensor = if w.scale {
                l.scales.map_or(0, |(_, _, offset)| offset)
            } else {
                l.offset
            };
            (l.piece.rank, tensor + w.dst)
        };
        let b = &mut out.builders[bi];
        match b.known.get(&id) {
            Some(&pattern) => b.routes.push_known(
                pattern,
                param,
                src,
                ws.iter().map(|w| {
                    let (rank, dst) = at(w);
                    [rank as u64, dst]
                }),
            ),
            None => {
                out.writes.clear();
                out.writes.extend(ws.iter().map(|w| {
                    let (rank, dst_offset) = at(w);
                    TaskWrite {
                        to_trainer: false,
                        rank,
                        mr: w.mr,
                        len: w.len,
                        src_offset: w.src_offset,
                        dst_offset,
                    }
                }));
                out.copies.clear();
                out.copies.extend(copies.iter().map(|c| {
                    let (from, num) = listed[c.base as usize].task_writes;
                    (from, num, c.first_rank, c.stride, c.count)
                }));
                let pattern =
                    b.routes
                        .push_task(param, *bx, source, transform, &out.writes, &out.copies);
                b.known.insert(id, pattern);
            }
        }
    }

    /// Every rollout rank's entry (each distinct layout stored once) with the writes it
    /// receives.
    fn rollout_entries(
        &self,
        rollout_writes: &[u64],
    ) -> (Vec<crate::table::RolloutLayout>, Vec<RolloutEntry>) {
        let mut layouts = RolloutLayouts::default();
        // Ranks sharing their tensors (the same rank of every engine) share a layout without
        // comparing tensor by tensor.
        let mut shared: Vec<(&InferRank, u32)> = Vec::new();
        let entries = self
            .infer
            .ranks
            .iter()
            .map(|r| RolloutEntry {
                rank: r.rank,
                engine: r.engine,
                local_rank: r.local_rank,
                layout: match shared.iter().find(|(s, _)| {
                    std::sync::Arc::ptr_eq(&s.tensors, &r.tensors) && s.mr_bytes == r.mr_bytes
                }) {
                    Some(&(_, id)) => id,
                    None => {
                        let id = layouts.intern(&r.mr_bytes, &r.tensors);
                        shared.push((r, id));
                        id
                    }
                },
                expect: vec![UnitExpect {
                    unit: 0,
                    writes: rollout_writes[r.rank as usize],
                }],
            })
            .collect();
        (layouts.into_layouts(), entries)
    }
}

/// End of the last of a rank's `shards` (sorted by offset): the size of its source arena.
fn arena_end(shards: &[ShardSpec]) -> u64 {
    shards
        .last()
        .map_or(0, |s| s.offset + s.global.numel() * s.dtype.size() as u64)
}

/// The finished trainer parts; refused when one would number its tasks past `u32`.
fn trainer_parts(builders: Vec<TrainerBuilder>) -> Result<Vec<CompactTrainer>, PlanError> {
    if let Some(b) = builders
        .iter()
        .find(|b| b.routes.num_tasks > u32::MAX as u64)
    {
        return Err(PlanError::TooLarge(format!(
            "training rank {} would have more than 2^32 tasks",
            b.rank
        )));
    }
    Ok(builders
        .into_par_iter()
        .map(|b| {
            let params: Vec<[u64; 1]> = b.params.iter().map(|&p| [p as u64]).collect();
            let groups: Vec<[u64; GROUP_FIELDS]> =
                b.groups.iter().map(|g| g.map(u64::from)).collect();
            CompactTrainer {
                rank: b.rank,
                source_arena_bytes: b.source_arena_bytes,
                gather_arena_bytes: b.gather_arena_bytes,
                params: Packed::of(&params),
                groups: Packed::of(&groups),
                routes: b.routes.finish(),
            }
        })
        .collect())
}

/// The transform for a region from `from` to a destination of `to` (fp8: block-quantised with
/// that recipe).
fn transform_for(fp8: Option<Fp8Recipe>, from: DType, to: DType) -> Transform {
    if let Some(recipe) = fp8 {
        Transform::Fp8Block { from, recipe }
    } else if from == to {
        Transform::Copy { dtype: from }
    } else {
        Transform::Cast { from, to }
    }
}

/// The writes of box `bx` to the `listed` targets of its dgroup, relative to their tensors'
/// offsets; per target, where its writes start (relative to the task's first) and how many.
fn cut_task(
    listed: &[ListedDst],
    bx: &TensorBox,
    writes: &mut Vec<ShapeWrite>,
    counts: &mut Vec<(u32, u32)>,
) {
    let pn = bx.ndim as usize;
    // Where the scales sit in the prepared output (Task::fp8_scales).
    let scale_offset = bx.numel().div_ceil(16) * 16;
    let first = writes.len();
    for (i, l) in listed.iter().enumerate() {
        let pc = &l.piece;
        let before = writes.len();
        let db = dst_box(pc, bx, l.shape.ndim as usize);
        for_each_run(&db, &l.shape, l.elem, |so, d, len| {
            push_split(writes, i as u32, false, l.mr, so, d, len);
        });
        if let Some((shape, mr, _)) = l.scales {
            let sb = scale_box(pc, bx, shape.ndim as usize, pn);
            for_each_run(&sb, &shape, 4, |so, d, len| {
                push_split(writes, i as u32, true, mr, scale_offset + so, d, len);
            });
        }
        counts.push(((before - first) as u32, (writes.len() - before) as u32));
    }
}

/// Pushes one run as writes of at most [`MAX_WRITE_BYTES`], to listed target `listed` (its
/// scale tensor with `scale`) at `dst` from the start of its tensor.
#[inline]
fn push_split(
    out: &mut Vec<ShapeWrite>,
    listed: u32,
    scale: bool,
    mr: u16,
    src: u64,
    dst: u64,
    len: u64,
) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_WRITE_BYTES);
        out.push(ShapeWrite {
            listed,
            scale,
            mr,
            len: n as u32,
            src_offset: src + done,
            dst: dst + done,
        });
        done += n;
    }
}
