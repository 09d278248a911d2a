//! Process-level faults: the real `weightsync` controller, trainers and rollouts on loopback.
//!
//! "Mid-sync" is made certain rather than lucky: a rollout is frozen with SIGSTOP (its sockets
//! stay open, it reads nothing, so trainers block in WRITE waiting for completions), the sync is
//! seen `running`, and only then is the victim killed with SIGKILL. The frozen rollout is
//! resumed right after, well inside the heartbeat timeout.
//!
//! Every scenario checks: the sabotaged sync is never `committed`; its failure names the worker;
//! and the next sync commits with `verified: true` (rollouts check every tensor against the
//! trainers' checksums and against an independent recomputation of the demo weights before they
//! report verified, and the controller tells rollouts `Commit` only in the committed state).

use std::time::Duration;

use weightsync_tests::process_cluster::{
    API_TOKEN, JobSpec, ProcessCluster, assert_committed_and_verified,
};
use weightsync_tests::processes::wait_until;

const READY: Duration = Duration::from_secs(60);
const SYNC: Duration = Duration::from_secs(40);

fn ready_cluster() -> ProcessCluster {
    let c = ProcessCluster::start(JobSpec::tiny());
    assert!(c.wait_ready(READY), "cluster never got ready\n{}", c.logs());
    c
}

fn trigger_id(c: &ProcessCluster, version: u64) -> u64 {
    let r = c
        .trigger(version, false)
        .unwrap_or_else(|e| panic!("trigger {version}: {e}"));
    assert!(
        r.status == 202 || r.status == 200,
        "trigger {version}: {} {}\n{}",
        r.status,
        r.text(),
        c.logs()
    );
    r.json()
        .and_then(|j| j["sync_id"].as_u64())
        .expect("sync_id in the trigger's answer")
}

fn wait_running(c: &ProcessCluster, id: u64) {
    let seen = wait_until(Duration::from_secs(20), || {
        c.sync_view(id)
            .filter(|v| v["state"] != "pending")
            .map(|_| ())
    });
    assert!(seen.is_some(), "sync {id} never ran\n{}", c.logs());
}

/// Starts a sync, waits until trainers are writing (`running`), freezes rollout 0 so bytes are
/// certainly in flight, calls `sabotage`, resumes rollout 0 (if still alive) and returns the
/// sync's final view. A sync that ended before it could be sabotaged (the tiny model syncs in
/// moments) does not count: the next version is tried, up to five times.
fn sabotaged_sync(
    c: &mut ProcessCluster,
    first_version: u64,
    sabotage: impl Fn(&mut ProcessCluster),
) -> serde_json::Value {
    for version in first_version..first_version + 5 {
        let id = trigger_id(c, version);
        wait_running(c, id);
        c.rollouts[0].as_ref().expect("rollout 0").pause();
        let still_running = c.sync_view(id).is_some_and(|v| v["state"] == "running");
        if !still_running {
            c.rollouts[0].as_ref().expect("rollout 0").resume();
            let view = c.wait_end(id, SYNC).expect("sync ends");
            assert_committed_and_verified(&view, "an unsabotaged sync", &|| c.logs());
            continue;
        }
        std::thread::sleep(Duration::from_millis(100));
        sabotage(c);
        if let Some(r) = c.rollouts[0].as_ref() {
            r.resume();
        }
        return c
            .wait_end(id, SYNC)
            .unwrap_or_else(|| panic!("sync {id} never ended\n{}", c.logs()));
    }
    panic!("five syncs in a row ended before they could be sabotaged");
}

fn assert_failed_naming(view: &serde_json::Value, worker: &str, logs: &dyn Fn() -> String) {
    assert_eq!(view["state"], "failed", "{view}\n{}", logs());
    assert_ne!(view["verified"], true);
    let named = view["failure"]["worker"].as_str().unwrap_or("");
    assert_eq!(named, worker, "the failure must name {worker}: {view}");
    assert!(
        !view["failure"]["cause"].as_str().unwrap_or("").is_empty(),
        "the failure must say why: {view}"
    );
}

#[test]
fn trainer_killed_mid_sync_is_named_and_the_next_sync_commits() {
    let mut c = ready_cluster();
    assert_committed_and_verified(&c.sync(1, SYNC), "sync 1", &|| c.logs());
    let view = sabotaged_sync(&mut c, 2, |c| c.kill_worker("trainer", 1));
    assert_failed_naming(&view, "trainer-1", &|| c.logs());

    c.start_worker("trainer", 1);
    assert!(
        c.wait_ready(READY),
        "not ready after the trainer came back\n{}",
        c.logs()
    );
    assert_committed_and_verified(&c.sync(10, SYNC), "sync after recovery", &|| c.logs());
}

