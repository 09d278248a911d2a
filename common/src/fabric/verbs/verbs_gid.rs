//! GIDs and how a queue pair addresses its peer.
//!
//! InfiniBand routes inside a subnet by LID, a 16-bit address the subnet manager hands out, and
//! needs a global route header (GRH) only across subnets. RoCE has no subnet manager and no LIDs:
//! every packet is routed by GID, so the RTR transition must set `is_global = 1` and put the peer's
//! GID into the GRH (`dgid`, with our own `sgid_index`). Copying an InfiniBand tutorial (LID,
//! `is_global = 0`) onto Soft-RoCE gives a queue pair that never connects and no error. The
//! [`Addressing`] of a connection is therefore decided once, from the local port's link layer and
//! the configured GID index, and both sides exchange what the other needs.
//!
//! A GID is 128 bits and is written like an IPv6 address (RoCE v2 GIDs *are* the interface's IPv6
//! or IPv4-mapped address, e.g. `::ffff:192.168.1.5`), so parsing and printing go through
//! [`std::net::Ipv6Addr`]. `ibv_devinfo -v` prints the uncompressed form
//! (`fe80:0000:0000:0000:5054:00ff:fe12:3456`), which parses too.

use std::fmt;
use std::net::Ipv6Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A 128-bit global identifier, in network byte order as the NIC stores it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// Whether every byte is zero (an unset GID table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address of an IPv4-mapped GID (RoCE v2 over IPv4), if it is one.
    pub fn ipv4(&self) -> Option<std::net::Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// Why a GID string was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid GID {input:?}: expected an IPv6-style address such as fe80::1 or ::ffff:10.0.0.1, or 32 hex digits"
)]
pub struct GidParseError {
    /// The rejected text.
    pub input: String,
}

impl FromStr for Gid {
    type Err = GidParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim();
        if let Ok(addr) = Ipv6Addr::from_str(t) {
            return Ok(Gid(addr.octets()));
        }
        // 32 bare hex digits (what some tools print, and `/sys/class/infiniband/*/gids/*` without
        // colons).
        let hex: String = t.chars().filter(|c| *c != ':').collect();
        if hex.len() == 32 && hex.chars().all(|c| c.is_ascii_hexdigit()) {
            let mut raw = [0u8; 16];
            for (i, byte) in raw.iter_mut().enumerate() {
                *byte =
                    u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| GidParseError {
                        input: s.to_owned(),
                    })?;
            }
            return Ok(Gid(raw));
        }
        Err(GidParseError {
            input: s.to_owned(),
        })
    }
}

/// The RoCE version (or InfiniBand) of a GID table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum GidType {
    /// InfiniBand (a port whose link layer is InfiniBand).
    Ib,
    /// RoCE v1: raw Ethernet frames, one L2 domain only.
    RoceV1,
    /// RoCE v2: UDP/IP, routable.
    RoceV2,
}

impl GidType {
    /// Parses the text of `gid_attrs/types/<i>` (`"IB/RoCE v1"`, `"RoCE v2"`) for a port whose
    /// link layer is `link`.
    pub fn from_sysfs(text: &str, link: LinkLayer) -> Option<GidType> {
        match text.trim() {
            "RoCE v2" => Some(GidType::RoceV2),
            "IB/RoCE v1" | "RoCE v1" | "IB" => Some(match link {
                LinkLayer::Ethernet => GidType::RoceV1,
                LinkLayer::InfiniBand => GidType::Ib,
            }),
            _ => None,
        }
    }
}

/// Which IP family a RoCE GID belongs to.
pub use super::super::config::GidFamily;

impl Gid {
    /// The family of the address this GID stands for.
    pub fn family(&self) -> GidFamily {
        if self.ipv4().is_some() {
            GidFamily::Ipv4
        } else {
            GidFamily::Ipv6
        }
    }
}

/// One populated entry of a port's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table.
    pub index: u8,
    /// The GID.
    pub gid: Gid,
    /// Its type, if the kernel says.
    pub kind: Option<GidType>,
}

