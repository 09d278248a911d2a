//! The fabric conformance suite: one set of checks that every backend must pass.
//!
//! Each check is an `async fn` generic over a [`BackendFactory`], which starts fresh instances of
//! the backend under test (with a given job token and lane count) and optionally offers the fault
//! hooks the backend supports. `tests/tests/fabric_tcp.rs` runs it for TCP; the verbs suite runs
//! the same functions when an RDMA device is named.
//!
//! What is checked (the contract documented on `FabricBackend`):
//! - bytes land byte-exact, at odd offsets and sizes, with writes split over lanes;
//! - a write from a strided source lands its runs in order, small and large, starting part-way
//!   into a run, its immediate counted once ([`strided_sources_land_gathered`]);
//! - immediates are counted exactly (many writes, several immediates, several lanes, arbitrary
//!   completion order), and never more than once for a split write;
//! - refused writes (wrong rkey, out of bounds, no write permission, deregistered, unauthenticated
//!   writer) return the right error, count no immediate, and leave the region and the canary bytes
//!   around it untouched;
//! - after `deregister` returns, no byte lands any more, even from a write in flight;
//! - a writer dying mid-payload never produces a counted immediate, and a receiver dying makes the
//!   writer's write fail instead of hanging;
//! - lanes recover after a failure;
//! - `reset_connections` resolves every write posted before it (landed, or failed with
//!   `ConnectionsReset`), none of them lands afterwards, and the next write works;
//! - at most once under faults: lanes cut at random moments during a burst of writes with
//!   distinct immediates never make an immediate count more often than it was written, and every
//!   write reported `Ok` is counted exactly once ([`immediates_at_most_once_under_cuts`]).
//!
//! Checks panic with a message naming what went wrong; each is bounded by a hang guard so a
//! broken backend fails instead of hanging CI (no check asserts on timing).

use std::future::Future;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use weightsync_common::fabric::{
    Access, Endpoint, FabricBackend, FabricError, Memory, MemoryLocation, RawMemory, Region,
    RegionDescriptor, RemoteAccessKind, Stride, WriteOp,
};

/// The job token the suite uses for instances that should trust each other.
pub const TOKEN: &str = "conformance-job-token";

/// Longest any single step may take before the suite calls it a hang.
pub const HANG_GUARD: Duration = Duration::from_secs(20);

/// Starts instances of the backend under test and offers its fault hooks.
pub trait BackendFactory: Sync {
    /// The backend.
    type Backend: FabricBackend;

    /// Starts a fresh instance (its own endpoint and immediate counter).
    fn start(
        &self,
        job_token: &str,
        lanes: usize,
    ) -> impl Future<Output = Result<Self::Backend, FabricError>> + Send;

    /// Breaks every lane from `backend` to `peer` as a pulled cable would. Returns `false` when
    /// the backend offers no such hook (the check is then skipped).
    fn cut_lanes(&self, _backend: &Self::Backend, _peer: &Endpoint) -> bool {
        false
    }

    /// Acts as a writer that authenticates with `job_token`, starts a write of `len` bytes with
    /// immediate `imm` into `dst` at offset 0, sends only part of the payload and dies. Returns
    /// `false` when the backend cannot emulate this (the check is then skipped).
    fn send_torn_write(
        &self,
        _job_token: &str,
        _dst: &RegionDescriptor,
        _len: u64,
        _imm: u32,
    ) -> impl Future<Output = bool> + Send {
        async { false }
    }
}

/// Awaits every future in order. The writes behind them make progress concurrently anyway:
/// backends post a write when it is created, not when it is first polled.
async fn join_all<F: Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut out = Vec::with_capacity(futures.len());
    for f in futures {
        out.push(f.await);
    }
    out
}

async fn guarded<T>(what: &str, f: impl Future<Output = T>) -> T {
    match tokio::time::timeout(HANG_GUARD, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {HANG_GUARD:?} (hang)"),
    }
}

const CANARY: u8 = 0xA5;
const CANARY_LEN: usize = 4096;

