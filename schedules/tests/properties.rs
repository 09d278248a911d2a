//! Properties over random small models and layouts: every destination byte written exactly
//! once, bytes conserved, tables deterministic, the compact form expanding to explicit plans
//! that compact back to it, the summary's counts those of the explicit writes, replicas balanced
//! within 5% of the best possible (computed here by an independent max-flow over replica sets).

mod common;

use std::collections::BTreeMap;

use common::*;
use proptest::prelude::*;
use weightsync_schedules::compact::TrainerRoutes;
use weightsync_schedules::table::{
    MAX_DIMS, RoutingTable, Source, TrainerPlan, Transform, WriteTarget,
};
use weightsync_schedules::*;

/// A random small model config (always valid) and expert form.
fn config() -> impl Strategy<Value = (String, ExpertForm)> {
    (
        0usize..4,
        prop::sample::select(vec![128u32, 256]),
        1u32..3,
        prop::sample::select(vec![256u32, 384, 512]),
        100u32..400,
        prop::sample::select(vec![
            ExpertForm::PerExpert,
            ExpertForm::Stacked,
            ExpertForm::StackedGateUp,
        ]),
        // Expert width: 192 puts fp8 blocks across gate and up rows.
        prop::sample::select(vec![192u32, 256]),
    )
        .prop_map(|(family, hidden, layers, inter, vocab, experts, moe_i)| {
            let json = match family {
                0 => format!(
                    r#"{{"model_type":"qwen3","hidden_size":{hidden},"intermediate_size":{inter},
                    "num_hidden_layers":{layers},"num_attention_heads":4,"num_key_value_heads":2,
                    "head_dim":128,"vocab_size":{vocab}}}"#
                ),
                1 => format!(
                    r#"{{"model_type":"qwen2","hidden_size":{hidden},"intermediate_size":{inter},
                    "num_hidden_layers":{layers},"num_attention_heads":2,"num_key_value_heads":1,
                    "head_dim":128,"vocab_size":{vocab},"tie_word_embeddings":true}}"#
                ),
                2 => format!(
                    r#"{{"model_type":"qwen3_moe","hidden_size":{hidden},"intermediate_size":{inter},
                    "moe_intermediate_size":{moe_i},"num_experts":4,"num_hidden_layers":{layers},
                    "num_attention_heads":4,"num_key_value_heads":4,"head_dim":128,
                    "vocab_size":{vocab}}}"#
                ),
                _ => format!(
                    r#"{{"model_type":"deepseek_v3","hidden_size":{hidden},"intermediate_size":{inter},
                    "moe_intermediate_size":{moe_i},"n_routed_experts":4,"n_shared_experts":1,
                    "first_k_dense_replace":1,"topk_method":"noaux_tc","num_hidden_layers":{layers},
                    "num_attention_heads":2,"q_lora_rank":128,"kv_lora_rank":128,
                    "qk_nope_head_dim":128,"qk_rope_head_dim":64,"v_head_dim":128,
                    "vocab_size":{vocab}}}"#
                ),
            };
            (json, experts)
        })
}

#[derive(Debug, Clone)]
struct Case {
    json: String,
    experts: ExpertForm,
    train: String,
    infer: String,
    fp8: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        config(),
        (1u32..3, 1u32..3, 1u32..3, 1u32..6, 1u32..3),
        (1u32..3, prop::sample::select(vec![1u32, 2, 4]), 1u32..4),
        any::<bool>(),
        prop::sample::select(vec!["fused", "hf"]),
    )
        .prop_map(
            |((json, experts), (pp, dp, ep, fsdp, tp), (itp, iep, idp), fp8, format)| {
                let iep = if iep > 1 && iep % itp != 0 { itp } else { iep };
                Case {
                    json,
                    experts,
                    train: format!("pp={pp},dp={dp},ep={ep},fsdp={fsdp},tp={tp}"),
                    infer: format!("tp={itp},ep={iep},dp={idp},format={format}"),
                    fp8,
                }
            },
        )
}

