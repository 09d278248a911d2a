//! Simulator invariants on hand-built tables (exact answers) and on planned ones.

use weightsync_common::protocol::Stage;

use super::*;
use crate::cost::CostModel;
use crate::simulate::delta::DeltaModel;
use crate::table::Transform;
use weightsync_common::DType;

/// A table where each trainer copies `tasks` tasks of `task_bytes` bf16 bytes, task `k` of
/// trainer `t` written whole to rollout `dst(t, k)`.
fn copy_table(
    trainers: u32,
    rollouts: u32,
    tasks: u32,
    task_bytes: u64,
    dst: impl Fn(u32, u32) -> u32,
) -> RoutingTable {
    crate::synthetic::CopyTable {
        trainers,
        rollouts,
        tasks,
        task_bytes,
        writes: 1,
    }
    .build("synthetic", |t, k, _| dst(t, k))
    .expect("a well-formed synthetic table")
}

/// A cluster where one MB takes 1 ms on the NIC, in H2D and in preparation.
fn balanced_cluster() -> ClusterModel {
    let cost = CostModel {
        nic_bytes_per_s: 1e9,
        per_wr_s: 0.0,
        h2d_bytes_per_s: 1e9,
        prep_bytes_per_s: 1e9,
        barrier_s: 0.0,
    };
    let mut c = ClusterModel::from_cost(cost);
    c.task_overhead_s = 0.0;
    c.watermark_bytes = 4_000_000;
    c.piece_bytes = Some(1_000_000);
    c
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-12)
}

#[test]
fn pipelined_stages_overlap_and_serialised_ones_add_up() {
    // 30 tasks of 1 MB: each stage 1 ms per task.
    let table = copy_table(1, 1, 30, 1_000_000, |_, _| 0);
    let piped = simulate(&table, &balanced_cluster()).unwrap();
    // Fill (h2d + prepare of the first piece) + 30 writes back to back.
    assert!(
        close(piped.predicted_s, 0.032, 1e-6),
        "{}",
        piped.predicted_s
    );
    let mut serial = balanced_cluster();
    serial.watermark_bytes = 1_000_000; // one piece in flight: nothing overlaps
    let ser = simulate(&table, &serial).unwrap();
    assert!(close(ser.predicted_s, 0.090, 1e-6), "{}", ser.predicted_s);
    assert!(ser.predicted_s / piped.predicted_s > 2.5);
    for r in [&piped, &ser] {
        assert!(r.predicted_s >= r.bound_s * (1.0 - 1e-9));
        assert!(close(r.bound_s, 0.030, 1e-9), "{}", r.bound_s);
    }
}

#[test]
fn fixed_costs_add_to_the_predicted_time_as_documented() {
    // The pipelined case above (0.032 s) with a 5 ms start and 2 ms after landing: both are
    // latencies on the controller's lane, before every trainer's first op and in the final
    // barrier, so they add exactly.
    let table = copy_table(2, 2, 30, 1_000_000, |t, _| t);
    let base = simulate(&table, &balanced_cluster()).unwrap();
    assert!(close(base.predicted_s, 0.032, 1e-6), "{}", base.predicted_s);
    let mut c = balanced_cluster();
    c.fixed = FixedCosts {
        start_s: 5e-3,
        after_landing_s: 2e-3,
    };
    let r = simulate(&table, &c).unwrap();
    assert!(close(r.predicted_s, 0.039, 1e-6), "{}", r.predicted_s);
    let first = r.critical_path.first().unwrap();
    assert_eq!(
        (first.stage, first.worker.as_str()),
        (Stage::Arm, "controller")
    );
    assert!(close(first.end_s, 5e-3, 1e-9), "{first:?}");
    let share = |class: &str| {
        r.critical_breakdown
            .iter()
            .find(|c| c.class == class)
            .map_or(0.0, |c| c.seconds)
    };
    assert!(close(share("sync start latency"), 5e-3, 1e-9));
    assert!(close(share("barrier latency"), 2e-3, 1e-9));
    // They are latencies, not work: on a shared host they take no CPU and still add exactly.
    let host = HostModel {
        h2d_s_per_byte: 0.5e-9,
        prep_s_per_byte: PrepRates::uniform(0.5e-9),
        net_s_per_byte: 0.5e-9,
        net_s_per_write: 0.0,
    };
    let (mut h0, mut h1) = (balanced_cluster(), c);
    h0.host = Some(host);
    h1.host = Some(host);
    let (a, b) = (
        simulate(&table, &h0).unwrap(),
        simulate(&table, &h1).unwrap(),
    );
    assert!(
        close(b.predicted_s - a.predicted_s, 7e-3, 1e-6),
        "{} -> {}",
        a.predicted_s,
        b.predicted_s
    );
}

