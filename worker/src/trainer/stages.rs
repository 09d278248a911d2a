//! The work of the "source to staging" (H2D) and prepare stages for one piece (run on blocking
//! threads), whatever the source is.
//!
//! Source to staging copies the piece's part of the source box into the lease's input range,
//! dense and row-major: the host gathers it out of a host shard; a source in device memory
//! copies the same rows ([`strided_copies`]) by DMA into the pinned lease
//! ([`DeviceStages::fill`]). Prepare turns that input into the piece's exact prepared bytes as
//! one [`PrepareJob`]: nothing for Copy (the staged input is already the output), a cast, or fp8
//! block quantisation per matrix and block strip, run with the CPU kernels of
//! [`crate::prepare`], or, for a piece read in place from device memory, by the source's
//! [`DeviceStages::prepare`] (the NVRTC kernels, then D2H into the lease).

use weightsync_common::fabric::Region;
use weightsync_schedules::table::{FP8_BLOCK, Source, Task, TensorBox, TrainerPlan, Transform};

use super::piece::{Grain, TaskPiece, TaskShape};
use crate::error::{Result, WorkerError};
use crate::prepare::{
    Fp8Shape, Threads, cast, cast_pitched, gather_box, pitched_span,
    quantise_fp8_block_rows_pitched,
};
use crate::source::device_stages::{
    DeviceStages, Fp8Strips, PrepareJob, PrepareKind, StridedCopy, strided_copies,
};
use crate::source::view::{SourceView, param_name, source_range};

/// Units of one matrix covered by a piece: `(matrix, first strip, end strip, first unit)`.
fn matrices(grain: &Grain, u0: u64, u1: u64) -> Vec<(u64, u64, u64, u64)> {
    let Grain::Strips { rows, .. } = *grain else {
        return Vec::new();
    };
    let rb = rows.div_ceil(FP8_BLOCK as u64);
    let mut out = Vec::new();
    let mut u = u0;
    while u < u1 {
        let l = u / rb;
        let end = ((l + 1) * rb).min(u1);
        out.push((l, u % rb, end - l * rb, u));
        u = end;
    }
    out
}

/// Unravels a flat index over `dims` (row-major).
fn unravel(mut i: u64, dims: &[u32]) -> Vec<u32> {
    let mut idx = vec![0u32; dims.len()];
    for d in (0..dims.len()).rev() {
        let n = dims[d].max(1) as u64;
        idx[d] = (i % n) as u32;
        i /= n;
    }
    idx
}

fn prepare_err(
    plan: &TrainerPlan,
    t: u32,
    task: &Task,
    e: crate::prepare::PrepareError,
) -> WorkerError {
    WorkerError::Prepare {
        task: t,
        param: param_name(plan, task.param),
        source: e,
    }
}

/// H2D: fills `input` (exactly `piece.layout.input` bytes) from the source (through `device`
/// when the source is device memory) or the gather arena.
pub(crate) fn stage_input(
    plan: &TrainerPlan,
    shape: &TaskShape,
    piece: &TaskPiece,
    source: &dyn SourceView,
    device: Option<&dyn DeviceStages>,
    gather: Option<&Region>,
    input: &mut [u8],
) -> Result<()> {
    let t = piece.task;
    match plan.tasks[t as usize].source {
        Source::Gather { offset, .. } => {
            // The gathered region is dense: the piece's units are one contiguous byte range.
            let gather = gather.ok_or_else(|| {
                WorkerError::InvalidPlan(format!(
                    "task {t} reads a gather arena this trainer does not have"
                ))
            })?;
            let at = offset + shape.grain.elems_before(piece.u0) * shape.in_size;
            gather
                .read_at(at, input)
                .map_err(|e| WorkerError::fabric(format!("task {t}: reading the gather arena"), e))
        }
        Source::Shard { shard } => {
            stage_from_shard(plan, shape, piece, shard, source, device, input)
        }
    }
}

/// One box of a shard to copy: its start and extent in the shard's coordinates, and where its
/// bytes go in the staged input.
struct ShardCopy {
    start: Vec<usize>,
    extent: Vec<usize>,
    out: std::ops::Range<usize>,
}

