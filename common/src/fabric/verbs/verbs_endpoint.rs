//! What two queue pairs must learn about each other before they can talk.
//!
//! An RC queue pair only reaches RTR once it knows the peer's QP number, the first packet sequence
//! number (PSN) the peer will send, and how to reach the peer (LID on InfiniBand, GID on RoCE).
//! These travel through the bootstrap TCP connection as bincode ([`QpEndpoint`]); the path MTU and
//! the largest message are exchanged too so that both sides agree on the smaller ones, the GID type
//! so that a pair that could never connect is refused, and the receive depth so that the writer
//! knows its initial receive credits.

use serde::{Deserialize, Serialize};

use super::verbs_gid::{Gid, GidType};

/// One side of a queue-pair connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QpEndpoint {
    /// The queue pair number.
    pub qp_num: u32,
    /// First PSN this side will send (24 bits); the peer uses it as its `rq_psn`.
    pub psn: u32,
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Our GID when routing globally (always on RoCE).
    pub gid: Option<Gid>,
    /// The port's active MTU as the verbs enum value (1 = 256 B .. 5 = 4096 B).
    pub mtu: u32,
    /// Receives this side posted before answering (a writer's initial credits; 1 from a writer).
    pub recv_depth: u32,
    /// Largest message this side's port carries.
    pub max_msg_size: u64,
    /// The type of `gid`, if known.
    pub gid_type: Option<GidType>,
}

/// The largest message both sides carry (a piece longer than the peer's limit fails there).
pub fn agreed_max_msg(local: u64, remote: u64) -> u64 {
    match (local, remote) {
        (0, r) => r.max(1),
        (l, 0) => l,
        (l, r) => l.min(r),
    }
}

/// PSNs are 24-bit.
pub const PSN_MASK: u32 = 0x00ff_ffff;

/// A random initial PSN (random so that a reconnected lane never accepts stale packets of the
/// queue pair it replaces).
pub fn random_psn() -> u32 {
    rand::random::<u32>() & PSN_MASK
}

/// The path MTU both sides can carry: the smaller of the two active MTUs (verbs enum values are
/// ordered by size).
pub fn agreed_mtu(local: u32, remote: u32) -> u32 {
    local.min(remote).clamp(1, 5)
}

/// Bytes in a verbs MTU enum value (for logs).
pub fn mtu_bytes(mtu: u32) -> u32 {
    128 << mtu.clamp(1, 5)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_bincode_round_trip() {
        let ep = QpEndpoint {
            qp_num: 0x11,
            psn: 0xabcdef,
            lid: 0,
            gid: Some("::ffff:10.1.2.3".parse().unwrap()),
            mtu: 3,
            recv_depth: 512,
            max_msg_size: 8 << 20,
            gid_type: Some(GidType::RoceV2),
        };
        let bytes = bincode::serialize(&ep).unwrap();
        assert_eq!(bincode::deserialize::<QpEndpoint>(&bytes).unwrap(), ep);
        let ib = QpEndpoint {
            gid: None,
            lid: 42,
            ..ep
        };
        let bytes = bincode::serialize(&ib).unwrap();
        assert_eq!(bincode::deserialize::<QpEndpoint>(&bytes).unwrap(), ib);
        assert!(bincode::deserialize::<QpEndpoint>(&bytes[..bytes.len() - 1]).is_err());
    }

    #[test]
    fn psn_is_24_bit_and_mtu_is_the_smaller() {
        for _ in 0..100 {
            assert_eq!(random_psn() & !PSN_MASK, 0);
        }
        assert_eq!(agreed_mtu(5, 3), 3);
        assert_eq!(agreed_mtu(1, 5), 1);
        assert_eq!(agreed_mtu(0, 9), 1);
        assert_eq!(mtu_bytes(1), 256);
        assert_eq!(mtu_bytes(5), 4096);
    }

    /// V14: an old rxe (8 MiB messages) and a ConnectX (1 GiB) agree on 8 MiB.
    #[test]
    fn max_message_is_the_smaller_of_both_sides() {
        assert_eq!(agreed_max_msg(1 << 30, 8 << 20), 8 << 20);
        assert_eq!(agreed_max_msg(8 << 20, 1 << 30), 8 << 20);
        assert_eq!(
            agreed_max_msg(1 << 30, 0),
            1 << 30,
            "an unknown peer limit keeps ours"
        );
    }
}
