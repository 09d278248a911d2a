//! Step 5, emission (pass 3, [`Planner::emit`]): the tasks and writes of every trainer, appended
//! to its plan directly in execution order. Per mesh group: the gather sends (each part of a
//! gather region written into its owner's gather arena), then the tasks reading local shards,
//! then the tasks reading the gather arena; each task's writes as maximal contiguous runs to
//! its listed targets, and [`WriteCopies`] for the targets laid out alike (see `targets`).
//!
//! Its own file because it is the only step that writes the table: the others decide, this one
//! spells the decisions out in the format workers execute ([`crate::table`]).

use weightsync_common::DType;

use super::place::{dst_box, scale_box};
use super::shapes::{Cursor, GatherKey, KnownShapes, ShapeMemo, ShapeWrite};
use super::targets::{ListedDst, TargetPlan};
use super::{Assign, Planner, RegionBox};
use crate::compact::{RoutesBuilder, TaskWrite};
use crate::error::PlanError;
use crate::layout_infer::InferRank;
use crate::layout_train::{align_up, ShardSpec};
use crate::packed::Packed;
use crate::runs::for_each_run;
use crate::table::{
    CompactTrainer, LocalShard, ParamRef, RolloutEntry, RolloutLayouts, RoutingTable, Source,
    TensorBox, Transform, UnitExpect, GROUP_FIELDS, MAX_WRITE_BYTES, TRAINER_GATHER_MR,
};

/// A trainer's part under construction.
struct TrainerBuilder {
    rank: u32,
    /// Model indices of its params, sorted.
    params: Vec<u32>,
    source_arena_bytes: u64,
    gather_arena_bytes: u64,
    /// Its mesh groups so far (see [`CompactTrainer::groups`]).
    groups: Vec<[u64; GROUP_FIELDS]>,
    routes: RoutesBuilder,
    /// Its pattern of each shape it has sent a task of.
    known: KnownShapes,
    /// Gather writes into this trainer in the current group.
    gather_expect: u32,
}

/// What emission builds: the trainers' parts and the rollouts' expected counts.
struct Emission {
    builders: Vec<TrainerBuilder>,
    /// Shard position -> index in its rank's shards.
    shard_local: Vec<u32>,
    /// Shard position -> index of its param in its rank's params.
    shard_param: Vec<u32>,
    /// Writes each rollout rank receives per sync.
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
    /// Per trainer, where the current mesh group's three classes of tasks start.
    starts: Vec<[u64; 3]>,
    /// The current task's writes and copies (scratch).
    writes: Vec<TaskWrite>,
    copies: Vec<(u32, u32, u32, u32, u32)>,
}

impl Emission {
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
            b.groups.push([
                id as u64,
                end - s0,
                s1 - s0,
                s2 - s1,
                b.gather_expect as u64,
            ]);
            b.gather_expect = 0;
            b.routes.flush();
        }
    }
}