/// A receive region registered in the middle of a larger allocation whose edges hold canary
/// bytes, so a write outside the region's bounds would be seen.
#[derive(Debug)]
pub struct CanaryRegion {
    region: Option<Region>,
    buf: *mut [u8],
    len: usize,
}

// SAFETY: the buffer is owned by this struct and only accessed through raw copies; the region
// handle is Send + Sync.
unsafe impl Send for CanaryRegion {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for CanaryRegion {}

impl CanaryRegion {
    /// Allocates `len` zeroed bytes between two canary blocks and registers them on `backend`.
    pub fn new<B: FabricBackend>(backend: &B, len: usize, access: Access) -> CanaryRegion {
        let mut v = vec![0u8; len + 2 * CANARY_LEN].into_boxed_slice();
        v[..CANARY_LEN].fill(CANARY);
        v[CANARY_LEN + len..].fill(CANARY);
        let buf = Box::into_raw(v);
        // SAFETY: buf is a live allocation of len + 2 * CANARY_LEN bytes, so the offset stays
        // inside it.
        let start = unsafe { (buf as *mut u8).add(CANARY_LEN) };
        // SAFETY: [start, start + len) is inside the allocation, which this struct frees only
        // after dropping the region (see Drop), and the suite never holds references into it.
        let raw = unsafe { RawMemory::new(start, len, MemoryLocation::Host) };
        let region = backend
            .register(Memory::Raw(raw), access)
            .expect("registering a canary region");
        CanaryRegion {
            region: Some(region),
            buf,
            len,
        }
    }

    /// The registered region.
    pub fn region(&self) -> &Region {
        self.region.as_ref().expect("region present until drop")
    }

    /// Its descriptor.
    pub fn descriptor(&self) -> RegionDescriptor {
        self.region().descriptor().clone()
    }

    /// The region's bytes.
    pub fn bytes(&self) -> Vec<u8> {
        self.region().to_vec().expect("reading the region")
    }

