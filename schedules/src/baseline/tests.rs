//! Byte counts of the baselines and their place against weightsync on the same cluster.

use super::*;
use crate::cost::CostModel;
use crate::simulate::simulate;
use crate::{ExpertForm, InferenceLayout, Model, TrainingLayout, plan};

fn table(infer: &str) -> RoutingTable {
    let model = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
    let train = TrainingLayout::build(&model, &"fsdp=4".parse().unwrap()).unwrap();
    let infer = InferenceLayout::build(&model, &infer.parse().unwrap()).unwrap();
    plan(&model, &train, &infer, &CostModel::default()).unwrap()
}

/// Two GPUs and two NICs per node: trainers on nodes 0-1, rollouts on nodes 2-3.
fn small_nodes() -> ClusterModel {
    ClusterModel {
        gpus_per_node: 2,
        nics_per_node: 2,
        ..Default::default()
    }
}

fn rx_on_nodes(r: &SimReport, nodes: &[u32]) -> Vec<u64> {
    nodes
        .iter()
        .map(|&n| {
            r.nics
                .iter()
                .filter(|u| u.node == n)
                .map(|u| u.rx_bytes)
                .sum()
        })
        .collect()
}

#[test]
fn model_bytes_count_each_tensor_once_in_both_formats() {
    let c = small_nodes();
    let bf16 = model_bytes(&table("tp=2,dp=2"), &c);
    let model = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
    assert_eq!(bf16.full_bytes, model.bytes());
    assert_eq!(bf16.checkpoint_bytes, bf16.full_bytes);
    assert_eq!(bf16.rollout_nodes, vec![2, 3]);
    let held: f64 = bf16.params.iter().flat_map(|p| p.per_node.values()).sum();
    assert!((held - bf16.full_bytes as f64).abs() < 1.0, "{held}");
    let fp8 = model_bytes(&table("tp=2,dp=2,dtype=fp8"), &c);
    // Linear layers halve; embeddings and norms stay bf16; scales add 4 bytes per block.
    assert!(fp8.checkpoint_bytes < fp8.full_bytes * 3 / 4, "{fp8:?}");
    assert!(fp8.checkpoint_bytes > fp8.full_bytes / 2);
    // tp=2: a rank holds about half an engine.
    assert!(
        fp8.max_rank_share > 0.45 && fp8.max_rank_share < 0.75,
        "{}",
        fp8.max_rank_share
    );
}

#[test]
fn gather_broadcast_moves_the_whole_model_to_every_inference_node() {
    let c = small_nodes();
    let t = table("tp=2,dp=2,dtype=fp8");
    let mb = model_bytes(&t, &c);
    let r = simulate_baseline(&t, &c, Baseline::GatherBroadcast, &Default::default()).unwrap();
    // Node 1 (trainers 2, 3) sends its half to node 0; node 0 takes it in.
    let into_root = rx_on_nodes(&r, &[0])[0] as f64;
    assert!((into_root - mb.full_bytes as f64 / 2.0).abs() < 0.01 * mb.full_bytes as f64);
    // Every inference node receives the whole model in bf16.
    for b in rx_on_nodes(&r, &[2, 3]) {
        assert!(
            (b as f64 - mb.full_bytes as f64).abs() < 1e-6 * mb.full_bytes as f64,
            "{b}"
        );
    }
    assert!(r.predicted_s >= r.bound_s);
    assert_eq!(r.method, "gather_broadcast");
}

#[test]
fn bucketed_broadcast_moves_the_checkpoint_format_once_per_inference_node() {
    let c = small_nodes();
    let t = table("tp=2,dp=2,dtype=fp8");
    let mb = model_bytes(&t, &c);
    let opts = BaselineOptions {
        bucket_bytes: 64 << 20,
        ..Default::default()
    };
    let r = simulate_baseline(&t, &c, Baseline::BucketedBroadcast, &opts).unwrap();
    for b in rx_on_nodes(&r, &[2, 3]) {
        let want = mb.checkpoint_bytes as f64;
        assert!((b as f64 - want).abs() < 1e-6 * want, "{b} vs {want}");
    }
    // Buckets of at most 64 MiB, except a tensor larger than that (the embedding), each at
    // least half full when the next tensor would not fit.
    let largest = mb.params.iter().map(|p| p.checkpoint).max().unwrap();
    assert!(largest > 64 << 20, "the embedding is larger than a bucket");
    let min = (mb.checkpoint_bytes - largest).div_ceil(64 << 20) + 1;
    assert!(
        r.pieces >= min && r.pieces <= 2 * min + 2,
        "{} buckets for {min}",
        r.pieces
    );
    assert!(r.predicted_s >= r.bound_s);
}

#[test]
fn weightsync_beats_both_baselines_on_the_same_cluster() {
    let c = small_nodes();
    let t = table("tp=2,dp=2,dtype=fp8");
    let ws = simulate(&t, &c).unwrap();
    for b in Baseline::ALL {
        let r = simulate_baseline(&t, &c, b, &Default::default()).unwrap();
        assert!(
            r.predicted_s > ws.predicted_s,
            "{}: {} <= {}",
            b.name(),
            r.predicted_s,
            ws.predicted_s
        );
    }
}

#[test]
fn bad_options_are_refused() {
    let c = small_nodes();
    let t = table("tp=2,dp=2");
    let opts = BaselineOptions {
        bucket_bytes: 0,
        ..Default::default()
    };
    let e = simulate_baseline(&t, &c, Baseline::BucketedBroadcast, &opts).unwrap_err();
    assert!(e.to_string().contains("bucket_bytes"), "{e}");
}