#[test]
fn task_overhead_is_paid_per_task_in_the_prepare_stage() {
    // 30 one-piece tasks, 1 ms per stage, plus 1 ms per task: preparation (2 ms a piece) is
    // the bottleneck: 1 ms of fill, 30 x 2 ms, 1 ms for the last write.
    let table = copy_table(1, 1, 30, 1_000_000, |_, _| 0);
    let mut c = balanced_cluster();
    c.task_overhead_s = 1e-3;
    let r = simulate(&table, &c).unwrap();
    assert!(close(r.predicted_s, 0.062, 1e-6), "{}", r.predicted_s);
}

#[test]
fn receivers_shared_by_many_senders_take_longer() {
    // 4 trainers x 10 MB each. Into one rollout: its NIC takes 40 MB. Into four: 10 MB each.
    let c = balanced_cluster();
    let one = simulate(&copy_table(4, 4, 10, 1_000_000, |_, _| 0), &c).unwrap();
    let spread = simulate(&copy_table(4, 4, 10, 1_000_000, |t, _| t), &c).unwrap();
    assert!(close(one.bound_s, 0.040, 1e-9));
    assert!(close(spread.bound_s, 0.010, 1e-9));
    assert!(one.predicted_s >= 0.040 - 1e-9, "{}", one.predicted_s);
    assert!(spread.predicted_s < one.predicted_s / 2.0);
    assert_eq!(one.receive.nics, 1);
    assert_eq!(spread.receive.nics, 4);
    assert!(one.receive.max_util > 0.9, "{:?}", one.receive);
    assert!(
        one.dominated_by.contains("receiving NIC"),
        "{}",
        one.dominated_by
    );
}

#[test]
fn faster_nics_never_make_a_sync_slower() {
    let table = copy_table(4, 2, 12, 700_000, |t, k| (t + k) % 2);
    let mut last = f64::INFINITY;
    for gbit in [8.0, 16.0, 40.0, 100.0, 400.0, 1600.0] {
        let c = balanced_cluster().with_nic_gbit(gbit);
        let r = simulate(&table, &c).unwrap();
        assert!(
            r.predicted_s <= last * (1.0 + 1e-9),
            "{gbit}: {} > {last}",
            r.predicted_s
        );
        assert!(r.predicted_s >= r.bound_s * (1.0 - 1e-9));
        last = r.predicted_s;
    }
}

#[test]
fn two_nics_per_gpu_stripe_a_sync() {
    // Network-bound: two NICs of half the rate per GPU move a sync as fast as one NIC of the
    // full rate, and two of the full rate nearly twice as fast as one.
    let table = copy_table(4, 2, 12, 700_000, |t, k| (t + k) % 2);
    let cluster = |gbit: f64, nics_per_gpu: u32| {
        let mut c = balanced_cluster().with_nic_gbit(gbit);
        c.cost.h2d_bytes_per_s = 1e12;
        c.cost.prep_bytes_per_s = 1e12;
        c.nics_per_node = c.gpus_per_node * nics_per_gpu;
        c
    };
    let (one, two_half, two_full) = (cluster(8.0, 1), cluster(4.0, 2), cluster(8.0, 2));
    let (a, b, c) = (
        simulate(&table, &one).unwrap(),
        simulate(&table, &two_half).unwrap(),
        simulate(&table, &two_full).unwrap(),
    );
    assert!(
        (b.predicted_s / a.predicted_s - 1.0).abs() < 0.05,
        "2 x half {} vs 1 x full {}",
        b.predicted_s,
        a.predicted_s
    );
    assert!(
        c.predicted_s < a.predicted_s * 0.6,
        "2 x full {} vs 1 x full {}",
        c.predicted_s,
        a.predicted_s
    );
    // Several NICs per GPU must be the same number for every GPU.
    let mut odd = balanced_cluster();
    odd.nics_per_node = odd.gpus_per_node * 2 + 1;
    assert!(
        simulate(&table, &odd)
            .unwrap_err()
            .to_string()
            .contains("whole multiple")
    );
}