    /// Panics unless both canary blocks are intact.
    pub fn assert_canaries(&self, what: &str) {
        let total = self.len + 2 * CANARY_LEN;
        let mut copy = vec![0u8; total];
        // SAFETY: buf is a live allocation of `total` bytes; the canary parts are never
        // registered, so nothing writes them concurrently (unless the backend is broken, which is
        // what this detects); the region part may be written concurrently, which only makes the
        // copied region bytes unspecified, and those are not inspected here.
        unsafe { std::ptr::copy_nonoverlapping(self.buf as *const u8, copy.as_mut_ptr(), total) };
        assert!(
            copy[..CANARY_LEN].iter().all(|&b| b == CANARY),
            "{what}: bytes before the region were overwritten"
        );
        assert!(
            copy[CANARY_LEN + self.len..].iter().all(|&b| b == CANARY),
            "{what}: bytes after the region were overwritten"
        );
    }
}

impl Drop for CanaryRegion {
    fn drop(&mut self) {
        if let Some(r) = self.region.take() {
            r.deregister();
        }
        // SAFETY: buf came from Box::into_raw in `new` and is freed once; the region was
        // deregistered above, so the backend no longer touches the memory.
        drop(unsafe { Box::from_raw(self.buf) });
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn source<B: FabricBackend>(backend: &B, data: &[u8]) -> Region {
    let r = backend
        .alloc(data.len().max(1), Access::SOURCE)
        .expect("registering a source");
    r.write_at(0, data).expect("filling a source");
    r
}

async fn pair<F: BackendFactory>(f: &F, lanes: usize) -> (F::Backend, F::Backend) {
    let a = f.start(TOKEN, lanes).await.expect("starting writer");
    let b = f.start(TOKEN, lanes).await.expect("starting receiver");
    (a, b)
}

/// Bytes land byte-exact: odd sizes and offsets, small and large (split over lanes) writes, a
/// batch with contiguous runs that get merged.
pub async fn bytes_land_exactly<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 6 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let data = pattern(len, 1);
    let src = source(&a, &data);
    let d = dst.descriptor();
    let mut expected = vec![0u8; len];
    let cases: &[(u64, u64, u64)] = &[
        (0, 0, 1),
        (1, 17, 4095),
        (4096, 8192, 4097),
        (100_000, 200_003, 65_536),
        (1 << 20, (2 << 20) + 3, 3 << 20),
        (len as u64 - 10, len as u64 - 10, 10),
    ];
    for &(so, doff, n) in cases {
        guarded("single write", a.write(WriteOp::new(&src, so, &d, doff, n)))
            .await
            .unwrap_or_else(|e| panic!("write {n} bytes at {doff}: {e}"));
        expected[doff as usize..(doff + n) as usize]
            .copy_from_slice(&data[so as usize..(so + n) as usize]);
    }
    assert!(dst.bytes() == expected, "single writes: bytes differ");
    // A batch: 64 pieces of 1000 bytes, contiguous on both sides (merged), in shuffled order.
    let mut ops: Vec<WriteOp> = (0..64u64)
        .map(|i| WriteOp::new(&src, 5_000_000 + i * 1000, &d, 5_100_000 + i * 1000, 1000))
        .collect();
    ops.reverse();
    guarded("batch", a.write_batch(ops))
        .await
        .unwrap_or_else(|e| panic!("batch: {e}"));
    expected[5_100_000..5_164_000].copy_from_slice(&data[5_000_000..5_064_000]);
    assert!(dst.bytes() == expected, "batch: bytes differ");
    dst.assert_canaries("bytes_land_exactly");
}

/// Writes from strided sources (runs at a constant stride, as a column slice of a row-major
/// matrix lies in memory) land their runs back to back, byte-exact, whatever size and start:
/// small (one payload), large (pulled, or split over lanes and WRs), starting part-way into a
/// run, in a batch with plain writes; each immediate counts once.
pub async fn strided_sources_land_gathered<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 8 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let data = pattern(len, 3);
    let src = source(&a, &data);
    let d = dst.descriptor();
    let counter = b.imm_counter().clone();
    let mut expected = vec![0u8; len];
    // (source offset of the first byte, run, stride, head, destination offset, bytes)
    let cases: &[(u64, u64, u64, u64, u64, u64)] = &[
        (0, 3072, 6144, 0, 0, 3072 * 4),
        (100 + 1000, 3000, 8192, 1000, 20_000, 40_000),
        (7, 1, 2, 0, 70_001, 999),
        (1 << 20, 6144, 12_288, 0, 100_000, 3 << 20),
        ((4 << 20) + 5, 4096, 4160, 5, (4 << 20) + 3, (1 << 20) + 11),
    ];
    let mut ops = Vec::new();
    for (i, &(so, run, stride, head, doff, n)) in cases.iter().enumerate() {
        let layout = Stride { run, stride, head };
        let op = WriteOp::new(&src, so, &d, doff, n)
            .with_stride(layout)
            .with_imm(300);
        let mut at = doff as usize;
        for (o, k) in layout.segments(so, n) {
            expected[at..at + k as usize].copy_from_slice(&data[o as usize..(o + k) as usize]);
            at += k as usize;
        }
        if i % 2 == 0 {
            guarded("strided write", a.write(op))
                .await
                .unwrap_or_else(|e| panic!("strided write {i}: {e}"));
        } else {
            ops.push(op);
        }
    }
    // A plain write in the same batch.
    ops.push(WriteOp::new(&src, 0, &d, 7 << 20, 5000).with_imm(300));
    expected[7 << 20..(7 << 20) + 5000].copy_from_slice(&data[..5000]);
    guarded("strided batch", a.write_batch(ops))
        .await
        .unwrap_or_else(|e| panic!("strided batch: {e}"));
    let writes = cases.len() as u64 + 1;
    guarded("expect(300)", counter.expect(300, writes))
        .await
        .unwrap_or_else(|e| panic!("expect(300, {writes}): {e}"));
    assert_eq!(counter.unclaimed(300), 0, "strided immediates over-counted");
    assert!(dst.bytes() == expected, "strided writes: bytes differ");
    dst.assert_canaries("strided_sources_land_gathered");
    // A layout that reads past the source is refused before anything is sent.
    let past =
        WriteOp::new(&src, (len - 100) as u64, &d, 0, 200).with_stride(Stride::new(100, 200));
    let err = a
        .write(past)
        .await
        .expect_err("a strided source past its region");
    assert!(err.to_string().contains("write source"), "{err}");
}

/// Immediates are counted exactly: many concurrent writes with several immediates, some large
/// enough to be split over lanes; each expectation resolves, and no extra arrival is left.
pub async fn immediates_counted_exactly<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 8 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let src = source(&a, &pattern(len, 2));
    let counter = b.imm_counter().clone();
    // Expect before, during and after the writes land: arrivals must never be lost.
    let early = counter.expect(100, 50);
    let mut writes = Vec::new();
    let mut per_imm = [0u64; 3];
    for i in 0..150u64 {
        let imm_ix = (i % 3) as usize;
        per_imm[imm_ix] += 1;
        let size = if i % 10 == 0 { 1 << 20 } else { 4096 + i };
        let off = (i * 53_000) % (len as u64 - (1 << 20));
        writes.push(a.write(WriteOp::new(&src, off, &d, off, size).with_imm(100 + imm_ix as u32)));
    }
    for r in guarded("150 writes", join_all(writes)).await {
        r.unwrap_or_else(|e| panic!("write with immediate: {e}"));
    }
    guarded("expect(100)", early)
        .await
        .unwrap_or_else(|e| panic!("expect(100): {e}"));
    for (ix, &n) in per_imm.iter().enumerate().skip(1) {
        let imm = 100 + ix as u32;
        guarded("expect", counter.expect(imm, n))
            .await
            .unwrap_or_else(|e| panic!("expect({imm}, {n}): {e}"));
    }
    for imm in 100..103 {
        assert_eq!(
            counter.unclaimed(imm),
            0,
            "immediate {imm} counted more often than written"
        );
    }
    // A batch whose contiguous runs merge: immediates inside the run must still count once each.
    let ops: Vec<WriteOp> = (0..8u64)
        .map(|i| WriteOp::new(&src, i * 512, &d, i * 512, 512).with_imm(200))
        .collect();
    guarded("batch with immediates", a.write_batch(ops))
        .await
        .unwrap_or_else(|e| panic!("batch: {e}"));
    guarded("expect(200, 8)", counter.expect(200, 8))
        .await
        .unwrap_or_else(|e| panic!("expect(200, 8): {e}"));
    assert_eq!(counter.unclaimed(200), 0, "batch immediates over-counted");
    dst.assert_canaries("immediates_counted_exactly");
}

