//! The fabric's registrations by rkey: lkeys for outgoing writes, memlock accounting, and the
//! owner's side of refusal diagnosis.
//!
//! The NIC enforces access on its own, so this table is not on the data path of incoming writes.
//! It answers three questions: which lkey covers a write's source, how much host memory this
//! fabric pinned (for the memlock pre-check), and, when a peer asks after an
//! `IBV_WC_REM_ACCESS_ERR`, why its write was refused.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::super::descriptor::Access;
use super::verbs_bootstrap::RefusalKind;
use super::verbs_mr::VerbsMr;

/// How many deregistered rkeys are remembered for diagnosis.
const REMEMBERED_DEREGISTRATIONS: usize = 4096;

/// Registrations of one verbs fabric.
#[derive(Default)]
pub struct Registry {
    mrs: HashMap<u32, (Arc<VerbsMr>, Access)>,
    pinned: u64,
    deregistered: HashSet<u32>,
    deregistered_order: VecDeque<u32>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("regions", &self.mrs.len())
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl Registry {
    /// Bytes of host memory pinned by live registrations.
    pub fn pinned(&self) -> u64 {
        self.pinned
    }

    /// Adds a registration.
    pub fn insert(&mut self, mr: Arc<VerbsMr>, access: Access) {
        let rkey = mr.rkey();
        if mr.is_host() {
            self.pinned += mr.len();
        }
        // The NIC may hand out a key again after deregistration: it is live once more.
        self.deregistered.remove(&rkey);
        self.mrs.insert(rkey, (mr, access));
    }

    /// Removes the registration of `rkey` and returns it (dropping it deregisters).
    pub fn remove(&mut self, rkey: u32) -> Option<Arc<VerbsMr>> {
        let (mr, _) = self.mrs.remove(&rkey)?;
        if mr.is_host() {
            self.pinned = self.pinned.saturating_sub(mr.len());
        }
        if self.deregistered.insert(rkey) {
            self.deregistered_order.push_back(rkey);
            if self.deregistered_order.len() > REMEMBERED_DEREGISTRATIONS {
                if let Some(old) = self.deregistered_order.pop_front() {
                    self.deregistered.remove(&old);
                }
            }
        }
        Some(mr)
    }

    /// Address, length and lkey of the registration of `rkey`. (No `Arc` is handed out: the
    /// deregistration hook must hold the last one so `ibv_dereg_mr` runs at once.)
    pub fn lookup(&self, rkey: u32) -> Option<(u64, u64, u32)> {
        self.mrs
            .get(&rkey)
            .map(|(mr, _)| (mr.addr(), mr.len(), mr.lkey()))
    }

    /// Why a write of `len` bytes at `addr` with `rkey` is refused here (`None`: it is not).
    pub fn diagnose(&self, rkey: u32, addr: u64, len: u64) -> Option<RefusalKind> {
        let live = self
            .mrs
            .get(&rkey)
            .map(|(mr, access)| (mr.addr(), mr.len(), *access));
        diagnose(live, self.deregistered.contains(&rkey), addr, len)
    }
}

/// The refusal reason for a write to `[addr, addr + len)` given the registration the rkey names
/// (`(base, len, access)`, if live) and whether the rkey was deregistered.
pub fn diagnose(
    live: Option<(u64, u64, Access)>,
    was_deregistered: bool,
    addr: u64,
    len: u64,
) -> Option<RefusalKind> {
    match live {
        Some((_, _, access)) if !access.contains(Access::REMOTE_WRITE) => {
            Some(RefusalKind::NoWritePermission)
        }
        Some((base, region_len, _)) => {
            let inside = addr >= base
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= base.saturating_add(region_len));
            if inside {
                None
            } else {
                Some(RefusalKind::OutOfBounds)
            }
        }
        None if was_deregistered => Some(RefusalKind::Deregistered),
        None => Some(RefusalKind::WrongRkey),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn diagnoses_each_refusal() {
        let live = Some((4096, 1000, Access::RECEIVE));
        assert_eq!(diagnose(live, false, 4096, 1000), None);
        assert_eq!(
            diagnose(live, false, 4096 + 900, 200),
            Some(RefusalKind::OutOfBounds)
        );
        assert_eq!(
            diagnose(live, false, 4000, 10),
            Some(RefusalKind::OutOfBounds)
        );
        assert_eq!(
            diagnose(live, false, u64::MAX, 2),
            Some(RefusalKind::OutOfBounds)
        );
        assert_eq!(
            diagnose(Some((4096, 1000, Access::SOURCE)), false, 4096, 8),
            Some(RefusalKind::NoWritePermission)
        );
        assert_eq!(
            diagnose(None, true, 4096, 8),
            Some(RefusalKind::Deregistered)
        );
        assert_eq!(diagnose(None, false, 4096, 8), Some(RefusalKind::WrongRkey));
    }
}
