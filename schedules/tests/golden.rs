//! Golden files: the full routing table of a small model, printed readably, pinned in
//! `tests/golden/`. A change in planning shows up as a reviewable diff. Regenerate with
//! `UPDATE_GOLDEN=1 cargo test -p weightsync-schedules --test golden`.
//!
//! The same tables, in bincode, seed the `routing_table` fuzz target: after a change of the
//! table format, rewrite them with
//! `FUZZ_SEEDS=$PWD/schedules/fuzz/corpus/routing_table cargo test -p weightsync-schedules --test golden`.

mod common;

use std::fmt::Write as _;

use common::*;
use weightsync_schedules::table::{RoutingTable, Source, Transform, WriteTarget};
use weightsync_schedules::*;

fn dump(table: &RoutingTable, summary: &Summary) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "model {} ({} params)", table.model, table.num_params);
    for t in &plans(table) {
        let _ = writeln!(
            s,
            "trainer {}: source {} B, gather arena {} B, {} shards",
            t.rank,
            t.source_arena_bytes,
            t.gather_arena_bytes,
            t.shards.len()
        );
        for g in &t.groups {
            if g.num_tasks == 0 && g.gather_expect == 0 {
                continue;
            }
            let _ = writeln!(
                s,
                "  group {} {:?}: {} tasks ({} gather sends, {} local), expects {} gathers",
                g.id, g.name, g.num_tasks, g.gather_sends, g.local_tasks, g.gather_expect
            );
            for task in t.group_tasks(g) {
                let src = match task.source {
                    Source::Shard { shard } => format!(
                        "shard {shard} {}",
                        t.source_box(task).expect("region inside its shard")
                    ),
                    Source::Gather { offset } => {
                        format!("gather @{offset} {}", task.region.shape())
                    }
                };
                let tr = match task.transform {
                    Transform::Copy { dtype } => format!("copy {dtype}"),
                    Transform::Cast { from, to } => format!("cast {from}->{to}"),
                    Transform::Fp8Block { from, .. } => {
                        let (offset, shape) = task.fp8_scales().expect("fp8 task has scales");
                        format!("fp8({from}) scales {shape} @{offset}")
                    }
                };
                let _ = writeln!(
                    s,
                    "    {} {} from {src}: {tr}, {} B",
                    t.params[task.param as usize].name,
                    task.region,
                    task.prepared_bytes()
                );
                for w in t.task_writes(task) {
                    let dst = match w.dst {
                        WriteTarget::Rollout(r) => format!("R{r}"),
                        WriteTarget::Trainer(o) => format!("T{o}"),
                    };
                    let _ = writeln!(
                        s,
                        "      [{}+{}] -> {dst}.mr{}@{} unit {}",
                        w.src_offset, w.len, w.mr, w.dst_offset, w.unit
                    );
                }
            }
        }
    }
    for r in &rollouts(table) {
        let _ = writeln!(
            s,
            "rollout {} (engine {} rank {}): {} B, expects {} writes",
            r.rank, r.engine, r.local_rank, r.mr_bytes[0], r.expect[0].writes
        );
        for t in &r.tensors {
            let _ = writeln!(
                s,
                "  {} {} {} @{}+{}",
                t.name, t.shape, t.dtype, t.offset, t.len
            );
        }
    }
    let _ = writeln!(s, "{}", serde_json::to_string_pretty(summary).unwrap());
    s
}