/// The boxes of `sub` (a task's region, in its shard's coordinates) that piece `piece` stages:
/// a run of rows, or the block strips of each matrix it covers.
fn piece_copies(
    shape: &TaskShape,
    piece: &TaskPiece,
    sub: &TensorBox,
    input_len: usize,
) -> Vec<ShardCopy> {
    let n = sub.ndim as usize;
    let whole = || -> (Vec<usize>, Vec<usize>) {
        (
            sub.start[..n].iter().map(|&x| x as usize).collect(),
            sub.len[..n].iter().map(|&x| x as usize).collect(),
        )
    };
    match shape.grain {
        Grain::Rows { .. } if n == 0 => vec![ShardCopy {
            start: vec![],
            extent: vec![],
            out: 0..input_len,
        }],
        Grain::Rows { .. } => {
            let (mut start, mut extent) = whole();
            start[0] += piece.u0 as usize;
            extent[0] = (piece.u1 - piece.u0) as usize;
            vec![ShardCopy {
                start,
                extent,
                out: 0..input_len,
            }]
        }
        Grain::Strips { rows, .. } => {
            let base = shape.grain.elems_before(piece.u0);
            matrices(&shape.grain, piece.u0, piece.u1)
                .into_iter()
                .map(|(l, ja, jb, first)| {
                    let lead = unravel(l, &sub.len[..n - 2]);
                    let (mut start, mut extent) = whole();
                    for d in 0..n - 2 {
                        start[d] += lead[d] as usize;
                        extent[d] = 1;
                    }
                    let r0 = ja * FP8_BLOCK as u64;
                    let r1 = (jb * FP8_BLOCK as u64).min(rows);
                    start[n - 2] += r0 as usize;
                    extent[n - 2] = (r1 - r0) as usize;
                    let from = ((shape.grain.elems_before(first) - base) * shape.in_size) as usize;
                    let len = ((r1 - r0) * sub.len[n - 1] as u64 * shape.in_size) as usize;
                    ShardCopy {
                        start,
                        extent,
                        out: from..from + len,
                    }
                })
                .collect()
        }
    }
}

/// H2D from one of the trainer's own shards: the piece's boxes gathered out of the shard by
/// the host, or copied as strided rows by the source's device stages.
fn stage_from_shard(
    plan: &TrainerPlan,
    shape: &TaskShape,
    piece: &TaskPiece,
    shard: u32,
    source: &dyn SourceView,
    device: Option<&dyn DeviceStages>,
    input: &mut [u8],
) -> Result<()> {
    let t = piece.task;
    let task = &plan.tasks[t as usize];
    let s = plan.shards[shard as usize];
    // Checked when the worker was built (TaskShape::of).
    let sub = plan
        .source_box(task)
        .ok_or_else(|| WorkerError::InvalidPlan(format!("task {t}: region outside its shard")))?;
    let dims: Vec<usize> = s
        .global
        .shape()
        .dims()
        .iter()
        .map(|&d| d as usize)
        .collect();
    let copies = piece_copies(shape, piece, &sub, input.len());
    if let Some(device) = device {
        let rows: Vec<StridedCopy> = copies
            .iter()
            .flat_map(|c| {
                strided_copies(
                    &dims,
                    shape.in_size as usize,
                    &c.start,
                    &c.extent,
                    c.out.start as u64,
                )
            })
            .collect();
        return device.fill(plan, shard, &rows, input);
    }
    source.read_shard(plan, shard, &mut |tensor: &[u8]| {
        if tensor.len() as u64 != s.bytes() {
            return Err(WorkerError::SourceTooShort {
                what: format!("shard of {}", param_name(plan, s.param)),
                need: s.bytes(),
                have: tensor.len() as u64,
            });
        }
        copies.iter().try_for_each(|c| {
            gather_box(
                tensor,
                shape.in_size as usize,
                &dims,
                &c.start,
                &c.extent,
                &mut input[c.out.clone()],
                Threads::One,
            )
            .map_err(|e| prepare_err(plan, t, task, e))
        })
    })
}

/// Prepare: turns the staged input into the piece's prepared values (and scales) in `buf`, the
/// whole lease.
pub(crate) fn prepare_piece(
    plan: &TrainerPlan,
    shape: &TaskShape,
    piece: &TaskPiece,
    buf: &mut [u8],
    threads: Threads,
) -> Result<()> {
    let values_at = piece.layout.values_at;
    let job = prepare_job(plan, shape, piece)?;
    let (input, out) = buf.split_at_mut(values_at as usize);
    run_job(plan, piece.task, &job, input, None, out, values_at, threads)
}

