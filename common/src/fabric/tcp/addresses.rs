//! Several local addresses (NICs) per fabric, and how an endpoint lists them.
//!
//! A host with several NICs moves a sync fastest when every NIC carries a share of it. The TCP
//! fabric listens on every configured address (`listen`, then `extra_listen`) and advertises all
//! of them in its [`Endpoint`]: one address is written as before (`"10.0.0.1:4711"`), several
//! are joined by commas, the `listen` address first (`"10.0.0.1:4711,10.0.1.1:4712"`). Because
//! the endpoint is the text every descriptor already carries, a peer learns all of a process's
//! addresses from any of its descriptors, through the controller, with no protocol change; and a
//! single-address endpoint reads exactly as it always did.
//!
//! A writer spreads its lanes to a peer over the pairs of addresses ([`LaneRoute`]): lane `i`
//! leaves from local address `i mod L` and goes to the peer's address `i mod R`, so with two
//! NICs on each side lanes 0, 2, ... use the first pair and lanes 1, 3, ... the second, and a
//! write striped over the lanes crosses both. Each local address counts the bytes it sent and
//! received, which is how a bench shows the striping.

use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::{FabricError, Result};

/// Separates the addresses of a multi-address endpoint.
const SEPARATOR: char = ',';

/// One address this fabric listens on and writes from, with its byte counters.
#[derive(Debug)]
pub(super) struct LocalAddress {
    /// The bound listener's address (its port is where peers connect).
    pub addr: SocketAddr,
    /// Bytes this process sent from this address (frame headers included), counted as a lane
    /// hands them to its socket: a write's bytes are all counted before its completion.
    pub bytes_sent: AtomicU64,
    /// Payload bytes that landed here through lanes accepted on this address, read from their
    /// sockets (bytes a same-host pull copied out of the writer crossed no address).
    pub bytes_received: AtomicU64,
}

impl LocalAddress {
    pub fn new(addr: SocketAddr) -> LocalAddress {
        LocalAddress {
            addr,
            bytes_sent: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
        }
    }
}

/// Bytes moved through one local address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressBytes {
    /// The address, as the endpoint lists it.
    pub address: String,
    /// Bytes sent from it (frame headers included).
    pub bytes_sent: u64,
    /// Payload bytes received on it (same-host pulls not counted: they cross no address).
    pub bytes_received: u64,
}

impl AddressBytes {
    pub(super) fn of(local: &LocalAddress) -> AddressBytes {
        AddressBytes {
            address: local.addr.to_string(),
            bytes_sent: local.bytes_sent.load(Ordering::Relaxed),
            bytes_received: local.bytes_received.load(Ordering::Relaxed),
        }
    }
}

/// The endpoint advertising `addrs` (the first is the primary address).
pub(super) fn endpoint_of(addrs: &[SocketAddr]) -> Endpoint {
    let parts: Vec<String> = addrs.iter().map(SocketAddr::to_string).collect();
    Endpoint(parts.join(&SEPARATOR.to_string()))
}

/// How many addresses `peer` advertises (without resolving them).
pub(super) fn address_count(peer: &Endpoint) -> usize {
    peer.as_str().split(SEPARATOR).count()
}

/// The peer's address number `index` (modulo their count), resolved. An error names the address
/// that could not be resolved.
pub(super) fn peer_address(peer: &Endpoint, index: usize) -> Result<SocketAddr> {
    let parts: Vec<&str> = peer.as_str().split(SEPARATOR).collect();
    let part = parts[index % parts.len()].trim();
    let unreachable = |e: std::io::Error| FabricError::PeerUnreachable {
        peer: peer.clone(),
        source: Arc::new(if parts.len() > 1 {
            std::io::Error::new(e.kind(), format!("address {part}: {e}"))
        } else {
            e
        }),
    };
    part.to_socket_addrs()
        .map_err(unreachable)?
        .next()
        .ok_or_else(|| {
            unreachable(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "resolves to no address",
            ))
        })
}

/// Which addresses one lane uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct LaneRoute {
    /// Index of the local address the lane leaves from (for its counters).
    pub local: usize,
    /// The local IP to bind before connecting; `None` lets the kernel choose (a single local
    /// address, as before, or a wildcard listen address).
    pub bind: Option<IpAddr>,
    /// Index of the peer's address the lane goes to.
    pub remote: usize,
}

impl LaneRoute {
    /// The route of lane `lane` when this side has `locals` and the peer `remotes` addresses.
    pub fn of_lane(lane: usize, locals: &[LocalAddress], remotes: usize) -> LaneRoute {
        let local = lane % locals.len().max(1);
        let bind = (locals.len() > 1)
            .then(|| locals[local].addr.ip())
            .filter(|ip| !ip.is_unspecified());
        LaneRoute {
            local,
            bind,
            remote: lane % remotes.max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locals(addrs: &[&str]) -> Vec<LocalAddress> {
        addrs
            .iter()
            .map(|a| LocalAddress::new(a.parse().unwrap()))
            .collect()
    }

    #[test]
    fn one_address_reads_as_before() {
        let ep = endpoint_of(&["127.0.0.1:4711".parse().unwrap()]);
        assert_eq!(ep.as_str(), "127.0.0.1:4711");
        assert_eq!(address_count(&ep), 1);
        assert_eq!(
            peer_address(&ep, 3).unwrap(),
            "127.0.0.1:4711".parse().unwrap()
        );
        let route = LaneRoute::of_lane(3, &locals(&["127.0.0.1:1"]), 1);
        assert_eq!(
            route,
            LaneRoute {
                local: 0,
                bind: None,
                remote: 0
            }
        );
    }

    #[test]
    fn lanes_spread_over_address_pairs() {
        let ep = endpoint_of(&[
            "127.0.0.1:4711".parse().unwrap(),
            "127.0.0.2:4712".parse().unwrap(),
        ]);
        assert_eq!(ep.as_str(), "127.0.0.1:4711,127.0.0.2:4712");
        assert_eq!(address_count(&ep), 2);
        assert_eq!(peer_address(&ep, 1).unwrap().port(), 4712);
        let mine = locals(&["127.0.0.1:1", "127.0.0.2:2"]);
        let routes: Vec<_> = (0..4)
            .map(|i| LaneRoute::of_lane(i, &mine, 2))
            .map(|r| (r.local, r.bind.map(|ip| ip.to_string()), r.remote))
            .collect();
        let one = Some("127.0.0.1".to_owned());
        let two = Some("127.0.0.2".to_owned());
        assert_eq!(
            routes,
            [
                (0, one.clone(), 0),
                (1, two.clone(), 1),
                (0, one, 0),
                (1, two, 1)
            ]
        );
        // A wildcard listen address binds nothing.
        let wild = locals(&["0.0.0.0:1", "127.0.0.2:2"]);
        assert_eq!(LaneRoute::of_lane(0, &wild, 1).bind, None);
    }

    #[test]
    fn an_unresolvable_address_is_named() {
        let ep = Endpoint("127.0.0.1:1,no-such-host.invalid:2".into());
        let err = peer_address(&ep, 1).unwrap_err().to_string();
        assert!(err.contains("no-such-host.invalid:2"), "{err}");
    }
}
