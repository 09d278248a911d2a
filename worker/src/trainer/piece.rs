//! Cutting tasks into pieces that fit the watermark, and mapping the table's writes onto them.
//!
//! The pipeline moves *pieces*, not tasks: a task whose staging (its source box plus its prepared
//! output) exceeds the piece budget is split along its natural grain so that every piece's
//! prepared bytes are a contiguous part of the task's prepared output:
//! - Copy and Cast split along dim 0 of the box (rows); the output is dense row-major, so rows
//!   `[r0, r1)` are output bytes `[r0 * row, r1 * row)`.
//! - Fp8Block splits into 128-row block strips, one 2-D matrix per index of the leading dims,
//!   linearised in row-major order: strips `[u0, u1)` are a contiguous range of fp8 values *and*
//!   a contiguous range of scale rows, so a piece never splits a quantisation block.
//!
//! The smallest piece (one row, one block strip) must fit the watermark; if it does not, the
//! worker refuses to start ([`WorkerError::WatermarkTooSmall`]) before anything is written.
//!
//! A table write whose prepared range spans several pieces is sent as several *parts*. Its
//! immediate must still count once and only after every byte landed, so only the last part
//! carries it, and that part is posted only after every earlier part completed (see
//! `pipeline`). All of this is computed once, when the worker is built, not per sync.

use weightsync_schedules::table::{FP8_BLOCK, MAX_DIMS, Source, Task, TrainerPlan, Transform};

use crate::error::{Result, WorkerError};
use crate::source::view::param_name;
use crate::watermark::aligned;

/// The grain of a task: what one indivisible unit of it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Grain {
    /// Rows along dim 0; `inner` elements per row.
    Rows {
        /// Rows in the box.
        rows: u64,
        /// Elements per row.
        inner: u64,
    },
    /// 128-row block strips of `lead` matrices of `[rows, cols]`.
    Strips {
        /// Number of matrices (product of the leading dims).
        lead: u64,
        /// Rows per matrix.
        rows: u64,
        /// Columns per matrix.
        cols: u64,
    },
}

impl Grain {
    /// Number of units.
    pub(crate) fn units(&self) -> u64 {
        match *self {
            Grain::Rows { rows, .. } => rows,
            Grain::Strips { lead, rows, .. } => lead * rows.div_ceil(FP8_BLOCK as u64),
        }
    }

    fn strips_per_matrix(rows: u64) -> u64 {
        rows.div_ceil(FP8_BLOCK as u64)
    }

    /// Elements of the box before unit `u` (row-major), for `u` in `0..=units`.
    pub(crate) fn elems_before(&self, u: u64) -> u64 {
        match *self {
            Grain::Rows { inner, .. } => u * inner,
            Grain::Strips { rows, cols, .. } => {
                let rb = Self::strips_per_matrix(rows);
                let (l, j) = (u / rb, u % rb);
                (l * rows + (j * FP8_BLOCK as u64).min(rows)) * cols
            }
        }
    }

    /// Scale entries (f32) before unit `u` (fp8 only).
    pub(crate) fn scales_before(&self, u: u64) -> u64 {
        match *self {
            Grain::Rows { .. } => 0,
            Grain::Strips { cols, .. } => u * cols.div_ceil(FP8_BLOCK as u64),
        }
    }
}

/// How a piece's staging lease is laid out (offsets relative to the lease).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagingLayout {
    /// Source bytes staged by H2D, at 0.
    pub input: u64,
    /// Where the prepared values start (0 for Copy: the staged input *is* the output).
    pub values_at: u64,
    /// Prepared value bytes.
    pub values: u64,
    /// Where the prepared scales start.
    pub scales_at: u64,
    /// Prepared scale bytes (fp8 only).
    pub scales: u64,
    /// Bytes of the whole lease.
    pub total: u64,
}

/// One part of a table write carried by a piece.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    /// Index of the write in [`TrainerPlan::writes`].
    pub write: u32,
    /// Offset of the part's bytes relative to the lease.
    pub staging_offset: u64,
    /// Offset in the destination MR.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
    /// Number of parts of this write over the whole task (1 = not split).
    pub parts: u32,
    /// Whether this is the write's last part (the one that carries the immediate).
    pub last: bool,
}

