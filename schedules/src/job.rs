//! The job: what a [`WorldSpec`] (the statement every process of a job shares) means to the
//! planner.
//!
//! Why here and not in the controller: three kinds of process read a `WorldSpec` and each needs a
//! different, pure part of it. The controller builds the whole [`Job`] and plans it once; a
//! rollout needs only its own tensors ([`rollout_layout`]: names, shapes, offsets, region sizes,
//! all from the inference layout, no planning) so that it can register its memory before it
//! registers with the controller; and a launcher checks a rank against the world's size
//! ([`world_size`], from the layout strings alone). None of them reads a file here: when the
//! model is a `config.json` path, the caller reads it and passes the text in.
//!
//! A declared model ([`is_declared`]: a `config.json` of an architecture the planner does not
//! know, or `--model declared[:NAME]`) has no layouts of its own: the controller plans it from
//! every worker's registration ([`declared_layouts`], [`plan_declared_job`]), and an engine lays
//! out its own tensors from what it declares ([`declared_rollout_layout`]). See
//! [`crate::declared`].

use weightsync_common::DType;
use weightsync_common::protocol::{TensorMeta, WorldSpec};

use crate::cost::CostModel;
use crate::declared::{DeclaredError, EngineDeclaration};
use crate::error::PlanError;
use crate::layout_infer::{InferDType, InferSpec, InferenceLayout};
use crate::layout_train::{TrainSpec, TrainingLayout};
use crate::model::Model;
use crate::planner::plan;
use crate::table::{RolloutPlan, RoutingTable};

/// Why a job's statement cannot be used: which part was wrong, and the planner's reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// The model, a layout string or the plan itself was refused.
    #[error("{part}: {source}")]
    Spec {
        /// `model`, `training layout`, `inference layout` or `planning`.
        part: &'static str,
        /// The planner's error.
        #[source]
        source: PlanError,
    },
    /// The inference dtype is neither bf16 nor fp8.
    #[error("inference dtype {0} is not supported (bf16 or fp8)")]
    InferDType(DType),
}

fn part(part: &'static str) -> impl Fn(PlanError) -> JobError {
    move |source| JobError::Spec { part, source }
}

/// A job's model and both layouts: everything but the routing table.
#[derive(Debug, Clone)]
pub struct JobLayouts {
    /// Logical parameters.
    pub model: Model,
    /// Every training rank's shards.
    pub train: TrainingLayout,
    /// Every inference rank's tensors.
    pub infer: InferenceLayout,
    /// The parsed inference spec.
    pub infer_spec: InferSpec,
}

/// A planned job: its layouts, the cost model it was planned with, and the routing table.
#[derive(Debug, Clone)]
pub struct Job {
    /// Model and layouts.
    pub layouts: JobLayouts,
    /// Cost model.
    pub cost: CostModel,
    /// The routing table.
    pub table: RoutingTable,
}

/// The training spec of a job.
pub fn train_spec(world: &WorldSpec) -> Result<TrainSpec, JobError> {
    world.train.parse().map_err(part("training layout"))
}

/// The inference spec of a job, with its dtype.
pub fn infer_spec(world: &WorldSpec) -> Result<InferSpec, JobError> {
    let mut spec: InferSpec = world.infer.parse().map_err(part("inference layout"))?;
    spec.dtype = match world.dtype {
        DType::F8E4M3 => InferDType::Fp8,
        DType::BF16 => InferDType::Bf16,
        other => return Err(JobError::InferDType(other)),
    };
    spec.check_fp8_recipe().map_err(part("inference layout"))?;
    Ok(spec)
}

/// The job's model: `model_config` is the text of the `config.json` that `world.model` names
/// when it is a path (the caller reads it); `None` takes `world.model` as a preset name.
pub fn model(
    world: &WorldSpec,
    model_config: Option<&str>,
    train: &TrainSpec,
) -> Result<Model, JobError> {
    if is_declared(world, model_config) {
        return Err(part("model")(
            DeclaredError::LayoutFromSpec {
                side: "parameter list",
                model: world.model.clone(),
            }
            .into(),
        ));
    }
    match model_config {
        Some(text) => Model::from_config_json(&world.model, text, train.experts),
        None => Model::preset(&world.model, train.experts),
    }
    .map_err(part("model"))
}