#[test]
fn rollout_killed_mid_sync_is_named_and_the_next_sync_commits() {
    let mut c = ready_cluster();
    assert_committed_and_verified(&c.sync(1, SYNC), "sync 1", &|| c.logs());
    // Rollout 0 is frozen mid-sync, then killed: its bytes never all land.
    let view = sabotaged_sync(&mut c, 2, |c| c.kill_worker("rollout", 0));
    assert_failed_naming(&view, "rollout-0", &|| c.logs());

    // A new rollout 0 registers new memory: the controller re-plans, and the next sync commits.
    c.start_worker("rollout", 0);
    assert!(
        c.wait_ready(READY),
        "not ready after the rollout came back\n{}",
        c.logs()
    );
    let plan = c.get("/v1/plan").expect("plan").text();
    assert!(
        plan.contains("re-plan") || plan.contains("rollout-0"),
        "plan log: {plan}"
    );
    assert_committed_and_verified(&c.sync(10, SYNC), "sync after recovery", &|| c.logs());
}

#[test]
fn controller_restarted_between_syncs_and_workers_rejoin() {
    let mut c = ready_cluster();
    assert_committed_and_verified(&c.sync(1, SYNC), "sync 1", &|| c.logs());
    c.kill_controller();
    c.start_controller();
    assert!(
        c.wait_ready(READY),
        "workers did not rejoin the restarted controller\n{}",
        c.logs()
    );
    assert_committed_and_verified(&c.sync(2, SYNC), "sync after restart", &|| c.logs());
}

#[test]
fn concurrent_triggers_start_one_sync_and_refuse_the_other_with_its_id() {
    let c = ready_cluster();
    assert_committed_and_verified(&c.sync(1, SYNC), "sync 1", &|| c.logs());
    // Freeze rollout 0 so the first sync cannot end before the second trigger arrives.
    c.rollouts[0].as_ref().expect("rollout 0").pause();
    let answers: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = [2u64, 3]
            .into_iter()
            .map(|v| {
                let c = &c;
                s.spawn(move || c.trigger(v, false).expect("trigger"))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    c.rollouts[0].as_ref().expect("rollout 0").resume();
    let statuses: Vec<u16> = answers.iter().map(|r| r.status).collect();
    let created: Vec<_> = answers.iter().filter(|r| r.status == 202).collect();
    let refused: Vec<_> = answers.iter().filter(|r| r.status == 409).collect();
    assert_eq!(
        (created.len(), refused.len()),
        (1, 1),
        "statuses {statuses:?}: {:?}",
        answers.iter().map(|r| r.text()).collect::<Vec<_>>()
    );
    let id = created[0]
        .json()
        .and_then(|j| j["sync_id"].as_u64())
        .expect("sync_id");
    assert!(
        refused[0].text().contains(&id.to_string()),
        "the refusal must name the running sync {id}: {}",
        refused[0].text()
    );
    let view = c.wait_end(id, SYNC).expect("the created sync ends");
    assert_committed_and_verified(&view, "the one concurrent sync", &|| c.logs());
    // Same version twice is idempotent: the existing sync's id comes back.
    let again = c
        .request(
            "POST",
            "/v1/syncs",
            Some(API_TOKEN),
            format!("{{\"version\": {}}}", view["version"]).as_bytes(),
        )
        .expect("re-trigger");
    assert_eq!(again.status, 200, "{}", again.text());
    assert_eq!(again.json().and_then(|j| j["sync_id"].as_u64()), Some(id));
}

#[test]
fn trigger_before_the_world_is_complete_is_refused_then_works() {
    let mut c = ProcessCluster::start(JobSpec::tiny());
    c.kill_worker("trainer", 1);
    assert!(
        wait_until(READY, || c.health().map(|_| ())).is_some(),
        "controller never answered\n{}",
        c.logs()
    );
    let r = c.trigger(1, false).expect("trigger");
    assert_eq!(r.status, 503, "{}", r.text());
    let msg = r.text();
    assert!(
        msg.contains("trainer-1")
            || msg.to_lowercase().contains("complete")
            || msg.contains("register"),
        "the refusal must say what is missing: {msg}"
    );
    c.start_worker("trainer", 1);
    assert!(c.wait_ready(READY), "never ready\n{}", c.logs());
    assert_committed_and_verified(&c.sync(1, SYNC), "sync once complete", &|| c.logs());
}

#[test]
fn duplicate_and_contradictory_registrations_are_refused_with_reasons() {
    let c = ready_cluster();
    // A second trainer-0 while the first is registered.
    let mut dup = c.spawn_worker("trainer", 0, &[("--reconnect-s", "2")]);
    let line = dup.wait_for_line("already registered", Duration::from_secs(20));
    dup.kill();
    assert!(line.is_some(), "duplicate not refused: {}", dup.log_text());
    // A trainer that believes the job is fsdp=4 (the job is fsdp=2).
    let mut bad = c.spawn_worker(
        "trainer",
        1,
        &[("--train", "fsdp=4"), ("--reconnect-s", "2")],
    );
    let line = bad.wait_for_line("different job", Duration::from_secs(20));
    bad.kill();
    let text = bad.log_text();
    assert!(line.is_some(), "contradictory layout not refused: {text}");
    assert!(
        text.contains("fsdp=4"),
        "the refusal should quote the contradiction: {text}"
    );
    let workers = c.get("/v1/workers").expect("workers").text();
    assert!(!workers.contains("fsdp=4"), "an impostor joined: {workers}");
    assert_committed_and_verified(&c.sync(1, SYNC), "sync after refusals", &|| c.logs());
}