/// A piece: units `[u0, u1)` of one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TaskPiece {
    /// Task index in the plan.
    pub task: u32,
    /// Piece index within the task.
    pub piece: u32,
    /// First unit.
    pub u0: u64,
    /// One past the last unit.
    pub u1: u64,
    /// Staging layout.
    pub layout: StagingLayout,
    /// Parts of the task's writes this piece carries, in posting order.
    pub parts: Vec<Part>,
}

/// Most elements one task may cover (2^40: 4 TiB of f32, beyond any tensor of any model), so
/// byte counts derived from a decoded region cannot overflow.
const MAX_TASK_ELEMS: u64 = 1 << 40;

/// Element sizes and grain of a task, after checking the transform against its source.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TaskShape {
    pub grain: Grain,
    pub in_size: u64,
    pub out_size: u64,
    pub copy: bool,
    /// Offset of the scales in the task's prepared output (fp8 only).
    pub scale_offset: u64,
}

impl TaskShape {
    /// The shape of `task`, or why it is inconsistent.
    pub(crate) fn of(task: &Task, index: u32, plan: &TrainerPlan) -> Result<TaskShape> {
        let region = &task.region;
        let n = region.ndim as usize;
        let param = param_name(plan, task.param);
        let invalid =
            |why: String| WorkerError::InvalidPlan(format!("task {index} ({param}): {why}"));
        // Everything below sizes buffers from the region: refuse a malformed one first (a
        // decoded table is not trusted to be one the planner made).
        if n > MAX_DIMS {
            return Err(invalid(format!(
                "region has {n} dims, at most {MAX_DIMS} are supported"
            )));
        }
        let elems = region.len[..n]
            .iter()
            .try_fold(1u64, |acc, &l| acc.checked_mul(l as u64))
            .filter(|&e| e <= MAX_TASK_ELEMS);
        if elems.is_none() {
            return Err(invalid(format!(
                "region {region} has more than {MAX_TASK_ELEMS} elements"
            )));
        }
        let (in_dtype, out_dtype) = (task.transform.input_dtype(), task.transform.output_dtype());
        let fp8 = matches!(task.transform, Transform::Fp8Block { .. });
        if fp8 && n < 2 {
            return Err(invalid(format!("fp8 needs at least 2 dims, box {region}")));
        }
        let scale_offset = task.fp8_scales().map_or(0, |(offset, _)| offset);
        // The dtype the source really holds.
        let src_dtype = match task.source {
            Source::Shard { shard } => {
                let s = plan.shards.get(shard as usize).ok_or_else(|| {
                    invalid(format!("shard {shard} out of {} shards", plan.shards.len()))
                })?;
                if plan.source_box(task).is_none() {
                    return Err(invalid(format!(
                        "region {region} does not lie in its shard {}",
                        s.global
                    )));
                }
                s.dtype
            }
            // A gathered region holds the transform's input, by definition.
            Source::Gather { .. } => in_dtype,
        };
        if src_dtype != in_dtype {
            return Err(WorkerError::DTypeMismatch {
                task: index,
                param,
                source_dtype: src_dtype,
                transform_dtype: in_dtype,
            });
        }
        let grain = if fp8 {
            let lead = region.len[..n - 2].iter().map(|&d| d as u64).product();
            Grain::Strips {
                lead,
                rows: region.len[n - 2] as u64,
                cols: region.len[n - 1] as u64,
            }
        } else if n == 0 {
            Grain::Rows { rows: 1, inner: 1 }
        } else {
            Grain::Rows {
                rows: region.len[0] as u64,
                inner: region.len[1..n].iter().map(|&d| d as u64).product(),
            }
        };
        let shape = TaskShape {
            grain,
            in_size: in_dtype.size() as u64,
            out_size: out_dtype.size() as u64,
            copy: matches!(task.transform, Transform::Copy { .. }),
            scale_offset,
        };
        let values = region.numel() * shape.out_size;
        let scales = shape.grain.scales_before(grain.units()) * 4;
        let need = if fp8 { scale_offset + scales } else { values };
        // The table defines the prepared size (Task::prepared_bytes); the pieces below lay it out
        // from the grain. Both must agree, or writes would read past what the pieces prepare.
        if task.prepared_bytes() != need {
            return Err(invalid(format!(
                "the table's prepared size {} differs from the {need} bytes its pieces prepare",
                task.prepared_bytes()
            )));
        }
        Ok(shape)
    }

