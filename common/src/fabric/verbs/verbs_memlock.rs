//! The locked-memory limit, checked before registering.
//!
//! `ibv_reg_mr` pins every page of host memory, and pinned pages count against `RLIMIT_MEMLOCK`.
//! Many distributions default to 8 MiB (or 64 KiB in containers), far below a weight buffer, and
//! the kernel then fails the registration with a bare `ENOMEM` or `EPERM` that says nothing about
//! limits. So the backend compares the limit with what it has already pinned plus the new region
//! *before* calling `ibv_reg_mr`, and maps `ENOMEM`/`EPERM` from it to the same message, which
//! names `ulimit -l` and the systemd / limits.conf settings that raise it. GPU memory registered
//! through GPUDirect is not pinned host memory and is not checked.

use super::super::error::FabricError;

/// What to tell the operator, shared by the pre-check and the errno mapping.
pub const MEMLOCK_HINT: &str = "raise the locked-memory limit: `ulimit -l unlimited` in the \
     shell that starts the worker, `LimitMEMLOCK=infinity` in its systemd unit, `--ulimit \
     memlock=-1` for docker, or `* - memlock unlimited` in /etc/security/limits.conf; check with \
     `ulimit -l`";

/// `RLIMIT_MEMLOCK` soft limit in bytes; `None` means unlimited.
pub fn memlock_limit() -> std::io::Result<Option<u64>> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the valid, exclusively borrowed `lim`.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(if lim.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(lim.rlim_cur)
    })
}

/// Checks that pinning `len` more bytes on top of `already_pinned` stays within `limit`.
pub fn check_memlock(len: u64, already_pinned: u64, limit: Option<u64>) -> Result<(), FabricError> {
    let Some(limit) = limit else {
        return Ok(());
    };
    let needed = already_pinned.saturating_add(len);
    if needed <= limit {
        return Ok(());
    }
    Err(FabricError::Registration {
        len,
        detail: format!(
            "the locked-memory limit (RLIMIT_MEMLOCK) is {} but registering needs {} pinned in \
             total ({} already registered by this fabric)",
            human_bytes(limit),
            human_bytes(needed),
            human_bytes(already_pinned)
        ),
        hint: Some(MEMLOCK_HINT.to_owned()),
    })
}

/// Maps a failed `ibv_reg_mr` to an error; `ENOMEM` and `EPERM` are almost always the memlock
/// limit (or a container without `IPC_LOCK`), so they carry the same hint.
pub fn registration_error(len: u64, err: std::io::Error) -> FabricError {
    let hint = match err.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EPERM) => Some(format!(
            "{MEMLOCK_HINT}; in a container also grant CAP_IPC_LOCK"
        )),
        _ => None,
    };
    FabricError::Registration {
        len,
        detail: format!("ibv_reg_mr failed: {err}"),
        hint,
    }
}

fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_limit_or_unlimited_passes() {
        check_memlock(1 << 20, 0, Some(8 << 20)).unwrap();
        check_memlock(4 << 20, 4 << 20, Some(8 << 20)).unwrap();
        check_memlock(u64::MAX, u64::MAX, None).unwrap();
    }

    #[test]
    fn over_limit_names_ulimit() {
        let err = check_memlock(64 << 20, 1 << 20, Some(8 << 20)).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("ulimit -l"), "{msg}");
        assert!(msg.contains("8.0 MiB"), "{msg}");
        assert!(msg.contains("65.0 MiB"), "{msg}");
        assert!(matches!(err, FabricError::Registration { len, .. } if len == 64 << 20));
        // No overflow at the top of the range.
        assert!(check_memlock(u64::MAX, 1, Some(u64::MAX - 1)).is_err());
    }

    #[test]
    fn enomem_and_eperm_from_reg_mr_name_ulimit() {
        for errno in [libc::ENOMEM, libc::EPERM] {
            let msg =
                registration_error(4096, std::io::Error::from_raw_os_error(errno)).to_string();
            assert!(msg.contains("ulimit -l"), "{msg}");
            assert!(msg.contains("ibv_reg_mr"), "{msg}");
        }
        let msg =
            registration_error(4096, std::io::Error::from_raw_os_error(libc::EINVAL)).to_string();
        assert!(!msg.contains("ulimit"), "{msg}");
    }

    #[test]
    fn reads_the_process_limit() {
        // Whatever this machine's limit is, reading it works and the check agrees with it.
        let limit = memlock_limit().unwrap();
        if let Some(l) = limit {
            assert!(check_memlock(l, 0, limit).is_ok());
            assert!(check_memlock(l.saturating_add(1), 0, limit).is_err() || l == u64::MAX);
        }
    }
}
