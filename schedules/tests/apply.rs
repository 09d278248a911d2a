//! Applies routing tables to a full random model with plain reference code and compares every
//! inference rank's tensors with the same tensors built independently (slicing and fusing the
//! full tensors in the test): bf16 and fp8, dense / GQA / MQA+bias / MoE / MLA, per-expert and
//! stacked experts, FSDP with uneven chunks (fp8 gathers), HSDP replicas, training TP, PP.

mod common;

use common::*;
use weightsync_schedules::*;

fn run_case(json: &str, experts: ExpertForm, train: &str, infer: &str, fp8: bool) -> Summary {
    let m = model(json, experts);
    let mut tspec: TrainSpec = train.parse().unwrap();
    tspec.experts = experts;
    let mut ispec: InferSpec = infer.parse().unwrap();
    ispec.dtype = if fp8 {
        InferDType::Fp8
    } else {
        InferDType::Bf16
    };
    let tl = TrainingLayout::build(&m, &tspec).unwrap();
    let il = InferenceLayout::build(&m, &ispec).unwrap();
    let table = plan(&m, &tl, &il, &CostModel::default()).unwrap();
    let full = random_model(&m, 7);
    let landed = execute(&table, &m, &full);
    check_coverage(&table, &landed);
    let mut exp = Expected::new(&m, &full, ispec.tp, ispec.ep, fp8);
    let n = compare_all(&table, &landed, &mut exp);
    assert!(n > 10, "{n} tensors checked");
    Summary::of(&table, &CostModel::default())
}

#[test]
fn dense_gqa_bf16_and_fp8_with_gathers() {
    run_case(DENSE, ExpertForm::PerExpert, "fsdp=2", "tp=2,dp=2", false);
    // fsdp=3 cuts 512-row tensors at 171 and 342: fp8 blocks straddle and are gathered.
    let s = run_case(DENSE, ExpertForm::PerExpert, "fsdp=3", "tp=4", true);
    assert!(s.gather_bytes > 0);
}

#[test]
fn mqa_with_bias_tied_embeddings_and_training_tp() {
    run_case(
        QWEN2_MQA,
        ExpertForm::PerExpert,
        "fsdp=2",
        "tp=2,dp=2",
        true,
    );
    run_case(DENSE, ExpertForm::PerExpert, "tp=2,fsdp=3", "tp=4", true);
    run_case(
        QWEN2_MQA,
        ExpertForm::PerExpert,
        "dp=2,fsdp=3",
        "tp=4",
        false,
    );
}

#[test]
fn moe_per_expert_and_stacked_under_ep() {
    run_case(
        MOE,
        ExpertForm::PerExpert,
        "pp=2,ep=2,fsdp=2",
        "tp=2,ep=4",
        true,
    );
    run_case(
        MOE,
        ExpertForm::Stacked,
        "ep=2,fsdp=3",
        "tp=2,ep=4,dp=2",
        true,
    );
    run_case(MOE, ExpertForm::PerExpert, "dp=2,fsdp=2", "tp=2", false);
}

#[test]
fn mla_with_shared_experts_and_score_bias() {
    run_case(
        MLA,
        ExpertForm::PerExpert,
        "pp=2,ep=2,fsdp=3",
        "tp=2,ep=4,dp=2",
        true,
    );
    run_case(MLA, ExpertForm::Stacked, "ep=4,fsdp=2", "tp=2,ep=2", false);
}
