//! While the controller re-plans Kimi-K2 (256 trainers, 128 rollouts, fp8), `GET /healthz`
//! answers at once: planning runs on a thread of its own, not under the coordinator's lock, so
//! the API and heartbeats are served throughout.
//!
//! The world registers straight into the served controller's state (no worker processes); the
//! first plan is the null one (so only the re-plan costs a Kimi-K2 planning), then a rollout
//! leaves and registers again, and `/healthz` is called over a real socket, back to back, for as
//! long as the re-plan runs. Every answer given while it ran must say so and come within 50 ms
//! (the planner, not under the lock, takes seconds).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use weightsync_agent::api_client::request;
use weightsync_common::DType;
use weightsync_common::protocol::{Blob, Registration, WorkerId, WorkerRole, WorldSpec};
use weightsync_controller::coordinator::Now;
use weightsync_controller::planning::{AssignmentError, NullPlanner, PlanOutput, Planner};
use weightsync_controller::{AppState, ControllerConfig, SchedulesPlanner};
use weightsync_tests::controller_harness::{API_TOKEN, JOB_TOKEN, ServedController};

/// The null plan first, then the real one: only the re-plan pays for planning Kimi-K2.
#[derive(Debug)]
struct RealFromTheSecondPlan;

impl Planner for RealFromTheSecondPlan {
    fn plan(
        &self,
        plan_id: u64,
        world: &WorldSpec,
        workers: &BTreeMap<WorkerId, Registration>,
    ) -> Result<PlanOutput, AssignmentError> {
        if plan_id == 1 {
            NullPlanner.plan(plan_id, world, workers)
        } else {
            SchedulesPlanner.plan(plan_id, world, workers)
        }
    }
}

fn kimi() -> WorldSpec {
    WorldSpec {
        model: "kimi-k2".into(),
        train: "pp=2,ep=8,fsdp=16".into(),
        infer: "tp=8,ep=32,dp=4".into(),
        dtype: DType::F8E4M3,
        verify: true,
    }
}

fn registration(id: WorkerId) -> Registration {
    Registration {
        id,
        host: "h".into(),
        pid: 1,
        world: kimi(),
        fabric_endpoint: Blob(id.to_string().into_bytes()),
        // A Kimi-K2 rollout has one region (the planner checks the count).
        regions: match id.role {
            WorkerRole::Rollout => vec![Blob(vec![0; 32])],
            WorkerRole::Trainer => Vec::new(),
        },
        tensors: Vec::new(),
        placement: None,
        skip: Vec::new(),
    }
}

async fn wait_planned(state: &AppState, plan_id: u64) {
    let deadline = Instant::now() + Duration::from_secs(600);
    while state.read(|c| c.latest_plan().map(|p| p.id)) != Some(plan_id) {
        let error = state.read(|c| c.plan_error().map(str::to_string));
        assert!(error.is_none(), "plan {plan_id} failed: {error:?}");
        assert!(
            Instant::now() < deadline,
            "plan {plan_id} not made in 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Calls `/healthz` every 5 ms while `go(answers so far)` holds; the latencies of the answers
/// `keep` accepts (during a re-plan: those that say the re-plan was running).
async fn healthz_latencies(
    http: &str,
    mut go: impl FnMut(usize) -> bool,
    keep: impl Fn(&serde_json::Value) -> bool,
) -> Vec<Duration> {
    let mut out = Vec::new();
    while go(out.len()) {
        let t = Instant::now();
        let r = request(http, "GET", "/healthz", None, None, Duration::from_secs(30))
            .await
            .expect("healthz answers");
        let took = t.elapsed();
        assert_eq!(r.status, 200, "{}", r.body);
        if keep(&r.json()) {
            out.push(took);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    out
}

/// Median, 99th percentile and maximum, in ms.
fn percentiles(d: &[Duration]) -> (f64, f64, f64) {
    let mut ms: Vec<f64> = d.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| {
        ms.get(((ms.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0.0)
    };
    (at(0.5), at(0.99), at(1.0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_answers_within_50_ms_while_the_controller_re_plans_kimi_k2() {
    let cfg = ControllerConfig::for_job(
        kimi(),
        JOB_TOKEN.into(),
        API_TOKEN.into(),
        Duration::from_secs(3600),
        Duration::from_secs(600),
        10,
    )
    .unwrap();
    assert_eq!(
        (cfg.coordinator.trainers, cfg.coordinator.rollouts),
        (256, 128)
    );
    let state = AppState::new(cfg, Box::new(RealFromTheSecondPlan));
    let ctl = ServedController::start(state.clone()).await;
    let workers = (0..256)
        .map(WorkerId::trainer)
        .chain((0..128).map(WorkerId::rollout));
    for (conn, id) in (1_000_000u64..).zip(workers) {
        state.step(|c| ((), c.register(conn, registration(id), Now::wall()).unwrap()));
    }
    wait_planned(&state, 1).await;

    let http = ctl.http.to_string();
    let idle = healthz_latencies(&http, |n| n < 500, |_| true).await;

    // rollout-7 restarts: the membership changed, the controller re-plans the whole job.
    let gone = 1_000_000 + 256 + 7;
    state.step(|c| ((), c.disconnect(gone, "restarted", Now::wall())));
    let started = Instant::now();
    state.step(|c| {
        let fx = c
            .register(2_000_000, registration(WorkerId::rollout(7)), Now::wall())
            .unwrap();
        ((), fx)
    });
    let during = healthz_latencies(
        &http,
        |_| state.read(|c| c.planning()) == Some(2),
        |h| h["planning"] == 2,
    )
    .await;
    let replan = started.elapsed();
    wait_planned(&state, 2).await;
    let summary = state.read(|c| c.latest_plan().map(|p| p.summary.clone()));
    assert!(
        summary.is_some_and(|s| s["work_requests"].as_u64().is_some_and(|n| n > 1_000_000)),
        "the re-plan is Kimi-K2's routing table"
    );
    let (p50, p99, max) = percentiles(&during);
    let (i50, i99, imax) = percentiles(&idle);
    println!(
        "re-plan of kimi-k2 took {:.1} s; /healthz answered {} times meanwhile: median {p50:.2} ms, \
         p99 {p99:.2} ms, max {max:.2} ms (idle, before it: median {i50:.2} ms, p99 {i99:.2} ms, \
         max {imax:.2} ms)",
        replan.as_secs_f64(),
        during.len(),
    );
    assert!(
        during.len() >= 10,
        "only {} answers during a {replan:?} re-plan",
        during.len()
    );
    // The bound is 50 ms; a shared machine stalls any thread now and then, so the 99th
    // percentile must meet it and no single answer may take a second (under the old lock, one
    // would have waited the whole re-plan).
    assert!(
        p99 < 50.0,
        "/healthz p99 {p99:.1} ms while the controller re-planned"
    );
    assert!(
        max < 1000.0,
        "/healthz took {max:.1} ms while the controller re-planned"
    );
    ctl.stop().await;
}