    /// Staging layout of units `[u0, u1)`.
    pub(crate) fn layout(&self, u0: u64, u1: u64) -> StagingLayout {
        let elems = self.grain.elems_before(u1) - self.grain.elems_before(u0);
        let input = elems * self.in_size;
        let values = elems * self.out_size;
        let scales = (self.grain.scales_before(u1) - self.grain.scales_before(u0)) * 4;
        let values_at = if self.copy { 0 } else { aligned(input) };
        let scales_at = values_at + aligned(values);
        let total = if self.copy {
            aligned(input)
        } else {
            scales_at + aligned(scales)
        };
        StagingLayout {
            input,
            values_at,
            values,
            scales_at,
            scales,
            total,
        }
    }

    /// The largest staging of a single unit (the smallest piece the task can be cut into).
    pub(crate) fn min_piece(&self) -> u64 {
        match self.grain {
            Grain::Rows { .. } => self.layout(0, 1).total,
            // The first strip of a matrix is the largest (only the last may be partial).
            Grain::Strips { .. } => self.layout(0, 1).total,
        }
    }

    /// What one unit is, in words (for errors).
    pub(crate) fn unit_name(&self) -> String {
        match self.grain {
            Grain::Rows { inner, .. } => format!("one row of {inner} elements"),
            Grain::Strips { rows, cols, .. } => format!(
                "one {}-row fp8 block strip of {cols} columns",
                rows.min(FP8_BLOCK as u64)
            ),
        }
    }

    /// The prepared-output ranges of units `[u0, u1)`: `(prepared offset, len, staging offset)`.
    fn out_ranges(&self, u0: u64, layout: &StagingLayout) -> [(u64, u64, u64); 2] {
        let v0 = self.grain.elems_before(u0) * self.out_size;
        let s0 = self.scale_offset + self.grain.scales_before(u0) * 4;
        [
            (v0, layout.values, layout.values_at),
            (s0, layout.scales, layout.scales_at),
        ]
    }
}

/// Cuts every task of the plan into pieces of at most `piece_budget` staging bytes (a single
/// unit may use up to `watermark`), and maps each task's writes onto the pieces.
pub(crate) fn plan_pieces(
    plan: &TrainerPlan,
    shapes: &[TaskShape],
    piece_budget: u64,
    watermark: u64,
) -> Result<Vec<Vec<TaskPiece>>> {
    let mut all = Vec::with_capacity(plan.tasks.len());
    for (t, (task, shape)) in plan.tasks.iter().zip(shapes).enumerate() {
        let t = t as u32;
        let min = shape.min_piece();
        if min > watermark {
            return Err(WorkerError::WatermarkTooSmall {
                task: t,
                param: param_name(plan, task.param),
                min_piece: min,
                unit: shape.unit_name(),
                watermark,
            });
        }
        let units = shape.grain.units();
        let mut pieces = Vec::new();
        let mut u0 = 0;
        while u0 < units {
            // Grow while the piece fits the budget; always take at least one unit.
            let mut u1 = u0 + 1;
            // Fast path for uniform rows: jump straight to the budget.
            if let Grain::Rows { .. } = shape.grain {
                let per = shape.layout(0, 1).total.max(1);
                u1 = (u0 + (piece_budget / per).max(1)).min(units);
                while u1 > u0 + 1 && shape.layout(u0, u1).total > piece_budget {
                    u1 -= 1;
                }
            } else {
                while u1 < units && shape.layout(u0, u1 + 1).total <= piece_budget {
                    u1 += 1;
                }
            }
            pieces.push(TaskPiece {
                task: t,
                piece: pieces.len() as u32,
                u0,
                u1,
                layout: shape.layout(u0, u1),
                parts: Vec::new(),
            });
            u0 = u1;
        }
        if pieces.is_empty() {
            // An empty box still gets one (empty) piece so its writes are accounted for.
            pieces.push(TaskPiece {
                task: t,
                piece: 0,
                u0: 0,
                u1: 0,
                layout: shape.layout(0, 0),
                parts: Vec::new(),
            });
        }
        map_writes(plan, task, t, shape, &mut pieces)?;
        all.push(pieces);
    }
    Ok(all)
}

