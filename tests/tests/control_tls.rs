//! TLS on the control channel and the HTTP API (issue 39), with certificates made by `rcgen`:
//! a job runs over mutual TLS and is triggered over HTTPS by the Rust API client; plain HTTP to
//! the TLS port gets no answer; an API client that trusts another CA, or whose CRL lists the
//! controller's certificate, is refused by name; a worker whose certificate another CA signed,
//! or the controller's CRL lists, is refused by name and registers nothing; a worker shown a
//! controller certificate from another CA, or one its CRL lists, refuses it by name.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use weightsync_agent::api_client::ClientError;
use weightsync_agent::embed::ApiClient;
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

    // The Rust API client triggers the sync over HTTPS (the certificate's IP SAN checked).
    let url = format!("https://{}", ctl.http);
    let api = |tls: TlsClient| ApiClient::with_tls(&url, Some(API_TOKEN), Some(tls)).unwrap();
    let trusted = api(TlsClient::server_only(&pki.job.ca, None, None).unwrap());
    let r = tokio::task::spawn_blocking(move || trusted.sync(1, true, Duration::from_secs(20)))
        .await
        .unwrap()
        .expect("the sync triggered over HTTPS");
    assert_eq!(
        (r.version, r.state.as_str(), &r.failure),
        (1, "committed", &None)
    );
    let committed = ctl.state.read(|c| c.last_sync());
    assert_eq!(committed.map(|(_, st)| st), Some(SyncState::Committed));
    // A client with a worker's certificate (mutual TLS where asked) is answered too.
    let mutual = api(TlsClient::new(&pki.job.worker, None).unwrap());
    let again = tokio::task::spawn_blocking(move || mutual.sync(1, false, Duration::from_secs(10)))
        .await
        .unwrap()
        .expect("the idempotent trigger over HTTPS with a client certificate");
    assert_eq!((again.state.as_str(), again.created), ("committed", false));

    // A client that trusts another CA, or whose CRL lists the controller's certificate, refuses
    // the controller by name and sends nothing.
    for (tls, cause) in [
        (
            TlsClient::server_only(&pki.other.ca, None, None).unwrap(),
            "UnknownIssuer",
        ),
        (
            TlsClient::server_only(&pki.job.ca, Some(&pki.job.controller_crl), None).unwrap(),
            "Revoked",
        ),
    ] {
        let client = api(tls);
        let err =
            tokio::task::spawn_blocking(move || client.sync(2, false, Duration::from_secs(10)))
                .await
                .unwrap()
                .expect_err("an untrusted controller was talked to");
        let text = err.to_string();
        assert!(matches!(err, ClientError::Tls { .. }), "{text}");
        assert!(text.contains("TLS") && text.contains(cause), "{text}");
    }
    assert_eq!(
        ctl.state.read(|c| c.last_sync()),
        committed,
        "a refused client synced"
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
    let err = refused_agent(&ctl, WorkerId::trainer(0), &stranger).await;
    let text = err.to_string();
    assert!(matches!(err, AgentError::Tls { .. }), "{text}");
    assert!(text.contains("trainer-0") && text.contains("TLS"), "{text}");
    assert!(
        text.contains("UnknownCA") || text.contains("certificate"),
        "{text}"
    );
    assert_eq!(registered(&ctl), 0);
    assert!(
        tls_refusal_counted(&ctl).await,
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

/// Runs `files`' worker against `ctl` until it stops; its error (it must be refused).
async fn refused_agent(ctl: &ServedController, id: WorkerId, files: &TlsFiles) -> AgentError {
    tokio::time::timeout(Duration::from_secs(10), tls_agent(ctl, id, files))
        .await
        .expect("a refused worker must stop, not retry")
        .unwrap()
        .expect_err("a worker the controller must refuse got through")
}

/// Whether `ctl` counted a TLS refusal (within 5 s).
async fn tls_refusal_counted(ctl: &ServedController) -> bool {
    eventually(Duration::from_secs(5), || {
        ctl.state.metrics().refused_count("tls") >= 1
    })
    .await
}

/// The controller's CRL revokes one worker's certificate: that worker is refused by name and
/// registers nothing, while a worker with a valid certificate of the same CA registers; a
/// worker whose own CRL lists the controller's certificate refuses the controller by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_certificate_is_refused_by_name_and_a_valid_one_registers() {
    let pki = TestPki::new();
    let ctl = tls_controller(&TlsFiles {
        crl: Some(pki.job.crl.clone()),
        ..pki.job.controller.clone()
    })
    .await;

    let err = refused_agent(&ctl, WorkerId::trainer(0), &pki.job.revoked_worker).await;
    let text = err.to_string();
    assert!(matches!(err, AgentError::Tls { .. }), "{text}");
    assert!(
        text.contains("trainer-0") && text.contains("CertificateRevoked"),
        "{text}"
    );
    assert_eq!(registered(&ctl), 0);
    assert!(
        tls_refusal_counted(&ctl).await,
        "the controller did not count the refusal of a revoked certificate"
    );

    // The worker's side: a CRL that lists the controller's certificate.
    let distrustful = TlsFiles {
        crl: Some(pki.job.controller_crl.clone()),
        ..pki.job.worker.clone()
    };
    let err = refused_agent(&ctl, WorkerId::rollout(0), &distrustful).await;
    let text = err.to_string();
    assert!(matches!(err, AgentError::Tls { .. }), "{text}");
    assert!(
        text.contains("rollout-0") && text.contains("Revoked"),
        "{text}"
    );
    assert_eq!(registered(&ctl), 0);

    // Fail closed: a controller whose CRL file covers another CA only cannot tell whether the
    // job CA's certificates are revoked, and refuses them.
    let uncovered = tls_controller(&TlsFiles {
        crl: Some(pki.other.crl.clone()),
        ..pki.job.controller.clone()
    })
    .await;
    let err = refused_agent(&uncovered, WorkerId::trainer(0), &pki.job.worker).await;
    assert!(matches!(err, AgentError::Tls { .. }), "{err}");
    assert_eq!(registered(&uncovered), 0);
    uncovered.stop().await;

    // A valid certificate of the same CA, with a CRL that lists only another certificate.
    let valid = TlsFiles {
        crl: Some(pki.job.crl.clone()),
        ..pki.job.worker.clone()
    };
    let agent = tls_agent(&ctl, WorkerId::trainer(0), &valid);
    assert!(
        eventually(Duration::from_secs(10), || registered(&ctl) == 1).await,
        "a worker with a valid certificate did not register under a CRL"
    );
    agent.abort();
    ctl.stop().await;
}

/// `weightsync demo --tls`: the real binaries (a served controller, worker processes started
/// with `--tls-cert/--tls-key/--tls-ca`, the demo's https trigger) sync a tiny Qwen3 over mutual
/// TLS with a CA made for the run. About 4 s.
#[test]
fn the_demo_syncs_over_mutual_tls_with_a_throwaway_ca() {
    use weightsync_tests::processes::{ChildProcess, weightsync_binary};
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-qwen3.json");
    std::fs::write(
        &model,
        r#"{"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 128, "vocab_size": 1000, "tie_word_embeddings": true}"#,
    )
    .unwrap();
    let mut cmd = std::process::Command::new(weightsync_binary());
    cmd.args(["demo", "--tls", "--exit", "--model"])
        .arg(&model)
        .args(["--train", "fsdp=1", "--infer", "tp=1,dp=1", "--syncs", "1"])
        .args(["--http", "127.0.0.1:0", "--watermark-mib", "4"]);
    let mut demo = ChildProcess::spawn("demo-tls", cmd, dir.path()).unwrap();
    let status = demo.wait_exit(Duration::from_secs(120));
    let log = demo.log_text();
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{log}");
    for needle in [
        "over mutual TLS, throwaway CA",
        "dashboard: https://",
        "1 of 1 syncs committed",
    ] {
        assert!(log.contains(needle), "no {needle:?} in:\n{log}");
    }
}

const TRAINER_SECRET: &str = "trainer-secret-0123456789";
const ENGINE_SECRET: &str = "engine-secret-0123456789";

/// A small dense Qwen3: one trainer, one engine.
const CONFIG: &str = r#"{"model_type":"qwen3","hidden_size":128,"intermediate_size":256,
 "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,
 "vocab_size":128}"#;

