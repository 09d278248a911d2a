//! Fabric configuration: which backend, how many lanes, how long to wait, which job.
//!
//! One serde struct so that the controller can hand the same settings to every worker (TOML or
//! JSON). The job token is the shared secret that lanes prove knowledge of during the handshake;
//! its `Debug` output is redacted so it never reaches a log.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::error::{FabricError, Result};

/// Which backend carries the writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// User-space RDMA emulation over TCP (works everywhere).
    #[default]
    Tcp,
    /// ibverbs (needs the `rdma` feature and an RDMA device).
    Verbs,
}

/// The job's shared secret. Never sent on the wire; `Debug` prints `JobToken(<redacted>)`.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct JobToken(pub String);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobToken(<redacted>)")
    }
}

impl JobToken {
    /// The 32-byte key both sides derive from the token for the handshake's keyed hashes.
    pub fn handshake_key(&self) -> [u8; 32] {
        blake3::derive_key("weightsync fabric job token v1", self.0.as_bytes())
    }
}

/// The IP family of the RoCE GID to pick when no GID index is configured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GidFamily {
    /// IPv4-mapped GIDs (`::ffff:a.b.c.d`).
    #[default]
    Ipv4,
    /// IPv6 GIDs.
    Ipv6,
}

/// Settings of the ibverbs backend (ignored by TCP).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct VerbsConfig {
    /// Device name (e.g. `mlx5_0`, `rxe0`); `None` picks the first device whose port is active.
    pub device: Option<String>,
    /// Port number (1-based).
    pub port: u8,
    /// GID index (addressing through the GRH). `None`: on RoCE the first RoCE v2 entry of
    /// `gid_family`; on InfiniBand the LID.
    pub gid_index: Option<u8>,
    /// Family of the automatically chosen RoCE GID.
    pub gid_family: GidFamily,
    /// RoCE: the GRH traffic class, i.e. the IP DSCP/ECN byte (DSCP 26 with ECN is 106). Lossless
    /// fabrics map RDMA to one DSCP; 0 rides the default (lossy) queue.
    pub traffic_class: u8,
    /// Service level (0..=15): the InfiniBand virtual lane, or the priority on RoCE fabrics that
    /// map it (commonly 3 for RDMA).
    pub service_level: u8,
    /// Receive buffers pre-posted per queue pair for WRITE_WITH_IMM completions (the writer's
    /// receive credits).
    pub recv_depth: u32,
    /// Send queue depth per queue pair.
    pub send_depth: u32,
    /// RNR retry count (7 means infinite in verbs; keep it finite).
    pub rnr_retry: u8,
    /// RNR NAK timer asked of writers (IB encoding: 12 = 0.64 ms, 18 = 5.12 ms, 20 = 10.24 ms).
    pub min_rnr_timer: u8,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms).
    pub ack_timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR` (0..=7).
    pub retry_cnt: u8,
}

impl Default for VerbsConfig {
    fn default() -> Self {
        VerbsConfig {
            device: None,
            port: 1,
            gid_index: None,
            gid_family: GidFamily::Ipv4,
            traffic_class: 0,
            service_level: 0,
            recv_depth: 512,
            send_depth: 512,
            rnr_retry: 6,
            min_rnr_timer: 18,
            ack_timeout: 14,
            retry_cnt: 7,
        }
    }
}

/// How a same-host receiver reads a writer's memory (see [`FabricConfig::same_host_path`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SameHostPath {
    /// `process_vm_readv` where allowed, shared memory where ptrace access is refused.
    #[default]
    Auto,
    /// Shared memory whenever both sides offer it.
    Shared,
    /// `process_vm_readv` only.
    Ptrace,
}

/// Everything needed to start a fabric.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FabricConfig {
    /// Backend.
    pub backend: BackendKind,
    /// Address to listen on (`"127.0.0.1:0"` picks a free port); it becomes the endpoint.
    pub listen: String,
    /// TCP: further local addresses, one per NIC beyond the first (e.g. `["10.0.1.7:0"]`). The
    /// fabric listens on each, its endpoint advertises all of them (`listen` first), and its
    /// lanes to a peer are spread over the pairs of local and peer addresses, so that one
    /// sync's bytes stripe across every NIC. Empty (the default) is the single-NIC setup.
    pub extra_listen: Vec<String>,
    /// Lanes (TCP connections or queue pairs) per peer. The default is chosen from the machine
    /// ([`FabricConfig::machine_lanes_per_peer`]); TCP opens at least one lane per address of
    /// either side, and once a writer said how many peers it writes to, at most its share of
    /// the machine's lanes ([`FabricConfig::lanes_for_peers`]).
    pub lanes_per_peer: usize,
    /// Writes longer than this may be split over the lanes to their peer (into pieces of at
    /// least this size); TCP splits one only where that makes it land sooner, i.e. over lanes
    /// with less queued than the write ([`place`](super::place)).
    pub stripe_min_bytes: u64,
    /// Time allowed to connect and authenticate a lane.
    pub connect_timeout_ms: u64,
    /// A lane whose peer makes no progress mid-frame for this long fails with `Timeout`.
    pub io_timeout_ms: u64,
    /// TCP: each lane's socket send buffer (bytes; 0 keeps the OS default and its autotuning),
    /// and its receive buffer too when `receive_buffer_bytes` is 0. The default, 1 MiB (the
    /// kernel doubles it), covers a datacenter link's bandwidth-delay product per lane while
    /// keeping what a writer has copied and not yet delivered small enough to stay in the CPU
    /// caches until the receiver copies it out: with 4 MiB, or with autotuning, the receiver
    /// copies from memory the sender's copy already pushed out of the cache, and pays for it.
    pub socket_buffer_bytes: usize,
    /// TCP: each lane's socket receive buffer (bytes; 0 means `socket_buffer_bytes`). The
    /// default, 4 MiB, lets a writer hand its frames over without waiting for the window, so
    /// that a stream of small frames wakes both ends less often; a receiver that keeps up
    /// holds far less than this.
    pub receive_buffer_bytes: usize,
    /// TCP: let a receiver on the writer's own machine copy each frame's bytes out of the
    /// writer's memory itself (`process_vm_readv`, one copy) instead of the socket carrying
    /// them (two copies): see `tcp::same_host`. Agreed per lane after authentication, only
    /// where the receiver can prove the writer's pid and read its memory; elsewhere the lane
    /// carries payloads. Both sides must allow it. Default on.
    pub same_host: bool,
    /// TCP, with `same_host`: how a same-host receiver reads the writer's sources. `auto`
    /// (default): `process_vm_readv` where the kernel allows it, else memory shared by file
    /// descriptor (`fabric::shared_memory`); `shared`: shared memory whenever both sides offer
    /// it; `ptrace`: `process_vm_readv` only (refused: payloads).
    pub same_host_path: SameHostPath,
    /// Shared secret of the job.
    pub job_token: JobToken,
    /// ibverbs settings.
    pub verbs: VerbsConfig,
}

impl Default for FabricConfig {
    fn default() -> Self {
        FabricConfig {
            backend: BackendKind::Tcp,
            listen: "127.0.0.1:0".into(),
            extra_listen: Vec::new(),
            lanes_per_peer: FabricConfig::machine_lanes_per_peer(1),
            stripe_min_bytes: 256 << 10,
            connect_timeout_ms: 5_000,
            io_timeout_ms: 10_000,
            socket_buffer_bytes: 1 << 20,
            receive_buffer_bytes: 4 << 20,
            same_host: true,
            same_host_path: SameHostPath::Auto,
            job_token: JobToken(String::new()),
            verbs: VerbsConfig::default(),
        }
    }
}

impl FabricConfig {
    /// A loopback TCP configuration with the given token and lane count (tests, benches).
    pub fn loopback(job_token: &str, lanes_per_peer: usize) -> Self {
        FabricConfig {
            lanes_per_peer,
            job_token: JobToken(job_token.to_owned()),
            ..Default::default()
        }
    }

    /// The lane count this machine should use per peer with `local_addresses` NICs: enough
    /// connections to keep every core copying (on loopback both ends' copies share the cores),
    /// at least two, and a whole number of lanes per address so that every NIC carries the
    /// same share.
    pub fn machine_lanes_per_peer(local_addresses: usize) -> usize {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let addresses = local_addresses.max(1);
        let base = cores.clamp(2, 8);
        base.div_ceil(addresses) * addresses
    }

    /// Lanes to open to each peer when a writer said it writes to `peers` of them
    /// ([`FabricBackend::expect_peers`](super::FabricBackend::expect_peers); 0: not said):
    /// the machine's lanes for one peer ([`FabricConfig::machine_lanes_per_peer`]) shared out
    /// over the peers, at least one each, and never more than `configured` (`lanes_per_peer`).
    /// Each TCP lane is a sending and a completion thread here and a receiving thread at the
    /// peer: a trainer writing to 4 rollouts over 2 lanes each ran 24 busy threads on this
    /// 2-core machine, and its syncs took 1.28x as long as with one lane each (`bench e2e`).
    pub fn lanes_for_peers(configured: usize, local_addresses: usize, peers: usize) -> usize {
        if peers == 0 {
            return configured;
        }
        let budget = FabricConfig::machine_lanes_per_peer(local_addresses);
        configured.min(budget.div_ceil(peers)).max(1)
    }

    /// Every local address to listen on and write from: `listen`, then `extra_listen`.
    pub fn listen_addresses(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.listen.as_str()).chain(self.extra_listen.iter().map(String::as_str))
    }

    /// Checks the settings, naming the first bad field.
    pub fn validate(&self) -> Result<()> {
        let mut seen = std::collections::HashSet::new();
        for (i, address) in self.listen_addresses().enumerate() {
            let field = if i == 0 {
                "listen".to_owned()
            } else {
                format!("extra_listen[{}]", i - 1)
            };
            if address.trim().is_empty() {
                return Err(FabricError::Config(format!("{field} is empty")));
            }
            if address.contains(',') {
                return Err(FabricError::Config(format!(
                    "{field} is {address:?}: one address per entry (list further NICs in \
                     extra_listen)"
                )));
            }
            if !seen.insert(address) {
                return Err(FabricError::Config(format!(
                    "{field} repeats the address {address}"
                )));
            }
        }
        if self.lanes_per_peer == 0 || self.lanes_per_peer > 64 {
            return Err(FabricError::Config(format!(
                "lanes_per_peer must be 1..=64, got {}",
                self.lanes_per_peer
            )));
        }
        if self.job_token.0.is_empty() {
            return Err(FabricError::Config(
                "job_token is empty: every process of a job must share a secret token".into(),
            ));
        }
        if self.connect_timeout_ms == 0 || self.io_timeout_ms == 0 {
            return Err(FabricError::Config(
                "connect_timeout_ms and io_timeout_ms must be positive".into(),
            ));
        }
        Ok(())
    }

    /// The send and receive buffer sizes a TCP lane's sockets ask for (0: the OS default).
    pub fn socket_buffers(&self) -> (usize, usize) {
        let receive = match self.receive_buffer_bytes {
            0 => self.socket_buffer_bytes,
            n => n,
        };
        (self.socket_buffer_bytes, receive)
    }

    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// `io_timeout_ms` as a duration.
    pub fn io_timeout(&self) -> Duration {
        Duration::from_millis(self.io_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_are_shared_out_over_the_peers_a_writer_names() {
        let budget = FabricConfig::machine_lanes_per_peer(1);
        // Not told: the configured count.
        assert_eq!(FabricConfig::lanes_for_peers(5, 1, 0), 5);
        // One peer: the machine's budget, capped by the configured count.
        assert_eq!(FabricConfig::lanes_for_peers(64, 1, 1), budget);
        assert_eq!(FabricConfig::lanes_for_peers(1, 1, 1), 1);
        // Many peers: at least one lane each, about the budget in all.
        assert_eq!(FabricConfig::lanes_for_peers(8, 1, 1000), 1);
        let p = 2;
        assert_eq!(FabricConfig::lanes_for_peers(64, 1, p), budget.div_ceil(p));
    }

    #[test]
    fn token_is_redacted_and_config_validates() {
        let c = FabricConfig::loopback("s3cret", 2);
        assert!(!format!("{c:?}").contains("s3cret"));
        c.validate().unwrap();
        let bad = FabricConfig {
            lanes_per_peer: 0,
            ..c.clone()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("lanes_per_peer")
        );
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<FabricConfig>(&json).unwrap(), c);
        let partial: FabricConfig = serde_json::from_str(r#"{"lanes_per_peer":4}"#).unwrap();
        assert_eq!(partial.lanes_per_peer, 4);
        assert!(
            partial.same_host,
            "same-host pulls are on unless turned off"
        );
        assert!(partial.extra_listen.is_empty());
    }

    #[test]
    fn a_config_without_extra_addresses_reads_as_before() {
        // What an older peer or controller sends: no `extra_listen` field.
        let old = r#"{"backend":"tcp","listen":"10.0.0.1:0","lanes_per_peer":2,
            "stripe_min_bytes":262144,"connect_timeout_ms":5000,"io_timeout_ms":10000,
            "socket_buffer_bytes":4194304,"job_token":"t"}"#;
        let c: FabricConfig = serde_json::from_str(old).unwrap();
        assert_eq!(c.listen_addresses().collect::<Vec<_>>(), ["10.0.0.1:0"]);
        c.validate().unwrap();
    }

    #[test]
    fn extra_addresses_are_checked_by_name() {
        let c = FabricConfig {
            extra_listen: vec!["127.0.0.2:0".into()],
            ..FabricConfig::loopback("t", 2)
        };
        c.validate().unwrap();
        assert_eq!(
            c.listen_addresses().collect::<Vec<_>>(),
            ["127.0.0.1:0", "127.0.0.2:0"]
        );
        let repeated = FabricConfig {
            extra_listen: vec!["127.0.0.1:0".into()],
            ..c.clone()
        };
        let err = repeated.validate().unwrap_err().to_string();
        assert!(
            err.contains("extra_listen[0]") && err.contains("127.0.0.1:0"),
            "{err}"
        );
        let listed = FabricConfig {
            listen: "127.0.0.1:0,127.0.0.2:0".into(),
            ..c
        };
        let err = listed.validate().unwrap_err().to_string();
        assert!(
            err.contains("listen") && err.contains("extra_listen"),
            "{err}"
        );
    }

    #[test]
    fn receive_buffer_follows_the_send_buffer_when_unset() {
        let c = FabricConfig::loopback("t", 2);
        assert_eq!(c.socket_buffers(), (1 << 20, 4 << 20));
        let same = FabricConfig {
            socket_buffer_bytes: 2 << 20,
            receive_buffer_bytes: 0,
            ..c
        };
        assert_eq!(same.socket_buffers(), (2 << 20, 2 << 20));
    }

    #[test]
    fn machine_lane_count_is_a_multiple_of_the_addresses() {
        for addresses in 1..=4 {
            let lanes = FabricConfig::machine_lanes_per_peer(addresses);
            assert!(lanes >= 2 && lanes >= addresses, "{addresses} -> {lanes}");
            assert_eq!(lanes % addresses, 0, "{addresses} -> {lanes}");
        }
    }
}
