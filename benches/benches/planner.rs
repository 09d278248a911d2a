//! Criterion bench of the planner at the anchor scale: Kimi-K2 from `pp=2,ep=8,fsdp=16` (256
//! bf16 training GPUs) to `tp=8,ep=32,dp=4` fp8 (128 inference GPUs), single-threaded (the
//! planner is pure and uses no threads). Also the whole path from config to table, and a dense
//! model for scale.

use criterion::{Criterion, criterion_group, criterion_main};
use weightsync_schedules::{
    CostModel, ExpertForm, InferDType, InferSpec, InferenceLayout, Model, TrainingLayout, plan,
};

fn inputs(
    model: &str,
    train: &str,
    infer: &str,
    dtype: InferDType,
) -> (Model, TrainingLayout, InferenceLayout) {
    let m = Model::preset(model, ExpertForm::PerExpert).expect("preset");
    let t = TrainingLayout::build(&m, &train.parse().expect("train spec")).expect("train");
    let mut spec: InferSpec = infer.parse().expect("infer spec");
    spec.dtype = dtype;
    let i = InferenceLayout::build(&m, &spec).expect("infer");
    (m, t, i)
}

fn planner(c: &mut Criterion) {
    let cost = CostModel::default();
    let mut g = c.benchmark_group("planner");
    g.sample_size(10);
    let (m, t, i) = inputs(
        "kimi-k2",
        "pp=2,ep=8,fsdp=16",
        "tp=8,ep=32,dp=4",
        InferDType::Fp8,
    );
    g.bench_function("kimi-k2 pp2-ep8-fsdp16 to tp8-ep32-dp4 fp8: plan", |b| {
        b.iter(|| plan(&m, &t, &i, &cost).expect("plan"))
    });
    g.bench_function(
        "kimi-k2 pp2-ep8-fsdp16 to tp8-ep32-dp4 fp8: config to table",
        |b| {
            b.iter(|| {
                let (m, t, i) = inputs(
                    "kimi-k2",
                    "pp=2,ep=8,fsdp=16",
                    "tp=8,ep=32,dp=4",
                    InferDType::Fp8,
                );
                plan(&m, &t, &i, &cost).expect("plan")
            })
        },
    );
    let (m, t, i) = inputs("qwen3-8b", "fsdp=8", "tp=8,dp=2", InferDType::Bf16);
    g.bench_function("qwen3-8b fsdp8 to tp8-dp2 bf16: plan", |b| {
        b.iter(|| plan(&m, &t, &i, &cost).expect("plan"))
    });
    g.finish();
}

criterion_group!(benches, planner);
criterion_main!(benches);
