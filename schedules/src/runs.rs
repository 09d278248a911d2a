//! Contiguous runs: how a dense row-major box of prepared bytes lands in a row-major tensor with
//! the fewest writes.
//!
//! A box whose trailing dimensions span the whole tensor is one run; otherwise one run per
//! index of the leading dimensions that do not. Runs are maximal: two consecutive runs are
//! never contiguous on both sides (they would have been one), which is what keeps the number of
//! work requests, and so the NIC's message rate, out of the way.

use crate::table::{MAX_DIMS, Shape, TensorBox};

/// Where box `bx` of a row-major tensor of `shape` starts (in elements), the first dimension
/// `k` such that every dimension after it spans the whole tensor, and the run length in elements
/// (the product of the box's extents from `k` on). `None` for an empty box.
#[inline]
fn split(bx: &TensorBox, shape: &Shape) -> Option<(u64, [u64; MAX_DIMS], usize, u64)> {
    // Every index below is then provably in bounds.
    let nd = (bx.ndim as usize).min(MAX_DIMS);
    for d in 0..nd {
        if bx.len[d] == 0 {
            return None;
        }
    }
    if nd == 0 {
        return Some((0, [0; MAX_DIMS], 0, 1));
    }
    let mut strides = [0u64; MAX_DIMS];
    let (mut acc, mut base) = (1u64, 0u64);
    for d in (0..nd).rev() {
        strides[d] = acc;
        base += bx.start[d] as u64 * acc;
        acc *= shape.dims[d] as u64;
    }
    let mut k = nd - 1;
    let mut chunk = bx.len[k] as u64;
    while k > 0 && bx.len[k] == shape.dims[k] && bx.start[k] == 0 {
        k -= 1;
        chunk *= bx.len[k] as u64;
    }
    Some((base, strides, k, chunk))
}

/// Number of runs [`for_each_run`] produces.
#[inline]
pub fn count_runs(bx: &TensorBox, shape: &Shape) -> u64 {
    let nd = (bx.ndim as usize).min(MAX_DIMS);
    // Plain indexed loops: this runs for every region and target of a large model.
    let mut runs = 1u64;
    for d in 0..nd {
        if bx.len[d] == 0 {
            return 0;
        }
    }
    let mut k = nd.saturating_sub(1);
    while k > 0 && bx.len[k] == shape.dims[k] && bx.start[k] == 0 {
        k -= 1;
    }
    for d in 0..k {
        runs *= bx.len[d] as u64;
    }
    runs
}

