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
use super::targets::TargetPlan;
use super::{Assign, Planner, Region};
use crate::error::PlanError;
use crate::layout_train::{align_up, ShardSpec};
use crate::runs::for_each_run;
use crate::table::{
    LocalShard, MeshGroup, ParamRef, RolloutPlan, RoutingTable, Source, Task, TensorBox,
    TrainerPlan, Transform, UnitExpect, Write, WriteCopies, WriteTarget, MAX_WRITE_BYTES,
    TRAINER_GATHER_MR,
};

/// A trainer's plan under construction.
struct TrainerBuilder {
    plan: TrainerPlan,
    /// Index in the layout's shard list of this rank's first shard.
    first_shard: usize,
    /// Gather writes into this trainer in the current group.
    gather_expect: u32,
}

/// What emission builds: the trainers' plans and the rollouts' expected counts.
struct Emission {
    builders: Vec<TrainerBuilder>,
    /// Shard position -> index in its rank's `plan.shards`.
    shard_local: Vec<u32>,
    /// Shard position -> index of its param in its rank's `plan.params`.
    shard_param: Vec<u32>,
    /// Writes each rollout rank receives per sync.
    rollout_writes: Vec<u64>,
    /// The target plan of the dgroup last emitted (tasks of a dgroup come together).
    targets: TargetPlan,
    /// Per trainer, where the current mesh group's three classes of tasks start.
    starts: Vec<[u32; 3]>,
}

impl Emission {
    /// Records where task class `class` of the current group starts on every trainer.
    fn mark_class_start(&mut self, class: usize) {
        for (r, b) in self.builders.iter().enumerate() {
            self.starts[r][class] = b.plan.tasks.len() as u32;
        }
    }

