//! What one process tells another so that the other can write into its memory.
//!
//! A [`RegionDescriptor`] is the RDMA triple (address, length, rkey) plus the [`Endpoint`] of the
//! process that owns the memory. It is plain serde data: workers send descriptors to the
//! controller, which puts them into the routing table; writers never need anything else. The rkey
//! is a capability: for the TCP backend it is a random 64-bit value, unguessable, and only valid
//! while the region stays registered; verbs uses the NIC's 32-bit rkey widened to `u64`.

use serde::{Deserialize, Serialize};

/// The bootstrap address of one process's fabric, e.g. `"127.0.0.1:4711"`.
///
/// For TCP it is where the fabric listens for lanes; the verbs backend exchanges queue-pair
/// details through the same address before switching to the NIC.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Endpoint(pub String);

impl Endpoint {
    /// The address as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<std::net::SocketAddr> for Endpoint {
    fn from(addr: std::net::SocketAddr) -> Self {
        Endpoint(addr.to_string())
    }
}

impl From<&str> for Endpoint {
    fn from(s: &str) -> Self {
        Endpoint(s.to_owned())
    }
}

/// Access rights of a registration (a small bit set, like `ibv_access_flags`).
///
/// Every registration may be used as a local write *source*. [`Access::REMOTE_WRITE`] lets peers
/// write into it; [`Access::LOCAL_WRITE`] is what verbs requires alongside remote write (the TCP
/// backend ignores it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Access(u8);

impl Access {
    /// Only a local source: peers cannot write into it.
    pub const SOURCE: Access = Access(0);
    /// Local writes by the NIC (verbs `IBV_ACCESS_LOCAL_WRITE`).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Peers may write into the region.
    pub const REMOTE_WRITE: Access = Access(2);
    /// What a receive buffer needs: local and remote write.
    pub const RECEIVE: Access = Access(1 | 2);

    /// Whether every flag of `other` is set in `self`.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// The raw bits.
    pub const fn bits(self) -> u8 {
        self.0
    }
}

impl std::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// Everything a peer needs to write into one registered region.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RegionDescriptor {
    /// The process that owns the memory.
    pub endpoint: Endpoint,
    /// Remote address of the region's first byte (a virtual address in the owner's process).
    pub base: u64,
    /// Length of the region in bytes.
    pub len: u64,
    /// The key that authorises writes into the region.
    pub rkey: u64,
}

impl RegionDescriptor {
    /// Whether `[offset, offset + len)` lies inside the region (without overflow).
    pub fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_combine() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        assert_eq!(a, Access::RECEIVE);
        assert!(a.contains(Access::REMOTE_WRITE));
        assert!(!Access::SOURCE.contains(Access::REMOTE_WRITE));
        assert!(Access::SOURCE.contains(Access::SOURCE));
    }

    #[test]
    fn descriptor_bounds_do_not_overflow() {
        let d = RegionDescriptor {
            endpoint: "127.0.0.1:1".into(),
            base: 4096,
            len: 100,
            rkey: 7,
        };
        assert!(d.contains(0, 100));
        assert!(d.contains(100, 0));
        assert!(!d.contains(1, 100));
        assert!(!d.contains(u64::MAX, 2));
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(serde_json::from_str::<RegionDescriptor>(&json).unwrap(), d);
    }
}