/// Calls `f(src_offset, dst_offset, len)` (bytes) for each run of box `bx` (in `shape`'s
/// coordinates, same number of dims) when the source is `bx` dense row-major and the
/// destination is the whole tensor `shape` dense row-major; elements are `elem` bytes.
///
/// The planner calls this for every task and target (millions of times for a large model), and
/// most boxes are a single run, so that case is straight-line code.
#[inline]
pub fn for_each_run(bx: &TensorBox, shape: &Shape, elem: u64, mut f: impl FnMut(u64, u64, u64)) {
    let Some((base, strides, k, chunk)) = split(bx, shape) else {
        return;
    };
    let len = chunk * elem;
    if k == 0 {
        f(0, base * elem, len);
        return;
    }
    let mut idx = [0u32; MAX_DIMS];
    let mut src = 0u64;
    loop {
        let rel: u64 = (0..k).map(|j| idx[j] as u64 * strides[j]).sum();
        f(src, (base + rel) * elem, len);
        src += len;
        // Advance the odometer over dims 0..k.
        let mut j = k;
        loop {
            if j == 0 {
                return;
            }
            j -= 1;
            idx[j] += 1;
            if idx[j] < bx.len[j] {
                break;
            }
            idx[j] = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(bx: TensorBox, shape: Shape) -> Vec<(u64, u64, u64)> {
        let mut v = vec![];
        for_each_run(&bx, &shape, 2, |a, b, c| v.push((a, b, c)));
        assert_eq!(v.len() as u64, count_runs(&bx, &shape));
        v
    }

    #[test]
    fn full_rows_are_one_run_partial_rows_are_many() {
        let s = Shape::new(&[4, 8]);
        assert_eq!(runs(TensorBox::new(&[1, 0], &[2, 8]), s), vec![(0, 16, 32)]);
        assert_eq!(
            runs(TensorBox::new(&[1, 2], &[2, 3]), s),
            vec![(0, 20, 6), (6, 36, 6)]
        );
        let s3 = Shape::new(&[3, 4, 8]);
        // One expert, rows 2..4 of it, whole rows: one run.
        assert_eq!(
            runs(TensorBox::new(&[1, 2, 0], &[1, 2, 8]), s3),
            vec![(0, (32 + 16) * 2, 32)]
        );
        // Two experts, rows 0..2 each: two runs.
        assert_eq!(runs(TensorBox::new(&[0, 0, 0], &[2, 2, 8]), s3).len(), 2);
        // Whole experts: one run.
        assert_eq!(runs(TensorBox::new(&[1, 0, 0], &[2, 4, 8]), s3).len(), 1);
        assert_eq!(
            runs(TensorBox::new(&[3], &[5]), Shape::new(&[10])),
            vec![(0, 6, 10)]
        );
    }

    /// Every box of every small shape: the runs tile the box's bytes in order, land where the
    /// row-major formula says, are maximal, and `count_runs` counts them.
    #[test]
    fn runs_match_the_row_major_formula_for_every_small_box() {
        let mut shapes = vec![Shape::new(&[])];
        for a in 1..=3u32 {
            shapes.push(Shape::new(&[a]));
            for b in 1..=3u32 {
                shapes.push(Shape::new(&[a, b]));
                for c in 1..=3u32 {
                    shapes.push(Shape::new(&[a, b, c]));
                }
            }
        }
        let mut boxes_checked = 0;
        for shape in shapes {
            let nd = shape.ndim as usize;
            // Every (start, len) per dim, len >= 1, as an odometer over dims.
            let ranges: Vec<Vec<(u32, u32)>> = (0..nd)
                .map(|d| {
                    let n = shape.dims[d];
                    (0..n)
                        .flat_map(|s| (1..=n - s).map(move |l| (s, l)))
                        .collect()
                })
                .collect();
            let total: usize = ranges.iter().map(Vec::len).product();
            for mut k in 0..total {
                let mut start = vec![0; nd];
                let mut len = vec![0; nd];
                for d in (0..nd).rev() {
                    let (s, l) = ranges[d][k % ranges[d].len()];
                    k /= ranges[d].len();
                    start[d] = s;
                    len[d] = l;
                }
                let bx = TensorBox::new(&start, &len);
                let got = runs(bx, shape);
                // Element by element: source index i (row-major over the box) lands at the
                // row-major index of its coordinates in the tensor.
                let mut expect = Vec::new();
                for i in 0..bx.numel() {
                    let mut rest = i;
                    let mut at = 0u64;
                    let strides = shape.strides();
                    for d in (0..nd).rev() {
                        let c = rest % len[d] as u64;
                        rest /= len[d] as u64;
                        at += (start[d] as u64 + c) * strides[d];
                    }
                    expect.push(at);
                }
                let mut src = 0;
                for &(so, dst, l) in &got {
                    assert_eq!(so, src * 2, "runs out of order for {bx} in {shape}");
                    for j in 0..l / 2 {
                        assert_eq!(dst / 2 + j, expect[(src + j) as usize], "{bx} in {shape}");
                    }
                    src += l / 2;
                }
                assert_eq!(src, bx.numel(), "runs do not cover {bx} in {shape}");
                for w in got.windows(2) {
                    assert_ne!(
                        w[0].1 + w[0].2,
                        w[1].1,
                        "runs of {bx} in {shape} not maximal"
                    );
                }
                boxes_checked += 1;
            }
        }
        assert!(boxes_checked > 1000, "{boxes_checked}");
    }
}