/// Where a task prepared reading its shard in place finds its input there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InPlace {
    /// Byte offset of the task's box in its shard.
    pub box_at: u64,
    /// `None`: the box is one contiguous range ([`TrainerPlan::in_place_input`]). Else
    /// `(run, pitch)` in bytes: runs that long, that far apart (a column slice cast or
    /// quantised where it lies, [`TrainerPlan::in_place_runs`]; host sources only).
    pub runs: Option<(u64, u64)>,
}

impl InPlace {
    /// How `plan`'s task `task` is prepared in place, if it is: a contiguous box on any
    /// source, a column slice only where the host reads it (`on_device` false).
    pub(crate) fn of(plan: &TrainerPlan, task: &Task, on_device: bool) -> Option<InPlace> {
        if let Some(box_at) = plan.in_place_input(task) {
            return Some(InPlace { box_at, runs: None });
        }
        if on_device {
            return None;
        }
        plan.in_place_runs(task).map(|r| InPlace {
            box_at: r.offset,
            runs: Some((r.run, r.pitch)),
        })
    }
}

/// Prepare reading the source in place: the piece's input is the part of shard `shard` where
/// the task's box lies (`at`: contiguous, or rows at a pitch) from the piece's first unit on;
/// the prepared bytes go to `buf`, the whole lease (at `lease_offset` of the staging arena), as
/// [`prepare_piece`] puts them (its input range is left untouched). A device source runs the
/// same job on the device (contiguous boxes only).
#[allow(clippy::too_many_arguments)]
pub(crate) fn prepare_from_source(
    plan: &TrainerPlan,
    shape: &TaskShape,
    piece: &TaskPiece,
    source: &dyn SourceView,
    device: Option<&dyn DeviceStages>,
    at: InPlace,
    lease_offset: u64,
    buf: &mut [u8],
    threads: Threads,
) -> Result<()> {
    let t = piece.task;
    let Source::Shard { shard } = plan.tasks[t as usize].source else {
        return Err(WorkerError::InvalidPlan(format!(
            "task {t}: prepared in place but not read from a shard"
        )));
    };
    let dense = shape.grain.elems_before(piece.u0) * shape.in_size;
    let len = piece.layout.input;
    // The piece's input starts at a run's start: its units are whole dim-0 rows of the box
    // (whole runs) or fp8 strips of whole rows (each row one run).
    let (lo, span) = match at.runs {
        None => (at.box_at + dense, len),
        Some((run, pitch)) => {
            if run == 0 || !dense.is_multiple_of(run) || !len.is_multiple_of(run) {
                return Err(WorkerError::InvalidPlan(format!(
                    "task {t}: a piece of {len} bytes at {dense} is not whole runs of {run} bytes"
                )));
            }
            let span = pitched_span((len / run) as usize, run as usize, pitch as usize);
            (at.box_at + dense / run * pitch, span as u64)
        }
    };
    let job = prepare_job(plan, shape, piece)?;
    if let Some(device) = device {
        if at.runs.is_some() {
            return Err(WorkerError::InvalidPlan(format!(
                "task {t}: a device source reads column slices through staging"
            )));
        }
        return device.prepare(plan, shard, lo, &job, lease_offset, buf);
    }
    let values_at = piece.layout.values_at;
    let out = &mut buf[values_at as usize..];
    let (lo, span) = (lo as usize, span as usize);
    source.read_shard(plan, shard, &mut |bytes: &[u8]| {
        let input = source_range(bytes, lo, span, || format!("shard of task {t}"))?;
        run_job(plan, t, &job, input, at.runs, out, values_at, threads)
    })
}

