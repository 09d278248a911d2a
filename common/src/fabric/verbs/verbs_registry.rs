//! The fabric's registrations: lkeys for outgoing writes, memlock accounting, and the owner's side
//! of refusal diagnosis.
//!
//! The NIC enforces access on its own, so this table is not on the data path of incoming writes.
//! It answers three questions: which lkey covers a write's source, how much host memory this
//! fabric pinned (for the memlock pre-check), and, when a peer asks after an
//! `IBV_WC_REM_ACCESS_ERR`, why its write was refused.
//!
//! Registrations are keyed by [`RegistrationKey`], the identity of the shared memory object a
//! [`Region`](super::super::Region) and its `VerbsMr` both hold, never by rkey: the rkey of a
//! registration without remote access means nothing by spec, and Soft-RoCE before Linux 6.5 gives
//! every such registration rkey 0, so keying by rkey let a second source registration replace
//! (and deregister) the first. Only diagnosis looks registrations up by rkey, and it prefers a
//! remote-writable one (whose rkey the NIC keeps unique).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::super::descriptor::Access;
use super::super::region::RegisteredMemory;
use super::verbs_bootstrap::RefusalKind;
use super::verbs_mr::VerbsMr;

/// How many deregistered rkeys are remembered for diagnosis.
const REMEMBERED_DEREGISTRATIONS: usize = 4096;

/// Identifies one registration: the address of its shared [`RegisteredMemory`]. Unique among live
/// registrations, because the registry entry (through its MR) and every `Region` clone hold that
/// object alive, so no other registration can be allocated at the same address meanwhile.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RegistrationKey(usize);

impl RegistrationKey {
    /// The key of the registration that owns `memory`.
    pub fn of(memory: &Arc<RegisteredMemory>) -> RegistrationKey {
        RegistrationKey(Arc::as_ptr(memory) as usize)
    }

    /// A key from a raw number (tests).
    pub fn from_raw(raw: usize) -> RegistrationKey {
        RegistrationKey(raw)
    }
}

/// What the registry needs to know of a memory registration (a `VerbsMr`; tests use plain data).
pub trait RegisteredKeys {
    /// Address of the first byte.
    fn addr(&self) -> u64;
    /// Length in bytes.
    fn bytes(&self) -> u64;
    /// Local key.
    fn lkey(&self) -> u32;
    /// Remote key (meaningful only with remote access).
    fn rkey(&self) -> u32;
    /// Whether the memory is pinned host memory (counts against memlock).
    fn is_host(&self) -> bool;
}

impl RegisteredKeys for VerbsMr {
    fn addr(&self) -> u64 {
        VerbsMr::addr(self)
    }
    fn bytes(&self) -> u64 {
        VerbsMr::len(self)
    }
    fn lkey(&self) -> u32 {
        VerbsMr::lkey(self)
    }
    fn rkey(&self) -> u32 {
        VerbsMr::rkey(self)
    }
    fn is_host(&self) -> bool {
        VerbsMr::is_host(self)
    }
}

/// Registrations of one verbs fabric.
pub struct Registry<M = VerbsMr> {
    mrs: HashMap<RegistrationKey, (Arc<M>, Access)>,
    pinned: u64,
    deregistered: HashSet<u32>,
    deregistered_order: VecDeque<u32>,
}

impl<M> Default for Registry<M> {
    fn default() -> Self {
        Registry {
            mrs: HashMap::new(),
            pinned: 0,
            deregistered: HashSet::new(),
            deregistered_order: VecDeque::new(),
        }
    }
}

impl<M> std::fmt::Debug for Registry<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registry")
            .field("regions", &self.mrs.len())
            .field("pinned", &self.pinned)
            .finish()
    }
}

impl<M: RegisteredKeys> Registry<M> {
    /// Bytes of host memory pinned by live registrations.
    pub fn pinned(&self) -> u64 {
        self.pinned
    }

    /// Number of live registrations.
    pub fn len(&self) -> usize {
        self.mrs.len()
    }

    /// Whether no registration is live.
    pub fn is_empty(&self) -> bool {
        self.mrs.is_empty()
    }

    /// Adds the registration `key`. A key already present is kept (and `mr` returned unused):
    /// one registration is never replaced by another.
    pub fn insert(&mut self, key: RegistrationKey, mr: Arc<M>, access: Access) -> Option<Arc<M>> {
        if self.mrs.contains_key(&key) {
            return Some(mr);
        }
        if mr.is_host() {
            self.pinned += mr.bytes();
        }
        if access.contains(Access::REMOTE_WRITE) {
            // The NIC may hand out a remote key again after deregistration: it is live once more.
            self.deregistered.remove(&mr.rkey());
        }
        self.mrs.insert(key, (mr, access));
        None
    }

