//! The controller with real worker processes (`weightsync worker ...`) on loopback, a small
//! Qwen3-shaped model with fp8 on and verification (checksums plus each rollout's independent
//! recomputation of every byte): syncs commit; a trainer killed mid-sync fails that sync with
//! the trainer named; once it is back, the controller re-plans and the next sync commits.

use std::process::Command;
use std::time::Duration;

use weightsync_agent::api_client::request;
use weightsync_common::DType;
use weightsync_common::protocol::WorldSpec;
use weightsync_controller::AppState;
use weightsync_controller::ControllerConfig;
use weightsync_controller::SchedulesPlanner;
use weightsync_tests::controller_harness::{API_TOKEN, JOB_TOKEN, ServedController, eventually};
use weightsync_tests::processes::{ChildProcess, weightsync_binary};

/// Qwen3 shapes scaled down: every fp8 block boundary still lines up with tp=2.
pub const TINY_QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
 "torch_dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000,
 "tie_word_embeddings": true, "attention_bias": false, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-06, "rope_theta": 1000000}"#;

fn spawn_worker(
    role: &str,
    rank: u32,
    world: &WorldSpec,
    control: std::net::SocketAddr,
    logs: &std::path::Path,
) -> ChildProcess {
    let mut cmd = Command::new(weightsync_binary());
    cmd.args(["worker", role, "--controller", &control.to_string()])
        .args(["--rank", &rank.to_string(), "--model", &world.model])
        .args([
            "--train",
            &world.train,
            "--infer",
            &world.infer,
            "--dtype",
            "fp8",
        ])
        .args(["--reconnect-s", "20"])
        .env("WEIGHTSYNC_JOB_TOKEN", JOB_TOKEN)
        .env_remove("RANK")
        .env_remove("SLURM_PROCID");
    if role == "trainer" {
        cmd.args(["--source", "demo:5", "--watermark-mib", "4"]);
    } else {
        cmd.args(["--demo-check-seed", "5"]);
    }
    ChildProcess::spawn(&format!("{role}-{rank}"), cmd, logs).expect("spawn worker")
}

async fn sync(http: &str, version: u64, wait: bool) -> serde_json::Value {
    let path = if wait {
        "/v1/syncs?wait=true"
    } else {
        "/v1/syncs"
    };
    let r = request(
        http,
        "POST",
        path,
        Some(API_TOKEN),
        Some(&format!("{{\"version\": {version}}}")),
        Duration::from_secs(120),
    )
    .await
    .expect("POST /v1/syncs");
    assert!(
        r.status == 200 || r.status == 202,
        "{}: {}",
        r.status,
        r.body
    );
    r.json()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_trainer_process_is_named_and_the_next_sync_commits_verified() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-qwen3.json");
    std::fs::write(&model, TINY_QWEN3).unwrap();
    let world = WorldSpec {
        model: model.to_string_lossy().into_owned(),
        train: "fsdp=2".into(),
        infer: "tp=2".into(),
        dtype: DType::F8E4M3,
        verify: true,
    };
    let mut cfg = ControllerConfig::for_job(
        world.clone(),
        JOB_TOKEN.into(),
        API_TOKEN.into(),
        Duration::from_secs(5),
        Duration::from_secs(60),
        50,
    )
    .unwrap();
    cfg.shutdown_workers = true;
    let ctl = ServedController::start(AppState::new(cfg, Box::new(SchedulesPlanner))).await;
    let http = ctl.http.to_string();
    let mut trainers: Vec<ChildProcess> = (0..2)
        .map(|r| spawn_worker("trainer", r, &world, ctl.control, dir.path()))
        .collect();
    let _rollouts: Vec<ChildProcess> = (0..2)
        .map(|r| spawn_worker("rollout", r, &world, ctl.control, dir.path()))
        .collect();
    let logs = |t: &[ChildProcess]| {
        t.iter()
            .map(|c| c.log_text())
            .collect::<Vec<_>>()
            .join("\n---\n")
    };
    assert!(
        eventually(Duration::from_secs(60), || ctl
            .state
            .read(|c| c.plan().is_some()))
        .await,
        "workers never registered: {}",
        logs(&trainers)
    );

    let v = sync(&http, 1, true).await;
    assert_eq!(v["state"], "committed", "{v}");
    assert_eq!(v["verified"], true, "{v}");
    assert!(v["bytes"].as_u64().unwrap() > 0);

    // trainer-1 freezes, the sync starts, then trainer-1 is killed in the middle of it.
    trainers[1].pause();
    let v = sync(&http, 2, false).await;
    let id = v["sync_id"].as_u64().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    trainers[1].kill();
    assert!(
        eventually(Duration::from_secs(20), || ctl
            .state
            .read(|c| c.sync(id).is_some_and(|s| s.state.is_terminal())))
        .await
    );
    let r = request(
        &http,
        "GET",
        &format!("/v1/syncs/{id}"),
        None,
        None,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    let v = r.json();
    assert_eq!(v["state"], "failed", "{v}");
    assert_eq!(v["failure"]["worker"], "trainer-1", "{v}");

    // It comes back; the controller re-plans for the new membership and the next sync commits.
    trainers[1] = spawn_worker("trainer", 1, &world, ctl.control, dir.path());
    assert!(
        eventually(Duration::from_secs(60), || {
            ctl.state
                .read(|c| c.plan().is_some_and(|p| p.id >= 2) && c.world_complete())
        })
        .await,
        "no re-plan: {}",
        logs(&trainers)
    );
    let v = sync(&http, 3, true).await;
    assert_eq!(v["state"], "committed", "{v}\n{}", logs(&trainers));
    assert_eq!(v["verified"], true);
    ctl.stop().await;
}