/// What preparing `piece` computes: its transform, and where each part of its output goes in
/// its lease (the one description the host and a device both run).
pub(crate) fn prepare_job(
    plan: &TrainerPlan,
    shape: &TaskShape,
    piece: &TaskPiece,
) -> Result<PrepareJob> {
    let t = piece.task;
    let task = &plan.tasks[t as usize];
    let lay = piece.layout;
    let kind = match task.transform {
        Transform::Copy { .. } => PrepareKind::Copy,
        Transform::Cast { from, to } => PrepareKind::Cast {
            from,
            to,
            values: lay.values_at..lay.values_at + lay.values,
        },
        Transform::Fp8Block { from, recipe } => {
            let Grain::Strips { rows, cols, .. } = shape.grain else {
                return Err(WorkerError::InvalidPlan(format!(
                    "task {t}: fp8 without block strips"
                )));
            };
            let e0 = shape.grain.elems_before(piece.u0);
            let s0 = shape.grain.scales_before(piece.u0);
            let strips = matrices(&shape.grain, piece.u0, piece.u1)
                .into_iter()
                .map(|(_, ja, jb, first)| {
                    let last = first + (jb - ja);
                    let ea = shape.grain.elems_before(first) - e0;
                    let eb = shape.grain.elems_before(last) - e0;
                    let sa = (shape.grain.scales_before(first) - s0) * 4;
                    let sb = (shape.grain.scales_before(last) - s0) * 4;
                    Fp8Strips {
                        matrix_rows: rows,
                        blocks: ja..jb,
                        input: ea * shape.in_size..eb * shape.in_size,
                        values: lay.values_at + ea..lay.values_at + eb,
                        scales: lay.scales_at + sa..lay.scales_at + sb,
                    }
                })
                .collect();
            PrepareKind::Fp8 {
                from,
                recipe,
                cols,
                strips,
            }
        }
    };
    Ok(PrepareJob {
        input: lay.input,
        kind,
    })
}

/// Runs `job` of task `t` on the host: reads `input` and writes `out`, the lease from byte
/// `out_at` on. `input` is dense (at least `job.input` bytes), or (`runs`: `(run, pitch)` in
/// bytes) runs of `run` bytes `pitch` bytes apart, read where they lie: a cast's runs, or fp8
/// rows.
#[allow(clippy::too_many_arguments)]
fn run_job(
    plan: &TrainerPlan,
    t: u32,
    job: &PrepareJob,
    input: &[u8],
    runs: Option<(u64, u64)>,
    out: &mut [u8],
    out_at: u64,
    threads: Threads,
) -> Result<()> {
    let task = &plan.tasks[t as usize];
    let err = |e| prepare_err(plan, t, task, e);
    let at = |r: &std::ops::Range<u64>| (r.start - out_at) as usize..(r.end - out_at) as usize;
    match &job.kind {
        PrepareKind::Copy => Ok(()),
        PrepareKind::Cast { from, to, values } => match runs {
            None => cast(
                &input[..job.input as usize],
                *from,
                &mut out[at(values)],
                *to,
                threads,
            ),
            Some((run, pitch)) => {
                let size = from.size() as u64;
                cast_pitched(
                    input,
                    *from,
                    (run / size) as usize,
                    (pitch / size) as usize,
                    &mut out[at(values)],
                    *to,
                    threads,
                )
            }
        }
        .map_err(err),
        PrepareKind::Fp8 {
            from,
            recipe,
            cols,
            strips,
        } => {
            for s in strips {
                let fshape = Fp8Shape {
                    rows: s.matrix_rows as usize,
                    cols: *cols as usize,
                };
                // Values and scales are disjoint ranges of `out`, values first.
                let (values, rest) = out.split_at_mut(at(&s.values).end);
                let scales_at = at(&s.scales);
                let shift = values.len();
                // The strip's rows where they lie: dense, or `pitch` apart.
                let (src, pitch) = match runs {
                    None => (
                        &input[s.input.start as usize..s.input.end as usize],
                        *cols as usize,
                    ),
                    Some((row, pitch)) => {
                        let (ra, rb) = (s.input.start / row, s.input.end / row);
                        let end = if rb > ra {
                            (rb - 1) * pitch + row
                        } else {
                            ra * pitch
                        };
                        (
                            &input[(ra * pitch) as usize..end as usize],
                            (pitch / (row / *cols)) as usize,
                        )
                    }
                };
                quantise_fp8_block_rows_pitched(
                    src,
                    *from,
                    fshape,
                    s.blocks.start as usize..s.blocks.end as usize,
                    pitch,
                    *recipe,
                    &mut values[at(&s.values)],
                    &mut rest[scales_at.start - shift..scales_at.end - shift],
                    threads,
                )
                .map_err(err)?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrices_split_units_at_matrix_edges() {
        let g = Grain::Strips {
            lead: 3,
            rows: 300,
            cols: 8,
        };
        // 3 strips per matrix; units 2..7 = (m0: strip 2), (m1: 0..3), (m2: 0..1).
        assert_eq!(
            matrices(&g, 2, 7),
            vec![(0, 2, 3, 2), (1, 0, 3, 3), (2, 0, 1, 6)]
        );
        assert_eq!(unravel(5, &[2, 3]), vec![1, 2]);
    }
}