impl Planner<'_> {
    /// Pass 3: tasks and writes, appended to each trainer's plan directly in execution order:
    /// per mesh group, gather sends, then local tasks, then gather-sourced tasks.
    pub(super) fn emit(
        &self,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<RoutingTable, PlanError> {
        let model = self.model;
        let np = model.params.len();
        let ngroups = model.num_mesh_groups();
        let mut out = self.emission();
        // Params in (mesh group, id) order.
        let mut by_group: Vec<u32> = (0..np as u32).collect();
        by_group.sort_by_key(|&p| (model.mesh_group(model.params[p as usize].role), p));
        // Gather regions by mesh group, in region (so param) order.
        let mut group_gathers: Vec<Vec<u32>> = vec![Vec::new(); ngroups as usize];
        for &ri in &self.gathers {
            let pid = self.dgroup_param(self.regions[ri as usize].dgroup);
            group_gathers[model.mesh_group(model.params[pid].role) as usize].push(ri);
        }
        let mut gather_offs: Vec<u64> = Vec::new();
        let mut gi = 0usize;
        for g in 0..ngroups {
            let g0 = gi;
            while gi < by_group.len()
                && model.mesh_group(model.params[by_group[gi] as usize].role) == g
            {
                gi += 1;
            }
            if gi / 4096 != g0 / 4096 {
                progress((np + gi) as u64, 2 * np as u64);
            }
            let gathers = &group_gathers[g as usize];
            self.emit_group(&mut out, g, &by_group[g0..gi], gathers, &mut gather_offs);
        }
        out.targets.flush(&mut out.rollout_writes);
        // The shapes are only needed while tasks are added: freed before the table is finished.
        out.shapes = ShapeMemo::default();
        for b in &mut out.builders {
            b.known = KnownShapes::default();
        }
        let (rollout_layouts, rollouts) = self.rollout_entries(&out.rollout_writes);
        let trainers = trainer_parts(out.builders)?;
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

    /// The empty parts of every trainer, and the shard lookups emission needs.
    fn emission(&self) -> Emission {
        let (builders, by_index) = self.trainer_builders();
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
        Emission {
            starts: vec![[0u64; 3]; builders.len()],
            builders,
            shard_local,
            shard_param,
            rollout_writes: vec![0u64; self.infer.ranks.len()],
            targets: TargetPlan::none(),
            class: 0,
            shapes: ShapeMemo::default(),
            task_cursor: Cursor::default(),
            gather_cursor: Cursor::default(),
            writes: Vec::new(),
            copies: Vec::new(),
        }
    }

    /// Per trainer, its part with its params and shards (`train.shards` is sorted by rank,
    /// offset); and per shard (layout order) the index of its param in its rank's params.
    fn trainer_builders(&self) -> (Vec<TrainerBuilder>, Vec<u32>) {
        let nt = self.train.ranks as usize;
        let mut rank_first = vec![0usize; nt + 1];
        for s in &self.train.shards {
            rank_first[s.rank as usize + 1] += 1;
        }
        for r in 0..nt {
            rank_first[r + 1] += rank_first[r];
        }
        // Param id -> index in the current rank's params (valid for the rank's own params).
        let mut local_param = vec![0u32; self.model.params.len()];
        let mut by_index = vec![0u32; self.train.shards.len()];
        let mut local: Vec<LocalShard> = Vec::new();
        let builders = (0..nt)
            .map(|r| {
                let shards = &self.train.shards[rank_first[r]..rank_first[r + 1]];
                let mut pids: Vec<u32> = shards.iter().map(|s| s.param).collect();
                if !pids.is_sorted() {
                    pids.sort_unstable();
                }
                pids.dedup();
                for (i, &p) in pids.iter().enumerate() {
                    local_param[p as usize] = i as u32;
                }
                local.clear();
                local.extend(shards.iter().map(|s| LocalShard {
                    param: local_param[s.param as usize],
                    global: s.global,
                    dtype: s.dtype,
                    offset: s.offset,
                }));
                for (i, l) in local.iter().enumerate() {
                    by_index[rank_first[r] + i] = l.param;
                }
                TrainerBuilder {
                    rank: r as u32,
                    params: pids,
                    source_arena_bytes: arena_end(shards),
                    gather_arena_bytes: 0,
                    groups: Vec::with_capacity(self.model.num_mesh_groups() as usize),
                    routes: RoutesBuilder::new(&local),
                    known: KnownShapes::default(),
                    gather_expect: 0,
                }
            })
            .collect();
        (builders, by_index)
    }

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
            for ri in self.region_first[pid as usize]..self.region_first[pid as usize + 1] {
                let reg = &self.regions[ri as usize];
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
        let ob = &mut out.builders[owner.rank as usize];
        let goff = ob.gather_arena_bytes;
        ob.gather_arena_bytes = align_up(goff + reg.bx.numel() * elem);
        let shape = reg.bx.shape();
        let mut received = 0;
        for &(part, s) in parts {
            let sh = self.shard(s);
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
            let shard = out.shard_local[s as usize];
            let param = out.shard_param[s as usize];
            let b = &mut out.builders[sh.rank as usize];
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
        out.builders[owner.rank as usize].gather_expect += received;
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
        if out.targets.dgroup != reg.dgroup {
            self.target_plan(reg.dgroup, &mut out.targets, &mut out.rollout_writes);
            out.class = out.shapes.class_of(&out.targets);
            out.task_cursor = Cursor::default();
        }
        let sh = self.shard(s);
        let dg = &self.dgroups[reg.dgroup as usize];
        let transform = transform_for(dg.fp8, sh.dtype, dg.dtype);
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
                let shard = out.shard_local[s as usize];
                (shard as u64, Source::Shard { shard })
            }
        };
        let param = out.shard_param[s as usize];
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
        let b = &mut out.builders[sh.rank as usize];
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
    let mut trainers = Vec::with_capacity(builders.len());
    for b in builders {
        if b.routes.num_tasks > u32::MAX as u64 {
            return Err(PlanError::TooLarge(format!(
                "training rank {} would have more than 2^32 tasks",
                b.rank
            )));
        }
        let params: Vec<[u64; 1]> = b.params.iter().map(|&p| [p as u64]).collect();
        trainers.push(CompactTrainer {
            rank: b.rank,
            source_arena_bytes: b.source_arena_bytes,
            gather_arena_bytes: b.gather_arena_bytes,
            params: Packed::of(&params),
            groups: Packed::of(&b.groups),
            routes: b.routes.finish(),
        });
    }
    Ok(trainers)
}

/// The transform for a region from `from` to a destination of `to` (fp8: block-quantised).
fn transform_for(fp8: bool, from: DType, to: DType) -> Transform {
    if fp8 {
        Transform::Fp8Block { from }
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