async fn expect_refusal<B: FabricBackend>(
    a: &B,
    op: WriteOp,
    want: &[RemoteAccessKind],
    what: &str,
) {
    let r = guarded(what, a.write(op)).await;
    match r {
        Err(e) => assert!(
            e.remote_access_kind().is_some_and(|k| want.contains(&k)),
            "{what}: expected one of {want:?}, got {e}"
        ),
        Ok(()) => panic!("{what}: write was accepted"),
    }
}

/// Wrong rkey, out of bounds, no permission and deregistered writes are refused with the right
/// error; nothing lands, no immediate is counted, canaries stay intact.
pub async fn refused_writes_touch_nothing<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 1 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let ro = CanaryRegion::new(&b, len, Access::SOURCE);
    let src = source(&a, &pattern(2 << 20, 3));
    let d = dst.descriptor();

    let mut wrong = d.clone();
    wrong.rkey ^= 0x5a5a_0001;
    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &wrong, 0, 4096).with_imm(1),
        &[RemoteAccessKind::WrongRkey],
        "wrong rkey",
    )
    .await;

    // A forged descriptor claiming a longer region: the writer's own check passes, the peer's
    // must not.
    let mut longer = d.clone();
    longer.len += 1 << 20;
    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &longer, len as u64 - 100, 200).with_imm(1),
        &[RemoteAccessKind::OutOfBounds],
        "straddling the end",
    )
    .await;
    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &longer, len as u64 + 10, 4096).with_imm(1),
        &[RemoteAccessKind::OutOfBounds],
        "past the end",
    )
    .await;
    let mut before = d.clone();
    before.base -= 64;
    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &before, 0, 128).with_imm(1),
        &[RemoteAccessKind::OutOfBounds],
        "before the start",
    )
    .await;

    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &ro.descriptor(), 0, 4096).with_imm(1),
        &[RemoteAccessKind::NoWritePermission],
        "no write permission",
    )
    .await;

    // A refused write in a batch beside good ones: the batch reports the refusal.
    let ops = vec![
        WriteOp::new(&src, 0, &d, 0, 1000),
        WriteOp::new(&src, 0, &wrong, 0, 1000),
    ];
    let r = guarded("mixed batch", a.write_batch(ops)).await;
    assert_eq!(
        r.err().and_then(|e| e.remote_access_kind()),
        Some(RemoteAccessKind::WrongRkey),
        "a batch with a refused write must fail"
    );
    let good_part = dst.region().copy_to_vec(0, 1000).expect("read");
    assert_eq!(
        good_part,
        pattern(2 << 20, 3)[..1000].to_vec(),
        "the good write of the mixed batch must land"
    );
    dst.region().write_at(0, &[0u8; 1000]).expect("reset");

    // Deregistered: a stale descriptor must be refused. A backend that forgot the key entirely
    // (like a NIC after `ibv_dereg_mr`) may say "wrong rkey"; both are correct.
    let gone = CanaryRegion::new(&b, len, Access::RECEIVE);
    let gone_desc = gone.descriptor();
    gone.region().deregister();
    expect_refusal(
        &a,
        WriteOp::new(&src, 0, &gone_desc, 0, 4096).with_imm(1),
        &[RemoteAccessKind::Deregistered, RemoteAccessKind::WrongRkey],
        "deregistered region",
    )
    .await;
    assert!(
        gone.bytes().iter().all(|&x| x == 0),
        "deregistered region changed"
    );
    gone.assert_canaries("deregistered");

    assert!(
        dst.bytes().iter().all(|&x| x == 0),
        "a refused write changed the region"
    );
    assert!(
        ro.bytes().iter().all(|&x| x == 0),
        "read-only region changed"
    );
    dst.assert_canaries("refused writes");
    ro.assert_canaries("refused writes (read-only region)");
    assert_eq!(
        b.imm_counter().unclaimed(1),
        0,
        "a refused write counted its immediate"
    );
    // The lanes still work after refusals.
    guarded(
        "write after refusals",
        a.write(WriteOp::new(&src, 0, &d, 0, 4096)),
    )
    .await
    .unwrap_or_else(|e| panic!("write after refusals: {e}"));
}