#[test]
fn message_rate_bounds_tiny_writes() {
    // 1000 writes of 1 KB at 10 us each: 10 ms of message cost, 1 ms of bytes.
    let table = copy_table(1, 1, 1000, 1000, |_, _| 0);
    let mut c = balanced_cluster();
    c.cost.per_wr_s = 10e-6;
    let r = simulate(&table, &c).unwrap();
    assert!(r.predicted_s >= 0.010 - 1e-9, "{}", r.predicted_s);
    assert_eq!(r.writes, 1000);
}

#[test]
fn timeline_has_every_stage_and_the_critical_path_spans_the_sync() {
    let table = copy_table(2, 2, 8, 1_000_000, |t, _| t);
    let mut c = balanced_cluster();
    c.cost.barrier_s = 1e-3;
    let r = simulate(&table, &c).unwrap();
    for stage in [
        Stage::H2d,
        Stage::Prepare,
        Stage::Write,
        Stage::Barrier,
        Stage::Land,
    ] {
        assert!(r.timeline.iter().any(|e| e.stage == stage), "no {stage:?}");
    }
    let first = r.critical_path.first().unwrap();
    let last = r.critical_path.last().unwrap();
    assert_eq!(first.start_s, 0.0);
    assert!(close(last.end_s, r.predicted_s, 1e-12));
    assert_eq!(last.stage, Stage::Barrier);
    let total: f64 = r.critical_breakdown.iter().map(|c| c.seconds).sum();
    assert!(
        close(total, r.predicted_s, 1e-9),
        "{total} vs {}",
        r.predicted_s
    );
    let trace = r.chrome_trace();
    let n = trace["traceEvents"].as_array().unwrap().len();
    assert!(n > r.timeline.len(), "{n}");
}

#[test]
fn a_shared_host_serialises_what_a_gpu_cluster_overlaps() {
    let table = copy_table(1, 1, 20, 1_000_000, |_, _| 0);
    let mut c = balanced_cluster();
    c.host = Some(HostModel {
        h2d_s_per_byte: 1e-9,
        prep_s_per_byte: PrepRates::uniform(1e-9),
        net_s_per_byte: 1e-9,
        net_s_per_write: 0.0,
    });
    let r = simulate(&table, &c).unwrap();
    // Every stage needs the whole host: 3 x 20 ms, no overlap possible.
    assert!(close(r.predicted_s, 0.060, 1e-6), "{}", r.predicted_s);
}

#[test]
fn a_host_cost_per_write_is_paid_per_work_request() {
    // 20 one-write tasks; the host pays only 2 ms per write (no per-byte costs): writes go one
    // at a time at 2 ms after 2 ms of fill (H2D, prepare of the first piece).
    let table = copy_table(1, 1, 20, 1_000_000, |_, _| 0);
    let mut c = balanced_cluster();
    c.host = Some(HostModel {
        h2d_s_per_byte: 0.0,
        prep_s_per_byte: PrepRates::uniform(0.0),
        net_s_per_byte: 0.0,
        net_s_per_write: 2e-3,
    });
    let r = simulate(&table, &c).unwrap();
    assert!(close(r.predicted_s, 0.042, 1e-6), "{}", r.predicted_s);
    assert!(r.dominated_by.contains("host CPU"), "{}", r.dominated_by);
}

#[test]
fn planned_small_model_obeys_the_bound_and_is_deterministic() {
    use crate::{InferenceLayout, Model, TrainingLayout, plan};
    let model = Model::preset("qwen3-0.6b", crate::ExpertForm::PerExpert).unwrap();
    let train = TrainingLayout::build(&model, &"fsdp=4".parse().unwrap()).unwrap();
    let infer = InferenceLayout::build(&model, &"tp=2,dp=2,dtype=fp8".parse().unwrap()).unwrap();
    let table = plan(&model, &train, &infer, &CostModel::default()).unwrap();
    let c = ClusterModel::default();
    let a = simulate(&table, &c).unwrap();
    let b = simulate(&table, &c).unwrap();
    assert_eq!(a, b);
    assert!(a.predicted_s >= a.bound_s);
    assert!(a.predicted_s > 0.0 && a.bound_s > 0.0);
    assert_eq!(a.trainers, 4);
    assert_eq!(a.rollouts, 4);
    let rolled: u64 = table
        .rollout_plans()
        .flat_map(|r| r.tensors)
        .map(|t| t.len)
        .sum();
    let received: u64 = a.nics.iter().map(|n| n.rx_bytes).sum();
    // Everything a rollout holds crossed a NIC (gathers add trainer-side receives).
    assert!(received >= rolled - rolled / 1000, "{received} < {rolled}");
}