/// A controller of a one-trainer, one-engine job with one secret per role and TLS, on a
/// runtime of its own (the embedded workers block).
fn serve_tls_job(
    dir: &tempfile::TempDir,
    tls: &TlsFiles,
) -> (tokio::runtime::Runtime, ServedController) {
    let path = dir.path().join("config.json");
    std::fs::write(&path, CONFIG).unwrap();
    let world = weightsync_common::protocol::WorldSpec {
        model: path.to_string_lossy().into_owned(),
        train: "fsdp=1".into(),
        infer: "tp=1,dp=1,format=hf".into(),
        dtype: weightsync_common::DType::BF16,
        verify: true,
    };
    let mut cfg = ControllerConfig::for_job(
        world,
        TRAINER_SECRET.into(),
        API_TOKEN.into(),
        Duration::from_secs(3),
        Duration::from_secs(30),
        16,
    )
    .unwrap();
    cfg.secrets.rollout = ENGINE_SECRET.into();
    cfg.tls = Some(TlsServer::new(tls).unwrap());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ctl = rt.block_on(ServedController::start(AppState::new(
        cfg,
        Box::new(weightsync_controller::SchedulesPlanner),
    )));
    (rt, ctl)
}

/// The fabric is bound to TLS: trainer and engine hold different role secrets and no fabric
/// secret (without TLS each would key its lanes with its own secret and no lane would open),
/// learn the same fabric key over mutual TLS, and a version lands byte for byte. The key is the
/// same for both roles and for a controller restarted from the same files, and differs for
/// another controller key; a plain controller hands out none.
#[test]
fn the_fabric_key_comes_over_tls_and_a_version_lands_with_per_role_secrets() {
    use weightsync_agent::embed::{
        DstTensor, EngineHandle, EngineOptions, SourceTensor, TrainerHandle, TrainerOptions,
    };
    use weightsync_tests::embed_fixture::Buffer;
    assert!(
        std::env::var_os("WEIGHTSYNC_FABRIC_TOKEN").is_none(),
        "this test needs no shared fabric secret in its environment"
    );
    let pki = TestPki::new();
    let dir = tempfile::tempdir().unwrap();
    let (rt, ctl) = serve_tls_job(&dir, &pki.job.controller);
    let control = ctl.control.to_string();

    // Both roles learn the same key, over TLS only.
    let client = TlsClient::new(&pki.job.worker, None).unwrap();
    let key_of = |secret: &str, id: WorkerId| {
        rt.block_on(weightsync_agent::fetch_job_over(
            &control,
            Some(&client),
            &secret.into(),
            id,
            weightsync_agent::AGENT_MAX_FRAME,
        ))
        .unwrap()
        .fabric_key
        .expect("a controller with TLS hands out the fabric key")
    };
    let trainer_key = key_of(TRAINER_SECRET, WorkerId::trainer(0));
    assert_eq!(trainer_key, key_of(ENGINE_SECRET, WorkerId::rollout(0)));
    let secrets = [TRAINER_SECRET, ENGINE_SECRET];
    let restarted = TlsServer::new(&pki.job.controller).unwrap();
    assert_eq!(trainer_key.0, restarted.fabric_key(&secrets));
    let other = TlsServer::new(&pki.other.controller).unwrap();
    assert_ne!(trainer_key.0, other.fabric_key(&secrets));

    let engine = EngineHandle::connect(EngineOptions {
        job_token: Some(ENGINE_SECRET.into()),
        tls: Some(pki.job.worker.clone()),
        ..EngineOptions::new(&control, 0)
    })
    .unwrap();
    let dst = Buffer::zeroed_layout(engine.layout());
    engine
        .register(
            dst.iter()
                .map(|(t, b)| DstTensor {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    memory: b.memory(),
                })
                .collect(),
        )
        .unwrap();
    let trainer = TrainerHandle::connect(TrainerOptions {
        job_token: Some(TRAINER_SECRET.into()),
        tls: Some(pki.job.worker.clone()),
        ..TrainerOptions::new(&control, 0)
    })
    .unwrap();
    let src: Vec<_> = trainer
        .layout()
        .into_iter()
        .map(|s| {
            let n = s.shape.iter().product::<u64>() as usize;
            let b = Buffer::zeroed(n * 2);
            // bf16 bit patterns of small finite numbers, different for each tensor.
            let seed = s.name.len() as u16;
            let bytes: Vec<u8> = (0..n)
                .flat_map(|i| (0x3c00u16 + ((i as u16).wrapping_add(seed) & 0xff)).to_le_bytes())
                .collect();
            b.fill(&bytes);
            (s, b)
        })
        .collect();
    trainer
        .register(
            src.iter()
                .map(|(s, b)| SourceTensor {
                    name: s.name.clone(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                    memory: b.memory(),
                })
                .collect(),
        )
        .unwrap();
    let out = trainer
        .push(1)
        .unwrap()
        .wait(Some(Duration::from_secs(20)))
        .unwrap_or_else(|e| panic!("the push over TLS failed: {e}"));
    assert_eq!(out.version, 1);
    engine
        .wait_for_version(1, Some(Duration::from_secs(20)))
        .unwrap();
    for (t, b) in &dst {
        let (_, s) = src.iter().find(|(s, _)| s.name == t.name).unwrap();
        assert!(b.read() == s.read(), "{} did not land over TLS", t.name);
    }
    drop(trainer);
    drop(engine);
    rt.block_on(ctl.stop());
}