/// A writer that does not know the job token can write nothing.
pub async fn unauthenticated_writer_refused<F: BackendFactory>(f: &F) {
    let b = f.start(TOKEN, 1).await.expect("starting receiver");
    let intruder = f
        .start("not-the-job-token", 1)
        .await
        .expect("starting intruder");
    let dst = CanaryRegion::new(&b, 1 << 16, Access::RECEIVE);
    let src = source(&intruder, &pattern(4096, 4));
    let r = guarded(
        "unauthenticated write",
        intruder.write(WriteOp::new(&src, 0, &dst.descriptor(), 0, 4096).with_imm(9)),
    )
    .await;
    match r {
        Err(FabricError::Auth { .. }) => {}
        Err(e) => panic!("unauthenticated write: expected an Auth error, got {e}"),
        Ok(()) => panic!("unauthenticated write was accepted"),
    }
    assert!(
        dst.bytes().iter().all(|&x| x == 0),
        "intruder changed bytes"
    );
    dst.assert_canaries("unauthenticated");
    assert_eq!(
        b.imm_counter().unclaimed(9),
        0,
        "intruder's immediate counted"
    );
}

/// After `deregister` returns no byte lands any more, even from large writes in flight; writes
/// that did not fully land before it fail and count no immediate.
pub async fn deregistration_takes_effect_at_once<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 16 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let src = source(&a, &pattern(len, 5));
    let writes: Vec<_> = (0..4)
        .map(|i| a.write(WriteOp::new(&src, 0, &d, 0, len as u64).with_imm(300 + i)))
        .collect();
    tokio::time::sleep(Duration::from_millis(5)).await;
    dst.region().deregister();
    let snapshot = dst.bytes();
    let results = guarded("writes racing deregistration", join_all(writes)).await;
    assert!(
        dst.bytes() == snapshot,
        "bytes landed after deregister() returned"
    );
    dst.assert_canaries("deregistration");
    for (i, r) in results.iter().enumerate() {
        let imm = 300 + i as u32;
        match r {
            Ok(()) => assert_eq!(
                b.imm_counter().unclaimed(imm),
                1,
                "write {i} succeeded but its immediate was not counted once"
            ),
            Err(e) => {
                assert!(
                    matches!(
                        e.remote_access_kind(),
                        Some(RemoteAccessKind::Deregistered | RemoteAccessKind::WrongRkey)
                    ),
                    "write {i} racing deregistration failed with {e}"
                );
                assert_eq!(
                    b.imm_counter().unclaimed(imm),
                    0,
                    "failed write {i} counted its immediate"
                );
            }
        }
    }
}

