//! The two steps a source supplies when the host cannot read it (device memory, feature `cuda`):
//! filling a staging lease with a piece's boxes, and preparing a piece read in place.
//!
//! Why hooks and not a second pipeline: the scheduler, the stages, the leases, the checksums and
//! the writes are the same whatever the source is (`trainer/pipeline.rs`, `trainer/stages.rs`). What
//! differs is only who moves the bytes: the host gathers a box out of host memory with
//! `gather_box`; a GPU source queues DMA copies into the (pinned) staging lease. So the stages
//! describe the work in plain data first, the same description for both, and hand it to the
//! source's [`DeviceStages`] when it has them:
//! - [`StridedCopy`]: a box of a dense row-major shard lowered to rows of bytes at a pitch (what
//!   `cuMemcpy2DAsync` copies), computed by [`strided_copies`];
//! - [`PrepareJob`]: what a piece's preparation computes and where it puts it in the lease (a
//!   cast, or fp8 block strips of matrices), which the host runs with the CPU kernels and a GPU
//!   source with the NVRTC kernels (bit-identical, see `crate::gpu`).
//!
//! A source without hooks (host memory, shared memory, a safetensors file, registered host
//! tensors) is read by the host stages as before.

use std::ops::Range;

use weightsync_common::{DType, Fp8Recipe};
use weightsync_schedules::table::TrainerPlan;

use crate::error::Result;

/// Rows of bytes of a shard, copied dense into a piece's staged input: row `r` is the
/// `width` bytes at `src + r * pitch` of the shard, and lands at `dst + r * width` of the
/// input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedCopy {
    /// Byte offset of the first row in the shard.
    pub src: u64,
    /// Bytes between the starts of two rows in the shard (at least `width` when `rows > 1`).
    pub pitch: u64,
    /// Bytes per row.
    pub width: u64,
    /// Rows.
    pub rows: u64,
    /// Byte offset of the first row in the staged input.
    pub dst: u64,
}

impl StridedCopy {
    /// Bytes of the shard the copy reads up to (exclusive end).
    pub fn src_end(&self) -> u64 {
        if self.rows == 0 {
            self.src
        } else {
            self.src + (self.rows - 1) * self.pitch + self.width
        }
    }

    /// Bytes of the input the copy writes up to (exclusive end).
    pub fn dst_end(&self) -> u64 {
        self.dst + self.rows * self.width
    }
}

