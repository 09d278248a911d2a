//! The process's CPU time (every thread, user + system): the one CPU clock of the benches.
//!
//! Why: on loopback there is no NIC to hand the copies to, so a sync and its fabric limit are
//! both bound by this machine's cores, and how close a sync can come to the fabric's rate is set
//! by the CPU work it does on top of the fabric's (staging copies, casts, fp8 quantisation,
//! checksums: what a GPU does on a real deployment). The e2e bench puts CPU seconds beside each
//! method's rate (`crate::e2e::Report::cpu_ceiling_vs_fabric`), the simulator's calibration
//! measures the fabric's CPU per byte, and the pipeline bench the cores' worth it gets, all with
//! this clock.
//!
//! Read with `clock_gettime(CLOCK_PROCESS_CPUTIME_ID)`: nanosecond resolution, and it counts
//! threads that have exited too (a `spawn_blocking` thread's work is not lost). It replaces
//! three clocks that disagreed in method and resolution (`/proc/self/stat` ticks of 10 ms,
//! `getrusage`, and this one). A per-thread clock (`prepare`'s kernel timing) is another
//! measure and stays with its bench.

/// CPU seconds (user + system, every thread, exited ones included) this process has used so
/// far, or `None` where the clock cannot be read.
pub fn process_cpu_s() -> Option<f64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux supports.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    (rc == 0).then_some(ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9)
}

/// Median of per-sync CPU seconds, `None` if any reading failed.
pub fn median(readings: &[Option<f64>]) -> Option<f64> {
    let mut v: Vec<f64> = readings.iter().copied().collect::<Option<_>>()?;
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU seconds of the calling thread alone.
    fn thread_cpu_s() -> f64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec; the clock id is a constant Linux supports.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        assert_eq!(rc, 0, "the thread CPU clock reads");
        ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
    }

    #[test]
    fn the_work_of_a_thread_that_exited_is_counted() {
        let before = process_cpu_s().expect("the process CPU clock reads on Linux");
        // A thread burns 50 ms of its own CPU (however long that takes on a shared machine),
        // then exits.
        let burnt = std::thread::spawn(|| {
            let start = thread_cpu_s();
            let mut x = 0u64;
            while thread_cpu_s() - start < 0.05 {
                for _ in 0..10_000 {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
            thread_cpu_s() - start
        })
        .join()
        .expect("the spinning thread");
        let after = process_cpu_s().expect("the process CPU clock reads on Linux");
        assert!(
            after - before >= burnt,
            "the process clock moved {:.4} s, the exited thread alone used {burnt:.4} s",
            after - before
        );
    }

    #[test]
    fn the_median_needs_every_reading() {
        assert_eq!(median(&[Some(3.0), Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median(&[Some(1.0), None]), None);
        assert_eq!(median(&[]), None);
    }
}
