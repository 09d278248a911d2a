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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::Serialize;
use weightsync_worker::Threads;

use super::super::E2eError;
use super::super::fabric_limit::FabricLimit;
use super::kernel_loop::KernelLoop;

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

/// Runs one fabric pass of `limit` (`landed` bytes) while `kernel` loops on the pool, and
/// charges each at its rate alone: `fabric_host_s_per_byte` (the model's host share per byte
/// landed) and `kernel_bytes_per_s` (the kernel over the whole pool). The kernel comes back
/// for the next measurement.
pub(crate) async fn measure(
    limit: &FabricLimit,
    landed: u64,
    fabric_host_s_per_byte: f64,
    kernel: KernelLoop,
    kernel_bytes_per_s: f64,
) -> Result<(Overlap, KernelLoop), E2eError> {
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let looping = {
        let stop = stop.clone();
        tokio::task::spawn_blocking(move || {
            let mut kernel = kernel;
            let mut bytes = 0u64;
            // At least one pass, even when the blocking pool started this task only after the
            // fabric had finished (a loaded host): a measurement with no kernel work in it
            // would charge the overlap nothing and read as an idle kernel.
            loop {
                kernel.pass(Threads::All)?;
                bytes += kernel.pass_bytes();
                if stop.load(Ordering::Relaxed) {
                    break;
                }
            }
            Ok::<_, E2eError>((bytes, start.elapsed().as_secs_f64(), kernel))
        })
    };
    let fabric = limit.sync().await;
    stop.store(true, Ordering::Relaxed);
    let (bytes, kernel_end, kernel) = looping
        .await
        .map_err(|e| E2eError::Setup(format!("the kernel beside the fabric panicked: {e}")))??;
    fabric?;
    let overlap = Overlap::of(
        kernel_end,
        landed as f64 * fabric_host_s_per_byte,
        bytes as f64 / kernel_bytes_per_s.max(1.0),
    );
    Ok((overlap, kernel))
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
    fn a_fabric_pass_beside_the_loop_charges_both_at_their_rates() {
        let rt = super::super::super::runtime().unwrap();
        rt.block_on(async {
            let pairs = [(0, 0, 8u64 << 20), (1, 0, 8 << 20)];
            let config = super::super::super::WorkerOptions::default().fabric_config();
            let limit = FabricLimit::start(&pairs, &config).await.unwrap();
            limit.sync().await.unwrap();
            let kernel = KernelLoop::copy(weights(4 << 20, 11)).spread(2);
            let (fabric_rate, kernel_rate) = (1e-10, 5e9);
            let (o, kernel) = measure(&limit, 16 << 20, fabric_rate, kernel, kernel_rate)
                .await
                .unwrap();
            assert_eq!(
                kernel.windows(),
                2,
                "the loop comes back for the next measurement"
            );
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
