//! Abuse of the controller's ports, against the real `weightsync controller` process.
//!
//! The controller's own router tests (controller crate, `oneshot`) cover the ordinary refusals
//! (bad JSON, unknown sync, missing token, wrong version type). These tests send what a client
//! library would not: bodies far past the limit (announced or not), deep JSON, bytes that are not
//! UTF-8, half-sent requests left hanging, hundreds of idle connections, and garbage on the
//! control-channel port. Each must get a 4xx with a message (or a closed connection), the
//! controller must keep serving, and its resident memory must not grow with the abuse.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use weightsync_tests::http_raw::{self, exchange, request_bytes};
use weightsync_tests::proc_stats;
use weightsync_tests::process_cluster::{API_TOKEN, JobSpec, ProcessCluster};
use weightsync_tests::processes::wait_until;

const T: Duration = Duration::from_secs(20);

/// A controller with no workers (nothing else is needed to abuse it).
fn lone_controller() -> ProcessCluster {
    let mut c = ProcessCluster::start(JobSpec::tiny());
    for r in 0..c.spec.trainers {
        c.kill_worker("trainer", r);
    }
    for r in 0..c.spec.rollouts {
        c.kill_worker("rollout", r);
    }
    assert!(
        wait_until(Duration::from_secs(60), || c.health().map(|_| ())).is_some(),
        "controller never answered\n{}",
        c.logs()
    );
    c
}

/// A blocking stream to `to` from the local address `local` (any of 127.0.0.0/8 on loopback).
async fn connect_from(local: &str, to: std::net::SocketAddr) -> std::io::Result<TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4()?;
    sock.bind(format!("{local}:0").parse().expect("a local address"))?;
    let stream = sock.connect(to).await?.into_std()?;
    stream.set_nonblocking(false)?;
    Ok(stream)
}

fn controller_pid(c: &ProcessCluster) -> u32 {
    c.controller.as_ref().expect("controller").pid()
}

