//! Several local addresses on loopback (127.0.0.1 and 127.0.0.2 both work on Linux `lo`): one
//! write's bytes cross both, a single-address peer still works both ways, and an address that
//! fails is named in the error.

use super::*;

fn two_addresses(token: &str, lanes: usize) -> FabricConfig {
    FabricConfig {
        extra_listen: vec!["127.0.0.2:0".into()],
        connect_timeout_ms: 3_000,
        io_timeout_ms: 3_000,
        // These tests count the bytes that cross each address; same-host pulls would copy them
        // out of the writer's memory instead, crossing none.
        same_host: false,
        ..FabricConfig::loopback(token, lanes)
    }
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 4096 + seed) as u8).collect()
}

#[tokio::test]
async fn one_write_stripes_over_both_addresses() {
    let a = TcpFabric::start(&two_addresses("multi", 2)).await.unwrap();
    let b = TcpFabric::start(&two_addresses("multi", 2)).await.unwrap();
    assert_eq!(b.endpoint().as_str().split(',').count(), 2);
    let len = 4 << 20;
    let src = a.alloc(len, Access::SOURCE).unwrap();
    let data = pattern(len, 1);
    src.write_at(0, &data).unwrap();
    let dst = b.alloc(len, Access::RECEIVE).unwrap();
    a.write(WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64).with_imm(3))
        .await
        .unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);
    b.imm_counter().expect(3, 1).await.unwrap();
    assert_eq!(b.imm_counter().unclaimed(3), 0);
    let sent = a.address_stats();
    let received = b.address_stats();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].address.split(':').next(), Some("127.0.0.2"));
    for s in &sent {
        assert!(s.bytes_sent >= 1 << 20, "{sent:?}");
    }
    for r in &received {
        assert!(r.bytes_received >= 1 << 20, "{received:?}");
    }
    assert_eq!(
        received.iter().map(|r| r.bytes_received).sum::<u64>(),
        len as u64
    );
}

#[tokio::test]
async fn a_batch_of_writes_stripes_over_both_addresses() {
    // A sync posts many writes at once; placement spreads them over every lane, so over both
    // NICs, with each write's bytes landing where they should.
    let a = TcpFabric::start(&two_addresses("multi", 4)).await.unwrap();
    let b = TcpFabric::start(&two_addresses("multi", 4)).await.unwrap();
    let (piece, n) = (64 << 10, 32);
    let src = a.alloc(piece * n, Access::SOURCE).unwrap();
    let data = pattern(piece * n, 2);
    src.write_at(0, &data).unwrap();
    let dst = b.alloc(piece * n, Access::RECEIVE).unwrap();
    // Every other piece, so that nothing merges into one big write.
    let ops: Vec<WriteOp> = (0..n)
        .step_by(2)
        .map(|k| {
            let off = (k * piece) as u64;
            WriteOp::new(&src, off, dst.descriptor(), off, piece as u64).with_imm(9)
        })
        .collect();
    a.write_batch(ops).await.unwrap();
    b.imm_counter().expect(9, n as u64 / 2).await.unwrap();
    let got = dst.to_vec().unwrap();
    for k in (0..n).step_by(2) {
        let r = k * piece..(k + 1) * piece;
        assert_eq!(got[r.clone()], data[r], "piece {k}");
    }
    assert!(a.address_stats().iter().all(|s| s.bytes_sent > 0));
    assert!(b.address_stats().iter().all(|s| s.bytes_received > 0));
}

#[tokio::test]
async fn a_peer_with_one_address_still_works_both_ways() {
    let multi = TcpFabric::start(&two_addresses("multi", 2)).await.unwrap();
    let single = TcpFabric::start(&FabricConfig::loopback("multi", 2))
        .await
        .unwrap();
    assert!(!single.endpoint().as_str().contains(','));
    let len = 2 << 20;
    for (from, to) in [(&multi, &single), (&single, &multi)] {
        let src = from.alloc(len, Access::SOURCE).unwrap();
        let data = pattern(len, 3);
        src.write_at(0, &data).unwrap();
        let dst = to.alloc(len, Access::RECEIVE).unwrap();
        from.write(WriteOp::new(&src, 0, dst.descriptor(), 0, len as u64))
            .await
            .unwrap();
        assert_eq!(dst.to_vec().unwrap(), data);
    }
    // The two-address writer used both of its addresses towards the one-address peer.
    assert!(multi.address_stats().iter().all(|s| s.bytes_sent > 0));
}

#[tokio::test]
async fn a_peer_address_that_fails_is_named() {
    let a = TcpFabric::start(&two_addresses("multi", 2)).await.unwrap();
    let b = TcpFabric::start(&FabricConfig::loopback("multi", 2))
        .await
        .unwrap();
    // b advertises a second address where nothing listens.
    let dead = std::net::TcpListener::bind("127.0.0.2:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let endpoint = Endpoint(format!("{},{dead}", b.endpoint()));
    let len = 2 << 20;
    let src = a.alloc(len, Access::SOURCE).unwrap();
    let dst = b.alloc(len, Access::RECEIVE).unwrap();
    let descriptor = RegionDescriptor {
        endpoint,
        ..dst.descriptor().clone()
    };
    let err = a
        .write(WriteOp::new(&src, 0, &descriptor, 0, len as u64))
        .await
        .unwrap_err();
    assert!(matches!(err, FabricError::PeerUnreachable { .. }), "{err}");
    assert!(err.to_string().contains(&dead.to_string()), "{err}");
}

#[tokio::test]
async fn a_local_address_that_cannot_be_bound_is_named() {
    // 192.0.2.0/24 is reserved for documentation: no host has it.
    let config = FabricConfig {
        extra_listen: vec!["192.0.2.1:0".into()],
        ..FabricConfig::loopback("multi", 2)
    };
    let err = TcpFabric::start(&config).await.unwrap_err().to_string();
    assert!(err.contains("192.0.2.1:0"), "{err}");
}
