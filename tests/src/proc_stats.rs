//! Resident memory and open file descriptors of a process, read from `/proc`.
//!
//! The load test samples every process of a run before the first sync and after the last one;
//! "flat" means neither number grows with the number of syncs. Linux only (as is the suite).

use std::path::PathBuf;

/// One sample of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcSample {
    /// Resident set size, KiB (`VmRSS` in `/proc/<pid>/status`).
    pub rss_kib: u64,
    /// Open file descriptors (entries of `/proc/<pid>/fd`).
    pub fds: u64,
    /// Threads (`Threads` in `/proc/<pid>/status`).
    pub threads: u64,
}

/// Reads a sample of `pid`; the error names the file that could not be read.
pub fn sample(pid: u32) -> Result<ProcSample, String> {
    let status_path = PathBuf::from(format!("/proc/{pid}/status"));
    let status = std::fs::read_to_string(&status_path)
        .map_err(|e| format!("reading {}: {e}", status_path.display()))?;
    let field = |name: &str| -> Result<u64, String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("no {name} in {}", status_path.display()))
    };
    let fd_dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let fds = std::fs::read_dir(&fd_dir)
        .map_err(|e| format!("reading {}: {e}", fd_dir.display()))?
        .count() as u64;
    Ok(ProcSample {
        rss_kib: field("VmRSS:")?,
        fds,
        threads: field("Threads:")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_this_process() {
        let s = sample(std::process::id()).unwrap();
        assert!(s.rss_kib > 0 && s.fds >= 3 && s.threads >= 1, "{s:?}");
        assert!(sample(u32::MAX).unwrap_err().contains("/proc/"));
    }
}
