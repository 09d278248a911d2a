//! A host kernel run pass after pass, each pass on the next of several copies of its window:
//! how the calibration times copies, casts and fp8 quantisation, and what it loops beside the
//! fabric ([`super::overlap`]).
//!
//! Why windows: a sync's kernels read and write memory far past the last-level cache, so the
//! rate that predicts them is the rate from memory, not from a cache that a small buffer
//! timed over and over stays in ([`super::cold`]). Every window holds the same input, so each
//! pass does the same work.

use rayon::prelude::*;
use weightsync_common::DType;
use weightsync_worker::{Fp8Shape, Threads, cast, quantise_fp8};

use super::super::E2eError;
use super::cold;

/// What a pass does to its window.
#[derive(Debug, Clone)]
enum Kind {
    /// A copy of the window, 1 MiB per job over the pool.
    Copy,
    /// f32 -> bf16 over the window.
    Cast,
    /// bf16 -> fp8 block quantisation of these shapes, with their element and scale offsets
    /// within the window.
    Fp8(Vec<(Fp8Shape, usize, usize)>),
}

/// A kernel over `windows` copies of its input window (see the module docs).
pub(crate) struct KernelLoop {
    kind: Kind,
    src: Vec<u8>,
    dst: Vec<u8>,
    scales: Vec<u8>,
    /// Input and output bytes of one window.
    in_len: usize,
    out_len: usize,
    windows: usize,
    next: usize,
}

impl std::fmt::Debug for KernelLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelLoop")
            .field("kind", &self.kind)
            .field("window_bytes", &self.in_len)
            .field("windows", &self.windows)
            .finish()
    }
}

/// `window` repeated `windows` times (at least once).
fn repeated(window: &[u8], windows: usize) -> Vec<u8> {
    let mut v = vec![0u8; window.len() * windows.max(1)];
    v.par_chunks_mut(window.len().max(1))
        .for_each(|w| w.copy_from_slice(window));
    v
}

/// `len` zero bytes with every page already faulted in: a kernel's first pass on a window
/// would otherwise time the kernel's page faults, not its copy.
fn touched(len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    v.par_chunks_mut(1 << 20).for_each(|c| c.fill(0));
    v
}

impl KernelLoop {
    fn new(kind: Kind, window: Vec<u8>, out_len: usize) -> KernelLoop {
        KernelLoop {
            kind,
            in_len: window.len(),
            src: window,
            dst: touched(out_len),
            scales: Vec::new(),
            out_len,
            windows: 1,
            next: 0,
        }
    }

    /// A copy of `window` (one window; see [`KernelLoop::past_cache`]).
    pub(crate) fn copy(window: Vec<u8>) -> KernelLoop {
        let out = window.len();
        KernelLoop::new(Kind::Copy, window, out)
    }

    /// f32 -> bf16 of `window` (f32; a ragged tail is dropped).
    pub(crate) fn cast(mut window: Vec<u8>) -> KernelLoop {
        window.truncate(window.len() / 4 * 4);
        let out = window.len() / 2;
        KernelLoop::new(Kind::Cast, window, out)
    }

    /// fp8 quantisation of the `shapes` that fit in `window` (bf16), one after another. Each
    /// shape reads its own part of the input and writes its own part of the output, as a
    /// trainer's tasks do: reading one cache-hot prefix for every shape would measure the
    /// cache, not the kernel on a layer's worth of tensors.
    pub(crate) fn fp8(window: Vec<u8>, shapes: &[Fp8Shape]) -> KernelLoop {
        let mut fp8 = Vec::new();
        let (mut e, mut s) = (0usize, 0usize);
        for sh in shapes {
            let elems = sh.rows * sh.cols;
            if (e + elems) * 2 > window.len() {
                break;
            }
            fp8.push((*sh, e, s));
            e += elems;
            s += sh.row_blocks() * sh.col_blocks() * 4;
        }
        let mut k = KernelLoop::new(Kind::Fp8(fp8), window, e);
        // Scales are a few bytes per block and stay in cache in a sync too: one set.
        k.scales = vec![0u8; s];
        k
    }

    /// The same kernel over `windows` copies of its first window.
    pub(crate) fn spread(mut self, windows: usize) -> KernelLoop {
        let windows = windows.max(1);
        self.src = repeated(&self.src[..self.in_len], windows);
        self.dst = touched(self.out_len * windows);
        self.windows = windows;
        self.next = 0;
        self
    }

    /// Spread over as many windows as it takes for the others' traffic to evict a cache of
    /// `cache` bytes twice before a window comes round again ([`cold::windows`]).
    pub(crate) fn past_cache(self, cache: Option<u64>) -> KernelLoop {
        let windows = cold::windows(self.pass_traffic(), cache);
        self.spread(windows)
    }

    /// Windows the loop cycles through.
    pub(crate) fn windows(&self) -> usize {
        self.windows
    }

    /// Input bytes of one pass.
    pub(crate) fn pass_bytes(&self) -> u64 {
        match self.kind {
            Kind::Copy | Kind::Cast => self.in_len as u64,
            Kind::Fp8(_) => self.out_len as u64 * 2,
        }
    }

    /// Bytes one pass reads and writes (what it pushes through the caches).
    pub(crate) fn pass_traffic(&self) -> u64 {
        self.pass_bytes() + self.out_len as u64
    }

