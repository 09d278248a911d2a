//! The fabric conformance suite against the ibverbs backend (feature `rdma`).
//!
//! The conformance checks need an RDMA device, so they are ignored by default. To run them, name
//! a device (a ConnectX port, or Soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`) and, on
//! RoCE, a RoCE v2 GID index from `ibv_devinfo -v`:
//!
//! ```text
//! WEIGHTSYNC_RDMA_DEVICE=rxe0 WEIGHTSYNC_RDMA_GID_INDEX=1 \
//!     cargo test -p weightsync-tests --features rdma --test fabric_verbs -- --ignored
//! ```
//!
//! Both instances of each check run in this process on the same device, talking over the NIC
//! (loopback through the port), bootstrapped over 127.0.0.1. The torn-write check is skipped:
//! a verbs writer cannot die half-way through a message the NIC already took (the NIC either
//! delivers the whole message, or the receiver gets no completion at all). The checks below the
//! conformance ones need no device and always run.
#![cfg(feature = "rdma")]

use weightsync_common::fabric::verbs::{device_names, VerbsFabric, ENV_DEVICE};
use weightsync_common::fabric::{
    BackendKind, Endpoint, Fabric, FabricConfig, FabricError, VerbsConfig,
};
use weightsync_tests::conformance::{self, BackendFactory};

struct Verbs;

impl BackendFactory for Verbs {
    type Backend = VerbsFabric;

    async fn start(&self, job_token: &str, lanes: usize) -> Result<VerbsFabric, FabricError> {
        // Device, port and GID index come from WEIGHTSYNC_RDMA_* (read by the backend).
        let config = FabricConfig {
            backend: BackendKind::Verbs,
            io_timeout_ms: 3_000,
            connect_timeout_ms: 3_000,
            ..FabricConfig::loopback(job_token, lanes)
        };
        VerbsFabric::start(&config).await
    }

    fn cut_lanes(&self, backend: &VerbsFabric, peer: &Endpoint) -> bool {
        backend.cut_lanes(peer);
        true
    }
}

/// Fails loudly when the ignored tests are run without naming a device.
fn require_device() {
    if std::env::var(ENV_DEVICE).map_or(true, |v| v.trim().is_empty()) {
        panic!(
            "{ENV_DEVICE} is not set: name an RDMA device (e.g. rxe0; found: {:?}) and, on RoCE, \
             WEIGHTSYNC_RDMA_GID_INDEX",
            device_names()
        );
    }
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn bytes_land_exactly_one_lane() {
    require_device();
    conformance::bytes_land_exactly(&Verbs, 1).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn bytes_land_exactly_four_lanes() {
    require_device();
    conformance::bytes_land_exactly(&Verbs, 4).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn immediates_counted_exactly_one_lane() {
    require_device();
    conformance::immediates_counted_exactly(&Verbs, 1).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn immediates_counted_exactly_four_lanes() {
    require_device();
    conformance::immediates_counted_exactly(&Verbs, 4).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn refused_writes_touch_nothing() {
    require_device();
    conformance::refused_writes_touch_nothing(&Verbs, 2).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn unauthenticated_writer_refused() {
    require_device();
    conformance::unauthenticated_writer_refused(&Verbs).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn deregistration_takes_effect_at_once() {
    require_device();
    conformance::deregistration_takes_effect_at_once(&Verbs, 2).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn receiver_death_fails_writes() {
    require_device();
    conformance::receiver_death_fails_writes(&Verbs, 2).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn lanes_recover() {
    require_device();
    conformance::lanes_recover(&Verbs, 2).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn reset_discards_posted_writes() {
    require_device();
    conformance::reset_discards_posted_writes(&Verbs, 2).await;
}

// ---- No device needed --------------------------------------------------------------------------

/// An infinite RNR retry is refused by configuration, before any device is touched.
#[tokio::test]
async fn infinite_rnr_retry_is_a_config_error() {
    let config = FabricConfig {
        backend: BackendKind::Verbs,
        verbs: VerbsConfig {
            rnr_retry: 7,
            ..Default::default()
        },
        ..FabricConfig::loopback("token", 1)
    };
    match Fabric::start(&config).await {
        Err(FabricError::Config(msg)) => {
            assert!(msg.contains("rnr_retry"), "{msg}");
            assert!(msg.contains("forever"), "{msg}");
        }
        Err(other) => panic!("expected a Config error, got {other}"),
        Ok(_) => panic!("rnr_retry = 7 was accepted"),
    }
}

/// Without a device (this CI machine), starting the verbs backend through the runtime `Fabric`
/// choice fails with an error that says what is missing, instead of crashing.
#[tokio::test]
async fn starting_without_a_device_says_so() {
    if !device_names().is_empty() {
        // A device exists: the ignored suite above covers this machine.
        return;
    }
    let config = FabricConfig {
        backend: BackendKind::Verbs,
        ..FabricConfig::loopback("token", 1)
    };
    let err = match Fabric::start(&config).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("the verbs backend started without any RDMA device"),
    };
    assert!(err.contains("RDMA"), "{err}");
    assert!(
        err.contains("no RDMA devices") || err.contains("no RDMA support"),
        "{err}"
    );
}
