//! How much of the host a sync's concurrent stages get, measured into the model.
//!
//! Why: the simulator's host CPU is a fluid resource that running flows share without loss:
//! a second of fabric work and a second of quantising take two seconds of host together. The
//! real host runs the fabric's lane threads, the pool's kernels and the pipelines' threads on
//! the same cores, and loses part of it to their interleaving (context switches, wake-ups that
//! wait for a core, caches the other stage evicted). Measured alone, each rate leaves that out,
//! and a host-bound sync then runs longer than its prediction.
//!
//! How, without the syncs being checked: the configuration's fabric pass (the `bench e2e`
//! fabric limit, the same one the fabric rate comes from) runs while the pool runs the
//! configuration's own kernel in a loop: fp8 quantisation on its fp8 task shapes, or a copy
//! over the pool when it has none (its staging copies). The host work the two did, each
//! charged at the rate it was measured at alone, over the wall time they took together, is
//! the share of the host concurrent stages get ([`Overlap::efficiency`], 1 for a lossless
//! host). The model's host costs per byte are divided by it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;
use weightsync_common::DType;
use weightsync_worker::{quantise_fp8, Fp8Shape, Threads};

use super::super::fabric_limit::FabricLimit;
use super::super::E2eError;

/// One measurement of the host shared by the fabric and a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Overlap {
    /// Wall seconds the two took together.
    pub wall_s: f64,
    /// Host seconds the fabric's bytes take at its rate alone.
    pub fabric_host_s: f64,
    /// Host seconds the kernel's bytes take at its rate alone.
    pub kernel_host_s: f64,
    /// `(fabric_host_s + kernel_host_s) / wall_s`, at most 1.
    pub efficiency: f64,
}

/// A kernel over the pool, pass after pass on the same buffers: how the calibration times fp8
/// quantisation and the copy over every core, and what it loops beside the fabric.
pub(crate) struct KernelLoop {
    src: Vec<u8>,
    dst: Vec<u8>,
    scales: Vec<u8>,
    /// fp8 shapes with their element and scale offsets (a copy has none).
    fp8: Vec<(Fp8Shape, usize, usize)>,
    copy: bool,
}

impl std::fmt::Debug for KernelLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelLoop")
            .field("input_bytes", &self.src.len())
            .field("fp8_shapes", &self.fp8.len())
            .field("copy", &self.copy)
            .finish()
    }
}

impl KernelLoop {
    /// A copy of `src` into `dst` (as long) over the pool, 1 MiB per job.
    pub(crate) fn copy(src: Vec<u8>, dst: Vec<u8>) -> KernelLoop {
        debug_assert_eq!(src.len(), dst.len());
        KernelLoop {
            src,
            dst,
            scales: Vec::new(),
            fp8: Vec::new(),
            copy: true,
        }
    }

    /// fp8 quantisation of the `shapes` that fit in `src` (bf16), one after another. Each shape
    /// reads its own part of the input and writes its own part of the output, as a trainer's
    /// tasks do: reading one cache-hot prefix for every shape would measure the cache, not the
    /// kernel on a layer's worth of tensors.
    pub(crate) fn fp8(src: Vec<u8>, shapes: &[Fp8Shape]) -> KernelLoop {
        let mut fp8 = Vec::new();
        let (mut e, mut s) = (0usize, 0usize);
        for sh in shapes {
            let elems = sh.rows * sh.cols;
            if (e + elems) * 2 > src.len() {
                break;
            }
            fp8.push((*sh, e, s));
            e += elems;
            s += sh.row_blocks() * sh.col_blocks() * 4;
        }
        KernelLoop {
            src,
            dst: vec![0u8; e],
            scales: vec![0u8; s],
            fp8,
            copy: false,
        }
    }

    /// The input buffer back.
    pub(crate) fn into_src(self) -> Vec<u8> {
        self.src
    }

    /// Input bytes of one pass.
    pub(crate) fn pass_bytes(&self) -> u64 {
        if self.copy {
            self.src.len() as u64
        } else {
            self.dst.len() as u64 * 2
        }
    }

