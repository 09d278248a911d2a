//! Refused writes never change a byte they may not write: fabric level, with guard pages.
//!
//! Two adjacent regions A and B fill a mapping fenced by `PROT_NONE` pages (a write one byte
//! before A or after B would kill this process with SIGSEGV), and every usable byte holds a
//! canary pattern. Forged writes (wrong rkey, out of bounds into the neighbour or the guard
//! pages, to a deregistered region, from a peer without the job token, and hand-made frames on
//! an authenticated lane) must all be refused and leave every byte as it was. A permitted write
//! then changes exactly its own bytes, so the check is not vacuous.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use weightsync_common::fabric::tcp::frame::{COMPLETION_LEN, Completion, FrameHeader};
use weightsync_common::fabric::tcp::handshake::client_handshake;
use weightsync_common::fabric::{
    Access, Endpoint, Fabric, FabricBackend, FabricConfig, FabricError, JobToken, PAGE_SIZE,
    RemoteAccessKind, WriteOp,
};
use weightsync_tests::canary::{GuardedPages, GuardedRegion, canary, first_change_outside};

const TOKEN: &str = "canary-suite-token";
const LIMIT: Duration = Duration::from_secs(20);

struct Setup {
    writer: Fabric,
    receiver: Fabric,
    pages: Arc<GuardedPages>,
    a: GuardedRegion,
    b: GuardedRegion,
}

async fn setup() -> Setup {
    let writer = Fabric::start(&FabricConfig::loopback(TOKEN, 2))
        .await
        .expect("writer");
    let receiver = Fabric::start(&FabricConfig::loopback(TOKEN, 2))
        .await
        .expect("receiver");
    let pages = Arc::new(GuardedPages::new(4).expect("guarded mapping"));
    pages.fill_with(canary);
    let half = 2 * PAGE_SIZE;
    let a = GuardedRegion::register(&receiver, &pages, 0, half, Access::RECEIVE).expect("A");
    let b = GuardedRegion::register(&receiver, &pages, half, half, Access::RECEIVE).expect("B");
    Setup {
        writer,
        receiver,
        pages,
        a,
        b,
    }
}

async fn refused(s: &Setup, op: WriteOp, what: &str) -> FabricError {
    let r = tokio::time::timeout(LIMIT, s.writer.write(op))
        .await
        .unwrap_or_else(|_| panic!("{what}: write hung"));
    r.expect_err(&format!("{what}: a forged write was accepted"))
}

