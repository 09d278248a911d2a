//! How far a kernel's buffers must reach for its measured rate to be a sync's.
//!
//! Why: a sync reads a trainer's whole shard and writes its staging and the rollouts' landing
//! memory: gigabytes, far past any last-level cache, so its copies and quantisation run at
//! memory speed. A kernel timed over and over on the same 64 MiB runs from the cache instead on
//! a host whose last level holds it (300 MiB on some servers), 2-3x faster than it runs in the
//! sync (measured: a two-thread memcpy of 64 MiB blocks 15 GB/s from cache, 5.6-7.6 GB/s
//! through 1 GiB), and a model built on it predicts every host-bound sync too short. So the
//! calibration's kernels cycle through enough copies of their window that each pass finds its
//! window evicted: the traffic of the other windows exceeds the cache twice over.

use std::path::Path;

/// The largest cache of cpu0 (the last level), in bytes, from sysfs; `None` where the kernel
/// does not say.
pub fn last_level_cache_bytes() -> Option<u64> {
    last_level_cache_in(Path::new("/sys/devices/system/cpu/cpu0/cache"))
}

/// [`last_level_cache_bytes`] under `dir` (one `index*` folder per cache, each with `level`,
/// `type` and `size`); instruction caches are left out.
fn last_level_cache_in(dir: &Path) -> Option<u64> {
    let mut best: Option<(u32, u64)> = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let p = entry.path();
        if !entry.file_name().to_string_lossy().starts_with("index") {
            continue;
        }
        let read = |f: &str| std::fs::read_to_string(p.join(f)).ok();
        if read("type").is_some_and(|t| t.trim() == "Instruction") {
            continue;
        }
        let (Some(level), Some(size)) = (
            read("level").and_then(|l| l.trim().parse::<u32>().ok()),
            read("size").and_then(|s| parse_size(&s)),
        ) else {
            continue;
        };
        if best.is_none_or(|(l, _)| level > l) {
            best = Some((level, size));
        }
    }
    best.map(|(_, size)| size)
}

/// A sysfs cache size: `307200K`, `32M`, `512` (bytes).
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let mul = match unit.trim() {
        "" => 1,
        "K" | "KB" | "KiB" => 1 << 10,
        "M" | "MB" | "MiB" => 1 << 20,
        "G" | "GB" | "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mul)
}

/// Most windows a kernel cycles through: a cache larger than this many windows is not chased
/// further (the buffers would take gigabytes of a host that also runs the cluster).
pub const MAX_WINDOWS: usize = 32;

/// Windows of `traffic` bytes each (what one pass reads and writes) a kernel cycles through so
/// that the others' traffic exceeds a cache of `cache` bytes twice before a window comes round
/// again: 1 where no cache is known.
pub fn windows(traffic: u64, cache: Option<u64>) -> usize {
    let Some(cache) = cache else { return 1 };
    let traffic = traffic.max(1);
    let others = (2 * cache).div_ceil(traffic) as usize;
    (others + 1).clamp(1, MAX_WINDOWS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_sizes_parse_with_their_units() {
        assert_eq!(parse_size("307200K\n"), Some(300 << 20));
        assert_eq!(parse_size("32M"), Some(32 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("512"), Some(512));
        assert_eq!(parse_size("12Q"), None);
        assert_eq!(parse_size(""), None);
    }

    #[test]
    fn the_last_level_is_the_highest_data_or_unified_cache() {
        let dir = tempfile::tempdir().unwrap();
        let cache = |name: &str, level: &str, ty: &str, size: &str| {
            let d = dir.path().join(name);
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("level"), level).unwrap();
            std::fs::write(d.join("type"), ty).unwrap();
            std::fs::write(d.join("size"), size).unwrap();
        };
        cache("index0", "1\n", "Data\n", "48K\n");
        cache("index1", "1\n", "Instruction\n", "32K\n");
        cache("index2", "2\n", "Unified\n", "2048K\n");
        assert_eq!(last_level_cache_in(dir.path()), Some(2 << 20));
        cache("index3", "3\n", "Unified\n", "307200K\n");
        assert_eq!(last_level_cache_in(dir.path()), Some(300 << 20));
        // A folder that is not a cache, and one without a readable size, change nothing.
        std::fs::create_dir(dir.path().join("power")).unwrap();
        cache("index4", "4\n", "Unified\n", "lots\n");
        assert_eq!(last_level_cache_in(dir.path()), Some(300 << 20));
        assert_eq!(last_level_cache_in(&dir.path().join("missing")), None);
    }

    #[test]
    fn windows_reach_twice_past_the_cache() {
        // 128 MiB of traffic per pass, a 300 MiB cache: 5 others (640 MiB) + its own.
        assert_eq!(windows(128 << 20, Some(300 << 20)), 6);
        // A cache smaller than half a pass: the one other window evicts it twice over.
        assert_eq!(windows(128 << 20, Some(32 << 20)), 2);
        assert_eq!(windows(128 << 20, None), 1);
        assert_eq!(windows(1, Some(1 << 40)), MAX_WINDOWS);
    }
}
