//! TLS on the control channel and the HTTP API (issue 39), with certificates made by `rcgen`:
//! a job runs over mutual TLS and is triggered over HTTPS; plain HTTP to the TLS port gets no
//! answer; a worker whose certificate another CA signed is refused by name and registers
//! nothing; a worker shown a controller certificate from another CA refuses it by name.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weightsync_agent::{AgentError, run_agent};
use weightsync_common::protocol::WorkerId;
use weightsync_common::tls::{TlsClient, TlsFiles, TlsServer};
use weightsync_controller::coordinator::Now;
use weightsync_controller::planning::NullPlanner;
use weightsync_controller::sync_record::SyncState;
use weightsync_controller::{AppState, ControllerConfig};
use weightsync_tests::controller_harness::*;
use weightsync_tests::tls_certs::TestPki;

async fn tls_controller(server: &TlsFiles) -> ServedController {
    let mut cfg = ControllerConfig::new(
        coordinator_config(1, 1, true),
        JOB_TOKEN.into(),
        API_TOKEN.into(),
    );
    cfg.tls = Some(TlsServer::new(server).expect("controller TLS"));
    ServedController::start(AppState::new(cfg, Box::new(NullPlanner))).await
}

fn tls_agent(
    ctl: &ServedController,
    id: WorkerId,
    files: &TlsFiles,
) -> tokio::task::JoinHandle<Result<(), AgentError>> {
    let mut cfg = agent_config(ctl.control, id, true);
    cfg.tls = Some(TlsClient::new(files, None).expect("worker TLS"));
    cfg.reconnect_for = Duration::from_secs(2);
    tokio::spawn(run_agent(cfg, ScriptedDriver::new()))
}

fn registered(ctl: &ServedController) -> usize {
    ctl.state.read(|c| c.workers(Now::wall()).len())
}

/// One HTTP/1.1 request over TLS (the controller's certificate checked against `ca`); the
/// response's text.
async fn https(addr: SocketAddr, ca: &std::path::Path, request: String) -> String {
    let mut roots = rustls::RootCertStore::empty();
    let pem = std::fs::read(ca).unwrap();
    use rustls::pki_types::pem::PemObject;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        #[allow(deprecated)]
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut s = connector.connect(name, tcp).await.expect("HTTPS handshake");
    s.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn get(path: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_over_mutual_tls_and_http_answers_only_over_tls() {
    let pki = TestPki::new();
    let ctl = tls_controller(&pki.job.controller).await;
    let agents =
        [WorkerId::trainer(0), WorkerId::rollout(0)].map(|id| tls_agent(&ctl, id, &pki.job.worker));
    assert!(
        eventually(Duration::from_secs(10), || ctl
            .state
            .read(|c| c.plan().is_some()))
        .await,
        "the world never completed over TLS: {:?}",
        ctl.state.read(|c| c.log())
    );

    let health = https(ctl.http, &pki.job.ca, get("/healthz")).await;
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");

    let body = r#"{"version":1}"#;
    let trigger = format!(
        "POST /v1/syncs?wait=true HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {API_TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let answer = https(ctl.http, &pki.job.ca, trigger).await;
    assert!(answer.starts_with("HTTP/1.1 2"), "{answer}");
    assert!(
        eventually(Duration::from_secs(10), || ctl
            .state
            .read(
                |c| c.last_sync().map(|(_, st)| st) == Some(SyncState::Committed)
            ))
        .await,
        "the sync triggered over HTTPS did not commit: {answer}"
    );

    // Plain HTTP to the TLS port: the handshake fails and no HTTP answer comes back.
    let mut plain = TcpStream::connect(ctl.http).await.unwrap();
    plain.write_all(get("/healthz").as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out);
    assert!(
        !text.contains("HTTP/1.1 200"),
        "plain HTTP was answered: {text}"
    );

    for a in agents {
        a.abort();
    }
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_certificate_another_ca_signed_is_refused_by_name() {
    let pki = TestPki::new();
    let ctl = tls_controller(&pki.job.controller).await;
    // It trusts the job's CA (so it accepts the controller) but shows a stranger's certificate.
    let stranger = TlsFiles {
        ca: pki.job.ca.clone(),
        ..pki.other.worker.clone()
    };
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        tls_agent(&ctl, WorkerId::trainer(0), &stranger),
    )
    .await
    .expect("a refused worker must stop, not retry")
    .unwrap();
    let err = ended.expect_err("a worker with a stranger's certificate registered");
    let text = err.to_string();
    assert!(matches!(err, AgentError::Tls { .. }), "{text}");
    assert!(text.contains("trainer-0") && text.contains("TLS"), "{text}");
    assert!(
        text.contains("UnknownCA") || text.contains("certificate"),
        "{text}"
    );
    assert_eq!(registered(&ctl), 0);
    assert!(
        eventually(Duration::from_secs(5), || ctl
            .state
            .metrics()
            .refused_count("tls")
            >= 1)
        .await,
        "the controller did not count the TLS refusal"
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_a_controller_whose_certificate_another_ca_signed() {
    let pki = TestPki::new();
    // A controller (an impostor, or another job's) whose certificate the job's CA did not sign.
    let impostor = TlsFiles {
        ca: pki.job.ca.clone(),
        ..pki.other.controller.clone()
    };
    let ctl = tls_controller(&impostor).await;
    let ended = tokio::time::timeout(
        Duration::from_secs(10),
        tls_agent(&ctl, WorkerId::rollout(0), &pki.job.worker),
    )
    .await
    .expect("a worker that refused the controller must stop, not retry")
    .unwrap();
    let err = ended.expect_err("a worker trusted a stranger's controller");
    let text = err.to_string();
    assert!(matches!(err, AgentError::Tls { .. }), "{text}");
    assert!(
        text.contains("rollout-0") && text.contains("UnknownIssuer"),
        "{text}"
    );
    assert_eq!(registered(&ctl), 0);
    ctl.stop().await;
}
