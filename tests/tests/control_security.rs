//! The controller against peers that hold the wrong secret or none (issue 39): each wrong
//! credential is refused by name and registers nothing; a worker refuses a controller that cannot
//! answer its nonce; and work done before authentication is bounded: a 4 GiB or 200 MiB frame
//! announcement and 2,000 idle connections cost the process little and a real worker still
//! registers, and 500 slowloris HTTP clients neither keep `/healthz` from answering nor hold
//! their connections past the header timeout.
//!
//! The floods come from 127.0.0.1 and the real worker (or health check) from 127.0.0.2: per-IP
//! caps protect other addresses, not a worker that shares its address with the attacker.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use weightsync_common::open_files::raise_open_file_limit;
use weightsync_common::protocol::{
    DEFAULT_MAX_FRAME, FromWorker, MAGIC, PREAUTH_MAX_FRAME, PROTOCOL_VERSION, ToWorker, WorkerId,
    WorkerRole, auth, encode_frame, read_frame, write_frame,
};
use weightsync_controller::control_channel::worker_handshake;
use weightsync_controller::coordinator::Now;
use weightsync_controller::planning::NullPlanner;
use weightsync_controller::{AppState, ControllerConfig, ControllerSecrets};
use weightsync_tests::controller_harness::*;

const TRAINER_SECRET: &str = "trainer-secret-0123456789";
const ENGINE_SECRET: &str = "engine-secret-0123456789";

fn state_with(edit: impl FnOnce(&mut ControllerConfig)) -> AppState {
    let mut cfg = ControllerConfig::new(
        coordinator_config(1, 1, false),
        JOB_TOKEN.into(),
        API_TOKEN.into(),
    );
    edit(&mut cfg);
    AppState::new(cfg, Box::new(NullPlanner))
}

fn registered(ctl: &ServedController) -> usize {
    ctl.state.read(|c| c.workers(Now::wall()).len())
}

async fn connect_from(local: &str, to: SocketAddr) -> TcpStream {
    let sock = TcpSocket::new_v4().unwrap();
    sock.bind(format!("{local}:0").parse().unwrap()).unwrap();
    sock.connect(to).await.unwrap()
}

/// A worker from `from` proving `secret` for `role` and registering as `id`: the stream (kept
/// open so a welcomed worker stays registered) and the controller's last reply.
async fn attempt(
    ctl: &ServedController,
    from: &str,
    secret: &str,
    role: WorkerRole,
    id: WorkerId,
) -> (TcpStream, Option<ToWorker>) {
    let mut s = connect_from(from, ctl.control).await;
    let Some(ToWorker::Challenge { nonce }) = read_frame(&mut s, PREAUTH_MAX_FRAME).await.unwrap()
    else {
        panic!("no challenge")
    };
    let mine = auth::nonce();
    let hello = FromWorker::Hello {
        role,
        nonce: mine,
        proof: auth::prove(secret, role, &nonce),
    };
    write_frame(&mut s, &hello, PREAUTH_MAX_FRAME)
        .await
        .unwrap();
    let reply = read_frame(&mut s, DEFAULT_MAX_FRAME).await.ok().flatten();
    let Some(ToWorker::Job { proof, .. }) = &reply else {
        return (s, reply);
    };
    assert!(
        auth::check_answer(secret, role, &mine, &nonce, proof),
        "the controller's answer to the worker's nonce must check"
    );
    let reg = FromWorker::Register(Box::new(registration(id, false)));
    write_frame(&mut s, &reg, DEFAULT_MAX_FRAME).await.unwrap();
    let reply = read_frame(&mut s, DEFAULT_MAX_FRAME).await.ok().flatten();
    (s, reply)
}

