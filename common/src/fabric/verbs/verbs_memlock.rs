//! The locked-memory limit, checked before registering.
//!
//! `ibv_reg_mr` pins every page of host memory, and pinned pages count against `RLIMIT_MEMLOCK`.
//! Many distributions default to 8 MiB (or 64 KiB in containers), far below a weight buffer, and
//! the kernel then fails the registration with a bare `ENOMEM` or `EPERM` that says nothing about
//! limits. So the backend compares the limit with what it has already pinned plus the new region
//! *before* calling `ibv_reg_mr`, and maps `ENOMEM`/`EPERM` from it to the same message, which
//! names `ulimit -l` and the systemd / limits.conf settings that raise it. GPU memory registered
//! through GPUDirect is not pinned host memory and is not checked.
//!
//! The kernel applies the limit only to processes without `CAP_IPC_LOCK` (`ib_umem_get`:
//! `new_pinned > lock_limit && !capable(CAP_IPC_LOCK)`): the capability decides, not the uid.
//! Containers started with `--cap-add IPC_LOCK` (the usual Docker / Kubernetes RDMA setup, which
//! often keeps the default 64 KiB or 8 MiB ulimit) are exempt, so the pre-check is skipped for
//! them ([`MemlockPolicy::of`]); root in a default `docker run` (no `IPC_LOCK`) is not, and is
//! checked like anyone (device review N9). Only where `/proc/self/status` cannot be read is
//! euid 0 taken as exempt. The errno mapping stays the real guard, and its hint then does not
//! ask for a capability the process already has.

use super::super::error::FabricError;

/// What to tell the operator, shared by the pre-check and the errno mapping.
pub const MEMLOCK_HINT: &str = "raise the locked-memory limit: `ulimit -l unlimited` in the \
     shell that starts the worker, `LimitMEMLOCK=infinity` in its systemd unit, `--ulimit \
     memlock=-1` for docker, or `* - memlock unlimited` in /etc/security/limits.conf; check with \
     `ulimit -l`";

/// Bit of `CAP_IPC_LOCK` in the capability sets (`linux/capability.h`).
pub const CAP_IPC_LOCK_BIT: u32 = 14;

/// Whether (and against what) registrations are pre-checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockPolicy {
    /// The kernel applies `RLIMIT_MEMLOCK` (`None`: unlimited).
    Enforced(Option<u64>),
    /// The kernel does not apply it: the process runs as root or holds `CAP_IPC_LOCK`.
    Exempt(ExemptBecause),
}

/// Why the memlock limit does not apply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExemptBecause {
    /// Effective user id 0 (rdma-core skips its own memlock warning for it too).
    Root,
    /// `CAP_IPC_LOCK` is in the effective capability set.
    CapIpcLock,
}

impl MemlockPolicy {
    /// The policy for a process with effective uid `euid`, effective capabilities `cap_eff`
    /// (the `CapEff` mask of `/proc/self/status`, `None` if unreadable) and soft limit `limit`.
    pub fn of(euid: u32, cap_eff: Option<u64>, limit: Option<u64>) -> MemlockPolicy {
        match cap_eff {
            Some(c) if c & (1 << CAP_IPC_LOCK_BIT) != 0 => {
                MemlockPolicy::Exempt(ExemptBecause::CapIpcLock)
            }
            // The capability set is known and lacks IPC_LOCK: the kernel enforces the limit,
            // root or not.
            Some(_) => MemlockPolicy::Enforced(limit),
            None if euid == 0 => MemlockPolicy::Exempt(ExemptBecause::Root),
            None => MemlockPolicy::Enforced(limit),
        }
    }

    /// The policy of this process.
    pub fn current() -> std::io::Result<MemlockPolicy> {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let euid = unsafe { libc::geteuid() };
        let cap_eff = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| parse_cap_eff(&s));
        Ok(MemlockPolicy::of(euid, cap_eff, memlock_limit()?))
    }

    /// Whether the process may pin without limit.
    pub fn is_exempt(&self) -> bool {
        matches!(self, MemlockPolicy::Exempt(_))
    }

    /// The pre-check of pinning `len` more bytes on top of `already_pinned`.
    pub fn check(&self, len: u64, already_pinned: u64) -> Result<(), FabricError> {
        match self {
            MemlockPolicy::Exempt(_) => Ok(()),
            MemlockPolicy::Enforced(limit) => check_memlock(len, already_pinned, *limit),
        }
    }
}

/// The effective capability mask from the text of `/proc/self/status` (`CapEff:\t<hex>`).
pub fn parse_cap_eff(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
}

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