/// A writer that dies mid-payload never produces a counted immediate; the receiver keeps
/// serving other writers.
pub async fn torn_write_never_counted<F: BackendFactory>(f: &F) {
    let (a, b) = pair(f, 1).await;
    let dst = CanaryRegion::new(&b, 1 << 20, Access::RECEIVE);
    let d = dst.descriptor();
    if !f.send_torn_write(TOKEN, &d, 1 << 20, 77).await {
        eprintln!("torn_write_never_counted: backend cannot emulate a torn write; skipped");
        return;
    }
    // Wait (bounded) until the receiver noticed the torn write, then check it is not counted.
    let expect = b
        .imm_counter()
        .expect_within(77, 1, Duration::from_millis(500));
    assert!(
        expect.await.is_err(),
        "a torn write's immediate was counted"
    );
    dst.assert_canaries("torn write");
    let src = source(&a, &pattern(4096, 6));
    guarded(
        "write after torn write",
        a.write(WriteOp::new(&src, 0, &d, 0, 4096).with_imm(78)),
    )
    .await
    .unwrap_or_else(|e| panic!("write after a torn write: {e}"));
    guarded("expect after torn write", b.imm_counter().expect(78, 1))
        .await
        .unwrap_or_else(|e| panic!("expect(78): {e}"));
}

/// A receiver that goes away makes the writer's writes fail (not hang).
pub async fn receiver_death_fails_writes<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 16 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let src = source(&a, &pattern(len, 7));
    guarded("first write", a.write(WriteOp::new(&src, 0, &d, 0, 4096)))
        .await
        .unwrap_or_else(|e| panic!("first write: {e}"));
    drop(dst);
    drop(b);
    // Keep writing until the writer notices; every write must resolve.
    let mut failed = false;
    for _ in 0..50 {
        let r = guarded(
            "write to a dead receiver",
            a.write(WriteOp::new(&src, 0, &d, 0, len as u64)),
        )
        .await;
        if r.is_err() {
            failed = true;
            break;
        }
    }
    assert!(failed, "writes to a dead receiver kept succeeding");
}