    /// Removes the registration `key` and returns it (dropping it deregisters).
    pub fn remove(&mut self, key: RegistrationKey) -> Option<Arc<M>> {
        let (mr, access) = self.mrs.remove(&key)?;
        if mr.is_host() {
            self.pinned = self.pinned.saturating_sub(mr.bytes());
        }
        let rkey = mr.rkey();
        let still_live = self
            .mrs
            .values()
            .any(|(m, a)| a.contains(Access::REMOTE_WRITE) && m.rkey() == rkey);
        if access.contains(Access::REMOTE_WRITE) && !still_live && self.deregistered.insert(rkey) {
            self.deregistered_order.push_back(rkey);
            if self.deregistered_order.len() > REMEMBERED_DEREGISTRATIONS
                && let Some(old) = self.deregistered_order.pop_front()
            {
                self.deregistered.remove(&old);
            }
        }
        Some(mr)
    }

    /// Address, length and lkey of the registration `key`. (No `Arc` is handed out: the
    /// deregistration hook must hold the last one so `ibv_dereg_mr` runs at once.)
    pub fn lookup(&self, key: RegistrationKey) -> Option<(u64, u64, u32)> {
        self.mrs
            .get(&key)
            .map(|(mr, _)| (mr.addr(), mr.bytes(), mr.lkey()))
    }

    /// Why a write of `len` bytes at `addr` with `rkey` is refused here (`None`: it is not).
    /// A remote-writable registration with that rkey answers first; a local-only one (whose
    /// rkey may be shared, e.g. 0 on old Soft-RoCE) only says "no write permission".
    pub fn diagnose(&self, rkey: u32, addr: u64, len: u64) -> Option<RefusalKind> {
        let with_rkey = || self.mrs.values().filter(|(mr, _)| mr.rkey() == rkey);
        let live = with_rkey()
            .find(|(_, access)| access.contains(Access::REMOTE_WRITE))
            .or_else(|| with_rkey().next())
            .map(|(mr, access)| (mr.addr(), mr.bytes(), *access));
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

    /// A registration as plain data.
    struct FakeMr {
        addr: u64,
        len: u64,
        lkey: u32,
        rkey: u32,
    }

    impl RegisteredKeys for FakeMr {
        fn addr(&self) -> u64 {
            self.addr
        }
        fn bytes(&self) -> u64 {
            self.len
        }
        fn lkey(&self) -> u32 {
            self.lkey
        }
        fn rkey(&self) -> u32 {
            self.rkey
        }
        fn is_host(&self) -> bool {
            true
        }
    }

    fn mr(addr: u64, len: u64, lkey: u32, rkey: u32) -> Arc<FakeMr> {
        Arc::new(FakeMr {
            addr,
            len,
            lkey,
            rkey,
        })
    }

    /// V1: Soft-RoCE before Linux 6.5 gives every local-only registration rkey 0. Two of them
    /// must coexist, each resolvable, and removing one must leave the other registered.
    #[test]
    fn two_local_only_registrations_with_rkey_zero_coexist() {
        let mut r: Registry<FakeMr> = Registry::default();
        let (a, b) = (
            RegistrationKey::from_raw(0x1000),
            RegistrationKey::from_raw(0x2000),
        );
        assert!(r.insert(a, mr(4096, 100, 11, 0), Access::SOURCE).is_none());
        assert!(r.insert(b, mr(8192, 200, 12, 0), Access::SOURCE).is_none());
        assert_eq!(r.len(), 2);
        assert_eq!(r.lookup(a), Some((4096, 100, 11)));
        assert_eq!(r.lookup(b), Some((8192, 200, 12)));
        assert_eq!(r.pinned(), 300);
        let gone = r.remove(a).expect("a was registered");
        assert_eq!(gone.lkey, 11, "removing a must return a's registration");
        assert_eq!(
            r.lookup(b),
            Some((8192, 200, 12)),
            "b must survive a's removal"
        );
        assert_eq!(r.pinned(), 200);
        assert!(r.remove(a).is_none());
        // A duplicate key never replaces the live registration.
        assert!(r.insert(b, mr(1, 1, 99, 0), Access::SOURCE).is_some());
        assert_eq!(r.lookup(b), Some((8192, 200, 12)));
    }

    #[test]
    fn diagnosis_prefers_the_remote_writable_registration_of_an_rkey() {
        let mut r: Registry<FakeMr> = Registry::default();
        let src = RegistrationKey::from_raw(1);
        let dst = RegistrationKey::from_raw(2);
        r.insert(src, mr(0x1000, 64, 5, 0), Access::SOURCE);
        r.insert(dst, mr(0x9000, 64, 7, 0), Access::RECEIVE);
        assert_eq!(r.diagnose(0, 0x9000, 64), None);
        assert_eq!(r.diagnose(0, 0x9000, 65), Some(RefusalKind::OutOfBounds));
        r.remove(dst);
        assert_eq!(
            r.diagnose(0, 0x9000, 8),
            Some(RefusalKind::NoWritePermission),
            "only the local-only registration with rkey 0 is left"
        );
        r.remove(src);
        assert_eq!(r.diagnose(0, 0x9000, 8), Some(RefusalKind::Deregistered));
    }

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
