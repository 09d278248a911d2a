//! The process's CPU time (every thread, user + system), for the CPU each method spends per sync.
//!
//! Why: on loopback there is no NIC to hand the copies to, so a sync and its fabric limit are
//! both bound by this machine's cores, and how close a sync can come to the fabric's rate is set
//! by the CPU work it does on top of the fabric's (staging copies, casts, fp8 quantisation,
//! checksums: what a GPU does on a real deployment). `ratio_vs_fabric` says how much of the
//! fabric's rate a sync keeps; the CPU seconds beside it say how much of the gap that work
//! explains: [`super::Report::cpu_ceiling_vs_fabric`] is the best `ratio_vs_fabric` the sync's
//! CPU seconds allow on this many cores.
//!
//! Read from `/proc/self/stat` (fields 14 and 15, `utime` and `stime`), which counts threads that
//! have exited too (a `spawn_blocking` thread's work is not lost). Its unit is USER_HZ, 100 per
//! second on every Linux ABI, so a reading is good to 10 ms per field; the syncs measured here
//! take hundreds of milliseconds of CPU. Elsewhere (no `/proc`) there is no reading: `None`.

/// Clock ticks per second of `/proc/<pid>/stat` (USER_HZ: fixed by the kernel ABI).
const USER_HZ: f64 = 100.0;

/// CPU seconds this process has used so far, or `None` where `/proc/self/stat` cannot be read.
pub fn process_cpu_s() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_stat(&stat)
}

/// `utime + stime` of one `/proc/<pid>/stat` line, in seconds. The command name (field 2) is in
/// parentheses and may hold spaces and parentheses, so the fields are counted from its last `)`.
fn parse_stat(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    // `rest` starts at field 3 (state): utime is field 14, stime field 15.
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
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

    #[test]
    fn a_stat_line_with_spaces_and_parentheses_in_the_name_parses() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        let line = "4242 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 250 75 0 0 20 0 3 0 100";
        assert_eq!(parse_stat(line), Some(3.25));
        assert_eq!(parse_stat("4242 (x) R 1 2"), None, "too few fields");
        assert_eq!(parse_stat("no parenthesis"), None);
    }

    #[test]
    fn this_process_reads_and_its_cpu_time_grows_with_work() {
        let Some(before) = process_cpu_s() else {
            assert!(
                !std::path::Path::new("/proc/self/stat").exists(),
                "/proc/self/stat exists but did not parse"
            );
            return;
        };
        // About 50 ms of CPU or more, whatever the machine (5 ticks).
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(200) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = process_cpu_s().unwrap();
        assert!(after >= before, "{before} -> {after}");
    }

    #[test]
    fn the_median_needs_every_reading() {
        assert_eq!(median(&[Some(3.0), Some(1.0), Some(2.0)]), Some(2.0));
        assert_eq!(median(&[Some(1.0), None]), None);
        assert_eq!(median(&[]), None);
    }
}