fn refusal(reply: Option<ToWorker>) -> String {
    match reply {
        Some(ToWorker::Rejected { reason }) => reason,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn vm_rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib << 10
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_wrong_credential_is_refused_by_name_and_registers_nothing() {
    let ctl = ServedController::start(state_with(|cfg| {
        cfg.secrets = ControllerSecrets {
            trainer: TRAINER_SECRET.into(),
            rollout: ENGINE_SECRET.into(),
            api: API_TOKEN.into(),
            read: None,
        };
    }))
    .await;
    let (t0, r0) = (WorkerId::trainer(0), WorkerId::rollout(0));
    let (_s, reply) = attempt(&ctl, "127.0.0.1", ENGINE_SECRET, WorkerRole::Trainer, t0).await;
    let reason = refusal(reply);
    assert!(
        reason.contains("a rollout credential cannot register a trainer"),
        "{reason}"
    );
    let (_s, reply) = attempt(&ctl, "127.0.0.1", TRAINER_SECRET, WorkerRole::Rollout, r0).await;
    let reason = refusal(reply);
    assert!(
        reason.contains("a trainer credential cannot register a rollout"),
        "{reason}"
    );
    // No secret at all (an unset variable proves the empty string), and the old job token.
    for secret in ["", JOB_TOKEN] {
        let (_s, reply) = attempt(&ctl, "127.0.0.1", secret, WorkerRole::Trainer, t0).await;
        let reason = refusal(reply);
        assert!(
            reason.contains("wrong secret for the trainer role"),
            "{reason}"
        );
    }
    // The engine's secret, proved for its own role, then a trainer's registration.
    let (_s, reply) = attempt(&ctl, "127.0.0.1", ENGINE_SECRET, WorkerRole::Rollout, t0).await;
    let reason = refusal(reply);
    assert!(
        reason.contains("proved the rollout secret, not the trainer one"),
        "{reason}"
    );
    assert_eq!(
        registered(&ctl),
        0,
        "a refused worker must register nothing"
    );
    assert_eq!(ctl.state.metrics().refused_count("auth"), 4);
    assert_eq!(ctl.state.metrics().refused_count("role"), 1);
    // The right secrets get in.
    let (_t, reply) = attempt(&ctl, "127.0.0.1", TRAINER_SECRET, WorkerRole::Trainer, t0).await;
    assert!(matches!(reply, Some(ToWorker::Welcome { .. })), "{reply:?}");
    let (_r, reply) = attempt(&ctl, "127.0.0.1", ENGINE_SECRET, WorkerRole::Rollout, r0).await;
    assert!(matches!(reply, Some(ToWorker::Welcome { .. })), "{reply:?}");
    assert_eq!(registered(&ctl), 2);
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_a_controller_that_cannot_answer_its_nonce() {
    // An impostor that relays nothing: it challenges, reads the Hello and sends a job with a
    // made-up answer.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let impostor = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let challenge = ToWorker::Challenge {
            nonce: auth::nonce(),
        };
        write_frame(&mut s, &challenge, PREAUTH_MAX_FRAME)
            .await
            .unwrap();
        let hello: Option<FromWorker> = read_frame(&mut s, PREAUTH_MAX_FRAME).await.unwrap();
        assert!(matches!(hello, Some(FromWorker::Hello { .. })));
        let job = ToWorker::Job {
            world: world(false),
            model_config: None,
            proof: [0; 32],
            fabric_key: None,
        };
        write_frame(&mut s, &job, DEFAULT_MAX_FRAME).await.unwrap();
        // What the worker sends next (nothing: it must not register).
        read_frame::<_, FromWorker>(&mut s, DEFAULT_MAX_FRAME)
            .await
            .ok()
            .flatten()
    });
    let err = weightsync_agent::fetch_job(
        &addr.to_string(),
        &ENGINE_SECRET.into(),
        WorkerRole::Rollout,
        weightsync_agent::AGENT_MAX_FRAME,
    )
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("did not prove it holds the rollout secret"),
        "{err}"
    );
    assert_eq!(impostor.await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unauthenticated_floods_cost_little_and_a_worker_still_registers() {
    raise_open_file_limit().unwrap();
    let ctl = ServedController::start(state(1, 1, false)).await;
    let before = vm_rss_bytes();
    for announced in [u32::MAX, 200 << 20] {
        let mut s = TcpStream::connect(ctl.control).await.unwrap();
        let challenge: Option<ToWorker> = read_frame(&mut s, PREAUTH_MAX_FRAME).await.unwrap();
        assert!(matches!(challenge, Some(ToWorker::Challenge { .. })));
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        header.extend_from_slice(&[0, 0]);
        header.extend_from_slice(&announced.to_le_bytes());
        s.write_all(&header).await.unwrap();
        // Up to 64 MiB of the body (a reader that accepted the announcement would hold it all):
        // the controller refuses at the header and closes, so the writes soon fail.
        let chunk = vec![0u8; 1 << 20];
        for _ in 0..64 {
            if s.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let mut rest = Vec::new();
        let ended = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut rest)).await;
        assert!(
            ended.is_ok(),
            "the connection announcing {announced} bytes stayed open"
        );
    }
    let mut idle = Vec::new();
    for _ in 0..2000 {
        idle.push(TcpStream::connect(ctl.control).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grown = vm_rss_bytes().saturating_sub(before);
    let capped = ctl.state.metrics().refused_count("preauth_cap");
    // The worker comes from another address than the flood, which is still connected.
    let (_w, reply) = attempt(
        &ctl,
        "127.0.0.2",
        JOB_TOKEN,
        WorkerRole::Trainer,
        WorkerId::trainer(0),
    )
    .await;
    eprintln!(
        "RSS grew {:.1} MB over 2 huge announcements and {} idle connections ({capped} closed at accept)",
        grown as f64 / 1e6,
        idle.len()
    );
    assert!(matches!(reply, Some(ToWorker::Welcome { .. })), "{reply:?}");
    assert!(grown < 50_000_000, "RSS grew by {grown} bytes");
    assert!(capped > 1000, "only {capped} connections were capped");
    drop(idle);
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_clients_neither_block_healthz_nor_outlast_the_header_timeout() {
    raise_open_file_limit().unwrap();
    let ctl = ServedController::start(state_with(|cfg| {
        cfg.http_limits.header_timeout = Duration::from_secs(2);
    }))
    .await;
    let mut held = Vec::new();
    for _ in 0..500 {
        let mut s = TcpStream::connect(ctl.http).await.unwrap();
        let _ = s
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            .await;
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut took = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        let mut s = connect_from("127.0.0.2", ctl.http).await;
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut resp = Vec::new();
        s.read_to_end(&mut resp).await.unwrap();
        took.push(start.elapsed());
        assert!(
            resp.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&resp)
        );
    }
    took.sort();
    eprintln!("/healthz beside 500 slowloris clients: {took:?}");
    assert!(
        took[2] < Duration::from_millis(100),
        "median /healthz {:?}",
        took[2]
    );
    // Every slow client is cut once the header timeout passes.
    let start = Instant::now();
    for s in &mut held {
        let mut buf = [0u8; 256];
        let cut = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
        })
        .await;
        assert!(
            cut.is_ok(),
            "a slowloris connection outlived the header timeout"
        );
    }
    assert!(start.elapsed() < Duration::from_secs(10));
    ctl.stop().await;
}