/// The box `start`/`extent` of a dense row-major tensor of shape `dims` (elements of
/// `elem` bytes), as strided copies into a dense row-major buffer starting at `out_at`: the
/// bytes `gather_box` would produce, in as few copies as the box allows (one per index of the
/// dims before the outermost one that varies, each covering that dim as its rows).
pub fn strided_copies(
    dims: &[usize],
    elem: usize,
    start: &[usize],
    extent: &[usize],
    out_at: u64,
) -> Vec<StridedCopy> {
    let n = dims.len();
    let elem = elem as u64;
    if n == 0 {
        return vec![StridedCopy {
            src: 0,
            pitch: elem,
            width: elem,
            rows: 1,
            dst: out_at,
        }];
    }
    if extent.contains(&0) {
        return Vec::new();
    }
    // Element strides of the tensor.
    let mut stride = vec![1u64; n];
    for d in (0..n - 1).rev() {
        stride[d] = stride[d + 1] * dims[d + 1] as u64;
    }
    // k: every dim after it is whole, so one index of the dims up to k is one contiguous run.
    let mut k = n - 1;
    while k > 0 && start[k] == 0 && extent[k] == dims[k] {
        k -= 1;
    }
    let run = extent[k] as u64 * stride[k] * elem;
    // The rows' dim: the innermost dim before k with more than one index (dims between it and
    // k have one index, a fixed offset).
    let row_dim = (0..k).rev().find(|&d| extent[d] > 1);
    let (rows, pitch) = match row_dim {
        Some(d) => (extent[d] as u64, stride[d] * elem),
        None => (1, run),
    };
    let outer_dims = row_dim.unwrap_or(0);
    let fixed: u64 = (0..n)
        .map(|d| start[d] as u64 * stride[d] * elem)
        .sum::<u64>();
    let outer: u64 = extent[..outer_dims].iter().map(|&e| e as u64).product();
    let mut copies = Vec::with_capacity(outer as usize);
    let mut idx = vec![0usize; outer_dims];
    let mut dst = out_at;
    for _ in 0..outer {
        let off: u64 = idx
            .iter()
            .enumerate()
            .map(|(d, &i)| i as u64 * stride[d] * elem)
            .sum();
        copies.push(StridedCopy {
            src: fixed + off,
            pitch,
            width: run,
            rows,
            dst,
        });
        dst += rows * run;
        // Next outer index, row-major.
        for d in (0..outer_dims).rev() {
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    copies
}

/// What preparing one piece computes (the same description for the host and a device).
#[derive(Debug, Clone, PartialEq)]
pub struct PrepareJob {
    /// Bytes of the piece's dense input.
    pub input: u64,
    /// The transform and where its output goes.
    pub kind: PrepareKind,
}

/// A piece's transform, with its output ranges in the lease.
#[derive(Debug, Clone, PartialEq)]
pub enum PrepareKind {
    /// Nothing to compute: the staged input is the output.
    Copy,
    /// Element-wise cast of the whole input into `values` (a range of the lease).
    Cast {
        /// Input dtype.
        from: DType,
        /// Output dtype.
        to: DType,
        /// Where the values go in the lease.
        values: Range<u64>,
    },
    /// fp8 e4m3 block quantisation of block strips of one or more matrices.
    Fp8 {
        /// Input dtype.
        from: DType,
        /// Whose arithmetic the block scales follow.
        recipe: Fp8Recipe,
        /// Columns of every matrix.
        cols: u64,
        /// Per matrix the piece touches, its strips.
        strips: Vec<Fp8Strips>,
    },
}

/// Consecutive 128-row block strips of one matrix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fp8Strips {
    /// Rows of the whole matrix.
    pub matrix_rows: u64,
    /// The strips, as block-row indices of the matrix.
    pub blocks: Range<u64>,
    /// Their input bytes, in the piece's dense input.
    pub input: Range<u64>,
    /// Their fp8 values, in the lease.
    pub values: Range<u64>,
    /// Their f32 scales, in the lease.
    pub scales: Range<u64>,
}

impl Fp8Strips {
    /// Rows these strips cover (the last strip of a matrix may be short).
    pub fn rows(&self) -> u64 {
        let block = weightsync_schedules::table::FP8_BLOCK as u64;
        (self.blocks.end * block).min(self.matrix_rows) - self.blocks.start * block
    }
}

impl PrepareJob {
    /// The range of the lease the job writes (values, and scales after them), `None` for a copy.
    pub fn output(&self) -> Option<Range<u64>> {
        match &self.kind {
            PrepareKind::Copy => None,
            PrepareKind::Cast { values, .. } => Some(values.clone()),
            PrepareKind::Fp8 { strips, .. } => {
                let start = strips.iter().map(|s| s.values.start).min()?;
                let end = strips.iter().map(|s| s.scales.end).max()?;
                Some(start..end)
            }
        }
    }
}

/// The fill and prepare steps of a source the host cannot read (see the module docs). Built
/// once per trainer by [`super::view::SourceView::device_stages`], bound to its staging arena.
///
/// Both steps return only when every byte they were asked for is in the host lease (the
/// device work they queue has completed): the pipeline then treats the lease exactly as after
/// the host steps (checksums, writes).
pub trait DeviceStages: Send + Sync + std::fmt::Debug {
    /// Copies `copies` of shard `shard` into `input`, the piece's staged input (a range of
    /// the staging arena).
    fn fill(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        copies: &[StridedCopy],
        input: &mut [u8],
    ) -> Result<()>;

    /// Prepares a piece whose input is the `job.input` bytes at `input_at` of shard `shard`
    /// (one contiguous range), writing the job's output ranges of `lease`, the piece's whole
    /// lease, which starts `lease_offset` bytes into the staging arena.
    fn prepare(
        &self,
        plan: &TrainerPlan,
        shard: u32,
        input_at: u64,
        job: &PrepareJob,
        lease_offset: u64,
        lease: &mut [u8],
    ) -> Result<()>;
}

#[cfg(test)]
pub(crate) mod host_emulation {
    //! Runs the hooks' descriptions on host memory: the stand-in for a device in tests without
    //! a GPU (the same descriptions a device source executes with DMA and kernels).

    use super::*;
    use crate::prepare::{Fp8Shape, Threads, cast, quantise_fp8_block_rows_pitched};

    /// Executes `copies` from `shard` into `input`.
    pub(crate) fn run_copies(copies: &[StridedCopy], shard: &[u8], input: &mut [u8]) {
        for c in copies {
            for r in 0..c.rows {
                let s = (c.src + r * c.pitch) as usize;
                let d = (c.dst + r * c.width) as usize;
                input[d..d + c.width as usize].copy_from_slice(&shard[s..s + c.width as usize]);
            }
        }
    }

    /// Executes `job` on `input` into `lease` the way a device does: each fp8 strip range as a
    /// smaller whole tensor (the device kernel's view), not the host's block-row entry point.
    pub(crate) fn run_job(job: &PrepareJob, input: &[u8], lease: &mut [u8]) {
        match &job.kind {
            PrepareKind::Copy => {}
            PrepareKind::Cast { from, to, values } => cast(
                input,
                *from,
                &mut lease[values.start as usize..values.end as usize],
                *to,
                Threads::One,
            )
            .unwrap(),
            PrepareKind::Fp8 {
                from,
                recipe,
                cols,
                strips,
            } => {
                for s in strips {
                    let shape = Fp8Shape {
                        rows: s.rows() as usize,
                        cols: *cols as usize,
                    };
                    let mut values = vec![0u8; (s.values.end - s.values.start) as usize];
                    let mut scales = vec![0u8; (s.scales.end - s.scales.start) as usize];
                    quantise_fp8_block_rows_pitched(
                        &input[s.input.start as usize..s.input.end as usize],
                        *from,
                        shape,
                        0..shape.rows.div_ceil(128),
                        shape.cols,
                        *recipe,
                        &mut values,
                        &mut scales,
                        Threads::One,
                    )
                    .unwrap();
                    lease[s.values.start as usize..s.values.end as usize].copy_from_slice(&values);
                    lease[s.scales.start as usize..s.scales.end as usize].copy_from_slice(&scales);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::host_emulation::run_copies;
    use super::*;
    use crate::prepare::{Threads, gather_box};
    use rand::{Rng, SeedableRng};

    /// Strided copies produce exactly `gather_box`'s bytes, for random boxes of random shapes
    /// of 0 to 4 dims, in few copies.
    #[test]
    fn strided_copies_equal_gather_box() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        for case in 0..3000 {
            let n = rng.random_range(0..=4usize);
            let dims: Vec<usize> = (0..n).map(|_| rng.random_range(1..=7)).collect();
            let elem = [1usize, 2, 4][rng.random_range(0..3)];
            let mut start = Vec::new();
            let mut extent = Vec::new();
            for &d in &dims {
                let s = rng.random_range(0..d);
                // Whole dims often, so that the contiguous merges are exercised.
                let e = if rng.random_bool(0.4) && s == 0 {
                    d
                } else {
                    rng.random_range(1..=d - s)
                };
                start.push(s);
                extent.push(e);
            }
            let numel: usize = dims.iter().product();
            let tensor: Vec<u8> = (0..numel * elem).map(|_| rng.random()).collect();
            let out_len = extent.iter().product::<usize>() * elem;
            let at = rng.random_range(0..5u64);
            let mut want = vec![0u8; out_len];
            gather_box(
                &tensor,
                elem,
                &dims,
                &start,
                &extent,
                &mut want,
                Threads::One,
            )
            .unwrap();
            let copies = strided_copies(&dims, elem, &start, &extent, at);
            let mut got = vec![0xa5u8; out_len + at as usize];
            run_copies(&copies, &tensor, &mut got);
            assert_eq!(
                &got[at as usize..],
                &want[..],
                "case {case}: {dims:?} {start:?} {extent:?}"
            );
            for c in &copies {
                assert!(c.src_end() <= tensor.len() as u64, "{c:?}");
                assert!(c.rows <= 1 || c.pitch >= c.width, "{c:?}");
            }
            assert_eq!(
                copies.iter().map(|c| c.rows * c.width).sum::<u64>(),
                out_len as u64
            );
            // One copy per index of the dims outside the rows' dim and the contiguous run.
            if n >= 1 {
                let whole_tail = (0..n)
                    .rev()
                    .take_while(|&d| start[d] == 0 && extent[d] == dims[d])
                    .count();
                if whole_tail == n {
                    assert_eq!(copies.len(), 1);
                }
            }
        }
    }

    #[test]
    fn a_column_band_of_a_matrix_is_one_copy_of_rows() {
        // Columns 2..5 of rows 1..4 of an [6, 8] f32 matrix.
        let copies = strided_copies(&[6, 8], 4, &[1, 2], &[3, 3], 0);
        assert_eq!(
            copies,
            vec![StridedCopy {
                src: (8 + 2) * 4,
                pitch: 32,
                width: 12,
                rows: 3,
                dst: 0
            }]
        );
        // Whole rows of a 3-d tensor: experts 1..3, one contiguous run each... merged as rows.
        let copies = strided_copies(&[4, 5, 6], 2, &[1, 0, 0], &[2, 5, 6], 7);
        assert_eq!(copies.len(), 1);
        assert_eq!(copies[0].rows, 1);
        assert_eq!(copies[0].width, 2 * 5 * 6 * 2);
        // Rows 1..3 of every expert: one copy of 4 rows at the expert pitch.
        let copies = strided_copies(&[4, 5, 6], 2, &[0, 1, 0], &[4, 2, 6], 0);
        assert_eq!(copies.len(), 1);
        assert_eq!((copies[0].rows, copies[0].pitch), (4, 60));
    }
}