    /// One pass on the next window, over the pool (`Threads::All`) or one thread.
    pub(crate) fn pass(&mut self, threads: Threads) -> Result<(), E2eError> {
        let w = self.next;
        self.next = (self.next + 1) % self.windows;
        let src = &self.src[w * self.in_len..(w + 1) * self.in_len];
        let dst = &mut self.dst[w * self.out_len..(w + 1) * self.out_len];
        match &self.kind {
            Kind::Copy => match threads {
                Threads::One => dst.copy_from_slice(src),
                _ => dst
                    .par_chunks_mut(1 << 20)
                    .zip(src.par_chunks(1 << 20))
                    .for_each(|(d, s)| d.copy_from_slice(s)),
            },
            Kind::Cast => cast(src, DType::F32, dst, DType::BF16, threads)
                .map_err(|e| E2eError::Setup(format!("measuring the cast: {e}")))?,
            Kind::Fp8(shapes) => {
                for &(shape, e0, s0) in shapes {
                    let e = shape.rows * shape.cols;
                    let sb = shape.row_blocks() * shape.col_blocks() * 4;
                    quantise_fp8(
                        &src[e0 * 2..(e0 + e) * 2],
                        DType::BF16,
                        shape,
                        &mut dst[e0..e0 + e],
                        &mut self.scales[s0..s0 + sb],
                        threads,
                    )
                    .map_err(|x| E2eError::Setup(format!("quantising {shape:?}: {x}")))?;
                }
            }
        }
        Ok(())
    }

    /// Output of window `w`.
    #[cfg(test)]
    fn output(&self, w: usize) -> &[u8] {
        &self.dst[w * self.out_len..(w + 1) * self.out_len]
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::loopback::weights;
    use super::*;

    #[test]
    fn the_loop_quantises_the_shapes_that_fit_window_after_window() {
        let shapes = [
            Fp8Shape {
                rows: 256,
                cols: 512,
            },
            Fp8Shape {
                rows: 128,
                cols: 256,
            },
            Fp8Shape {
                rows: 4096,
                cols: 4096,
            },
        ];
        // 1 MiB of input: the first two shapes fit (256 KiB + 64 KiB of bf16), the third not.
        let input = weights(1 << 20, 11);
        let mut k = KernelLoop::fp8(input.clone(), &shapes).spread(3);
        assert_eq!(k.windows(), 3);
        assert_eq!(k.pass_bytes(), (256 * 512 + 128 * 256) * 2);
        assert_eq!(k.pass_traffic(), (256 * 512 + 128 * 256) * 3);
        k.pass(Threads::All).unwrap();
        // Only the first window was written so far.
        assert!(k.output(1).iter().all(|&b| b == 0));
        // What one pass wrote is what quantising each shape on its own gives.
        let scale_bytes = shapes[1].row_blocks() * shapes[1].col_blocks() * 4;
        let (mut values, mut scales) = (vec![0u8; 128 * 256], vec![0u8; scale_bytes]);
        let at = 256 * 512;
        quantise_fp8(
            &input[at * 2..(at + 128 * 256) * 2],
            DType::BF16,
            shapes[1],
            &mut values,
            &mut scales,
            Threads::One,
        )
        .unwrap();
        assert_eq!(k.output(0)[at..at + 128 * 256], values[..]);
        let first_scales = shapes[0].row_blocks() * shapes[0].col_blocks() * 4;
        assert_eq!(
            k.scales[first_scales..first_scales + scale_bytes],
            scales[..]
        );
        // The next passes take the other windows in turn, each the same work; then round again.
        k.pass(Threads::One).unwrap();
        k.pass(Threads::All).unwrap();
        assert_eq!(k.output(1), k.output(0));
        assert_eq!(k.output(2), k.output(0));
        assert_eq!(k.next, 0);
    }

    #[test]
    fn copies_and_casts_cycle_through_their_windows() {
        let input = weights(1 << 20, 11);
        let c = KernelLoop::copy(input.clone());
        assert_eq!(c.windows(), 1);
        // A 1 MiB cache: one other window's 2 MiB of traffic evicts it twice over.
        let mut c = c.past_cache(Some(1 << 20));
        assert_eq!(c.windows(), 2);
        assert_eq!((c.pass_bytes(), c.pass_traffic()), (1 << 20, 2 << 20));
        c.pass(Threads::One).unwrap();
        assert_eq!(c.output(0), &input[..]);
        assert!(c.output(1).iter().all(|&b| b == 0));
        c.pass(Threads::All).unwrap();
        assert_eq!(c.output(1), &input[..]);

        // f32 input (whole values only: a ragged tail is dropped), bf16 out.
        let f32_in: Vec<u8> = (0..1000u32)
            .flat_map(|i| (i as f32 * 0.25).to_le_bytes())
            .chain([7u8, 7])
            .collect();
        let mut k = KernelLoop::cast(f32_in.clone()).spread(2);
        assert_eq!((k.pass_bytes(), k.pass_traffic()), (4000, 6000));
        k.pass(Threads::All).unwrap();
        let mut expect = vec![0u8; 2000];
        cast(
            &f32_in[..4000],
            DType::F32,
            &mut expect,
            DType::BF16,
            Threads::One,
        )
        .unwrap();
        assert_eq!(k.output(0), &expect[..]);
        // One window when asked for none, or with no cache known.
        assert_eq!(KernelLoop::copy(input.clone()).spread(0).windows(), 1);
        assert_eq!(KernelLoop::copy(input).past_cache(None).windows(), 1);
    }
}