/// Builds the inputs; `None` when the random combination is legitimately refused (a degree
/// that does not divide, an fp8 shard off the block grid, packed experts under training tp).
fn inputs(c: &Case) -> Option<(Model, TrainingLayout, InferenceLayout)> {
    let m = Model::from_config_json("random", &c.json, c.experts).unwrap();
    let mut ts: TrainSpec = c.train.parse().unwrap();
    ts.experts = c.experts;
    let mut is: InferSpec = c.infer.parse().unwrap();
    is.dtype = if c.fp8 {
        InferDType::Fp8
    } else {
        InferDType::Bf16
    };
    let t = TrainingLayout::build(&m, &ts).ok()?;
    let i = InferenceLayout::build(&m, &is).ok()?;
    Some((m, t, i))
}

/// Exact-once coverage and expected counts, from the writes alone.
fn check_writes_tile_tensors(table: &RoutingTable) {
    let mut coverage = vec![Vec::new(); table.rollouts.len()];
    let mut received = vec![0u64; table.rollouts.len()];
    for t in &plans(table) {
        for w in t.all_writes() {
            if let WriteTarget::Rollout(r) = w.dst {
                coverage[r as usize].push((w.dst_offset, w.len as u64));
                received[r as usize] += 1;
            }
        }
    }
    let landed = Landed {
        arenas: vec![],
        coverage,
        received,
    };
    check_coverage(table, &landed);
}

/// Every task delivers its whole prepared output (values and scales) to each destination rank
/// it writes to, and gathers deliver each gathered region whole.
fn check_conservation(table: &RoutingTable) {
    let dst_total: u64 = rollouts(table)
        .iter()
        .flat_map(|r| r.tensors.iter().map(|t| t.len))
        .sum();
    let mut written = 0u64;
    let mut gathered: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let trainers = plans(table);
    for t in &trainers {
        for task in &t.tasks {
            let payload = match task.transform {
                // Values and one f32 per 128x128 block of each matrix (no padding).
                Transform::Fp8Block { .. } => {
                    let n = task.region.ndim as usize;
                    let l = &task.region.len[..n];
                    let matrices: u64 = l[..n - 2].iter().map(|&x| x as u64).product();
                    let blocks = (l[n - 2].div_ceil(128) * l[n - 1].div_ceil(128)) as u64;
                    task.region.numel() + matrices * blocks * 4
                }
                _ => task.prepared_bytes(),
            };
            let mut per_dst: BTreeMap<WriteTarget, u64> = BTreeMap::new();
            for w in t.task_writes(task) {
                *per_dst.entry(w.dst).or_default() += w.len as u64;
                if let WriteTarget::Rollout(_) = w.dst {
                    written += w.len as u64;
                } else if let WriteTarget::Trainer(o) = w.dst {
                    *gathered.entry((o, 0)).or_default() += w.len as u64;
                }
            }
            for (dst, bytes) in per_dst {
                match dst {
                    WriteTarget::Rollout(_) => assert_eq!(bytes, payload, "task {task:?}"),
                    WriteTarget::Trainer(_) => assert_eq!(bytes, task.prepared_bytes()),
                }
            }
        }
    }
    assert_eq!(written, dst_total, "bytes written vs destination bytes");
    // What gather-sourced tasks read equals what was gathered into each trainer.
    for t in &trainers {
        let need: u64 = t
            .tasks
            .iter()
            .filter_map(|k| match k.source {
                Source::Gather { .. } => Some(k.source_bytes()),
                _ => None,
            })
            .sum();
        assert_eq!(need, gathered.get(&(t.rank, 0)).copied().unwrap_or(0));
    }
}