/// The seeds of the `control_handshake` fuzz target: what a worker might send first.
fn handshake_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let frame = |m: &FromWorker| encode_frame(m, DEFAULT_MAX_FRAME).unwrap();
    let hello = |role| {
        frame(&FromWorker::Hello {
            role,
            nonce: [7; 32],
            proof: [9; 32],
        })
    };
    let register = |id| frame(&FromWorker::Register(Box::new(registration(id, true))));
    let header = |len: u32| {
        let mut h = MAGIC.to_vec();
        h.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&[0, 0]);
        h.extend_from_slice(&len.to_le_bytes());
        h
    };
    let trainer = [hello(WorkerRole::Trainer), register(WorkerId::trainer(0))].concat();
    let rollout = [hello(WorkerRole::Rollout), register(WorkerId::rollout(0))].concat();
    let crossed = [hello(WorkerRole::Rollout), register(WorkerId::trainer(1))].concat();
    let truncated = trainer[..trainer.len() / 2].to_vec();
    vec![
        ("hello-trainer-register.bin", trainer),
        ("hello-rollout-register.bin", rollout),
        ("hello-rollout-register-trainer.bin", crossed),
        ("register-first.bin", register(WorkerId::trainer(0))),
        ("announce-4gib.bin", header(u32::MAX)),
        (
            "announce-200mib.bin",
            [header(200 << 20), vec![0; 64]].concat(),
        ),
        ("hello-truncated.bin", truncated),
    ]
}

/// Replays the committed `control_handshake` seeds through the controller's handshake: each is
/// refused (none can know the challenge). With `FUZZ_SEEDS=<dir>` it first rewrites them there:
/// `FUZZ_SEEDS=$PWD/controller/fuzz/corpus/control_handshake cargo test -p weightsync-tests
/// --test control_security control_handshake_seeds`.
#[tokio::test]
async fn control_handshake_seeds_are_refused() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../controller/fuzz/corpus/control_handshake");
    if let Ok(out) = std::env::var("FUZZ_SEEDS") {
        for (name, bytes) in handshake_seeds() {
            std::fs::write(std::path::Path::new(&out).join(name), bytes).unwrap();
        }
    }
    let cfg = state(1, 1, true).config().clone();
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        let mut rd = &bytes[..];
        let mut wr = tokio::io::sink();
        let got = worker_handshake(&mut rd, &mut wr, &cfg).await;
        assert!(got.is_err(), "a seed registered: {got:?}");
        replayed += 1;
    }
    assert_eq!(
        replayed,
        handshake_seeds().len(),
        "seeds missing in {dir:?}"
    );
    // A worker that knows the secret gets through the same function (the seeds fail on the
    // proof, not on something else).
    let (mut worker, mut controller) = tokio::io::duplex(1 << 16);
    let id = WorkerId::rollout(0);
    let client = tokio::spawn(async move {
        let Some(ToWorker::Challenge { nonce }) =
            read_frame(&mut worker, PREAUTH_MAX_FRAME).await.unwrap()
        else {
            panic!("no challenge")
        };
        let hello = FromWorker::Hello {
            role: id.role,
            nonce: auth::nonce(),
            proof: auth::prove(JOB_TOKEN, id.role, &nonce),
        };
        write_frame(&mut worker, &hello, PREAUTH_MAX_FRAME)
            .await
            .unwrap();
        let _job: Option<ToWorker> = read_frame(&mut worker, DEFAULT_MAX_FRAME).await.unwrap();
        let reg = FromWorker::Register(Box::new(registration(id, true)));
        write_frame(&mut worker, &reg, DEFAULT_MAX_FRAME)
            .await
            .unwrap();
        worker
    });
    let (mut rd, mut wr) = tokio::io::split(&mut controller);
    let reg = worker_handshake(&mut rd, &mut wr, &cfg).await.unwrap();
    assert_eq!(reg.id, id);
    drop(client.await.unwrap());
}