/// Builds the model and both layouts of a job (no planning).
pub fn layouts(world: &WorldSpec, model_config: Option<&str>) -> Result<JobLayouts, JobError> {
    let tspec = train_spec(world)?;
    let model = model(world, model_config, &tspec)?;
    let infer_spec = infer_spec(world)?;
    // The two layouts are independent: built at once (the training side's error first).
    let (train, infer) = rayon::join(
        || TrainingLayout::build(&model, &tspec),
        || InferenceLayout::build(&model, &infer_spec),
    );
    let train = train.map_err(part("training layout"))?;
    let infer = infer.map_err(part("inference layout"))?;
    Ok(JobLayouts {
        model,
        train,
        infer,
        infer_spec,
    })
}

/// The model and the inference layout alone (what a rollout needs to lay out its tensors; the
/// training layout, which a rollout never reads, is not built).
pub fn inference_layout(
    world: &WorldSpec,
    model_config: Option<&str>,
) -> Result<(Model, InferenceLayout), JobError> {
    let model = model(world, model_config, &train_spec(world)?)?;
    let infer =
        InferenceLayout::build(&model, &infer_spec(world)?).map_err(part("inference layout"))?;
    Ok((model, infer))
}

/// Builds and plans a job with the default cost model.
pub fn plan_job(world: &WorldSpec, model_config: Option<&str>) -> Result<Job, JobError> {
    let layouts = layouts(world, model_config)?;
    let cost = CostModel::default();
    let table =
        plan(&layouts.model, &layouts.train, &layouts.infer, &cost).map_err(part("planning"))?;
    Ok(Job {
        layouts,
        cost,
        table,
    })
}

/// The name a job gives a declared model explicitly: `declared` or `declared:NAME`.
fn declared_by_name(model: &str) -> Option<&str> {
    match model.split_once(':') {
        Some(("declared", name)) if !name.is_empty() => Some(name),
        _ if model == "declared" => Some(model),
        _ => None,
    }
}

/// Whether the job's model is declared by its workers ([`crate::declared`]): the job names it
/// `declared` (or `declared:NAME`), or its `config.json` names a `model_type` the planner does
/// not know (a config that is not JSON, or misses a field of a known family, is not declared:
/// it is an error of its own, which [`model`] names).
pub fn is_declared(world: &WorldSpec, model_config: Option<&str>) -> bool {
    declared_by_name(&world.model).is_some()
        || model_config.is_some_and(|text| {
            matches!(
                crate::model_config::ModelConfig::parse_json(text),
                Err(PlanError::UnknownFamily { .. })
            )
        })
}

/// The numbers of training and inference ranks of a declared job. (Whether its engines can
/// hold the layout string's ranks is known only from their declarations: engines of whole
/// tensors need `tp=1`, `ep=1`, `format=hf`; see [`crate::declared::check_engines`].)
pub fn declared_world(world: &WorldSpec) -> Result<(u32, u32), JobError> {
    world_size(world)
}