/// After lanes are cut, writes on them fail, and the next writes reconnect and succeed.
pub async fn lanes_recover<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let len = 4 << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let data = pattern(len, 8);
    let src = source(&a, &data);
    guarded("connect", a.connect(b.endpoint()))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    guarded(
        "write before cut",
        a.write(WriteOp::new(&src, 0, &d, 0, 4096)),
    )
    .await
    .unwrap_or_else(|e| panic!("write before cut: {e}"));
    if !f.cut_lanes(&a, b.endpoint()) {
        eprintln!("lanes_recover: backend offers no cut hook; skipped");
        return;
    }
    let mut recovered = false;
    for attempt in 0..20 {
        match guarded(
            "write after cut",
            a.write(WriteOp::new(&src, 0, &d, 0, len as u64).with_imm(400)),
        )
        .await
        {
            Ok(()) => {
                recovered = true;
                break;
            }
            Err(e) => {
                assert!(
                    e.remote_access_kind().is_none(),
                    "attempt {attempt}: a cut lane must not look like a refusal: {e}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    assert!(recovered, "lanes did not recover after a cut");
    assert!(dst.bytes() == data, "bytes after recovery differ");
    guarded("expect after recovery", b.imm_counter().expect(400, 1))
        .await
        .unwrap_or_else(|e| panic!("expect(400) after recovery: {e}"));
    dst.assert_canaries("lanes_recover");
}

/// `reset_connections` while writes are in flight: each of them resolves (landed, or failed with
/// `ConnectionsReset`, never hanging or looking like a refusal), their immediate is counted at
/// most once per write, nothing of them lands after a write posted later, and later writes work.
pub async fn reset_discards_posted_writes<F: BackendFactory>(f: &F, lanes: usize) {
    let (a, b) = pair(f, lanes).await;
    let chunk = 4usize << 20;
    let n = 8;
    let len = chunk * n;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let old = source(&a, &pattern(len, 9));
    guarded("connect", a.connect(b.endpoint()))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let posted: Vec<_> = (0..n as u64)
        .map(|i| {
            let off = i * chunk as u64;
            a.write(WriteOp::new(&old, off, &d, off, chunk as u64).with_imm(500))
        })
        .collect();
    guarded("reset", a.reset_connections()).await;
    let mut landed = 0;
    for (i, r) in join_all(posted).await.into_iter().enumerate() {
        match r {
            Ok(()) => landed += 1,
            Err(FabricError::ConnectionsReset { .. }) => {}
            Err(e) => panic!("write {i} posted before the reset: unexpected {e}"),
        }
    }
    let counted = b.imm_counter().unclaimed(500);
    assert!(
        counted >= landed && counted <= n as u64,
        "{landed} writes acknowledged, {counted} immediates counted, {n} posted"
    );
    // The next write reconnects and lands; nothing of the reset writes lands over it later.
    let fresh = pattern(len, 10);
    let new = source(&a, &fresh);
    guarded(
        "write after reset",
        a.write(WriteOp::new(&new, 0, &d, 0, len as u64).with_imm(501)),
    )
    .await
    .unwrap_or_else(|e| panic!("write after reset: {e}"));
    guarded("expect after reset", b.imm_counter().expect(501, 1))
        .await
        .unwrap_or_else(|e| panic!("expect(501) after reset: {e}"));
    // Give a stale frame every chance to arrive (not a timing assertion: nothing may arrive).
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        dst.bytes() == fresh,
        "bytes of a write posted before the reset landed after a later write"
    );
    assert!(
        b.imm_counter().unclaimed(500) == counted,
        "an immediate of a reset write was counted after the reset"
    );
    dst.assert_canaries("reset_discards_posted_writes");
}

/// Writes per burst of [`immediates_at_most_once_under_cuts`].
pub const CUT_BURST_WRITES: u32 = 160;

/// What one run of [`immediates_at_most_once_under_cuts`] saw (for the report of a run).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CutRunStats {
    /// Writes posted.
    pub writes: u64,
    /// Writes that resolved `Ok` (each counted exactly once).
    pub landed: u64,
    /// Writes that failed because a lane was cut under them (none counted twice).
    pub failed: u64,
    /// Failed writes whose immediate was counted anyway (landed, reported failed: allowed).
    pub failed_but_counted: u64,
    /// Cuts made.
    pub cuts: u64,
}

/// At most once, under faults: `reps` bursts of [`CUT_BURST_WRITES`] writes, each with its own
/// immediate (sizes from 1 KiB to 1 MiB, so on several lanes some are striped and carry their
/// immediate on a deferred tail), while the writer's lanes to the receiver are cut 1 to 3 times
/// at random moments (seeded by `seed`). After each burst every write has resolved; then
/// - no immediate is ever counted more than once (a backend that re-sends a write whose first
///   attempt may have landed counts it twice: the "committed" a rollout must never see early);
/// - every write that resolved `Ok` is counted exactly once (after a bounded settle: a verbs
///   receiver counts on its own thread, shortly after the writer's acknowledgement);
/// - failed writes are counted at most once (a write reported failed may have landed).
///
/// The lanes recover after the last burst. Skipped when the backend offers no cut hook.
pub async fn immediates_at_most_once_under_cuts<F: BackendFactory>(
    f: &F,
    lanes: usize,
    reps: u32,
    seed: u64,
) -> CutRunStats {
    let (a, b) = pair(f, lanes).await;
    let len = 8usize << 20;
    let dst = CanaryRegion::new(&b, len, Access::RECEIVE);
    let d = dst.descriptor();
    let src = source(&a, &pattern(len, 11));
    guarded("connect", a.connect(b.endpoint()))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}"));
    let counter = b.imm_counter().clone();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut stats = CutRunStats::default();
    let what = |rep: u32| format!("lanes {lanes}, seed {seed}, burst {rep}");
    for rep in 0..reps {
        let base = 0x5000_0000 + rep * 0x1_0000;
        let mut posted = Vec::with_capacity(CUT_BURST_WRITES as usize);
        for i in 0..CUT_BURST_WRITES {
            let size: u64 = if i % 16 == 7 {
                1 << 20
            } else {
                rng.random_range(1u64 << 10..=64 << 10)
            };
            let off = rng.random_range(0..(len as u64 - size)) & !7;
            let imm = base + i;
            posted.push((
                imm,
                a.write(WriteOp::new(&src, off, &d, off, size).with_imm(imm)),
            ));
        }
        stats.writes += u64::from(CUT_BURST_WRITES);
        // Cut while the burst is in flight, at random moments.
        let cuts = rng.random_range(1..=3u32);
        for _ in 0..cuts {
            tokio::time::sleep(Duration::from_micros(rng.random_range(0..2_000))).await;
            if !f.cut_lanes(&a, b.endpoint()) {
                eprintln!(
                    "immediates_at_most_once_under_cuts: backend offers no cut hook; skipped"
                );
                return stats;
            }
            stats.cuts += 1;
        }
        let (imms, writes): (Vec<u32>, Vec<_>) = posted.into_iter().unzip();
        let results = guarded("a burst of writes under cuts", join_all(writes)).await;
        for (imm, r) in imms.iter().zip(&results) {
            if let Err(e) = r {
                assert!(
                    e.remote_access_kind().is_none(),
                    "{}: immediate {imm:#x}: a cut lane must not look like a refusal: {e}",
                    what(rep)
                );
            }
        }
        // Every acknowledged write is counted (bounded settle), ...
        let deadline = Instant::now() + HANG_GUARD;
        loop {
            let missing = imms
                .iter()
                .zip(&results)
                .filter(|(imm, r)| r.is_ok() && counter.unclaimed(**imm) == 0)
                .count();
            if missing == 0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {missing} writes resolved Ok but their immediates were never counted",
                what(rep)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        // ... and a late duplicate has every chance to arrive (not a timing assertion: none
        // may arrive at all).
        tokio::time::sleep(Duration::from_millis(10)).await;
        for (imm, r) in imms.iter().zip(&results) {
            let counted = counter.unclaimed(*imm);
            assert!(
                counted <= 1,
                "{}: immediate {imm:#x} was written once and counted {counted} times ({})",
                what(rep),
                if r.is_ok() {
                    "write Ok"
                } else {
                    "write failed"
                }
            );
            match r {
                Ok(()) => stats.landed += 1,
                Err(_) => {
                    stats.failed += 1;
                    stats.failed_but_counted += counted;
                }
            }
        }
    }
    // The lanes recover after the cuts.
    guarded(
        "write after the cuts",
        a.write(WriteOp::new(&src, 0, &d, 0, 4096).with_imm(0x5fff_ffff)),
    )
    .await
    .unwrap_or_else(|e| panic!("lanes {lanes}, seed {seed}: write after the cuts: {e}"));
    dst.assert_canaries("immediates_at_most_once_under_cuts");
    stats
}