/// Reads the populated entries of a port's GID table from sysfs under `root` (normally
/// `/sys/class/infiniband`). Empty (all-zero) and unreadable entries are skipped.
pub fn read_gid_table(
    root: &std::path::Path,
    device: &str,
    port: u8,
    table_len: usize,
    link: LinkLayer,
) -> Vec<GidEntry> {
    let port_dir = root.join(device).join("ports").join(port.to_string());
    (0..table_len.min(256))
        .filter_map(|i| {
            let gid: Gid = std::fs::read_to_string(port_dir.join("gids").join(i.to_string()))
                .ok()?
                .parse()
                .ok()?;
            if gid.is_zero() {
                return None;
            }
            let kind = std::fs::read_to_string(
                port_dir.join("gid_attrs").join("types").join(i.to_string()),
            )
            .ok()
            .and_then(|t| GidType::from_sysfs(&t, link));
            Some(GidEntry {
                index: i as u8,
                gid,
                kind,
            })
        })
        .collect()
}

/// The GID index to use on RoCE when none is configured: the first RoCE v2 entry of `prefer`,
/// else the first RoCE v2 entry of the other family.
pub fn choose_gid(entries: &[GidEntry], prefer: GidFamily) -> Result<u8, AddressingError> {
    let v2 = || entries.iter().filter(|e| e.kind == Some(GidType::RoceV2));
    v2().find(|e| e.gid.family() == prefer)
        .or_else(|| v2().next())
        .map(|e| e.index)
        .ok_or(AddressingError::NoRoceV2 {
            entries: entries.len(),
        })
}

/// Refuses a peer whose GID cannot talk to ours: a different RoCE version, or a different IP
/// family (IPv4-mapped against IPv6). Missing information on either side passes.
pub fn check_same_gid_family(
    ours: (Gid, Option<GidType>),
    theirs: (Gid, Option<GidType>),
) -> Result<(), String> {
    if let (Some(a), Some(b)) = (ours.1, theirs.1)
        && a != b
    {
        return Err(format!(
            "GID type mismatch: ours {} is {a:?}, the peer's {} is {b:?}; use the same RoCE \
                 version on both sides (WEIGHTSYNC_RDMA_GID_INDEX, see `ibv_devinfo -v`)",
            ours.0, theirs.0
        ));
    }
    if ours.0.family() != theirs.0.family() {
        return Err(format!(
            "GID family mismatch: ours {} is {:?}, the peer's {} is {:?}; such a pair never \
             connects (set verbs.gid_family / WEIGHTSYNC_RDMA_GID_FAMILY, or the GID index, \
             alike on both sides)",
            ours.0,
            ours.0.family(),
            theirs.0,
            theirs.0.family()
        ));
    }
    Ok(())
}

/// The link layer of a port, from `ibv_port_attr::link_layer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkLayer {
    /// InfiniBand: LIDs from a subnet manager.
    InfiniBand,
    /// Ethernet: RoCE (Soft-RoCE `rxe`, ConnectX in Ethernet mode).
    Ethernet,
}

impl LinkLayer {
    /// Maps the raw verbs value (`IBV_LINK_LAYER_*`); `UNSPECIFIED` (old drivers) means
    /// InfiniBand, as in libibverbs itself.
    pub fn from_raw(raw: u8) -> LinkLayer {
        if u32::from(raw) == ibverbs_sys::IBV_LINK_LAYER_ETHERNET {
            LinkLayer::Ethernet
        } else {
            LinkLayer::InfiniBand
        }
    }
}

/// How our queue pairs address the peer in the RTR transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addressing {
    /// Local route by LID, no GRH (`is_global = 0`).
    Lid,
    /// Global route: `is_global = 1`, the peer's GID in the GRH, our GID at `sgid_index`.
    Global {
        /// Index of our own GID in the port's GID table.
        sgid_index: u8,
    },
}

/// Why no addressing could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AddressingError {
    /// RoCE cannot route without a GID.
    #[error(
        "port link layer is Ethernet (RoCE) but no GID index is configured: RoCE routes by GID \
         only; set WEIGHTSYNC_RDMA_GID_INDEX (or verbs.gid_index) to a RoCE v2 entry of \
         `ibv_devinfo -v` (often 1 or 3)"
    )]
    RoceNeedsGid,
    /// Automatic selection found no RoCE v2 entry.
    #[error(
        "no RoCE v2 entry among the port's {entries} populated GIDs (is the netdev up, with an \
         IP address?); set WEIGHTSYNC_RDMA_GID_INDEX to an entry of `ibv_devinfo -v`"
    )]
    NoRoceV2 {
        /// Populated entries seen.
        entries: usize,
    },
    /// The configured index is outside the port's GID table.
    #[error("GID index {index} is outside the port's GID table of {table_len} entries")]
    GidIndexOutOfRange {
        /// Configured index.
        index: u8,
        /// Entries in the table.
        table_len: usize,
    },
    /// InfiniBand port without a LID and without a GID to route by.
    #[error(
        "InfiniBand port has LID 0 (no subnet manager assigned one) and no GID index is \
         configured; start a subnet manager (opensm) or set WEIGHTSYNC_RDMA_GID_INDEX"
    )]
    NoLid,
}