fn check(name: &str, json: &str, train: &str, infer: &str, dtype: InferDType) {
    let tspec: TrainSpec = train.parse().unwrap();
    let m = Model::from_config_json("golden", json, tspec.experts).unwrap();
    let t = TrainingLayout::build(&m, &tspec).unwrap();
    let mut spec: InferSpec = infer.parse().unwrap();
    spec.dtype = dtype;
    let i = InferenceLayout::build(&m, &spec).unwrap();
    let cost = CostModel::default();
    let table = plan(&m, &t, &i, &cost).unwrap();
    if let Some(dir) = std::env::var_os("FUZZ_SEEDS") {
        let seed = std::path::Path::new(&dir).join(format!("{name}.bin"));
        std::fs::write(&seed, table.to_bincode()).unwrap();
    }
    let summary = Summary::of(&table, &cost);
    // Counted run by run, the figures are those counted task by task.
    assert_eq!(summary, Summary::of_each_task(&table, &cost), "{name}");
    // The same table and figures on one thread and on three as on rayon's default pool.
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (t, s) = pool.install(|| {
            let t = TrainingLayout::build(&m, &tspec).unwrap();
            let table = plan(&m, &t, &i, &cost).unwrap();
            let s = Summary::of(&table, &cost);
            (table, s)
        });
        assert!(
            t.to_bincode() == table.to_bincode() && s == summary,
            "{name}: planned on {threads} threads, the table or its summary differs"
        );
    }
    let text = dump(&table, &summary);
    let path = format!("{}/tests/golden/{name}.txt", env!("CARGO_MANIFEST_DIR"));
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{path}: {e} (run with UPDATE_GOLDEN=1 to create it)"));
    if want != text {
        let line = want
            .lines()
            .zip(text.lines())
            .position(|(a, b)| a != b)
            .unwrap_or(want.lines().count().min(text.lines().count()));
        panic!(
            "{name}: table differs from {path} at line {}:\n  want: {:?}\n  got:  {:?}",
            line + 1,
            want.lines().nth(line),
            text.lines().nth(line)
        );
    }
}

/// One decoder layer of the small dense model.
fn one_layer() -> String {
    DENSE.replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":1")
}

#[test]
fn dense_fsdp3_to_tp2_dp2_fp8_with_gathers() {
    check(
        "dense_fsdp3_tp2_dp2_fp8",
        &one_layer(),
        "fsdp=3",
        "tp=2,dp=2",
        InferDType::Fp8,
    );
}

#[test]
fn dense_hsdp_to_tp4_bf16() {
    check(
        "dense_dp2_fsdp2_tp4_bf16",
        &one_layer(),
        "dp=2,fsdp=2",
        "tp=4",
        InferDType::Bf16,
    );
}

#[test]
fn hf_dense_fsdp3_to_tp2_dp2_fp8_with_gathers() {
    // transformers' unfused q/k/v and gate/up, embedding whole on both tp ranks.
    check(
        "hf_dense_fsdp3_tp2_dp2_fp8",
        &one_layer(),
        "fsdp=3",
        "tp=2,dp=2,format=hf",
        InferDType::Fp8,
    );
}

#[test]
fn hf_moe_packed_experts_fsdp3_to_ep2_fp8() {
    // transformers' packed gate_up_proj [4, 384, 256] from FSDP2 chunks of 2, 2 and 0 experts,
    // each expert quantised as one [384, 256] grid (its middle block row mixes gate and up).
    check(
        "hf_moe_i192_fsdp3_ep2_fp8",
        MOE_ONE_LAYER_I192,
        "fsdp=3,experts=stacked-gate-up",
        "ep=2,format=hf",
        InferDType::Fp8,
    );
}

/// One MoE decoder layer, 4 experts 192 wide.
const MOE_ONE_LAYER_I192: &str = r#"{"model_type":"qwen3_moe","hidden_size":256,
 "intermediate_size":512,"moe_intermediate_size":192,"num_experts":4,"num_experts_per_tok":2,
 "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":128,
 "vocab_size":300}"#;

/// The committed `routing_table` fuzz seeds are tables of the current format (rewrite them with
/// `FUZZ_SEEDS`, see the module docs, when it changes).
#[test]
fn routing_table_fuzz_seeds_decode_in_the_current_format() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/routing_table");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let table = RoutingTable::from_bincode(&std::fs::read(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for rank in 0..table.trainers.len() as u32 {
            table.slice(rank).unwrap().expand().unwrap();
        }
        checked += 1;
    }
    assert!(checked >= 2, "only {checked} seeds in {dir}");
}
