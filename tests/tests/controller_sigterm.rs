//! SIGTERM (what Kubernetes and Slurm send) stops a real `weightsync controller` process
//! cleanly: it exits 0 within seconds, writes its state file one last time (the test deletes
//! the file first, so only the stop can have written it, with this incarnation), and closes
//! every worker's control connection, which tells the worker to reconnect to the controller
//! that follows.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use weightsync_common::DType;
use weightsync_common::protocol::{
    Blob, DEFAULT_MAX_FRAME, FromWorker, Registration, ToWorker, WorkerId, WorldSpec, auth,
    read_frame, write_frame,
};
use weightsync_tests::processes::{ChildProcess, free_port, weightsync_binary};

const JOB_TOKEN: &str = "sigterm-job-token";

fn world() -> WorldSpec {
    WorldSpec {
        model: "qwen3-0.6b".into(),
        train: "fsdp=2".into(),
        infer: "tp=1".into(),
        dtype: DType::BF16,
        verify: true,
    }
}

/// `GET path` on the controller's HTTP address: the body as JSON, if it answered 200.
fn get_json(http: SocketAddr, path: &str) -> Option<serde_json::Value> {
    let mut s = TcpStream::connect_timeout(&http, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {http}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200")
        .then(|| serde_json::from_str(body).ok())
        .flatten()
}

/// A stand-in trainer: registers, then reads until the controller closes the connection.
/// Returns how long after `registered` was signalled the connection closed.
async fn fake_trainer(control: SocketAddr, registered: tokio::sync::oneshot::Sender<()>) {
    let mut s = tokio::net::TcpStream::connect(control).await.unwrap();
    let Ok(Some(ToWorker::Challenge { nonce })) =
        read_frame::<_, ToWorker>(&mut s, DEFAULT_MAX_FRAME).await
    else {
        panic!("no challenge");
    };
    let id = WorkerId::trainer(0);
    let reg = Registration {
        id,
        host: "fake".into(),
        pid: 0,
        world: world(),
        fabric_endpoint: Blob(b"127.0.0.1:9".to_vec()),
        regions: Vec::new(),
        tensors: Vec::new(),
        placement: None,
        skip: Vec::new(),
    };
    for msg in [
        FromWorker::Hello {
            role: id.role,
            nonce: auth::nonce(),
            proof: auth::prove(JOB_TOKEN, id.role, &nonce),
        },
        FromWorker::Register(Box::new(reg)),
    ] {
        write_frame(&mut s, &msg, DEFAULT_MAX_FRAME).await.unwrap();
    }
    let _ = registered.send(());
    // Heartbeats and the rest, until the connection ends (EOF or a reset): the worker is told.
    while let Ok(Some(_)) = read_frame::<_, ToWorker>(&mut s, DEFAULT_MAX_FRAME).await {}
}

#[test]
fn sigterm_stops_the_controller_with_exit_0_its_state_saved_and_workers_told() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("controller-state.json");
    let http: SocketAddr = format!("127.0.0.1:{}", free_port("127.0.0.1"))
        .parse()
        .unwrap();
    let control: SocketAddr = format!("127.0.0.1:{}", free_port("127.0.0.1"))
        .parse()
        .unwrap();
    let mut cmd = Command::new(weightsync_binary());
    cmd.args(["controller", "--http", &http.to_string()])
        .args(["--control", &control.to_string()])
        .args([
            "--model",
            "qwen3-0.6b",
            "--train",
            "fsdp=2",
            "--infer",
            "tp=1",
        ])
        .arg("--state-file")
        .arg(&state)
        .env("WEIGHTSYNC_JOB_TOKEN", JOB_TOKEN)
        .env("WEIGHTSYNC_API_TOKEN", "sigterm-api-token")
        .env("RUST_LOG", "info");
    let mut ctl = ChildProcess::spawn("controller", cmd, dir.path()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let health = loop {
        if let Some(h) = get_json(http, "/healthz") {
            break h;
        }
        assert!(Instant::now() < deadline, "no /healthz\n{}", ctl.log_text());
        std::thread::sleep(Duration::from_millis(50));
    };
    let incarnation = u64::from_str_radix(health["incarnation"].as_str().unwrap(), 16).unwrap();

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let worker = rt.spawn(fake_trainer(control, tx));
    rt.block_on(rx).expect("the fake trainer registered");
    let deadline = Instant::now() + Duration::from_secs(20);
    while get_json(http, "/v1/workers").and_then(|w| w["workers"].as_array().map(|a| a.len()))
        != Some(1)
    {
        assert!(
            Instant::now() < deadline,
            "never registered\n{}",
            ctl.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    // Only the stop can write the file from here on.
    std::fs::remove_file(&state).expect("the state file written at start");
    // SAFETY: kill(2) on the controller's pid, a child of this process still running.
    assert_eq!(unsafe { libc::kill(ctl.pid() as i32, libc::SIGTERM) }, 0);
    let status = ctl
        .wait_exit(Duration::from_secs(15))
        .unwrap_or_else(|| panic!("still running 15 s after SIGTERM\n{}", ctl.log_text()));
    assert!(status.success(), "{status}\n{}", ctl.log_text());
    assert!(
        ctl.log_text().contains("SIGTERM: stopping"),
        "{}",
        ctl.log_text()
    );
    // Told: the worker's connection ended.
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(5), worker).await })
        .expect("the worker's connection closed by the stop")
        .unwrap();
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&state).expect("the stop saved the state file"))
            .unwrap();
    assert_eq!(saved["incarnation"].as_u64(), Some(incarnation), "{saved}");
    assert!(saved["next_sync_id"].as_u64().is_some(), "{saved}");
}
