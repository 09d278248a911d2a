//! Strided N-d sub-box gather: copy a box out of a row-major tensor into a contiguous output.
//!
//! This is how a destination shard (a tensor-parallel slice along any dim) is cut out of a
//! training shard. The box is reduced to "rows" of contiguous bytes: trailing dims that the box
//! spans fully merge into one run, so a dim-0 slice is a single memcpy and a dim-1 slice of a
//! matrix is one memcpy per row.

use rayon::prelude::*;

use super::{PrepareError, Threads, expect_len};

/// Output bytes per rayon task.
const PAR_CHUNK_BYTES: usize = 256 << 10;

/// Copies the box `start[d] .. start[d] + extent[d]` of a row-major tensor of `shape`
/// (elements of `elem_size` bytes, held in `src`) into `out`, row-major and contiguous.
///
/// `src` must be exactly the tensor (`prod(shape) * elem_size` bytes) and `out` exactly the box.
pub fn gather_box(
    src: &[u8],
    elem_size: usize,
    shape: &[usize],
    start: &[usize],
    extent: &[usize],
    out: &mut [u8],
    threads: Threads,
) -> Result<(), PrepareError> {
    if shape.len() != start.len() || shape.len() != extent.len() {
        return Err(PrepareError::Shape(format!(
            "box rank mismatch: shape {shape:?}, start {start:?}, extent {extent:?}"
        )));
    }
    if elem_size == 0 {
        return Err(PrepareError::Shape("element size 0".into()));
    }
    for d in 0..shape.len() {
        if start[d]
            .checked_add(extent[d])
            .is_none_or(|end| end > shape[d])
        {
            return Err(PrepareError::Shape(format!(
                "box dim {d}: {}..{}+{} exceeds extent {}",
                start[d], start[d], extent[d], shape[d]
            )));
        }
    }
    let numel = |dims: &[usize]| dims.iter().product::<usize>();
    expect_len("gather source", numel(shape) * elem_size, src.len())?;
    expect_len("gather output", numel(extent) * elem_size, out.len())?;
    if out.is_empty() {
        return Ok(());
    }

    // Innermost dim `k` such that every dim after it is spanned fully: runs are contiguous
    // from there on.
    let rank = shape.len();
    let mut k = rank.saturating_sub(1);
    while k > 0 && extent[k] == shape[k] {
        k -= 1;
    }
    let inner = if rank == 0 { 1 } else { numel(&shape[k + 1..]) };
    let run = if rank == 0 { 1 } else { extent[k] * inner } * elem_size;
    // Source byte strides of the outer dims 0..=k.
    let mut strides = vec![0usize; rank];
    let mut acc = elem_size;
    for d in (0..rank).rev() {
        strides[d] = acc;
        acc *= shape[d];
    }
    let outer_dims: Vec<usize> = extent[..k.min(rank)].to_vec();
    let base: usize = (0..rank).map(|d| start[d] * strides[d]).sum();
    // Source offset of the r-th run: unravel r over the outer dims.
    let src_offset = |mut r: usize| -> usize {
        let mut off = base;
        for d in (0..outer_dims.len()).rev() {
            off += (r % outer_dims[d]) * strides[d];
            r /= outer_dims[d];
        }
        off
    };
    let copy_runs = |first_run: usize, out: &mut [u8]| {
        for (i, dst) in out.chunks_exact_mut(run).enumerate() {
            let off = src_offset(first_run + i);
            dst.copy_from_slice(&src[off..off + run]);
        }
    };
    match threads {
        Threads::One => copy_runs(0, out),
        Threads::All => {
            let runs_per_task = (PAR_CHUNK_BYTES / run).max(1);
            out.par_chunks_mut(runs_per_task * run)
                .enumerate()
                .for_each(|(t, chunk)| copy_runs(t * runs_per_task, chunk));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Element-by-element reference: walks every index of the box.
    fn reference(
        src: &[u8],
        es: usize,
        shape: &[usize],
        start: &[usize],
        extent: &[usize],
    ) -> Vec<u8> {
        let total: usize = extent.iter().product();
        let mut out = Vec::with_capacity(total * es);
        for flat in 0..total {
            let mut rem = flat;
            let mut idx = vec![0; shape.len()];
            for d in (0..shape.len()).rev() {
                idx[d] = start[d] + rem % extent[d];
                rem /= extent[d];
            }
            let mut off = 0;
            for d in 0..shape.len() {
                off = off * shape[d] + idx[d];
            }
            out.extend_from_slice(&src[off * es..(off + 1) * es]);
        }
        out
    }

    fn case() -> impl Strategy<Value = (Vec<usize>, Vec<usize>, Vec<usize>, usize)> {
        (1usize..=4, prop::sample::select(vec![1usize, 2, 4]))
            .prop_flat_map(|(rank, es)| (prop::collection::vec(1usize..7, rank), Just(es)))
            .prop_flat_map(|(shape, es)| {
                let boxes: Vec<_> = shape
                    .iter()
                    .map(|&n| (0..n).prop_flat_map(move |s| (Just(s), 0..=n - s)))
                    .collect();
                (Just(shape), boxes, Just(es))
            })
            .prop_map(|(shape, boxes, es)| {
                let (start, extent) = boxes.into_iter().unzip();
                (shape, start, extent, es)
            })
    }

    proptest! {
        #[test]
        fn matches_elementwise_reference((shape, start, extent, es) in case()) {
            let n: usize = shape.iter().product::<usize>() * es;
            let src: Vec<u8> = (0..n).map(|i| (i * 7 + 3) as u8).collect();
            let want = reference(&src, es, &shape, &start, &extent);
            for threads in [Threads::One, Threads::All] {
                let mut out = vec![0u8; want.len()];
                gather_box(&src, es, &shape, &start, &extent, &mut out, threads).unwrap();
                prop_assert_eq!(&out, &want);
            }
        }
    }

    #[test]
    fn large_dim1_slice_uses_many_tasks_and_matches() {
        let shape = [1024, 512];
        let src: Vec<u8> = (0..1024 * 512 * 2).map(|i| (i % 251) as u8).collect();
        let want = reference(&src, 2, &shape, &[0, 256], &[1024, 256]);
        let mut out = vec![0u8; want.len()];
        gather_box(
            &src,
            2,
            &shape,
            &[0, 256],
            &[1024, 256],
            &mut out,
            Threads::All,
        )
        .unwrap();
        assert_eq!(out, want);
    }

    #[test]
    fn refuses_out_of_range_box_and_wrong_lengths() {
        let src = vec![0u8; 4 * 6 * 2];
        let mut out = vec![0u8; 4 * 3 * 2];
        let err =
            gather_box(&src, 2, &[4, 6], &[0, 4], &[4, 3], &mut out, Threads::One).unwrap_err();
        assert!(err.to_string().contains("dim 1"), "{err}");
        let err = gather_box(
            &src[..40],
            2,
            &[4, 6],
            &[0, 3],
            &[4, 3],
            &mut out,
            Threads::One,
        )
        .unwrap_err();
        assert_eq!(
            err,
            PrepareError::Length {
                what: "gather source",
                expected: 48,
                actual: 40
            }
        );
        let err = gather_box(&src, 2, &[4, 6], &[0, 0], &[4], &mut out, Threads::One).unwrap_err();
        assert!(err.to_string().contains("rank"), "{err}");
    }
}