    /// One pass over the pool.
    pub(crate) fn pass(&mut self) -> Result<(), E2eError> {
        if self.copy {
            self.dst
                .par_chunks_mut(1 << 20)
                .zip(self.src.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
            return Ok(());
        }
        for &(shape, e0, s0) in &self.fp8 {
            let e = shape.rows * shape.cols;
            let sb = shape.row_blocks() * shape.col_blocks() * 4;
            quantise_fp8(
                &self.src[e0 * 2..(e0 + e) * 2],
                DType::BF16,
                shape,
                &mut self.dst[e0..e0 + e],
                &mut self.scales[s0..s0 + sb],
                Threads::All,
            )
            .map_err(|x| E2eError::Setup(format!("quantising {shape:?}: {x}")))?;
        }
        Ok(())
    }
}

/// Runs one fabric pass of `limit` (`landed` bytes) while `kernel` loops on the pool, and
/// charges each at its rate alone: `fabric_host_s_per_byte` (the model's host share per byte
/// landed) and `kernel_bytes_per_s` (the kernel over the whole pool).
pub(crate) async fn measure(
    limit: &FabricLimit,
    landed: u64,
    fabric_host_s_per_byte: f64,
    kernel: KernelLoop,
    kernel_bytes_per_s: f64,
) -> Result<Overlap, E2eError> {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let looping = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || {
            let mut kernel = kernel;
            let mut bytes = 0u64;
            while !stop.load(Ordering::Relaxed) {
                kernel.pass()?;
                bytes += kernel.pass_bytes();
            }
            Ok::<_, E2eError>((bytes, start.elapsed().as_secs_f64()))
        })
    };
    let fabric = limit.sync().await;
    stop.store(true, Ordering::Relaxed);
    let (bytes, kernel_end) = looping
        .await
        .map_err(|e| E2eError::Setup(format!("the kernel beside the fabric panicked: {e}")))??;
    fabric?;
    Ok(Overlap::of(
        kernel_end,
        landed as f64 * fabric_host_s_per_byte,
        bytes as f64 / kernel_bytes_per_s.max(1.0),
    ))
}

impl Overlap {
    /// The figures of a run that took `wall_s` and did work worth the given host seconds.
    pub fn of(wall_s: f64, fabric_host_s: f64, kernel_host_s: f64) -> Overlap {
        let wall_s = wall_s.max(1e-9);
        Overlap {
            wall_s,
            fabric_host_s,
            kernel_host_s,
            efficiency: ((fabric_host_s + kernel_host_s) / wall_s).min(1.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::loopback::weights;
    use super::*;

    #[test]
    fn the_loop_quantises_the_shapes_that_fit_or_copies() {
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
        let mut k = KernelLoop::fp8(weights(1 << 20, 11), &shapes);
        assert_eq!(k.fp8.len(), 2);
        assert_eq!(k.pass_bytes(), (256 * 512 + 128 * 256) * 2);
        k.pass().unwrap();
        // What one pass wrote is what quantising each shape on its own gives.
        let scale_bytes = shapes[1].row_blocks() * shapes[1].col_blocks() * 4;
        let (mut values, mut scales) = (vec![0u8; 128 * 256], vec![0u8; scale_bytes]);
        let at = 256 * 512;
        quantise_fp8(
            &k.src[at * 2..(at + 128 * 256) * 2],
            DType::BF16,
            shapes[1],
            &mut values,
            &mut scales,
            Threads::One,
        )
        .unwrap();
        assert_eq!(k.dst[at..at + 128 * 256], values[..]);
        let first_scales = shapes[0].row_blocks() * shapes[0].col_blocks() * 4;
        assert_eq!(
            k.scales[first_scales..first_scales + scale_bytes],
            scales[..]
        );
        // No fp8 shapes: a copy of the whole buffer.
        let mut c = KernelLoop::copy(weights(1 << 20, 11), vec![0u8; 1 << 20]);
        assert_eq!(c.pass_bytes(), 1 << 20);
        c.pass().unwrap();
        assert_eq!(c.dst, c.src);
    }

    #[test]
    fn a_fabric_pass_beside_the_loop_charges_both_at_their_rates() {
        let rt = super::super::super::runtime().unwrap();
        rt.block_on(async {
            let pairs = [(0, 0, 8u64 << 20), (1, 0, 8 << 20)];
            let config = super::super::super::WorkerOptions::default().fabric_config();
            let limit = FabricLimit::start(&pairs, &config).await.unwrap();
            limit.sync().await.unwrap();
            let kernel = KernelLoop::copy(weights(4 << 20, 11), vec![0u8; 4 << 20]);
            let (fabric_rate, kernel_rate) = (1e-10, 5e9);
            let o = measure(&limit, 16 << 20, fabric_rate, kernel, kernel_rate)
                .await
                .unwrap();
            // The fabric is charged for the bytes it landed; the loop ran at least one pass of
            // its 4 MiB; the share is what both were worth over the time they took.
            assert!((o.fabric_host_s - (16u64 << 20) as f64 * fabric_rate).abs() < 1e-12);
            let passes = o.kernel_host_s * kernel_rate / (4u64 << 20) as f64;
            assert!(
                passes >= 1.0 && (passes - passes.round()).abs() < 1e-6,
                "{o:?}"
            );
            assert!(o.wall_s > 0.0 && o.efficiency > 0.0 && o.efficiency <= 1.0);
            let expected = ((o.fabric_host_s + o.kernel_host_s) / o.wall_s).min(1.0);
            assert!((o.efficiency - expected).abs() < 1e-12, "{o:?}");
        });
    }

    #[test]
    fn efficiency_is_the_host_work_done_over_the_wall_time_at_most_one() {
        let o = Overlap::of(0.5, 0.3, 0.1);
        assert!((o.efficiency - 0.8).abs() < 1e-12, "{o:?}");
        assert_eq!(Overlap::of(0.1, 0.3, 0.1).efficiency, 1.0);
        assert_eq!(Overlap::of(0.0, 0.0, 0.0).efficiency, 0.0);
    }
}