    /// Closes mesh group `id` on every trainer: its [`MeshGroup`] entry.
    fn close_group(&mut self, id: u16, name: String) {
        for (r, b) in self.builders.iter_mut().enumerate() {
            let end = b.plan.tasks.len() as u32;
            let [s0, s1, s2] = self.starts[r];
            b.plan.groups.push(MeshGroup {
                id,
                name: name.clone(),
                first_task: s0,
                num_tasks: end - s0,
                gather_sends: s1 - s0,
                local_tasks: s2 - s1,
                gather_expect: b.gather_expect,
            });
            b.gather_expect = 0;
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
        let rollouts = self.rollout_plans(&out.rollout_writes);
        let trainers = trainer_plans(out.builders)?;
        progress(2 * np as u64, 2 * np as u64);
        Ok(RoutingTable {
            model: model.name.clone(),
            num_params: np as u64,
            num_elements: model.num_elements(),
            trainers,
            rollouts,
        })
    }

    /// The empty plans of every trainer, and the shard lookups emission needs.
    fn emission(&self) -> Emission {
        let builders = self.trainer_builders();
        // Shard position -> (index in its rank's shard list, index of its param in the rank's
        // params): looked up once per task, so dense arrays in position order.
        let mut by_index = vec![0u32; self.train.shards.len()];
        for b in &builders {
            for (i, sh) in b.plan.shards.iter().enumerate() {
                by_index[b.first_shard + i] = sh.param;
            }
        }
        let mut first_shard = vec![0u32; builders.len()];
        for b in &builders {
            first_shard[b.plan.rank as usize] = b.first_shard as u32;
        }
        let (shard_local, shard_param) = self
            .shard_order
            .iter()
            .zip(&self.shards)
            .map(|(&g, sh)| (g - first_shard[sh.rank as usize], by_index[g as usize]))
            .unzip();
        Emission {
            starts: vec![[0u32; 3]; builders.len()],
            builders,
            shard_local,
            shard_param,
            rollout_writes: vec![0u64; self.infer.ranks.len()],
            targets: TargetPlan::none(),
        }
    }

    /// Per trainer, its plan with its params and shards (`train.shards` is sorted by rank,
    /// offset) and room for the tasks and writes pass 2 expects.
    fn trainer_builders(&self) -> Vec<TrainerBuilder> {
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
        let mut pids: Vec<u32> = Vec::new();
        (0..nt)
            .map(|r| {
                let shards = &self.train.shards[rank_first[r]..rank_first[r + 1]];
                pids.clear();
                pids.extend(shards.iter().map(|s| s.param));
                if !pids.is_sorted() {
                    pids.sort_unstable();
                }
                pids.dedup();
                for (i, &p) in pids.iter().enumerate() {
                    local_param[p as usize] = i as u32;
                }
                TrainerBuilder {
                    plan: self.empty_trainer_plan(r, shards, &pids, &local_param),
                    first_shard: rank_first[r],
                    gather_expect: 0,
                }
            })
            .collect()
    }

    /// Trainer `r`'s plan before emission: its params `pids` (sorted), its `shards` (their
    /// params numbered by `local_param`), its arenas' sizes and capacity for its tasks.
    fn empty_trainer_plan(
        &self,
        r: usize,
        shards: &[ShardSpec],
        pids: &[u32],
        local_param: &[u32],
    ) -> TrainerPlan {
        let model = self.model;
        TrainerPlan {
            rank: r as u32,
            params: pids
                .iter()
                .map(|&p| ParamRef {
                    id: p,
                    name: model.params[p as usize].name.clone(),
                    shape: model.params[p as usize].shape,
                })
                .collect(),
            shards: shards
                .iter()
                .map(|s| LocalShard {
                    param: local_param[s.param as usize],
                    global: s.global,
                    dtype: s.dtype,
                    offset: s.offset,
                })
                .collect(),
            source_arena_bytes: shards
                .last()
                .map_or(0, |s| s.offset + s.global.numel() * s.dtype.size() as u64),
            gather_arena_bytes: 0,
            groups: Vec::with_capacity(model.num_mesh_groups() as usize),
            tasks: Vec::with_capacity(self.est_tasks[r] as usize),
            writes: Vec::with_capacity(self.est_writes[r] as usize),
            copies: Vec::with_capacity(self.est_tasks[r] as usize),
        }
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
        out.close_group(g, self.model.mesh_group_name(g));
    }

    /// Emits the Copy tasks that assemble gather region `reg` in its owner's gather arena;
    /// returns the region's offset there.
    fn emit_gather_sends(
        &self,
        out: &mut Emission,
        reg: &Region,
        owner_shard: u32,
        parts: &[(TensorBox, u32)],
        g: u16,
    ) -> u64 {
        let owner = self.shard(owner_shard);
        let elem = owner.dtype.size() as u64;
        let ob = &mut out.builders[owner.rank as usize];
        let goff = ob.plan.gather_arena_bytes;
        ob.plan.gather_arena_bytes = align_up(goff + reg.bx.numel() * elem);
        let shape = reg.bx.shape();
        let mut received = 0;
        for &(part, s) in parts {
            let sh = self.shard(s);
            let b = &mut out.builders[sh.rank as usize];
            let first_write = b.plan.writes.len() as u32;
            let rel = part.relative_to(&reg.bx);
            let mut nw = 0u32;
            let writes = &mut b.plan.writes;
            for_each_run(&rel, &shape, elem, |so, d, len| {
                push_split(
                    writes,
                    &mut nw,
                    WriteTarget::Trainer(owner.rank),
                    TRAINER_GATHER_MR,
                    g,
                    so,
                    goff + d,
                    len,
                );
            });
            let task = Task {
                param: out.shard_param[s as usize],
                region: part,
                source: Source::Shard {
                    shard: out.shard_local[s as usize],
                },
                transform: Transform::Copy { dtype: sh.dtype },
                first_write,
                num_writes: nw,
                first_copy: b.plan.copies.len() as u32,
                num_copies: 0,
            };
            b.plan.tasks.push(task);
            received += nw;
        }
        out.builders[owner.rank as usize].gather_expect += received;
        goff
    }

    /// Emits the task that prepares box `bx` of region `reg` (from shard `s`, or from the
    /// gather arena at `gather` on `s`'s rank) and writes it to every target of its group.
    fn emit_task(
        &self,
        out: &mut Emission,
        reg: &Region,
        bx: &TensorBox,
        s: u32,
        gather: Option<u64>,
    ) {
        if out.targets.dgroup != reg.dgroup {
            self.target_plan(reg.dgroup, &mut out.targets, &mut out.rollout_writes);
        }
        let sh = self.shard(s);
        let dg = &self.dgroups[reg.dgroup as usize];
        let pn = bx.ndim as usize;
        let transform = transform_for(dg.fp8, sh.dtype, dg.dtype);
        let b = &mut out.builders[sh.rank as usize];
        let first_write = b.plan.writes.len() as u32;
        let first_copy = b.plan.copies.len() as u32;
        let writes = &mut b.plan.writes;
        let mut nw = 0u32;
        // Where the scales sit in the prepared output (Task::fp8_scales).
        let scale_offset = bx.numel().div_ceil(16) * 16;
        for l in out.targets.listed.iter_mut() {
            let pc = &l.piece;
            let before = nw;
            let dst = WriteTarget::Rollout(pc.rank);
            let db = dst_box(pc, bx, l.shape.ndim as usize);
            for_each_run(&db, &l.shape, l.elem, |so, d, len| {
                push_split(writes, &mut nw, dst, l.mr, 0, so, l.offset + d, len);
            });
            if let Some((shape, mr, offset)) = l.scales {
                let sb = scale_box(pc, bx, shape.ndim as usize, pn);
                for_each_run(&sb, &shape, 4, |so, d, len| {
                    push_split(
                        writes,
                        &mut nw,
                        dst,
                        mr,
                        0,
                        scale_offset + so,
                        offset + d,
                        len,
                    );
                });
            }
            out.rollout_writes[pc.rank as usize] += (nw - before) as u64;
            l.task_writes = (before, nw - before);
        }
        for c in out.targets.copies.iter_mut() {
            let (from, num) = out.targets.listed[c.base as usize].task_writes;
            // Counted toward each rank when the dgroup's tasks are done (TargetPlan::flush).
            c.writes += num as u64;
            b.plan.copies.push(WriteCopies {
                from,
                num,
                first_rank: c.first_rank,
                stride: c.stride,
                count: c.count,
            });
        }
        let source = match gather {
            Some(offset) => Source::Gather { offset },
            None => Source::Shard {
                shard: out.shard_local[s as usize],
            },
        };
        let task = Task {
            param: out.shard_param[s as usize],
            region: *bx,
            source,
            transform,
            first_write,
            num_writes: nw,
            first_copy,
            num_copies: out.targets.copies.len() as u32,
        };
        b.plan.tasks.push(task);
    }

    /// Every rollout rank's plan: its tensors and the writes it receives.
    fn rollout_plans(&self, rollout_writes: &[u64]) -> Vec<RolloutPlan> {
        self.infer
            .ranks
            .iter()
            .map(|r| RolloutPlan {
                rank: r.rank,
                engine: r.engine,
                local_rank: r.local_rank,
                mr_bytes: r.mr_bytes.clone(),
                tensors: r.tensors.clone(),
                expect: vec![UnitExpect {
                    unit: 0,
                    writes: rollout_writes[r.rank as usize],
                }],
            })
            .collect()
    }
}

/// The finished trainer plans; refused when one would number its writes or tasks past `u32`.
fn trainer_plans(builders: Vec<TrainerBuilder>) -> Result<Vec<TrainerPlan>, PlanError> {
    let mut trainers = Vec::with_capacity(builders.len());
    for b in builders {
        if b.plan.writes.len() > u32::MAX as usize || b.plan.tasks.len() > u32::MAX as usize {
            return Err(PlanError::TooLarge(format!(
                "training rank {} would have more than 2^32 writes",
                b.plan.rank
            )));
        }
        trainers.push(b.plan);
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

/// Pushes one run as writes of at most [`MAX_WRITE_BYTES`].
#[allow(clippy::too_many_arguments)]
#[inline]
fn push_split(
    out: &mut Vec<Write>,
    count: &mut u32,
    dst: WriteTarget,
    mr: u16,
    unit: u16,
    src: u64,
    dst_off: u64,
    len: u64,
) {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_WRITE_BYTES);
        out.push(Write {
            dst,
            mr,
            unit,
            len: n as u32,
            src_offset: src + done,
            dst_offset: dst_off + done,
        });
        *count += 1;
        done += n;
    }
}
