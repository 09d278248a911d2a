//! The receiver's registration table: rkey -> memory, base, access.
//!
//! This is the TCP backend's stand-in for the NIC's memory-translation table. Every incoming
//! frame is checked here (rkey, bounds, permission) *before* a byte is read into memory. rkeys
//! are random 64-bit values drawn from the OS generator, so a peer cannot guess one; removal
//! (deregistration) happens under the table lock, after the region's memory was revoked, so a
//! lookup either sees a live entry or none.
//!
//! A receiver may also guard its regions with a [`WriteWindow`]: then a write is accepted only
//! while a sync is armed on it (between a rollout's `Prepare` and its landing), so bytes sent
//! while the engine serves never reach its weights.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

use parking_lot::RwLock;

use crate::fabric::descriptor::Access;
use crate::fabric::error::RemoteAccessKind;
use crate::fabric::region::RegisteredMemory;

/// When a receiver accepts writes into its regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WriteWindow {
    /// At any time (the default: a receiver that never said otherwise).
    #[default]
    Always,
    /// Never: the receiver guards its regions and no sync is armed.
    Closed,
    /// Now: a sync is armed.
    Armed,
}

impl WriteWindow {
    fn code(self) -> u8 {
        match self {
            WriteWindow::Always => 0,
            WriteWindow::Closed => 1,
            WriteWindow::Armed => 2,
        }
    }
}

/// One registration as the receiver sees it.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The memory (shared with the owner's `Region`).
    pub memory: Arc<RegisteredMemory>,
    /// Address peers use for the first byte.
    pub base: u64,
    /// Access rights.
    pub access: Access,
}

#[derive(Debug, Default)]
struct Entries {
    live: HashMap<u64, Registration>,
    /// rkeys of deregistered regions, so a stale descriptor gets "deregistered" rather than
    /// "unknown rkey" (clearer diagnosis; registrations are few and long-lived, so this is small).
    gone: HashSet<u64>,
}

/// rkey -> registration.
#[derive(Debug, Default)]
pub struct RegistrationTable {
    entries: RwLock<Entries>,
    /// [`WriteWindow::code`] of the current window.
    window: AtomicU8,
}

impl RegistrationTable {
    /// Sets when writes are accepted (see [`WriteWindow`]); takes effect for the next frame.
    pub fn set_window(&self, window: WriteWindow) {
        self.window.store(window.code(), Ordering::SeqCst);
    }

    /// The window in force.
    pub fn window(&self) -> WriteWindow {
        match self.window.load(Ordering::SeqCst) {
            0 => WriteWindow::Always,
            1 => WriteWindow::Closed,
            _ => WriteWindow::Armed,
        }
    }

    /// Inserts a registration under a fresh random rkey and returns the rkey.
    pub fn insert(&self, memory: Arc<RegisteredMemory>, access: Access) -> u64 {
        let base = memory.as_ptr() as u64;
        let mut entries = self.entries.write();
        loop {
            let rkey: u64 = rand::random();
            if rkey != 0 && !entries.live.contains_key(&rkey) && !entries.gone.contains(&rkey) {
                entries.live.insert(
                    rkey,
                    Registration {
                        memory,
                        base,
                        access,
                    },
                );
                return rkey;
            }
        }
    }

    /// Removes a registration (after its memory was revoked).
    pub fn remove(&self, rkey: u64) {
        let mut entries = self.entries.write();
        if entries.live.remove(&rkey).is_some() {
            entries.gone.insert(rkey);
        }
    }

    /// Number of live registrations.
    pub fn len(&self) -> usize {
        self.entries.read().live.len()
    }

    /// Whether there are no registrations.
    pub fn is_empty(&self) -> bool {
        self.entries.read().live.is_empty()
    }

    /// Checks a remote write of `len` bytes at address `addr` with `rkey`; on success returns the
    /// registration and the offset inside it.
    pub fn check_write(
        &self,
        rkey: u64,
        addr: u64,
        len: u64,
    ) -> Result<(Registration, u64), RemoteAccessKind> {
        let entries = self.entries.read();
        let Some(reg) = entries.live.get(&rkey) else {
            return Err(if entries.gone.contains(&rkey) {
                RemoteAccessKind::Deregistered
            } else {
                RemoteAccessKind::WrongRkey
            });
        };
        let offset = addr
            .checked_sub(reg.base)
            .ok_or(RemoteAccessKind::OutOfBounds)?;
        let region_len = reg.memory.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > region_len) {
            return Err(RemoteAccessKind::OutOfBounds);
        }
        if !reg.access.contains(Access::REMOTE_WRITE) {
            return Err(RemoteAccessKind::NoWritePermission);
        }
        if !reg.memory.is_live() {
            return Err(RemoteAccessKind::Deregistered);
        }
        if self.window() == WriteWindow::Closed {
            return Err(RemoteAccessKind::OutsideWindow);
        }
        Ok((reg.clone(), offset))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::Memory;

    #[test]
    fn checks_rkey_bounds_permission_and_liveness() {
        let table = RegistrationTable::default();
        let rw = RegisteredMemory::new(Memory::alloc(100).unwrap());
        let ro = RegisteredMemory::new(Memory::alloc(100).unwrap());
        let k_rw = table.insert(rw.clone(), Access::RECEIVE);
        let k_ro = table.insert(ro.clone(), Access::SOURCE);
        assert_ne!(k_rw, k_ro);
        let base = rw.as_ptr() as u64;
        let (_, off) = table.check_write(k_rw, base + 10, 90).unwrap();
        assert_eq!(off, 10);
        assert_eq!(
            table.check_write(k_rw ^ 1, base, 1).unwrap_err(),
            RemoteAccessKind::WrongRkey
        );
        assert_eq!(
            table.check_write(k_rw, base + 10, 91).unwrap_err(),
            RemoteAccessKind::OutOfBounds
        );
        assert_eq!(
            table.check_write(k_rw, base - 1, 1).unwrap_err(),
            RemoteAccessKind::OutOfBounds
        );
        assert_eq!(
            table.check_write(k_rw, base, u64::MAX).unwrap_err(),
            RemoteAccessKind::OutOfBounds
        );
        assert_eq!(
            table.check_write(k_ro, ro.as_ptr() as u64, 1).unwrap_err(),
            RemoteAccessKind::NoWritePermission
        );
        rw.revoke();
        assert_eq!(
            table.check_write(k_rw, base, 1).unwrap_err(),
            RemoteAccessKind::Deregistered
        );
        table.remove(k_rw);
        assert_eq!(
            table.check_write(k_rw, base, 1).unwrap_err(),
            RemoteAccessKind::Deregistered
        );
        assert_eq!(table.len(), 1);
    }
}