fn assert_untouched(s: &Setup, before: &[u8], what: &str) {
    let after = s.pages.snapshot();
    if let Some(i) = first_change_outside(before, &after, (0, 0)) {
        panic!("{what}: byte {i} of the guarded mapping changed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_writes_change_no_byte_and_a_permitted_one_only_its_own() {
    let s = setup().await;
    let src = s
        .writer
        .alloc(3 * PAGE_SIZE, Access::SOURCE)
        .expect("source");
    src.write_at(0, &vec![0x11; 3 * PAGE_SIZE]).expect("fill");
    let before = s.pages.snapshot();
    let (a, b) = (s.a.descriptor(), s.b.descriptor());

    let mut wrong = a.clone();
    wrong.rkey ^= 0x0101_0101;
    let e = refused(
        &s,
        WriteOp::new(&src, 0, &wrong, 0, 64).with_imm(1),
        "wrong rkey",
    )
    .await;
    assert_eq!(
        e.remote_access_kind(),
        Some(RemoteAccessKind::WrongRkey),
        "{e}"
    );

    // A's key, a descriptor forged to reach into B.
    let mut longer = a.clone();
    longer.len += b.len;
    let e = refused(
        &s,
        WriteOp::new(&src, 0, &longer, a.len - 16, 64).with_imm(1),
        "A's key straddling into B",
    )
    .await;
    assert_eq!(
        e.remote_access_kind(),
        Some(RemoteAccessKind::OutOfBounds),
        "{e}"
    );
    let e = refused(
        &s,
        WriteOp::new(&src, 0, &longer, a.len, 64).with_imm(1),
        "A's key wholly inside B",
    )
    .await;
    assert_eq!(
        e.remote_access_kind(),
        Some(RemoteAccessKind::OutOfBounds),
        "{e}"
    );

    // Into the guard pages: before A, after B.
    let mut before_a = a.clone();
    before_a.base -= 32;
    refused(
        &s,
        WriteOp::new(&src, 0, &before_a, 0, 64),
        "before A (guard page)",
    )
    .await;
    let mut longer_b = b.clone();
    longer_b.len += PAGE_SIZE as u64;
    refused(
        &s,
        WriteOp::new(&src, 0, &longer_b, b.len - 8, 64),
        "past B (guard page)",
    )
    .await;

    // B deregistered: its old descriptor writes nothing.
    s.b.region().deregister();
    let e = refused(
        &s,
        WriteOp::new(&src, 0, &b, 0, 4096).with_imm(2),
        "deregistered B",
    )
    .await;
    assert!(
        matches!(
            e.remote_access_kind(),
            Some(RemoteAccessKind::Deregistered | RemoteAccessKind::WrongRkey)
        ),
        "{e}"
    );

    // A peer without the job token.
    let intruder = Fabric::start(&FabricConfig::loopback("not-the-token", 1))
        .await
        .expect("intruder");
    let isrc = intruder
        .alloc(PAGE_SIZE, Access::SOURCE)
        .expect("intruder source");
    let r = tokio::time::timeout(LIMIT, intruder.write(WriteOp::new(&isrc, 0, &a, 0, 64)))
        .await
        .expect("unauthenticated write hung");
    assert!(
        matches!(r, Err(FabricError::Auth { .. })),
        "intruder: {r:?}"
    );

    assert_untouched(&s, &before, "after forged writes");
    let stats = s.receiver.imm_counter().stats();
    assert_eq!(
        stats.arrived, 0,
        "a refused write counted an immediate: {stats:?}"
    );

    // A permitted write changes exactly its bytes.
    tokio::time::timeout(LIMIT, s.writer.write(WriteOp::new(&src, 0, &a, 100, 50)))
        .await
        .expect("permitted write hung")
        .expect("permitted write");
    let after = s.pages.snapshot();
    assert_eq!(first_change_outside(&before, &after, (100, 150)), None);
    assert!(
        after[100..150].iter().all(|&x| x == 0x11),
        "the permitted bytes landed"
    );
}

/// A lane that authenticated (it knows the token) and then sends hand-made frames: out of
/// bounds, overflowing addresses, a payload shorter than announced, a PULL it did not agree
/// on. Nothing lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hand_made_frames_on_an_authenticated_lane_change_nothing() {
    let s = setup().await;
    let before = s.pages.snapshot();
    let a = s.a.descriptor();
    let peer: Endpoint = s.receiver.endpoint().clone();
    let key = JobToken(TOKEN.into()).handshake_key();
    let connect = || {
        let mut st = TcpStream::connect(peer.as_str()).expect("connect");
        st.set_read_timeout(Some(LIMIT)).expect("timeout");
        client_handshake(&mut st, &key, rand::random(), &peer).expect("handshake");
        st
    };

    // Out of bounds by one byte at A's end, signalled: refused with a completion, payload
    // drained or lane dropped, A and B unchanged.
    let mut st = connect();
    let h = FrameHeader {
        signalled: true,
        imm: Some(7),
        part: None,
        rkey: a.rkey,
        addr: a.base + a.len - 63,
        len: 64,
        source: None,
        stride: None,
        epoch: 0,
    };
    st.write_all(&h.encode()).expect("header");
    st.write_all(&[0x22; 64]).expect("payload");
    let mut c = [0u8; COMPLETION_LEN];
    // The receiver answers with a refusal, or drops a lane that misbehaves (also a refusal).
    if st.read_exact(&mut c).is_ok() {
        let done = Completion::decode(&c).expect("a valid completion");
        assert_eq!(
            done.error.map(|e| e.0),
            Some(RemoteAccessKind::OutOfBounds),
            "{done:?}"
        );
    }

    // Address overflow: the decoder refuses the header; the lane is dropped.
    let mut st = connect();
    let mut raw = FrameHeader {
        signalled: true,
        imm: None,
        part: None,
        rkey: a.rkey,
        addr: 0,
        len: 64,
        source: None,
        stride: None,
        epoch: 0,
    }
    .encode();
    raw[16..24].copy_from_slice(&(u64::MAX - 8).to_le_bytes());
    st.write_all(&raw).expect("header");
    let _ = st.write_all(&[0x33; 64]);
    let mut sink = Vec::new();
    let _ = st.read_to_end(&mut sink);

    // A payload shorter than announced, then the writer vanishes: a torn write, not counted.
    let mut st = connect();
    let h = FrameHeader {
        signalled: true,
        imm: Some(9),
        part: None,
        rkey: a.rkey,
        addr: a.base,
        len: 4096,
        source: None,
        stride: None,
        epoch: 0,
    };
    st.write_all(&h.encode()).expect("header");
    st.write_all(&[0x44; 1000]).expect("partial payload");
    drop(st);

    // A PULL frame on a lane that agreed no same-host pulls (`client_handshake` offers none),
    // naming a source this very process holds (so a receiver that pulled anyway could read it):
    // the lane is dropped, nothing lands.
    let bait = vec![0x66u8; 64];
    let mut st = connect();
    let pull = FrameHeader {
        signalled: true,
        imm: Some(11),
        part: None,
        rkey: a.rkey,
        addr: a.base + 200,
        len: 64,
        source: Some(bait.as_ptr() as u64),
        stride: None,
        epoch: 0,
    };
    st.write_all(&pull.encode()).expect("pull header");
    let _ = st.read_to_end(&mut sink);
    drop(bait);

    // Frames on a lane that never authenticated.
    let mut st = TcpStream::connect(peer.as_str()).expect("connect");
    st.set_read_timeout(Some(LIMIT)).expect("timeout");
    let _ = st.write_all(
        &FrameHeader {
            addr: a.base + 8,
            ..h
        }
        .encode(),
    );
    let _ = st.write_all(&[0x55; 4096]);
    let _ = st.read_to_end(&mut sink);

    // Give the receiver threads time to act on what they got, then check: only the torn
    // write's prefix may have landed in A (inside the region it was allowed to write), nothing
    // else anywhere, and no immediate counted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after = s.pages.snapshot();
    assert_eq!(
        first_change_outside(&before, &after, (0, 1000)),
        None,
        "a hand-made frame changed bytes it may not write"
    );
    assert!(
        after[..1000]
            .iter()
            .zip(&before[..1000])
            .all(|(x, y)| x == y || *x == 0x44),
        "bytes in A other than the torn write's own prefix changed"
    );
    let stats = s.receiver.imm_counter().stats();
    assert_eq!(
        stats.arrived, 0,
        "a hand-made frame counted an immediate: {stats:?}"
    );
    // The receiver still serves honest writers.
    let src = s.writer.alloc(PAGE_SIZE, Access::SOURCE).expect("source");
    tokio::time::timeout(
        LIMIT,
        s.writer.write(WriteOp::new(&src, 0, &a, 0, 64).with_imm(3)),
    )
    .await
    .expect("honest write hung")
    .expect("honest write after hand-made frames");
}
