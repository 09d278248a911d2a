//! The fabric conformance suite against the TCP backend, with 1, 2 and 4 lanes, plus the TCP-only
//! fault hooks: cutting lanes, and a raw client that authenticates, sends half a frame and dies.

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use weightsync_common::fabric::tcp::frame::FrameHeader;
use weightsync_common::fabric::tcp::handshake::client_handshake;
use weightsync_common::fabric::{
    Endpoint, FabricConfig, FabricError, JobToken, RegionDescriptor, TcpFabric,
};
use weightsync_tests::conformance::{self, BackendFactory};

/// The TCP backend, with same-host pulls on or off.
struct Tcp {
    same_host: bool,
}

impl BackendFactory for Tcp {
    type Backend = TcpFabric;

    async fn start(&self, job_token: &str, lanes: usize) -> Result<TcpFabric, FabricError> {
        let config = FabricConfig {
            io_timeout_ms: 3_000,
            connect_timeout_ms: 3_000,
            same_host: self.same_host,
            ..FabricConfig::loopback(job_token, lanes)
        };
        TcpFabric::start(&config).await
    }

    fn cut_lanes(&self, backend: &TcpFabric, peer: &Endpoint) -> bool {
        backend.cut_lanes(peer);
        true
    }

    async fn send_torn_write(
        &self,
        job_token: &str,
        dst: &RegionDescriptor,
        len: u64,
        imm: u32,
    ) -> bool {
        let token = job_token.to_owned();
        let dst = dst.clone();
        tokio::task::spawn_blocking(move || {
            let mut s = TcpStream::connect(dst.endpoint.as_str()).expect("connect");
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let key = JobToken(token).handshake_key();
            client_handshake(&mut s, &key, 12345, &dst.endpoint).expect("handshake");
            let header = FrameHeader {
                signalled: true,
                imm: Some(imm),
                part: None,
                rkey: dst.rkey,
                addr: dst.base,
                len,
                source: None,
                stride: None,
                epoch: 0,
            };
            s.write_all(&header.encode()).unwrap();
            s.write_all(&vec![0xEE; (len / 2) as usize]).unwrap();
            s.flush().unwrap();
            // Dies here: the connection closes with half the payload sent.
        })
        .await
        .expect("torn writer thread");
        true
    }
}

/// The suite, once per way a same-host lane carries bytes: pulled by the receiver out of the
/// writer's memory (the default where both run on one machine), and as payloads on the socket
/// (what lanes between machines do).
macro_rules! conformance_suite {
    ($name:ident, $factory:expr_2021) => {
        mod $name {
            use super::*;

            const F: Tcp = $factory;

            #[tokio::test]
            async fn bytes_land_exactly_one_lane() {
                conformance::bytes_land_exactly(&F, 1).await;
            }

            #[tokio::test]
            async fn bytes_land_exactly_four_lanes() {
                conformance::bytes_land_exactly(&F, 4).await;
            }

            #[tokio::test]
            async fn strided_sources_land_gathered_one_lane() {
                conformance::strided_sources_land_gathered(&F, 1).await;
            }

            #[tokio::test]
            async fn strided_sources_land_gathered_four_lanes() {
                conformance::strided_sources_land_gathered(&F, 4).await;
            }

            #[tokio::test]
            async fn immediates_counted_exactly_one_lane() {
                conformance::immediates_counted_exactly(&F, 1).await;
            }

            #[tokio::test]
            async fn immediates_counted_exactly_four_lanes() {
                conformance::immediates_counted_exactly(&F, 4).await;
            }

            #[tokio::test]
            async fn refused_writes_touch_nothing() {
                conformance::refused_writes_touch_nothing(&F, 2).await;
            }

            #[tokio::test]
            async fn unauthenticated_writer_refused() {
                conformance::unauthenticated_writer_refused(&F).await;
            }

            #[tokio::test]
            async fn deregistration_takes_effect_at_once() {
                conformance::deregistration_takes_effect_at_once(&F, 2).await;
            }

            #[tokio::test]
            async fn torn_write_never_counted() {
                conformance::torn_write_never_counted(&F).await;
            }

            #[tokio::test]
            async fn receiver_death_fails_writes() {
                conformance::receiver_death_fails_writes(&F, 2).await;
            }

            #[tokio::test]
            async fn lanes_recover() {
                conformance::lanes_recover(&F, 2).await;
            }

            #[tokio::test]
            async fn reset_discards_posted_writes_one_lane() {
                conformance::reset_discards_posted_writes(&F, 1).await;
            }

            #[tokio::test]
            async fn reset_discards_posted_writes_four_lanes() {
                conformance::reset_discards_posted_writes(&F, 4).await;
            }

            #[tokio::test]
            async fn immediates_at_most_once_under_cuts_one_lane() {
                at_most_once_under_cuts(&F, 1).await;
            }

            #[tokio::test]
            async fn immediates_at_most_once_under_cuts_two_lanes() {
                at_most_once_under_cuts(&F, 2).await;
            }

            #[tokio::test]
            async fn immediates_at_most_once_under_cuts_four_lanes() {
                at_most_once_under_cuts(&F, 4).await;
            }
        }
    };
}

conformance_suite!(pulled, Tcp { same_host: true });
conformance_suite!(payloads, Tcp { same_host: false });