/// The summary's counts, recomputed write by write from the explicit plans.
fn check_summary_figures(table: &RoutingTable, explicit: &[TrainerPlan], cost: &CostModel) {
    let s = Summary::of(table, cost);
    assert_eq!(
        s,
        Summary::of_each_task(table, cost),
        "run by run or task by task"
    );
    let nr = table.rollouts.len();
    let (mut tasks, mut wrs, mut routes, mut gather, mut gather_wrs, mut local) =
        (0, 0, 0, 0, 0, 0);
    let mut rx = vec![0u64; nr];
    let mut rx_wrs = vec![0u64; nr];
    let mut tx_max = 0u64;
    for t in explicit {
        let mut tx = 0u64;
        for task in &t.tasks {
            tasks += 1;
            let mut last = None;
            for w in t.task_writes(task) {
                match w.dst {
                    WriteTarget::Rollout(r) => {
                        wrs += 1;
                        tx += w.len as u64;
                        rx[r as usize] += w.len as u64;
                        rx_wrs[r as usize] += 1;
                        routes += (last != Some(r)) as u64;
                        last = Some(r);
                    }
                    WriteTarget::Trainer(o) if o == t.rank => local += w.len as u64,
                    WriteTarget::Trainer(_) => {
                        wrs += 1;
                        tx += w.len as u64;
                        gather += w.len as u64;
                        gather_wrs += 1;
                    }
                }
            }
        }
        tx_max = tx_max.max(tx);
    }
    assert_eq!(s.tasks, tasks);
    assert_eq!(s.work_requests, wrs);
    assert_eq!(s.routes, routes);
    assert_eq!(s.bytes_to_move, rx.iter().sum::<u64>());
    assert_eq!(s.receiver.max_bytes, rx.iter().copied().max().unwrap_or(0));
    assert_eq!(
        s.receiver.max_wrs,
        rx_wrs.iter().copied().max().unwrap_or(0)
    );
    assert_eq!(s.sender.max_bytes, tx_max);
    assert_eq!(
        (s.gather_bytes, s.gather_work_requests, s.gather_local_bytes),
        (gather, gather_wrs, local)
    );
}