#[test]
fn empty_tables_and_bad_clusters_are_errors() {
    let t = copy_table(1, 1, 1, 1000, |_, _| 0);
    let mut c = balanced_cluster();
    c.prep.fp8 = -1.0;
    assert!(
        simulate(&t, &c)
            .unwrap_err()
            .to_string()
            .contains("prep.fp8")
    );
    let mut e = t.clone();
    e.rollouts.clear();
    assert!(matches!(
        simulate(&e, &balanced_cluster()),
        Err(SimError::Empty(_))
    ));
}

/// The headline case at full size: too slow for a debug build, run with
/// `cargo test --release -p weightsync-schedules kimi -- --ignored --nocapture`.
#[test]
#[ignore = "plans and simulates Kimi-K2 on 384 GPUs: seconds in release, minutes in debug"]
fn kimi_k2_256_to_128() {
    use crate::{InferenceLayout, Model, TrainingLayout, plan};
    let t0 = std::time::Instant::now();
    // WS_TABLE_CACHE=path keeps the planned table between runs (planning is not under test).
    let cache = std::env::var("WS_TABLE_CACHE").ok();
    let cached = cache
        .as_ref()
        .and_then(|p| std::fs::read(p).ok())
        .and_then(|b| RoutingTable::from_bincode(&b).ok());
    let table = match cached {
        Some(t) => t,
        None => {
            let model = Model::preset("kimi-k2", crate::ExpertForm::PerExpert).unwrap();
            let train =
                TrainingLayout::build(&model, &"pp=2,ep=8,fsdp=16".parse().unwrap()).unwrap();
            let infer =
                InferenceLayout::build(&model, &"tp=8,ep=32,dp=4,dtype=fp8".parse().unwrap())
                    .unwrap();
            let t = plan(&model, &train, &infer, &CostModel::default()).unwrap();
            if let Some(p) = &cache {
                std::fs::write(p, t.to_bincode()).unwrap();
            }
            t
        }
    };
    let planned = t0.elapsed();
    for t in [0u32, 100, 128, 255] {
        let p = table.trainer_plan(t).unwrap();
        let gs = p.groups.iter().filter(|g| g.gather_sends > 0).count();
        let ge = p.groups.iter().filter(|g| g.gather_expect > 0).count();
        eprintln!(
            "trainer {t}: {} groups, {} tasks, {} writes, {} with gather sends, {} waiting",
            p.groups.len(),
            p.tasks.len(),
            p.writes.len(),
            gs,
            ge
        );
    }
    let c = ClusterModel::default();
    let t1 = std::time::Instant::now();
    let low = super::lower::lower(&table, &c, None).unwrap();
    let t2 = std::time::Instant::now();
    let out = super::engine::run(&low.plan).unwrap();
    eprintln!(
        "lower {:?}, engine {:?}, predicted {:.4}",
        t2 - t1,
        t2.elapsed(),
        out.makespan
    );
    let t3 = std::time::Instant::now();
    let r = simulate(&table, &ClusterModel::default()).unwrap();
    eprintln!("simulate() {:?}", t3.elapsed());
    eprintln!(
        "plan {:?}, simulate {:?}: predicted {:.3} s, bound {:.3} s ({}), pieces {}, ops {}, events {}",
        planned,
        t0.elapsed() - planned,
        r.predicted_s,
        r.bound_s,
        r.bound_nic,
        r.pieces,
        r.ops,
        r.events
    );
    eprintln!("send {:?}\nreceive {:?}", r.send, r.receive);
    eprintln!("{:#?}", r.critical_breakdown);
    for s in r.critical_path.iter().take(8) {
        eprintln!("{s:?}");
    }
    assert!(r.predicted_s >= r.bound_s);
}