/// At most once under random cuts, 20 bursts per lane count (seeded, so a failure names the
/// seed and burst that reproduce it).
async fn at_most_once_under_cuts(f: &Tcp, lanes: usize) {
    let stats =
        conformance::immediates_at_most_once_under_cuts(f, lanes, 20, 0x17 + lanes as u64).await;
    eprintln!("tcp (same_host {}), {lanes} lanes: {stats:?}", f.same_host);
    assert_eq!(stats.writes, 20 * u64::from(conformance::CUT_BURST_WRITES));
    assert!(stats.cuts >= 20, "every burst was cut: {stats:?}");
}

/// A raw peer that authenticates and then stops reading until the returned sender is dropped;
/// then it runs `then` on its socket (the thread's result).
fn stalled_peer<T: Send + 'static>(
    then: impl FnOnce(std::net::TcpStream) -> T + Send + 'static,
) -> (
    std::net::SocketAddr,
    std::sync::mpsc::Sender<()>,
    std::thread::JoinHandle<T>,
) {
    use weightsync_common::fabric::tcp::handshake::server_handshake;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (release, hold) = std::sync::mpsc::channel::<()>();
    let peer = std::thread::spawn(move || {
        let (mut s, peer) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let key = JobToken(conformance::TOKEN.into()).handshake_key();
        server_handshake(&mut s, &key, &peer.into(), false).unwrap();
        let _ = hold.recv();
        then(s)
    });
    (addr, release, peer)
}

/// A writer with `io_timeout_ms` and one lane, and a 64 MiB write to a peer at `addr` (the peer
/// never checks rkeys: it does not read).
async fn big_write_to(
    addr: std::net::SocketAddr,
    io_timeout_ms: u64,
) -> (
    TcpFabric,
    weightsync_common::fabric::Region,
    RegionDescriptor,
    u64,
) {
    use weightsync_common::fabric::{Access, FabricBackend};
    let config = FabricConfig {
        io_timeout_ms,
        ..FabricConfig::loopback(conformance::TOKEN, 1)
    };
    let writer = TcpFabric::start(&config).await.unwrap();
    let len = 64u64 << 20;
    let src = writer.alloc(len as usize, Access::SOURCE).unwrap();
    let dst = RegionDescriptor {
        endpoint: addr.into(),
        base: 1 << 20,
        len,
        rkey: 1,
    };
    (writer, src, dst, len)
}

/// The partition case, made deterministic: the peer stops reading, so the write's frames sit in
/// the writer's send queue. `reset_connections` fails the write at once with `ConnectionsReset`
/// (not after `io_timeout`), and the queued bytes are discarded: when the peer reads again it
/// gets what its own receive buffer held, then a reset, never the rest of the 64 MiB.
#[tokio::test]
async fn reset_fails_a_stalled_write_at_once_and_discards_its_queued_bytes() {
    use std::io::Read;
    use weightsync_common::fabric::{FabricBackend, WriteOp};

    // After the writer has reset, read whatever still arrives.
    let (addr, release, stalled) = stalled_peer(|mut s| {
        let mut got = 0u64;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            match s.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n as u64,
            }
        }
        got
    });
    // Far longer than the test: only the reset can end the write.
    let (writer, src, dst, len) = big_write_to(addr, 600_000).await;
    let write = tokio::spawn(writer.write(WriteOp::new(&src, 0, &dst, 0, len)));
    // Wait until the sender is blocked on a full send queue.
    let sent = tokio::time::timeout(conformance::HANG_GUARD, async {
        loop {
            let s = writer.stats().bytes_sent;
            tokio::time::sleep(Duration::from_millis(50)).await;
            if s > 0 && writer.stats().bytes_sent == s {
                return s;
            }
        }
    })
    .await
    .expect("the writer never filled its send queue");
    writer.reset_connections().await;
    let r = tokio::time::timeout(conformance::HANG_GUARD, write)
        .await
        .expect("the reset write must resolve at once, not wait for io_timeout")
        .unwrap();
    assert!(
        matches!(r, Err(FabricError::ConnectionsReset { .. })),
        "expected ConnectionsReset, got {r:?}"
    );
    assert_eq!(writer.stats().lane_failures, 0, "a reset is not a failure");
    drop(release);
    let got = stalled.join().unwrap();
    assert!(
        got <= sent && got < len,
        "the peer read {got} bytes after the reset; the writer had handed {sent} to its kernel \
         and queued {len}"
    );
}

/// A peer that authenticates and then stops reading makes the writer fail with `Timeout` after
/// `io_timeout` instead of hanging (TCP-specific: the stalled peer is a raw socket).
#[tokio::test]
async fn stalled_reader_times_out() {
    use weightsync_common::fabric::{FabricBackend, WriteOp};

    // Never read a frame; keep the socket open until the test is done.
    let (addr, release, stalled) = stalled_peer(drop);
    let (writer, src, dst, len) = big_write_to(addr, 300).await;
    let r = tokio::time::timeout(
        conformance::HANG_GUARD,
        writer.write(WriteOp::new(&src, 0, &dst, 0, len)),
    )
    .await
    .expect("the write must fail, not hang");
    assert!(
        matches!(r, Err(FabricError::Timeout { .. })),
        "expected a timeout, got {r:?}"
    );
    assert!(writer.stats().lane_failures >= 1);
    drop(release);
    stalled.join().unwrap();
}
