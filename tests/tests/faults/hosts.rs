//! Several hosts on one machine: the real processes, each in its own network namespace on a
//! bridged lan (see `weightsync_tests::netns`). Needs root; elsewhere each test says why it
//! skips and returns.

use std::time::{Duration, Instant};

use weightsync_tests::netns::{self, Lan};
use weightsync_tests::process_cluster::{
    JobSpec, Placement, ProcessCluster, assert_committed_and_verified,
};
use weightsync_tests::processes::wait_until;

const READY: Duration = Duration::from_secs(60);

/// Host 0 runs the controller, hosts 1.. the trainers, then the rollouts.
fn placed(lan: &Lan, spec: &JobSpec) -> Placement {
    let host = |i: usize| {
        let h = lan.host(i);
        (
            vec![
                "ip".to_owned(),
                "netns".to_owned(),
                "exec".to_owned(),
                h.ns.name().to_owned(),
            ],
            h.addr.to_string(),
        )
    };
    let t = spec.trainers as usize;
    Placement::Hosts {
        controller: host(0),
        controller_ns: lan.host(0).ns.name().to_owned(),
        trainers: (0..t).map(|i| host(1 + i)).collect(),
        rollouts: (0..spec.rollouts as usize)
            .map(|i| host(1 + t + i))
            .collect(),
    }
}

fn lan_for(spec: &JobSpec) -> Option<Lan> {
    if let Some(why) = netns::unavailable_reason() {
        eprintln!("SKIPPED (network namespaces unavailable): {why}");
        return None;
    }
    Some(Lan::new(1 + (spec.trainers + spec.rollouts) as usize).expect("building the lan"))
}

/// Index of rollout `r`'s host.
fn rollout_host(spec: &JobSpec, r: u32) -> usize {
    1 + (spec.trainers + r) as usize
}

#[test]
fn sync_across_hosts_commits_and_a_partition_mid_sync_fails_cleanly() {
    let spec = JobSpec::tiny();
    let Some(lan) = lan_for(&spec) else { return };
    let c = ProcessCluster::start_placed(spec.clone(), placed(&lan, &spec));
    assert!(
        c.wait_ready(READY),
        "never ready across hosts\n{}",
        c.logs()
    );
    assert_committed_and_verified(
        &c.sync(1, Duration::from_secs(40)),
        "sync across hosts",
        &|| c.logs(),
    );

    // Once trainers write, freeze rollout 0 so the sync is certainly in flight, then cut its
    // host off the lan. A sync that ended before the freeze is retried with the next version.
    let mut sabotaged = None;
    for version in 2..7 {
        let r = c.trigger(version, false).expect("trigger");
        let id = r
            .json()
            .and_then(|j| j["sync_id"].as_u64())
            .expect("sync_id");
        let started = wait_until(Duration::from_secs(20), || {
            c.sync_view(id)
                .filter(|v| v["state"] != "pending")
                .map(|_| ())
        });
        assert!(started.is_some(), "sync {id} never started\n{}", c.logs());
        let frozen = c.rollouts[0].as_ref().expect("rollout 0");
        frozen.pause();
        if c.sync_view(id).is_some_and(|v| v["state"] == "running") {
            lan.set_link(rollout_host(&spec, 0), false)
                .expect("partition");
            frozen.resume();
            sabotaged = Some((id, Instant::now()));
            break;
        }
        frozen.resume();
        assert_committed_and_verified(
            &c.wait_end(id, Duration::from_secs(40)).expect("sync ends"),
            "an unsabotaged sync",
            &|| c.logs(),
        );
    }
    let (id, cut_at) = sabotaged.expect("five syncs ended before they could be partitioned");
    let limit =
        Duration::from_millis(spec.heartbeat_timeout_ms) + Duration::from_secs(spec.sync_timeout_s);
    let view = c
        .wait_end(id, limit + Duration::from_secs(10))
        .unwrap_or_else(|| panic!("the partitioned sync never ended\n{}", c.logs()));
    let took = cut_at.elapsed();
    eprintln!(
        "partitioned sync ended {} after {took:?}: {}",
        view["state"], view["failure"]
    );
    assert_eq!(view["state"], "failed", "{view}");
    assert!(
        !view["failure"]["worker"].as_str().unwrap_or("").is_empty(),
        "the failure must name a worker: {view}"
    );
    assert!(
        took <= limit + Duration::from_secs(5),
        "failing took {took:?} (limit {limit:?})"
    );

    // Heal the partition: rollout 0 reconnects, and the very next sync commits verified.
    //
    // This is the regression test for the stale-frame finding: frames of the failed sync that
    // a trainer's TCP lane still held were delivered once the link healed, during the next sync,
    // and failed its verification. Trainers now answer the abort only after they stopped and
    // reset their lanes (RST, send queues discarded), and the controller starts no sync before
    // they did, so nothing of the failed sync can land any more.
    lan.set_link(rollout_host(&spec, 0), true).expect("heal");
    assert!(c.wait_ready(READY), "not ready after healing\n{}", c.logs());
    assert_committed_and_verified(
        &c.sync(10, Duration::from_secs(40)),
        "first sync after healing",
        &|| c.logs(),
    );
    assert_committed_and_verified(
        &c.sync(11, Duration::from_secs(40)),
        "second sync after healing",
        &|| c.logs(),
    );
}

#[test]
fn sync_with_delay_and_loss_commits() {
    if let Some(why) = netns::netem_unavailable_reason() {
        eprintln!("SKIPPED (netem unavailable): {why}");
        return;
    }
    let spec = JobSpec::tiny();
    let Some(lan) = lan_for(&spec) else { return };
    for i in 0..lan.len() {
        lan.netem(i, 5, 1.0).expect("netem 5 ms delay, 1% loss");
    }
    let c = ProcessCluster::start_placed(spec.clone(), placed(&lan, &spec));
    assert!(c.wait_ready(READY), "never ready with netem\n{}", c.logs());
    for v in 1..=2 {
        assert_committed_and_verified(
            &c.sync(v, Duration::from_secs(60)),
            "sync with 5 ms delay and 1% loss",
            &|| c.logs(),
        );
    }
}