/// The model and both layouts of a declared job, from its workers' declarations: `trainers[r]`
/// is training rank `r`'s registration's tensors, `engines[i]` inference rank `i`'s (with its
/// skip list). Every disagreement is refused naming the tensor and both sides.
pub fn declared_layouts(
    world: &WorldSpec,
    trainers: &[&[TensorMeta]],
    engines: &[EngineDeclaration<'_>],
) -> Result<JobLayouts, JobError> {
    let infer_spec = infer_spec(world)?;
    crate::declared::check_engines(&infer_spec, engines)
        .map_err(|e| part("inference layout")(e.into()))?;
    let (t, r) = declared_world(world)?;
    if trainers.len() != t as usize || engines.len() != r as usize {
        return Err(part("declarations")(PlanError::BadSpec {
            spec: format!("{} / {}", world.train, world.infer),
            reason: format!(
                "the job has {t} training and {r} inference ranks, but {} trainers and {} \
                 engines declared their tensors",
                trainers.len(),
                engines.len()
            ),
        }));
    }
    let name = declared_by_name(&world.model).unwrap_or(&world.model);
    let (model, train) =
        crate::declared::from_trainers(name, trainers).map_err(part("trainers' declarations"))?;
    let infer = crate::declared::inference_layout(&model, &train, &infer_spec, engines)
        .map_err(part("declarations"))?;
    Ok(JobLayouts {
        model,
        train,
        infer,
        infer_spec,
    })
}

/// Builds and plans a declared job with the default cost model (see [`declared_layouts`]).
pub fn plan_declared_job(
    world: &WorldSpec,
    trainers: &[&[TensorMeta]],
    engines: &[EngineDeclaration<'_>],
) -> Result<Job, JobError> {
    let layouts = declared_layouts(world, trainers, engines)?;
    let cost = CostModel::default();
    let table =
        plan(&layouts.model, &layouts.train, &layouts.infer, &cost).map_err(part("planning"))?;
    Ok(Job {
        layouts,
        cost,
        table,
    })
}

/// An engine's own tensors and region size in a declared job, from its declarations alone (no
/// trainer's, no planning): what it registers before the controller plans, and what the table
/// will give it ([`same_rollout_layout`]). Inference rank `rank` is engine `rank / n`, local
/// rank `rank % n`, `n = max(tp, ep)` of the job's inference layout (as
/// [`crate::declared::inference_layout`] numbers them): a tensor-parallel rank declares its
/// boxes as sources ([`weightsync_common::protocol::TensorSource`]).
pub fn declared_rollout_layout(
    world: &WorldSpec,
    rank: u32,
    tensors: &[TensorMeta],
    skip: &[String],
) -> Result<RolloutPlan, JobError> {
    let n = infer_spec(world)?.engine_ranks().max(1);
    let (tensors, bytes) =
        crate::declared::engine_tensors(rank, EngineDeclaration { tensors, skip })
            .map_err(|e| part("declarations")(e.into()))?;
    Ok(RolloutPlan {
        rank,
        engine: rank / n,
        local_rank: rank % n,
        mr_bytes: vec![bytes],
        tensors,
        expect: Vec::new(),
    })
}

/// Number of training and inference ranks a job has, from its layout strings alone (no model,
/// no layout built): what a launcher checks a rank against.
pub fn world_size(world: &WorldSpec) -> Result<(u32, u32), JobError> {
    let trainers = train_spec(world)?
        .world()
        .map_err(part("training layout"))?;
    let i = infer_spec(world)?;
    let rollouts = i
        .engine_ranks()
        .checked_mul(i.dp)
        .ok_or_else(|| JobError::Spec {
            part: "inference layout",
            source: PlanError::TooLarge(format!("inference world size of {i}")),
        })?;
    Ok((trainers, rollouts))
}

/// Whether two statements are the same job: the same model, dtype and verification, and layout
/// strings that parse to the same layouts (`tp=2,dp=2` is `dp=2,tp=2`, `format=transformers` is
/// `format=hf`, `embed=vocab` with `format=fused` is `format=fused`). A layout string that does
/// not parse is the same only as itself, letter for letter. What the controller checks a
/// worker's statement against and a worker checks the controller's against, so that two
/// spellings of one job do not refuse each other.
pub fn same_job(a: &WorldSpec, b: &WorldSpec) -> bool {
    job_differences(a, b).is_empty()
}

/// The fields in which two statements describe different jobs (see [`same_job`]), each as
/// `(field, a's text, b's text)`: `model`, `train`, `infer`, `dtype`, `verify`.
pub fn job_differences(a: &WorldSpec, b: &WorldSpec) -> Vec<(&'static str, String, String)> {
    fn same<T: std::str::FromStr + PartialEq>(x: &str, y: &str) -> bool {
        x == y || matches!((x.parse::<T>(), y.parse::<T>()), (Ok(p), Ok(q)) if p == q)
    }
    let same_train = |x: &str, y: &str| {
        same::<TrainSpec>(x, y)
            || match (x.parse::<TrainSpec>(), y.parse::<TrainSpec>()) {
                (Ok(p), Ok(q)) => a.model == b.model && same_held_dtype(&a.model, p, q),
                _ => false,
            }
    };
    let WorldSpec {
        model,
        train,
        infer,
        dtype,
        verify,
    } = a;
    let fields = [
        ("model", *model == b.model, model.clone(), b.model.clone()),
        (
            "train",
            same_train(train, &b.train),
            train.clone(),
            b.train.clone(),
        ),
        (
            "infer",
            same::<InferSpec>(infer, &b.infer),
            infer.clone(),
            b.infer.clone(),
        ),
        (
            "dtype",
            *dtype == b.dtype,
            dtype.to_string(),
            b.dtype.to_string(),
        ),
        (
            "verify",
            *verify == b.verify,
            verify.to_string(),
            b.verify.to_string(),
        ),
    ];
    fields
        .into_iter()
        .filter(|(_, same, _, _)| !same)
        .map(|(field, _, x, y)| (field, x, y))
        .collect()
}

/// Whether two training specs that differ only in `dtype` state the same held dtype: one leaves
/// it out and the other names the model's own (`fsdp=2,dtype=bf16` of a bf16 model is
/// `fsdp=2`). Known only for a preset model; a model given by its `config.json` compares the
/// specs as written (its config is not at hand here).
fn same_held_dtype(model: &str, a: TrainSpec, b: TrainSpec) -> bool {
    let model_dtype = || {
        crate::presets::preset_config(model)
            .and_then(|text| crate::model::ModelConfig::from_json(text).ok())
            .map(|c| c.dtype)
    };
    let held = |s: TrainSpec, m: DType| s.dtype.unwrap_or(m);
    TrainSpec { dtype: None, ..a } == TrainSpec { dtype: None, ..b }
        && a.dtype != b.dtype
        && model_dtype().is_some_and(|m| held(a, m) == held(b, m))
}

/// One inference rank's tensors and region sizes, as the planner will lay them out, with no
/// expectations yet (`expect` is empty: how many writes land per sync comes only with the
/// table, in the controller's assignment). A rollout allocates and registers this before it
/// registers with the controller.
pub fn rollout_layout(infer: &InferenceLayout, rank: u32) -> Result<RolloutPlan, JobError> {
    let r = infer.ranks.get(rank as usize).ok_or(JobError::Spec {
        part: "inference layout",
        source: PlanError::NoSuchRank {
            side: "inference",
            rank,
            ranks: infer.ranks.len() as u32,
        },
    })?;
    Ok(RolloutPlan {
        rank: r.rank,
        engine: r.engine,
        local_rank: r.local_rank,
        mr_bytes: r.mr_bytes.clone(),
        tensors: r.tensors.to_vec(),
        expect: Vec::new(),
    })
}

/// Whether `plan` (from the table) lays out exactly the tensors of `layout` (computed by the
/// rollout itself): same rank, regions and tensors; only the expectations may differ.
pub fn same_rollout_layout(layout: &RolloutPlan, plan: &RolloutPlan) -> bool {
    layout.rank == plan.rank
        && layout.engine == plan.engine
        && layout.local_rank == plan.local_rank
        && layout.mr_bytes == plan.mr_bytes
        && layout.tensors == plan.tensors
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(model: &str, train: &str, infer: &str, dtype: DType) -> WorldSpec {
        WorldSpec {
            model: model.into(),
            train: train.into(),
            infer: infer.into(),
            dtype,
            verify: true,
        }
    }

    #[test]
    fn same_job_compares_what_the_strings_mean() {
        let w = world("qwen3-8b", "dp=2,fsdp=2", "tp=2,format=hf", DType::BF16);
        let spelled = world(
            "qwen3-8b",
            "fsdp=2,dp=2,tp=1",
            "format=transformers,tp=2,dp=1",
            DType::BF16,
        );
        assert!(same_job(&w, &spelled) && same_job(&spelled, &w));
        // fused splits the embedding already: embed=vocab changes nothing there.
        let fused = world("qwen3-8b", "fsdp=4", "tp=2", DType::BF16);
        assert!(same_job(
            &fused,
            &world("qwen3-8b", "fsdp=4", "tp=2,embed=vocab", DType::BF16)
        ));
        for other in [
            world(
                "qwen3-8b",
                "dp=2,fsdp=2",
                "tp=2,format=hf,embed=vocab",
                DType::BF16,
            ),
            world("qwen3-8b", "fsdp=4", "tp=2,format=hf", DType::BF16),
            world("qwen3-0.6b", "dp=2,fsdp=2", "tp=2,format=hf", DType::BF16),
            world("qwen3-8b", "dp=2,fsdp=2", "tp=2,format=hf", DType::F8E4M3),
            WorldSpec {
                verify: false,
                ..w.clone()
            },
        ] {
            assert!(!same_job(&w, &other), "{other:?}");
        }
        // A training dtype that names the model's own is the model's (qwen3-8b is bf16); f32
        // shards are another job, and so is any dtype of a model known only by its path.
        let held = world("qwen3-8b", "fsdp=2,dp=2,dtype=bf16", "tp=2", DType::BF16);
        let implied = world("qwen3-8b", "dp=2,fsdp=2", "tp=2", DType::BF16);
        assert!(same_job(&held, &implied) && same_job(&implied, &held));
        let f32_shards = world("qwen3-8b", "fsdp=2,dp=2,dtype=f32", "tp=2", DType::BF16);
        assert_eq!(
            job_differences(&f32_shards, &implied),
            vec![(
                "train",
                "fsdp=2,dp=2,dtype=f32".to_string(),
                "dp=2,fsdp=2".to_string()
            )]
        );
        let by_path = |train: &str| world("/models/q8/config.json", train, "tp=2", DType::BF16);
        assert!(!same_job(&by_path("fsdp=2,dtype=bf16"), &by_path("fsdp=2")));
        // Only the fields that differ in meaning are named.
        let other = world("qwen3-8b", "fsdp=2,dp=2", "tp=4,format=hf", DType::BF16);
        let d = job_differences(&w, &other);
        assert_eq!(
            d,
            vec![("infer", "tp=2,format=hf".into(), "tp=4,format=hf".into())]
        );
        // A string that does not parse is the same only as itself.
        let bad = world("qwen3-8b", "dp=2,fsdp=2", "tp=two", DType::BF16);
        assert!(same_job(&bad, &bad.clone()));
        assert!(!same_job(
            &bad,
            &world("qwen3-8b", "dp=2,fsdp=2", "tp=two ", DType::BF16)
        ));
    }

    #[test]
    fn world_size_from_the_strings_matches_the_built_layouts() {
        for (m, t, i) in [
            ("qwen3-0.6b", "fsdp=4", "tp=2,dp=2"),
            ("qwen3-30b-a3b", "pp=2,ep=2,fsdp=2", "tp=2,ep=4,dp=2"),
            ("qwen3-8b", "dp=2,fsdp=2,tp=2", "tp=4"),
        ] {
            let w = world(m, t, i, DType::F8E4M3);
            let l = layouts(&w, None).unwrap();
            assert_eq!(
                world_size(&w).unwrap(),
                (l.train.ranks, l.infer.ranks.len() as u32),
                "{m} {t} {i}"
            );
        }
    }

    #[test]
    fn a_rollouts_own_layout_is_the_tables_without_expectations() {
        let w = world("qwen3-0.6b", "fsdp=4", "tp=2,dp=2", DType::F8E4M3);
        let job = plan_job(&w, None).unwrap();
        for (rank, planned) in job.table.rollout_plans().enumerate() {
            let own = rollout_layout(&job.layouts.infer, rank as u32).unwrap();
            assert!(own.expect.is_empty());
            assert!(same_rollout_layout(&own, &planned), "rank {rank}");
        }
        let e = rollout_layout(&job.layouts.infer, 4).unwrap_err();
        assert!(e.to_string().contains("no inference rank 4"), "{e}");
    }

    #[test]
    fn bad_statements_name_the_part() {
        let e = layouts(&world("qwen3-0.6b", "fsdp=x", "tp=1", DType::BF16), None).unwrap_err();
        assert!(e.to_string().starts_with("training layout"), "{e}");
        let e = layouts(&world("nope", "fsdp=1", "tp=1", DType::BF16), None).unwrap_err();
        assert!(e.to_string().starts_with("model"), "{e}");
        let e = world_size(&world("qwen3-0.6b", "fsdp=1", "tp=1", DType::F32)).unwrap_err();
        assert_eq!(e, JobError::InferDType(DType::F32));
        let e = layouts(&world("m", "fsdp=1", "tp=1", DType::BF16), Some("{")).unwrap_err();
        assert!(e.to_string().starts_with("model: bad model config"), "{e}");
    }
}