/// Maps a failed `ibv_reg_mr` to an error. For a process the limit applies to, `ENOMEM` and
/// `EPERM` are almost always the memlock limit (or a container without `IPC_LOCK`), so they carry
/// the same hint; for an exempt one (root, `CAP_IPC_LOCK`) the limit is not the cause, and the
/// hint says what else is.
pub fn registration_error(len: u64, err: std::io::Error, policy: MemlockPolicy) -> FabricError {
    let hint = match (err.raw_os_error(), policy) {
        (Some(libc::ENOMEM) | Some(libc::EPERM), MemlockPolicy::Exempt(why)) => Some(format!(
            "the locked-memory limit does not apply ({}), so this is not `ulimit -l`: the device \
             may be out of translation resources or the region larger than its max_mr_size \
             (`ibv_devinfo -v`), or the host out of memory",
            match why {
                ExemptBecause::Root => "running as root",
                ExemptBecause::CapIpcLock => "the process holds CAP_IPC_LOCK",
            }
        )),
        (Some(libc::ENOMEM) | Some(libc::EPERM), MemlockPolicy::Enforced(_)) => Some(format!(
            "{MEMLOCK_HINT}; in a container grant CAP_IPC_LOCK (`--cap-add IPC_LOCK`, or \
             `securityContext.capabilities.add: [IPC_LOCK]`), which lifts the limit"
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
        let enforced = MemlockPolicy::Enforced(Some(8 << 20));
        for errno in [libc::ENOMEM, libc::EPERM] {
            let msg = registration_error(4096, std::io::Error::from_raw_os_error(errno), enforced)
                .to_string();
            assert!(msg.contains("ulimit -l"), "{msg}");
            assert!(msg.contains("ibv_reg_mr"), "{msg}");
        }
        let msg = registration_error(
            4096,
            std::io::Error::from_raw_os_error(libc::EINVAL),
            enforced,
        )
        .to_string();
        assert!(!msg.contains("ulimit"), "{msg}");
    }

    /// V2: a container with CAP_IPC_LOCK (bit 14 of CapEff) and the default 64 KiB ulimit, and
    /// root, register 16 MiB: the kernel allows it, so the pre-check must too.
    #[test]
    fn cap_ipc_lock_or_root_skips_the_memlock_precheck() {
        let status = "Name:\tworker\nCapInh:\t0000000000000000\nCapPrm:\t00000000a80c25fb\n\
                      CapEff:\t00000000a80c65fb\nCapBnd:\t00000000a80c65fb\n";
        let cap_eff = parse_cap_eff(status);
        assert_eq!(cap_eff, Some(0xa80c_65fb));
        let limit = Some(64 << 10);
        let with_cap = MemlockPolicy::of(1000, cap_eff, limit);
        assert_eq!(with_cap, MemlockPolicy::Exempt(ExemptBecause::CapIpcLock));
        with_cap.check(16 << 20, 0).unwrap();
        // Root without IPC_LOCK (a default `docker run`): the kernel enforces the limit.
        let root = MemlockPolicy::of(0, parse_cap_eff("CapEff:\t00000000a80425fb\n"), limit);
        assert_eq!(root, MemlockPolicy::Enforced(limit));
        assert!(root.check(16 << 20, 0).is_err());
        // Root whose capabilities cannot be read is taken as exempt.
        let root = MemlockPolicy::of(0, None, limit);
        assert_eq!(root, MemlockPolicy::Exempt(ExemptBecause::Root));
        root.check(16 << 20, 1 << 30).unwrap();
        // Without the capability (the default Docker set lacks bit 14) the limit holds.
        let plain = MemlockPolicy::of(1000, parse_cap_eff("CapEff:\t00000000a80425fb\n"), limit);
        assert_eq!(plain, MemlockPolicy::Enforced(limit));
        assert!(plain.check(16 << 20, 0).is_err());
        // An unreadable status falls back to the limit unless root.
        assert_eq!(
            MemlockPolicy::of(1000, None, limit),
            MemlockPolicy::Enforced(limit)
        );
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }

    /// V2: the kernel's ENOMEM for an exempt process must not blame the ulimit nor ask for a
    /// capability the process holds.
    #[test]
    fn an_exempt_process_is_not_told_to_grant_cap_ipc_lock() {
        let exempt = MemlockPolicy::Exempt(ExemptBecause::CapIpcLock);
        let msg = registration_error(
            1 << 30,
            std::io::Error::from_raw_os_error(libc::ENOMEM),
            exempt,
        )
        .to_string();
        assert!(!msg.contains("grant CAP_IPC_LOCK"), "{msg}");
        assert!(!msg.contains("ulimit -l unlimited"), "{msg}");
        assert!(msg.contains("max_mr_size"), "{msg}");
        let enforced = MemlockPolicy::Enforced(Some(64 << 10));
        let msg = registration_error(
            1 << 30,
            std::io::Error::from_raw_os_error(libc::ENOMEM),
            enforced,
        )
        .to_string();
        assert!(
            msg.contains("CAP_IPC_LOCK") && msg.contains("ulimit -l"),
            "{msg}"
        );
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