fn assert_4xx_with_message(r: &http_raw::RawResponse, what: &str) {
    assert!(
        (400..500).contains(&r.status),
        "{what}: expected a 4xx, got {} {}",
        r.status,
        r.text()
    );
    let msg = r
        .json()
        .and_then(|j| j["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| r.text());
    assert!(msg.len() > 5, "{what}: no clear message: {:?}", r.text());
}

fn still_serving(c: &ProcessCluster, what: &str) {
    let h = c
        .health()
        .unwrap_or_else(|| panic!("{what}: the controller stopped answering\n{}", c.logs()));
    assert_eq!(h["status"], "ok", "{what}: {h}");
}

#[test]
fn oversized_deep_and_garbled_bodies_get_4xx_and_memory_stays_flat() {
    let c = lone_controller();
    let pid = controller_pid(&c);
    let before = proc_stats::sample(pid).expect("sample");

    // 64 MiB body, honestly announced.
    let big = vec![b'7'; 64 << 20];
    let r = exchange(
        c.http,
        &request_bytes(
            "POST",
            "/v1/syncs",
            &[
                ("Authorization", &format!("Bearer {API_TOKEN}")),
                ("Content-Type", "application/json"),
            ],
            &big,
        ),
        T,
    )
    .expect("answer to a 64 MiB body");
    assert_4xx_with_message(&r, "64 MiB body");

    // Chunked, no length, 32 MiB of chunks.
    let mut s = http_raw::connect(c.http, T).expect("connect");
    let _ = s.write_all(
        format!(
            "POST /v1/syncs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_TOKEN}\r\n\
             Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .as_bytes(),
    );
    let chunk = format!("{:x}\r\n{}\r\n", 1 << 20, "9".repeat(1 << 20));
    for _ in 0..32 {
        if s.write_all(chunk.as_bytes()).is_err() {
            break; // refused and closed early: fine
        }
    }
    let _ = s.write_all(b"0\r\n\r\n");
    let r = http_raw::read_response(&mut s).expect("answer to 32 MiB of chunks");
    assert_4xx_with_message(&r, "32 MiB chunked body");

    // JSON nested as deep as the body limit allows, and far deeper than serde's recursion limit.
    let depth = 8000;
    let deep = format!(
        "{{\"version\": {}1{}}}",
        "[".repeat(depth),
        "]".repeat(depth)
    );
    let r = http_raw::send(
        c.http,
        "POST",
        "/v1/syncs",
        Some(API_TOKEN),
        deep.as_bytes(),
    )
    .expect("answer to deep JSON");
    assert_4xx_with_message(&r, "deep JSON");
    let deep_obj = format!("{}{}", "{\"a\":".repeat(3000), "}".repeat(3000));
    let r = http_raw::send(
        c.http,
        "POST",
        "/v1/syncs",
        Some(API_TOKEN),
        deep_obj.as_bytes(),
    )
    .expect("answer to deep objects");
    assert_4xx_with_message(&r, "deep objects");

    // Not UTF-8, NUL bytes, numbers past u64, duplicate keys, and the same under a wrong token.
    let garbled: [&[u8]; 5] = [
        b"{\"version\": \xff\xfe}",
        b"{\"version\": 1}\0\0\0",
        b"{\"version\": 340282366920938463463374607431768211456}",
        b"{\"version\": 1, \"version\": 2}",
        b"\x00\x01\x02\x03",
    ];
    for body in garbled {
        let r = http_raw::send(c.http, "POST", "/v1/syncs", Some(API_TOKEN), body)
            .expect("answer to a garbled body");
        assert_4xx_with_message(
            &r,
            &format!("garbled body {:?}", String::from_utf8_lossy(body)),
        );
        let r = http_raw::send(c.http, "POST", "/v1/syncs", Some("wrong"), body)
            .expect("answer to a garbled unauthorised body");
        assert_eq!(r.status, 401, "unauthorised garbled body: {}", r.text());
    }
    // A garbage request line and header block.
    let r = exchange(c.http, b"\x16\x03\x01\x02\x00 not http at all\r\n\r\n", T);
    if let Ok(r) = r {
        assert!(
            (400..500).contains(&r.status),
            "garbage request line: {}",
            r.status
        );
    }

    still_serving(&c, "after oversized and garbled bodies");
    let after = proc_stats::sample(pid).expect("sample");
    eprintln!(
        "controller RSS {} KiB -> {} KiB, fds {} -> {}",
        before.rss_kib, after.rss_kib, before.fds, after.fds
    );
    assert!(
        after.rss_kib < before.rss_kib + 32 * 1024,
        "controller RSS grew from {} to {} KiB after abuse (a body was buffered?)",
        before.rss_kib,
        after.rss_kib
    );
}

/// Found by this suite and fixed: the body limit was enforced only while the body was read, so a
/// request announcing 1 TB and sending a few bytes held its connection until the request
/// timeout. The controller now refuses an announced over-limit `Content-Length` at once (413).
#[test]
fn announced_terabyte_body_is_refused_at_once() {
    let c = lone_controller();
    // A 1 TB Content-Length with a few bytes behind it: refused without waiting for the rest.
    let started = Instant::now();
    let head = format!(
        "POST /v1/syncs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_TOKEN}\r\n\
         Content-Type: application/json\r\nContent-Length: 1000000000000\r\n\r\n{{\"version\": 1"
    );
    let r = exchange(c.http, head.as_bytes(), T).expect("answer to a 1 TB announcement");
    assert_4xx_with_message(&r, "1 TB Content-Length");
    assert!(
        started.elapsed() < T,
        "the controller waited for a body it would refuse"
    );
}

#[test]
fn slow_partial_requests_and_many_idle_connections_do_not_block_service() {
    let c = lone_controller();
    let pid = controller_pid(&c);
    let before = proc_stats::sample(pid).expect("sample");

    // 300 connections from one address (127.0.0.3; the honest client below comes from
    // 127.0.0.1, as another host would: the controller caps each address's connections, so one
    // address cannot hold the port for everyone): a third say nothing, a third stop inside the
    // headers, a third announce a body and send half of it.
    let from = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut held = Vec::new();
    for i in 0..300 {
        let Ok(mut s) = from.block_on(connect_from("127.0.0.3", c.http)) else {
            break;
        };
        match i % 3 {
            0 => {}
            1 => {
                let _ = s.write_all(b"POST /v1/syncs HTTP/1.1\r\nHost: x\r\nAuthori");
            }
            _ => {
                let _ = s.write_all(
                    format!(
                        "POST /v1/syncs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_TOKEN}\r\n\
                         Content-Type: application/json\r\nContent-Length: 20\r\n\r\n{{\"vers"
                    )
                    .as_bytes(),
                );
            }
        }
        held.push(s);
    }
    assert!(
        held.len() >= 250,
        "could open only {} connections",
        held.len()
    );
    // An honest client is still served, promptly, while they hang.
    let started = Instant::now();
    still_serving(&c, "with 300 hanging connections");
    let r = c.trigger(1, false).expect("trigger while connections hang");
    assert_eq!(r.status, 503, "world incomplete: {}", r.text());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "served only after {:?}",
        started.elapsed()
    );

    let during = proc_stats::sample(pid).expect("sample");
    drop(held);
    // Once the clients go, so do the server's sockets.
    let settled = wait_until(Duration::from_secs(10), || {
        proc_stats::sample(pid)
            .ok()
            .filter(|s| s.fds <= before.fds + 5)
    });
    eprintln!(
        "controller fds {} -> {} (300 hanging) -> {:?}; RSS {} -> {} KiB",
        before.fds,
        during.fds,
        settled.map(|s| s.fds),
        before.rss_kib,
        during.rss_kib
    );
    assert!(
        settled.is_some(),
        "sockets of closed connections were not released"
    );
    assert!(
        during.rss_kib < before.rss_kib + 64 * 1024,
        "300 idle connections cost {} KiB",
        during.rss_kib - before.rss_kib
    );
}

#[test]
fn garbage_on_the_control_channel_is_dropped_and_the_controller_lives() {
    let c = lone_controller();
    let pid = controller_pid(&c);
    let before = proc_stats::sample(pid).expect("sample");
    let payloads: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        vec![0xff; 4096],
        // A valid magic and version announcing a 4 GiB frame.
        [
            b"WSYC".as_slice(),
            &weightsync_common::protocol::PROTOCOL_VERSION.to_le_bytes(),
            &[0, 0],
            &u32::MAX.to_le_bytes(),
        ]
        .concat(),
        // A valid header and a body of garbage.
        [
            b"WSYC".as_slice(),
            &weightsync_common::protocol::PROTOCOL_VERSION.to_le_bytes(),
            &[0, 0],
            &64u32.to_le_bytes(),
            &[0xAB; 64],
        ]
        .concat(),
    ];
    for p in &payloads {
        let mut s = TcpStream::connect(c.control).expect("connect control");
        s.set_read_timeout(Some(T)).expect("timeout");
        let _ = s.write_all(p);
        let mut sink = Vec::new();
        // The controller closes the connection (possibly after its challenge); it must not hang
        // past its handshake timeout.
        let started = Instant::now();
        let _ = s.read_to_end(&mut sink);
        assert!(started.elapsed() < T, "control connection left hanging");
    }
    still_serving(&c, "after control-channel garbage");
    let workers = c.get("/v1/workers").expect("workers");
    let registered = workers.json().map(|j| j["workers"].clone());
    assert_eq!(
        registered,
        Some(serde_json::json!([])),
        "garbage registered: {}",
        workers.text()
    );
    let after = proc_stats::sample(pid).expect("sample");
    assert!(
        after.rss_kib < before.rss_kib + 32 * 1024,
        "a 4 GiB frame announcement grew RSS from {} to {} KiB",
        before.rss_kib,
        after.rss_kib
    );
}