/// The best possible maximum sender load (bytes), by binary search and an Edmonds-Karp max
/// flow written independently of the planner: replica sets (ranks holding the same shard box)
/// carry the destination bytes that box feeds.
fn best_possible(model: &Model, train: &TrainingLayout, infer: &InferenceLayout) -> u64 {
    let mut sets: BTreeMap<Vec<u32>, u64> = BTreeMap::new();
    let mut holders: BTreeMap<(u32, [u32; MAX_DIMS], [u32; MAX_DIMS]), Vec<u32>> = BTreeMap::new();
    for s in &train.shards {
        holders
            .entry((s.param, s.global.start, s.global.len))
            .or_default()
            .push(s.rank);
    }
    for pc in &infer.pieces {
        let t = &infer.ranks[pc.rank as usize].tensors[pc.tensor as usize];
        for ((p, start, len), ranks) in holders.range((pc.param, [0; MAX_DIMS], [0; MAX_DIMS])..) {
            if *p != pc.param {
                break;
            }
            let b = weightsync_schedules::table::TensorBox {
                ndim: pc.src.ndim,
                start: *start,
                len: *len,
            };
            if let Some(x) = b.intersect(&pc.src) {
                let mut r = ranks.clone();
                r.sort_unstable();
                r.dedup();
                *sets.entry(r).or_default() += x.numel() * t.dtype.size() as u64;
            }
        }
    }
    let _ = model;
    let sets: Vec<(Vec<u32>, u64)> = sets.into_iter().collect();
    let total: u64 = sets.iter().map(|s| s.1).sum();
    let n = train.ranks as usize;
    let feasible = |cap: u64| -> bool {
        // Nodes: 0 source, 1..=S sets, S+1..=S+n ranks, S+n+1 sink. Dense capacity matrix.
        let s_n = sets.len();
        let v = s_n + n + 2;
        let sink = v - 1;
        let mut c = vec![vec![0u64; v]; v];
        for (j, (members, amount)) in sets.iter().enumerate() {
            c[0][1 + j] = *amount;
            for &r in members {
                c[1 + j][1 + s_n + r as usize] = u64::MAX / 4;
            }
        }
        for r in 0..n {
            c[1 + s_n + r][sink] = cap;
        }
        let mut flow = 0u64;
        loop {
            let mut prev = vec![usize::MAX; v];
            prev[0] = 0;
            let mut q = std::collections::VecDeque::from([0usize]);
            while let Some(x) = q.pop_front() {
                for y in 0..v {
                    if prev[y] == usize::MAX && c[x][y] > 0 {
                        prev[y] = x;
                        q.push_back(y);
                    }
                }
            }
            if prev[sink] == usize::MAX {
                break;
            }
            let mut f = u64::MAX;
            let mut y = sink;
            while y != 0 {
                f = f.min(c[prev[y]][y]);
                y = prev[y];
            }
            let mut y = sink;
            while y != 0 {
                c[prev[y]][y] -= f;
                c[y][prev[y]] += f;
                y = prev[y];
            }
            flow += f;
        }
        flow == total
    };
    let (mut lo, mut hi) = (0u64, total);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if feasible(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn exact_once_conservation_and_determinism(c in case()) {
        let Some((m, t, i)) = inputs(&c) else { return Ok(()) };
        let cost = CostModel::default();
        let table = plan(&m, &t, &i, &cost).unwrap();
        check_writes_tile_tensors(&table);
        check_conservation(&table);
        // Same inputs, byte-identical table; shard order in the input does not matter.
        let again = plan(&m, &t, &i, &cost).unwrap();
        prop_assert_eq!(table.to_bincode(), again.to_bincode());
        let mut shuffled = t.clone();
        shuffled.shards.reverse();
        let third = plan(&m, &shuffled, &i, &cost).unwrap();
        prop_assert!(table.to_bincode() == third.to_bincode());
        // Nor whether the engines are planned as repeats of engine 0: with the last engine's
        // pieces listed in reverse the layout is no longer one engine repeated
        // (`engine_period` is None) and is planned piece by piece, to the same table.
        if let Some(p) = i.engine_period().filter(|p| p.engines > 1 && p.pieces > 1) {
            let mut unperiodic = i.clone();
            unperiodic.pieces[(p.engines as usize - 1) * p.pieces..].reverse();
            prop_assert_eq!(unperiodic.engine_period(), None);
            let fourth = plan(&m, &t, &unperiodic, &cost).unwrap();
            prop_assert!(table.to_bincode() == fourth.to_bincode());
        }
        // Nor does the number of threads planning it (layouts, analysis, emission, summary).
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let (l3, t3, s3) = pool.install(|| {
            let (_, t, _) = inputs(&c).unwrap();
            let table = plan(&m, &t, &i, &cost).unwrap();
            let s = Summary::of(&table, &cost);
            (t, table, s)
        });
        prop_assert_eq!(&l3, &t);
        prop_assert!(table.to_bincode() == t3.to_bincode());
        prop_assert_eq!(Summary::of(&table, &cost), s3);
        // The table round-trips through bincode; each slice expands to an explicit plan (no
        // copies left) whose compact form is the slice's own routes again.
        let back = RoutingTable::from_bincode(&table.to_bincode()).unwrap();
        prop_assert_eq!(&back, &table);
        let explicit = plans(&table);
        for (r, x) in explicit.iter().enumerate() {
            prop_assert!(x.copies.is_empty());
            prop_assert_eq!(x.rank as usize, r);
            let again = TrainerRoutes::from_plan(x).unwrap();
            let mut slice = table.slice(r as u32).unwrap();
            slice.routes = again;
            prop_assert_eq!(&slice.expand().unwrap(), x);
        }
        // The summary, counted on the compact form, is what the explicit writes add up to.
        check_summary_figures(&table, &explicit, &cost);
        // A table made from the explicit plans is the same table, but for how its tasks are
        // grouped into patterns (which may be finer: copies become explicit writes).
        let rebuilt = RoutingTable::from_plans(
            &table.model,
            table.num_params,
            table.num_elements,
            &explicit,
            &rollouts(&table),
        )
        .unwrap();
        prop_assert_eq!(&plans(&rebuilt), &explicit);
        prop_assert_eq!(Summary::of(&rebuilt, &cost), Summary::of(&table, &cost));
    }

    #[test]
    fn replicas_balanced_within_5_percent_of_best(c in case()) {
        // Bytes only (no work-request cost, so every replicated region may be split), bf16 (no
        // gathers): the planner's busiest sender against the best possible.
        let c = Case { fp8: false, ..c };
        let Some((m, t, i)) = inputs(&c) else { return Ok(()) };
        let cost = CostModel { per_wr_s: 0.0, ..CostModel::default() };
        let table = plan(&m, &t, &i, &cost).unwrap();
        let s = Summary::of(&table, &cost);
        let best = best_possible(&m, &t, &i);
        prop_assert!(
            s.sender.max_bytes as f64 <= 1.05 * best as f64,
            "busiest sender {} vs best possible {} ({:?})", s.sender.max_bytes, best, c
        );
    }
}
