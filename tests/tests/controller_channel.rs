//! The control channel end to end on loopback: real agents (with scripted drivers that move no
//! bytes) register, follow the version protocol, get killed mid-sync, go silent, come back.

use std::sync::atomic::Ordering;
use std::time::Duration;

use weightsync_agent::run_agent;
use weightsync_common::protocol::{
    DEFAULT_MAX_FRAME, FromWorker, ToWorker, WorkerId, WorkerRole, auth, read_frame, write_frame,
};
use weightsync_controller::sync_record::SyncState;
use weightsync_tests::controller_harness::*;

fn spawn_agent(
    ctl: &ServedController,
    id: WorkerId,
    driver: ScriptedDriver,
) -> tokio::task::JoinHandle<Result<(), weightsync_agent::AgentError>> {
    let verify = ctl.state.config().coordinator.world.verify;
    tokio::spawn(run_agent(agent_config(ctl.control, id, verify), driver))
}

async fn wait_state(ctl: &ServedController, id: u64, want: SyncState) -> bool {
    eventually(Duration::from_secs(10), || {
        ctl.state.read(|c| c.sync(id).map(|s| s.state)) == Some(want)
    })
    .await
}

fn trigger(ctl: &ServedController, version: u64) -> u64 {
    ctl.state.step(
        |c| match c.trigger(version, weightsync_controller::coordinator::Now::wall()) {
            Ok((weightsync_controller::coordinator::Triggered::Created(id), fx)) => (id, fx),
            other => panic!("trigger {version}: {other:?}"),
        },
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_fails_the_sync_by_name_and_the_next_sync_commits() {
    let ctl = ServedController::start(state(2, 2, true)).await;
    let mut agents = std::collections::BTreeMap::new();
    let mut drivers = std::collections::BTreeMap::new();
    for id in ids(2, 2) {
        let d = ScriptedDriver::new();
        drivers.insert(id, d.clone());
        agents.insert(id, spawn_agent(&ctl, id, d));
    }
    assert!(
        eventually(Duration::from_secs(10), || ctl
            .state
            .read(|c| c.plan().is_some()))
        .await,
        "world never completed: {:?}",
        ctl.state.read(|c| c.log())
    );

    let s1 = trigger(&ctl, 1);
    assert!(
        wait_state(&ctl, s1, SyncState::Committed).await,
        "sync 1 did not commit"
    );
    let view = ctl.state.read(|c| c.sync(s1).unwrap().view(true));
    assert_eq!(view.verified, Some(true));
    assert_eq!(view.lanes.as_ref().unwrap().len(), 4);
    for d in drivers.values() {
        assert!(
            eventually(Duration::from_secs(5), || d
                .outcomes
                .lock()
                .unwrap()
                .contains(&(1, true)))
            .await
        );
    }

    // trainer-1 hangs mid-write; kill it while it is in the middle of the sync.
    let victim = WorkerId::trainer(1);
    drivers[&victim].hang.store(true, Ordering::SeqCst);
    let s2 = trigger(&ctl, 2);
    assert!(
        eventually(Duration::from_secs(10), || drivers[&victim]
            .running
            .load(Ordering::SeqCst))
        .await,
        "victim never started writing"
    );
    agents.remove(&victim).unwrap().abort();
    assert!(
        wait_state(&ctl, s2, SyncState::Failed).await,
        "sync 2 did not fail"
    );
    let failure = ctl
        .state
        .read(|c| c.sync(s2).unwrap().failure.clone())
        .unwrap();
    assert_eq!(failure.worker, victim, "{failure}");
    assert!(failure.cause.contains("closed"), "{failure}");
    // Rollouts were told version 2 is not valid.
    for r in 0..2 {
        let d = &drivers[&WorkerId::rollout(r)];
        assert!(
            eventually(Duration::from_secs(5), || d
                .outcomes
                .lock()
                .unwrap()
                .contains(&(2, false)))
            .await,
            "rollout-{r} was not told version 2 is invalid"
        );
    }

    // The trainer comes back; the controller re-plans (membership changed) and says so.
    let d = ScriptedDriver::new();
    agents.insert(victim, spawn_agent(&ctl, victim, d));
    assert!(
        eventually(Duration::from_secs(10), || ctl
            .state
            .read(|c| c.plan().is_some_and(|p| p.id == 2)))
        .await,
        "no re-plan after the trainer came back"
    );
    let reason = ctl.state.read(|c| c.plan().unwrap().reason.clone());
    assert!(reason.contains("trainer-1"), "{reason}");

    let s3 = trigger(&ctl, 3);
    assert!(
        wait_state(&ctl, s3, SyncState::Committed).await,
        "sync 3 did not commit"
    );
    ctl.stop().await;
}

async fn raw_worker(
    ctl: &ServedController,
    token: &str,
    id: WorkerId,
) -> (tokio::net::TcpStream, Option<ToWorker>) {
    let mut s = tokio::net::TcpStream::connect(ctl.control).await.unwrap();
    let Some(ToWorker::Challenge { nonce }) = read_frame(&mut s, DEFAULT_MAX_FRAME).await.unwrap()
    else {
        panic!("no challenge")
    };
    let hello = FromWorker::Hello {
        role: id.role,
        nonce: auth::nonce(),
        proof: auth::prove(token, id.role, &nonce),
    };
    write_frame(&mut s, &hello, DEFAULT_MAX_FRAME)
        .await
        .unwrap();
    let verify = ctl.state.config().coordinator.world.verify;
    let _ = write_frame(
        &mut s,
        &FromWorker::Register(Box::new(registration(id, verify))),
        DEFAULT_MAX_FRAME,
    )
    .await;
    let reply = reply_after_job(&mut s).await;
    (s, reply)
}

/// The controller's answer to a registration, after the `Job` it sends to a worker that proved
/// the token.
async fn reply_after_job(s: &mut tokio::net::TcpStream) -> Option<ToWorker> {
    match read_frame(s, DEFAULT_MAX_FRAME).await.ok().flatten() {
        Some(ToWorker::Job { .. }) => read_frame(s, DEFAULT_MAX_FRAME).await.ok().flatten(),
        other => other,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_token_duplicate_and_contradicting_registrations_are_refused() {
    let ctl = ServedController::start(state(1, 1, false)).await;
    let (_s, reply) = raw_worker(&ctl, "wrong", WorkerId::trainer(0)).await;
    match reply {
        Some(ToWorker::Rejected { reason }) => assert!(
            reason.contains("wrong secret for the trainer role"),
            "{reason}"
        ),
        other => panic!("expected rejection, got {other:?}"),
    }
    let (_keep, reply) = raw_worker(&ctl, JOB_TOKEN, WorkerId::trainer(0)).await;
    assert!(matches!(reply, Some(ToWorker::Welcome { .. })), "{reply:?}");
    let (_s, reply) = raw_worker(&ctl, JOB_TOKEN, WorkerId::trainer(0)).await;
    match reply {
        Some(ToWorker::Rejected { reason }) => {
            assert!(reason.contains("already registered"), "{reason}")
        }
        other => panic!("expected rejection, got {other:?}"),
    }
    let (_s, reply) = raw_worker(&ctl, JOB_TOKEN, WorkerId::rollout(5)).await;
    match reply {
        Some(ToWorker::Rejected { reason }) => assert!(reason.contains("outside"), "{reason}"),
        other => panic!("expected rejection, got {other:?}"),
    }
    // A worker launched for another job.
    let mut s = tokio::net::TcpStream::connect(ctl.control).await.unwrap();
    let Some(ToWorker::Challenge { nonce }) = read_frame(&mut s, DEFAULT_MAX_FRAME).await.unwrap()
    else {
        panic!()
    };
    write_frame(
        &mut s,
        &FromWorker::Hello {
            role: WorkerRole::Rollout,
            nonce: auth::nonce(),
            proof: auth::prove(JOB_TOKEN, WorkerRole::Rollout, &nonce),
        },
        DEFAULT_MAX_FRAME,
    )
    .await
    .unwrap();
    let mut reg = registration(WorkerId::rollout(0), false);
    reg.world.infer = "tp=4".into();
    write_frame(
        &mut s,
        &FromWorker::Register(Box::new(reg)),
        DEFAULT_MAX_FRAME,
    )
    .await
    .unwrap();
    match reply_after_job(&mut s).await {
        Some(ToWorker::Rejected { reason }) => assert!(reason.contains("tp=4"), "{reason}"),
        other => panic!("expected rejection, got {other:?}"),
    }
    // Garbage on the control port closes that connection only.
    {
        use tokio::io::AsyncWriteExt;
        let mut g = tokio::net::TcpStream::connect(ctl.control).await.unwrap();
        let _ = g.write_all(&[0xff; 4096]).await;
    }
    assert_eq!(
        ctl.state.read(|c| c
            .workers(weightsync_controller::coordinator::Now::wall())
            .len()),
        1
    );
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_worker_fails_the_running_sync_within_the_heartbeat_timeout() {
    let mut st_cfg = coordinator_config(1, 1, false);
    st_cfg.heartbeat_timeout = Duration::from_millis(800);
    let cfg =
        weightsync_controller::ControllerConfig::new(st_cfg, JOB_TOKEN.into(), API_TOKEN.into());
    let st = weightsync_controller::AppState::new(
        cfg,
        Box::new(weightsync_controller::planning::NullPlanner),
    );
    let ctl = ServedController::start(st).await;
    let _trainer = spawn_agent(&ctl, WorkerId::trainer(0), ScriptedDriver::new());
    // The rollout registers, accepts its assignment, and then says nothing at all (a hung
    // process).
    let (mut silent, reply) = raw_worker(&ctl, JOB_TOKEN, WorkerId::rollout(0)).await;
    assert!(matches!(reply, Some(ToWorker::Welcome { .. })), "{reply:?}");
    let assign = read_frame::<_, ToWorker>(&mut silent, DEFAULT_MAX_FRAME).await;
    let Ok(Some(ToWorker::Assign(a))) = assign else {
        panic!("expected the assignment, got {assign:?}")
    };
    let ready = FromWorker::Ready {
        plan_id: a.plan_id(),
        regions: Vec::new(),
        tensors: Vec::new(),
    };
    write_frame(&mut silent, &ready, DEFAULT_MAX_FRAME)
        .await
        .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || ctl
            .state
            .read(|c| c.plan().is_some()))
        .await
    );
    let s = trigger(&ctl, 1);
    assert!(wait_state(&ctl, s, SyncState::Failed).await);
    let failure = ctl
        .state
        .read(|c| c.sync(s).unwrap().failure.clone())
        .unwrap();
    assert_eq!(
        failure.worker,
        WorkerId {
            role: WorkerRole::Rollout,
            rank: 0
        }
    );
    assert!(failure.cause.contains("heartbeat"), "{failure}");
    ctl.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sidecar_launched_for_another_job_stops_naming_what_differs() {
    let ctl = ServedController::start(state(1, 1, false)).await;
    let mut cfg = agent_config(ctl.control, WorkerId::rollout(0), false);
    cfg.world.infer = "tp=4".into();
    let err = run_agent(cfg, ScriptedDriver::new()).await.unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("rollout-0") && msg.contains("infer") && msg.contains("tp=4"),
        "{msg}"
    );
    // The job it would have learned is the controller's.
    let (world, model_config) = weightsync_agent::fetch_job(
        &ctl.control.to_string(),
        &JOB_TOKEN.into(),
        WorkerRole::Rollout,
        weightsync_agent::AGENT_MAX_FRAME,
    )
    .await
    .unwrap();
    assert_eq!((world, model_config), (world_of(&ctl), None));
    assert!(
        weightsync_agent::fetch_job(
            &ctl.control.to_string(),
            &"wrong".into(),
            WorkerRole::Rollout,
            1 << 20
        )
        .await
        .is_err()
    );
    ctl.stop().await;
}

fn world_of(ctl: &ServedController) -> weightsync_common::protocol::WorldSpec {
    ctl.state.config().coordinator.world.clone()
}