#[test]
fn tasks_prepared_in_place_pay_no_h2d() {
    // One piece in flight, so the stages add up: a staged copy pays H2D, prepare and write
    // (1 ms each per 1 MB task); a cast reading its whole shard in place skips the H2D.
    let mut serial = balanced_cluster();
    serial.watermark_bytes = 1_000_000;
    let staged = copy_table(1, 1, 30, 1_000_000, |_, _| 0);
    let mut in_place = staged.clone();
    for trainer in &mut in_place.trainers {
        for p in &mut trainer.routes.patterns {
            p.transform = Transform::Cast {
                from: DType::BF16,
                to: DType::F16,
            };
        }
    }
    let plan = in_place.trainer_plan(0).unwrap();
    assert!(plan.tasks.iter().all(|t| plan.in_place_input(t).is_some()));
    let a = simulate(&staged, &serial).unwrap();
    let b = simulate(&in_place, &serial).unwrap();
    assert!(close(a.predicted_s, 0.090, 1e-6), "{}", a.predicted_s);
    assert!(close(b.predicted_s, 0.060, 1e-6), "{}", b.predicted_s);
}

/// `copy_table`'s tasks as bf16 -> f16 casts: tasks that keep a delta base (2-byte elements).
fn cast_table(
    trainers: u32,
    rollouts: u32,
    tasks: u32,
    dst: impl Fn(u32, u32) -> u32,
) -> RoutingTable {
    let mut table = copy_table(trainers, rollouts, tasks, 1_000_000, dst);
    for trainer in &mut table.trainers {
        for p in &mut trainer.routes.patterns {
            p.transform = Transform::Cast {
                from: DType::BF16,
                to: DType::F16,
            };
        }
    }
    table
}

#[test]
fn a_delta_sync_where_nothing_changed_costs_what_is_not_the_wire() {
    // Nothing changed and a free scan: each write is one byte, so the delta sync takes what a
    // full sync takes on NICs with no bandwidth limit (preparation, fixed costs), fixed costs
    // adding exactly.
    let table = cast_table(2, 2, 30, |t, _| t);
    let free_scan = DeltaModel::new(0.0, 1e30);
    for (start, after) in [(0.0, 0.0), (5e-3, 2e-3)] {
        let mut c = balanced_cluster();
        c.fixed.start_s = start;
        c.fixed.after_landing_s = after;
        let d = simulate_delta(&table, &c, &free_scan).unwrap();
        let mut no_wire = c;
        no_wire.cost.nic_bytes_per_s = 1e30;
        let full = simulate(&table, &no_wire).unwrap();
        // (Within the nanosecond each 1-byte write takes.)
        assert!(
            close(d.sync.predicted_s, full.predicted_s, 1e-6),
            "{} vs {}",
            d.sync.predicted_s,
            full.predicted_s
        );
        // 30 casts of 1 ms each, one at a time: 30 ms of preparation, the start and the rest.
        assert!(close(d.sync.predicted_s, 0.030 + start + after, 1e-6));
        assert_eq!((d.wire_bytes, d.delta_writes, d.dense_writes), (60, 60, 0));
        assert_eq!(d.dense_bytes, 60_000_000);
        assert_eq!(d.apply_bytes, 0);
    }
}

#[test]
fn a_delta_sync_where_everything_changed_is_the_full_sync() {
    let table = cast_table(2, 2, 30, |t, _| t);
    let c = balanced_cluster();
    let full = simulate(&table, &c).unwrap();
    let d = simulate_delta(&table, &c, &DeltaModel::new(1.0, 1e30)).unwrap();
    // Every run goes dense: the same bytes on the same links, in the same time.
    assert_eq!((d.wire_bytes, d.dense_bytes), (60_000_000, 60_000_000));
    assert_eq!((d.delta_writes, d.dense_writes, d.apply_bytes), (0, 60, 0));
    assert!(close(d.sync.predicted_s, full.predicted_s, 1e-9));
    assert!(close(d.sync.bound_s, full.bound_s, 1e-12));
    // The dense runs' bases still take the new bytes: with a real memory rate, never faster.
    let slow = simulate_delta(&table, &c, &DeltaModel::new(1.0, 1e9)).unwrap();
    assert!(slow.sync.predicted_s > full.predicted_s * 1.5);
    assert!(
        slow.sync.dominated_by.starts_with("preparation"),
        "{}",
        slow.sync.dominated_by
    );
}

