//! Raising the process's open-file limit at start.
//!
//! Every control connection, HTTP client and fabric lane is a file descriptor. Linux hands a
//! process a soft limit of 1,024 by default while the hard limit is usually far higher, so a
//! controller of about a thousand workers (or one under a flood of idle connections) would fail
//! its `accept`s and keep restarted workers out. The binaries call [`raise_open_file_limit`]
//! first thing: the soft limit goes up to the hard one, which needs no privilege.

/// Raises the soft `RLIMIT_NOFILE` to the hard limit and returns the limit now in force.
pub fn raise_open_file_limit() -> std::io::Result<u64> {
    rlimit::increase_nofile_limit(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_reaches_the_hard_one() {
        let now = raise_open_file_limit().unwrap();
        let (soft, hard) = rlimit::getrlimit(rlimit::Resource::NOFILE).unwrap();
        assert_eq!(soft, now);
        assert_eq!(soft, hard);
    }
}