/// Chooses how to address peers, from the port's link layer, its LID, the GID table length and the
/// configured GID index.
pub fn choose_addressing(
    link: LinkLayer,
    lid: u16,
    gid_table_len: usize,
    gid_index: Option<u8>,
) -> Result<Addressing, AddressingError> {
    if let Some(index) = gid_index {
        if usize::from(index) >= gid_table_len {
            return Err(AddressingError::GidIndexOutOfRange {
                index,
                table_len: gid_table_len,
            });
        }
        return Ok(Addressing::Global { sgid_index: index });
    }
    match link {
        LinkLayer::Ethernet => Err(AddressingError::RoceNeedsGid),
        LinkLayer::InfiniBand if lid == 0 => Err(AddressingError::NoLid),
        LinkLayer::InfiniBand => Ok(Addressing::Lid),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_like_ipv6() {
        let g: Gid = "fe80:0000:0000:0000:5054:00ff:fe12:3456".parse().unwrap();
        assert_eq!(g.to_string(), "fe80::5054:ff:fe12:3456");
        assert_eq!(g.0[0], 0xfe);
        assert_eq!(g.0[15], 0x56);
        assert_eq!(g.to_string().parse::<Gid>().unwrap(), g);

        let v4: Gid = "::ffff:192.168.1.5".parse().unwrap();
        assert_eq!(v4.ipv4(), Some(std::net::Ipv4Addr::new(192, 168, 1, 5)));
        assert_eq!(v4.to_string(), "::ffff:192.168.1.5");
        assert_eq!(g.ipv4(), None);
    }

    #[test]
    fn parses_bare_hex_and_rejects_garbage() {
        let g: Gid = "fe80000000000000505400fffe123456".parse().unwrap();
        assert_eq!(g, "fe80::5054:ff:fe12:3456".parse().unwrap());
        for bad in [
            "",
            "rxe0",
            "fe80::zz",
            "1234",
            "fe80000000000000505400fffe1234567",
        ] {
            let err = bad.parse::<Gid>().unwrap_err();
            assert!(err.to_string().contains("invalid GID"), "{err}");
        }
        assert!(Gid::default().is_zero());
        assert!(!g.is_zero());
    }

    #[test]
    fn gid_serde_round_trips() {
        let g: Gid = "::ffff:10.0.0.7".parse().unwrap();
        let bytes = bincode::serialize(&g).unwrap();
        assert_eq!(bytes.len(), 16);
        assert_eq!(bincode::deserialize::<Gid>(&bytes).unwrap(), g);
        let json = serde_json::to_string(&g).unwrap();
        assert_eq!(serde_json::from_str::<Gid>(&json).unwrap(), g);
    }

    #[test]
    fn roce_needs_a_gid_and_infiniband_uses_the_lid() {
        assert_eq!(
            choose_addressing(LinkLayer::Ethernet, 0, 4, Some(1)),
            Ok(Addressing::Global { sgid_index: 1 })
        );
        let err = choose_addressing(LinkLayer::Ethernet, 0, 4, None).unwrap_err();
        assert_eq!(err, AddressingError::RoceNeedsGid);
        assert!(err.to_string().contains("WEIGHTSYNC_RDMA_GID_INDEX"));
        assert_eq!(
            choose_addressing(LinkLayer::InfiniBand, 7, 1, None),
            Ok(Addressing::Lid)
        );
        assert_eq!(
            choose_addressing(LinkLayer::InfiniBand, 0, 1, None),
            Err(AddressingError::NoLid)
        );
        // A GID index on InfiniBand means a global route (e.g. across subnets).
        assert_eq!(
            choose_addressing(LinkLayer::InfiniBand, 7, 2, Some(0)),
            Ok(Addressing::Global { sgid_index: 0 })
        );
        assert_eq!(
            choose_addressing(LinkLayer::Ethernet, 0, 2, Some(2)),
            Err(AddressingError::GidIndexOutOfRange {
                index: 2,
                table_len: 2
            })
        );
    }

    fn entry(index: u8, gid: &str, kind: GidType) -> GidEntry {
        GidEntry {
            index,
            gid: gid.parse().unwrap(),
            kind: Some(kind),
        }
    }

    /// V13: without a configured index RoCE picks RoCE v2, of the preferred family.
    #[test]
    fn automatic_gid_choice_takes_roce_v2_of_the_preferred_family() {
        let table = [
            entry(0, "fe80::5054:ff:fe12:3456", GidType::RoceV1),
            entry(1, "fe80::5054:ff:fe12:3456", GidType::RoceV2),
            entry(2, "::ffff:10.0.0.7", GidType::RoceV1),
            entry(3, "::ffff:10.0.0.7", GidType::RoceV2),
        ];
        assert_eq!(choose_gid(&table, GidFamily::Ipv4), Ok(3));
        assert_eq!(choose_gid(&table, GidFamily::Ipv6), Ok(1));
        assert_eq!(
            choose_gid(&table[..3], GidFamily::Ipv4),
            Ok(1),
            "falls back to v2 IPv6"
        );
        let err = choose_gid(&table[..1], GidFamily::Ipv4).unwrap_err();
        assert!(err.to_string().contains("RoCE v2"), "{err}");
    }

    /// V13: a pair of GIDs of different families or RoCE versions never connects: refuse it.
    #[test]
    fn mismatched_gid_families_or_types_are_refused() {
        let v4: Gid = "::ffff:10.0.0.7".parse().unwrap();
        let v4b: Gid = "::ffff:10.0.0.8".parse().unwrap();
        let ll: Gid = "fe80::1".parse().unwrap();
        let v2 = Some(GidType::RoceV2);
        check_same_gid_family((v4, v2), (v4b, v2)).unwrap();
        let err = check_same_gid_family((v4, v2), (ll, v2)).unwrap_err();
        assert!(err.contains("family"), "{err}");
        let err = check_same_gid_family((v4, v2), (v4b, Some(GidType::RoceV1))).unwrap_err();
        assert!(err.contains("type"), "{err}");
        check_same_gid_family((v4, None), (v4b, v2)).unwrap();
    }

    /// V17: GID types come from sysfs, not from `ibv_query_gid_ex` (rdma-core >= 32).
    #[test]
    fn gid_table_is_read_from_sysfs() {
        let root = tempfile::tempdir().unwrap();
        let port = root.path().join("rxe0/ports/1");
        std::fs::create_dir_all(port.join("gids")).unwrap();
        std::fs::create_dir_all(port.join("gid_attrs/types")).unwrap();
        let gids = [
            "fe80:0000:0000:0000:5054:00ff:fe12:3456",
            "fe80:0000:0000:0000:5054:00ff:fe12:3456",
            "0000:0000:0000:0000:0000:ffff:0a00:0007",
            "0000:0000:0000:0000:0000:0000:0000:0000",
        ];
        let types = ["IB/RoCE v1", "RoCE v2", "RoCE v2", ""];
        for (i, (g, t)) in gids.iter().zip(types).enumerate() {
            std::fs::write(port.join("gids").join(i.to_string()), format!("{g}\n")).unwrap();
            std::fs::write(
                port.join("gid_attrs/types").join(i.to_string()),
                format!("{t}\n"),
            )
            .unwrap();
        }
        let table = read_gid_table(root.path(), "rxe0", 1, 4, LinkLayer::Ethernet);
        assert_eq!(table.len(), 3, "the zero entry is skipped: {table:?}");
        assert_eq!(table[0].kind, Some(GidType::RoceV1));
        assert_eq!(
            table[2].gid.ipv4(),
            Some(std::net::Ipv4Addr::new(10, 0, 0, 7))
        );
        assert_eq!(choose_gid(&table, GidFamily::Ipv4), Ok(2));
        assert_eq!(
            GidType::from_sysfs("IB/RoCE v1", LinkLayer::InfiniBand),
            Some(GidType::Ib)
        );
        assert!(read_gid_table(root.path(), "mlx5_0", 1, 4, LinkLayer::Ethernet).is_empty());
    }

    #[test]
    fn link_layer_from_raw() {
        assert_eq!(
            LinkLayer::from_raw(ibverbs_sys::IBV_LINK_LAYER_ETHERNET as u8),
            LinkLayer::Ethernet
        );
        assert_eq!(
            LinkLayer::from_raw(ibverbs_sys::IBV_LINK_LAYER_INFINIBAND as u8),
            LinkLayer::InfiniBand
        );
        assert_eq!(LinkLayer::from_raw(0), LinkLayer::InfiniBand);
    }
}