#[test]
fn a_sparse_delta_sync_moves_the_encodings_and_applies_them_before_the_barrier() {
    // 4 trainers into one rollout: the receiving NIC bounds the full sync (120 ms).
    let table = cast_table(4, 1, 30, |_, _| 0);
    let c = balanced_cluster();
    let m = DeltaModel::new(0.02, 1e10);
    let full = simulate(&table, &c).unwrap();
    let d = simulate_delta(&table, &c, &m).unwrap();
    let run = m.run(1_000_000, 2);
    assert!(run.kind.is_some());
    let expect_wire = 120.0 * run.wire_bytes;
    assert!(
        close(d.wire_bytes as f64, expect_wire, 1e-6),
        "{}",
        d.wire_bytes
    );
    assert!(close(d.wire_fraction, run.wire_bytes / 1e6, 1e-6));
    // The delta bound is the encodings over the one receiving NIC; the full bound the bytes.
    assert!(close(full.bound_s, 0.120, 1e-9));
    assert!(
        close(d.sync.bound_s, expect_wire / 1e9, 1e-6),
        "{}",
        d.sync.bound_s
    );
    assert!(d.sync.predicted_s >= d.sync.bound_s);
    // The rollout applies every change, after its last write, and the sync waits for it.
    assert!(close(d.apply_bytes as f64, 120.0 * run.apply_bytes, 1e-6));
    assert!(close(d.max_apply_s, 120.0 * run.apply_bytes / 1e10, 1e-6));
    let apply = d
        .sync
        .timeline
        .iter()
        .find(|e| e.worker == "rollout-0" && e.stage == Stage::Verify)
        .expect("an apply on the rollout");
    let last_write = d
        .sync
        .timeline
        .iter()
        .filter(|e| e.stage == Stage::Write)
        .map(|e| e.end_ns)
        .max()
        .unwrap();
    assert!(apply.start_ns >= last_write);
    assert!(d.sync.predicted_s >= apply.end_ns as f64 * 1e-9);
    assert!(d.sync.predicted_s < full.predicted_s / 2.0);
    assert!(
        d.sync
            .critical_breakdown
            .iter()
            .any(|s| s.class == "delta apply")
    );
}

#[test]
fn copies_keep_no_base_and_go_dense() {
    let table = copy_table(2, 2, 10, 1_000_000, |t, _| t);
    let c = balanced_cluster();
    let d = simulate_delta(&table, &c, &DeltaModel::new(0.01, 1e30)).unwrap();
    assert_eq!(d.wire_bytes, d.dense_bytes);
    assert_eq!((d.delta_writes, d.encode_bytes, d.apply_bytes), (0, 0, 0));
    assert!(close(
        d.sync.predicted_s,
        simulate(&table, &c).unwrap().predicted_s,
        1e-9
    ));
    let e = simulate_delta(&table, &c, &DeltaModel::new(-0.1, 1e9)).unwrap_err();
    assert!(e.to_string().contains("delta.changed"), "{e}");
}

#[test]
fn planned_fp8_delta_sync_moves_a_few_percent() {
    use crate::{InferenceLayout, Model, TrainingLayout, plan};
    let model = Model::preset("qwen3-0.6b", crate::ExpertForm::PerExpert).unwrap();
    let train = TrainingLayout::build(&model, &"fsdp=4".parse().unwrap()).unwrap();
    let infer = InferenceLayout::build(&model, &"tp=2,dp=2,dtype=fp8".parse().unwrap()).unwrap();
    let table = plan(&model, &train, &infer, &CostModel::default()).unwrap();
    let c = ClusterModel::default();
    let full = simulate(&table, &c).unwrap();
    let d = simulate_delta(&table, &c, &DeltaModel::new(0.02, 1e12)).unwrap();
    assert!(d.delta_writes > 0 && d.dense_writes > 0, "{d:?}");
    assert!(d.wire_bytes < d.dense_bytes);
    assert!(d.sync.bound_s < full.bound_s && d.sync.predicted_s < full.predicted_s);
    assert!(d.sync.predicted_s >= d.sync.bound_s);
}