fn map_writes(
    plan: &TrainerPlan,
    task: &Task,
    t: u32,
    shape: &TaskShape,
    pieces: &mut [TaskPiece],
) -> Result<()> {
    let first = task.first_write as usize;
    let count = task.num_writes as usize;
    if first + count > plan.writes.len() {
        return Err(WorkerError::InvalidPlan(format!(
            "task {t}: writes {first}..{} out of {}",
            first + count,
            plan.writes.len()
        )));
    }
    for wi in first..first + count {
        let w = plan.writes[wi];
        let (a, b) = (w.src_offset, w.src_offset + w.len as u64);
        if b > task.prepared_bytes() {
            return Err(WorkerError::InvalidPlan(format!(
                "task {t}: write {wi} reads prepared bytes {a}..{b} of {}",
                task.prepared_bytes()
            )));
        }
        let mut found: Vec<(usize, Part)> = Vec::new();
        let mut covered = 0;
        for (pi, piece) in pieces.iter().enumerate() {
            for (prep, len, at) in shape.out_ranges(piece.u0, &piece.layout) {
                let lo = a.max(prep);
                let hi = b.min(prep + len);
                if lo < hi {
                    covered += hi - lo;
                    found.push((
                        pi,
                        Part {
                            write: wi as u32,
                            staging_offset: at + (lo - prep),
                            dst_offset: w.dst_offset + (lo - a),
                            len: hi - lo,
                            parts: 0,
                            last: false,
                        },
                    ));
                }
            }
        }
        if covered != b - a {
            return Err(WorkerError::InvalidPlan(format!(
                "task {t}: write {wi} covers prepared bytes {a}..{b}, of which only {covered} are produced (padding between values and scales?)"
            )));
        }
        let n = found.len() as u32;
        let last = found.len().saturating_sub(1);
        for (k, (pi, mut part)) in found.into_iter().enumerate() {
            part.parts = n;
            part.last = k == last;
            pieces[pi].parts.push(part);
        }
        if n == 0 {
            // A zero-length write still carries its immediate: give it a part of its own.
            pieces[0].parts.push(Part {
                write: wi as u32,
                staging_offset: 0,
                dst_offset: w.dst_offset,
                len: 0,
                parts: 1,
                last: true,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_common::DType;
    use weightsync_schedules::table::{
        LocalShard, MeshGroup, ParamRef, Shape, TensorBox, Write, WriteTarget,
    };

    /// A plan with one task over a `[rows, cols]` shard and one write of everything.
    pub(crate) fn one_task_plan(
        rows: u32,
        cols: u32,
        transform: Transform,
        prepared: u64,
    ) -> TrainerPlan {
        let shape = Shape::new(&[rows, cols]);
        let dtype = match transform {
            Transform::Copy { dtype } => dtype,
            Transform::Cast { from, .. } | Transform::Fp8Block { from, .. } => from,
        };
        TrainerPlan {
            rank: 0,
            params: vec![ParamRef {
                id: 0,
                name: "w".into(),
                shape,
            }],
            shards: vec![LocalShard {
                param: 0,
                global: TensorBox::full(shape),
                dtype,
                offset: 0,
            }],
            source_arena_bytes: shape.numel() * dtype.size() as u64,
            gather_arena_bytes: 0,
            groups: vec![MeshGroup {
                id: 0,
                name: "g".into(),
                first_task: 0,
                num_tasks: 1,
                gather_sends: 0,
                local_tasks: 1,
                gather_expect: 0,
            }],
            tasks: vec![Task {
                param: 0,
                region: TensorBox::full(shape),
                source: Source::Shard { shard: 0 },
                transform,
                first_write: 0,
                num_writes: 1,
                first_copy: 0,
                num_copies: 0,
            }],
            copies: Vec::new(),
            writes: vec![Write {
                dst: WriteTarget::Rollout(0),
                mr: 0,
                unit: 0,
                len: prepared as u32,
                src_offset: 0,
                dst_offset: 1000,
            }],
        }
    }

    fn fp8(rows: u32, cols: u32) -> (Transform, u64) {
        // Values, padded to 16 bytes, then one f32 scale per 128x128 block.
        let values = rows as u64 * cols as u64;
        let scales = (rows.div_ceil(128) * cols.div_ceil(128)) as u64;
        let prepared = values.div_ceil(16) * 16 + scales * 4;
        (
            Transform::Fp8Block {
                from: DType::BF16,
                recipe: weightsync_common::Fp8Recipe::Vllm,
            },
            prepared,
        )
    }

    #[test]
    fn rows_split_to_budget_and_parts_tile_the_write() {
        let plan = one_task_plan(
            100,
            64,
            Transform::Cast {
                from: DType::F32,
                to: DType::BF16,
            },
            100 * 64 * 2,
        );
        let shape = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap();
        // One row: 256 bytes in + 128 out = 384 staging.
        assert_eq!(shape.min_piece(), 384);
        let pieces = plan_pieces(&plan, &[shape], 384 * 10, 1 << 20).unwrap();
        assert_eq!(pieces[0].len(), 10);
        let parts: Vec<Part> = pieces[0].iter().flat_map(|p| p.parts.clone()).collect();
        assert_eq!(parts.len(), 10);
        assert_eq!(parts.iter().map(|p| p.len).sum::<u64>(), 100 * 64 * 2);
        assert!(parts.iter().all(|p| p.parts == 10));
        assert_eq!(parts.iter().filter(|p| p.last).count(), 1);
        assert!(parts.last().unwrap().last);
        // Parts continue each other on the destination.
        for w in parts.windows(2) {
            assert_eq!(w[0].dst_offset + w[0].len, w[1].dst_offset);
        }
        assert!(pieces[0].iter().all(|p| p.layout.total <= 384 * 10));
    }

    #[test]
    fn fp8_splits_by_block_strips_and_refuses_a_tiny_watermark() {
        let (t, prepared) = fp8(300, 256);
        let plan = one_task_plan(300, 256, t, prepared);
        let shape = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap();
        assert_eq!(shape.grain.units(), 3);
        // One full strip: 128*256*2 in + 128*256 values + 2 scales (aligned to 64).
        assert_eq!(shape.min_piece(), 65536 + 32768 + 64);
        let pieces = plan_pieces(&plan, &[shape], 1, 1 << 20).unwrap();
        assert_eq!(pieces[0].len(), 3);
        assert_eq!(pieces[0][2].layout.values, 44 * 256);
        // Values parts and scale parts: 3 + 3 parts of one write.
        let parts: Vec<Part> = pieces[0].iter().flat_map(|p| p.parts.clone()).collect();
        assert_eq!(parts.len(), 6);
        assert_eq!(
            parts.iter().map(|p| p.len).sum::<u64>(),
            300 * 256 + 3 * 2 * 4
        );
        let err = plan_pieces(&plan, &[shape], 1, 50_000).unwrap_err();
        assert!(
            matches!(err, WorkerError::WatermarkTooSmall { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("128-row fp8 block strip"), "{err}");
    }

    #[test]
    fn dtype_mismatch_foreign_regions_and_overlong_writes_are_refused() {
        let mut plan = one_task_plan(4, 4, Transform::Copy { dtype: DType::BF16 }, 32);
        plan.shards[0].dtype = DType::F32;
        let err = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap_err();
        assert!(matches!(err, WorkerError::DTypeMismatch { .. }), "{err}");
        // A region reaching past its shard.
        let mut plan = one_task_plan(4, 4, Transform::Copy { dtype: DType::BF16 }, 32);
        plan.tasks[0].region = TensorBox::new(&[2, 0], &[4, 4]);
        let err = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap_err();
        assert!(
            err.to_string().contains("does not lie in its shard"),
            "{err}"
        );
        // A region with more dims than a box holds, and one too large to size.
        let mut plan = one_task_plan(4, 4, Transform::Copy { dtype: DType::BF16 }, 32);
        plan.tasks[0].region.ndim = 7;
        let err = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap_err();
        assert!(err.to_string().contains("region has 7 dims"), "{err}");
        let mut plan = one_task_plan(4, 4, Transform::Copy { dtype: DType::BF16 }, 32);
        plan.tasks[0].region = TensorBox::new(&[0, 0], &[u32::MAX, u32::MAX]);
        let err = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
        // A write reading past the prepared output.
        let mut plan = one_task_plan(4, 4, Transform::Copy { dtype: DType::BF16 }, 32);
        plan.writes[0].len = 33;
        let shape = TaskShape::of(&plan.tasks[0], 0, &plan).unwrap();
        let err = plan_pieces(&plan, &[shape], 1 << 20, 1 << 20).unwrap_err();
        assert!(
            err.to_string().contains("reads prepared bytes 0..33 of 32"),
            "{err}"
        );
    }
}
