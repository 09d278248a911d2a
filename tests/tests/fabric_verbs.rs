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
//! On RoCE the GID index may be left out: the backend picks the first RoCE v2 entry
//! (`WEIGHTSYNC_RDMA_GID_FAMILY` chooses IPv4 or IPv6). `tests/verbs-device-check.sh` runs all of
//! this, plus the hardware-counter checks, on a named device.
//!
//! Both instances of each check run in this process on the same device, talking over the NIC
//! (loopback through the port), bootstrapped over 127.0.0.1. The torn-write check is skipped:
//! a verbs writer cannot die half-way through a message the NIC already took (the NIC either
//! delivers the whole message, or the receiver gets no completion at all). After the conformance
//! checks come the device checks of the review (registrations, memlock, receive credits); the
//! checks at the end need no device and always run.
#![cfg(feature = "rdma")]

use std::time::Duration;

use weightsync_common::fabric::verbs::verbs_memlock::{MemlockPolicy, memlock_limit};
use weightsync_common::fabric::verbs::{ENV_DEVICE, VerbsFabric, device_names};
use weightsync_common::fabric::{
    Access, BackendKind, Endpoint, Fabric, FabricBackend, FabricConfig, FabricError,
    RemoteAccessKind, VerbsConfig, WriteOp, WriteWindow,
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

/// A verbs fabric with `lanes` lanes and `recv_depth` receives per queue pair.
async fn verbs_with(lanes: usize, recv_depth: u32) -> VerbsFabric {
    let config = FabricConfig {
        backend: BackendKind::Verbs,
        io_timeout_ms: 5_000,
        connect_timeout_ms: 3_000,
        verbs: VerbsConfig {
            recv_depth,
            ..Default::default()
        },
        ..FabricConfig::loopback(conformance::TOKEN, lanes)
    };
    VerbsFabric::start(&config).await.expect("starting verbs")
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
async fn strided_sources_land_gathered_one_lane() {
    require_device();
    conformance::strided_sources_land_gathered(&Verbs, 1).await;
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn strided_sources_land_gathered_four_lanes() {
    require_device();
    conformance::strided_sources_land_gathered(&Verbs, 4).await;
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

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn immediates_at_most_once_under_cuts_one_lane() {
    require_device();
    let stats = conformance::immediates_at_most_once_under_cuts(&Verbs, 1, 20, 0x17).await;
    eprintln!("verbs, 1 lane: {stats:?}");
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn immediates_at_most_once_under_cuts_two_lanes() {
    require_device();
    let stats = conformance::immediates_at_most_once_under_cuts(&Verbs, 2, 20, 0x19).await;
    eprintln!("verbs, 2 lanes: {stats:?}");
}

#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn immediates_at_most_once_under_cuts_four_lanes() {
    require_device();
    let stats = conformance::immediates_at_most_once_under_cuts(&Verbs, 4, 20, 0x1b).await;
    eprintln!("verbs, 4 lanes: {stats:?}");
}

// ---- Device checks of the review ---------------------------------------------------------------

/// V1: two SOURCE (local-only) registrations in one fabric coexist, also where the driver gives
/// both rkey 0 (Soft-RoCE before Linux 6.5), and dropping one leaves the other usable.
#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn two_local_only_sources_coexist() {
    require_device();
    let (a, b) = (verbs_with(1, 512).await, verbs_with(1, 512).await);
    let dst = b.alloc(1 << 20, Access::RECEIVE).unwrap();
    let first = a.alloc(1 << 16, Access::SOURCE).unwrap();
    let second = a.alloc(1 << 16, Access::SOURCE).unwrap();
    eprintln!(
        "source rkeys: {:#x} and {:#x} (both 0 on rxe before Linux 6.5)",
        first.rkey(),
        second.rkey()
    );
    first.write_at(0, &[7u8; 4096]).unwrap();
    a.write(WriteOp::new(&first, 0, dst.descriptor(), 0, 4096))
        .await
        .expect("write from the first source");
    drop(second);
    a.write(WriteOp::new(&first, 0, dst.descriptor(), 4096, 4096))
        .await
        .expect("write from the first source after the second was dropped");
    assert_eq!(dst.copy_to_vec(0, 8192).unwrap(), vec![7u8; 8192]);
}

/// V2: run as root (or with CAP_IPC_LOCK) under `ulimit -l 64`: registering 16 MiB succeeds,
/// as the kernel allows it.
#[tokio::test]
#[ignore = "requires an RDMA device and root or CAP_IPC_LOCK with a small `ulimit -l`"]
async fn registration_above_the_memlock_limit_when_exempt() {
    require_device();
    let policy = MemlockPolicy::current().unwrap();
    eprintln!(
        "memlock limit {:?}, policy {policy:?}",
        memlock_limit().unwrap()
    );
    assert!(
        policy.is_exempt(),
        "run this check as root or with CAP_IPC_LOCK (the script does)"
    );
    let a = verbs_with(1, 512).await;
    let region = a
        .alloc(16 << 20, Access::RECEIVE)
        .expect("16 MiB above the ulimit");
    assert_eq!(region.len(), 16 << 20);
}

/// V4: a receiver with only 8 receives per queue pair takes 10,000 zero-length immediates
/// without the writer meeting RNR (the script compares the RNR hardware counters around this),
/// and a receiver whose progress thread stalls for 10 ms mid-stream does not fail the writer.
#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn small_receive_queue_and_a_stalled_receiver_meet_no_rnr() {
    require_device();
    let (a, b) = (verbs_with(2, 8).await, verbs_with(2, 8).await);
    let dst = b.alloc(4096, Access::RECEIVE).unwrap();
    let src = a.alloc(4096, Access::SOURCE).unwrap();
    let d = dst.descriptor().clone();
    let mut writes = Vec::new();
    for i in 0..10_000u32 {
        if i == 5_000 {
            b.stall_progress(Duration::from_millis(10));
        }
        writes.push(a.write(WriteOp::new(&src, 0, &d, 0, 0).with_imm(0x7000 + (i % 4))));
    }
    for (i, w) in writes.into_iter().enumerate() {
        w.await
            .unwrap_or_else(|e| panic!("zero-length write {i} with a small receive queue: {e}"));
    }
    for imm in 0x7000..0x7004 {
        b.imm_counter()
            .expect_within(imm, 2_500, Duration::from_secs(10))
            .await
            .unwrap_or_else(|e| panic!("expect({imm:#x}, 2500): {e}"));
    }
}

/// Waits (bounded) until `b` counted `n` writes outside its window: the refusal's async event
/// reaches the receiver's event thread a little after the writer's NAK.
async fn outside_window_reaches(b: &VerbsFabric, n: u64) {
    for _ in 0..200 {
        if b.stats().outside_window >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(b.stats().outside_window, n, "{:?}", b.stats());
}

/// Issue 39: a verbs receiver's write window, enforced by the NIC (`verbs_window`). A write into
/// a receiver whose window is closed is refused (the queue pair has no remote write), counted as
/// `outside_window` from the refusal's async event, and changes no byte and counts no
/// immediate; inside the armed window writes land. Covers both ways a queue pair gets the
/// window's access: connected while closed (INIT without remote write) and modified RTS -> RTS
/// while connected (closing, and arming again without reconnecting).
#[tokio::test]
#[ignore = "requires an RDMA device: set WEIGHTSYNC_RDMA_DEVICE (e.g. rxe0)"]
async fn a_closed_write_window_refuses_writes_in_the_nic() {
    require_device();
    let (a, b) = (verbs_with(1, 64).await, verbs_with(1, 64).await);
    let len = 1 << 16;
    let dst = b.alloc(len, Access::RECEIVE).unwrap();
    dst.write_at(0, &vec![1u8; len]).unwrap();
    let src = a.alloc(len, Access::SOURCE).unwrap();
    let op = || WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64).with_imm(0x39);
    let refused = |e: &FabricError| {
        e.remote_access_kind() == Some(RemoteAccessKind::OutsideWindow)
            || e.to_string().contains("invalid request")
    };
    // 1. Closed before any lane exists: the queue pair comes up without remote write.
    b.set_write_window(WriteWindow::Closed);
    src.write_at(0, &vec![7u8; len]).unwrap();
    let err = a
        .write(op())
        .await
        .expect_err("a write into a closed window");
    assert!(refused(&err), "refused for another reason: {err}");
    outside_window_reaches(&b, 1).await;
    assert_eq!(dst.to_vec().unwrap(), vec![1u8; len], "bytes changed");
    assert_eq!(
        b.imm_counter().unclaimed(0x39),
        0,
        "a refused write counted"
    );

    // 2. Armed: the writer reconnects (its lane broke) and the write lands.
    b.set_write_window(WriteWindow::Armed { epoch: 1 });
    a.write(op())
        .await
        .expect("a write inside the armed window");
    assert_eq!(dst.to_vec().unwrap(), vec![7u8; len]);
    b.imm_counter()
        .expect_within(0x39, 1, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(b.stats().inbound_queue_pairs >= 1, "{:?}", b.stats());

    // 3. Closed and armed again on the connected queue pair (RTS -> RTS both ways): it lands
    //    through the same lane.
    b.set_write_window(WriteWindow::Closed);
    b.set_write_window(WriteWindow::Armed { epoch: 2 });
    src.write_at(0, &vec![8u8; len]).unwrap();
    a.write(op()).await.expect("a write after close and re-arm");
    assert_eq!(dst.to_vec().unwrap(), vec![8u8; len]);
    assert_eq!(b.stats().outside_window, 1, "no refusal while armed");

    // 4. Closed on the connected queue pair: refused, counted, nothing lands.
    b.set_write_window(WriteWindow::Closed);
    src.write_at(0, &vec![9u8; len]).unwrap();
    let err = a.write(op()).await.expect_err("a write after the close");
    assert!(refused(&err), "refused for another reason: {err}");
    outside_window_reaches(&b, 2).await;
    assert_eq!(dst.to_vec().unwrap(), vec![8u8; len], "bytes changed");
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
