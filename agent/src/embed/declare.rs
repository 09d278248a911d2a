//! What an engine of a declared model declares, from what it holds: every tensor (name, shape,
//! dtype), the names it takes nothing of, and what some tensors are made of
//! ([`TensorSource`]), checked and laid out before anything is registered.
//!
//! Why a file of its own: it is pure (no controller, no fabric), so the declarations an engine
//! sends for a layout can be planned and compared with the config path's table in a test, for
//! tensor-parallel ranks as for whole-tensor engines. A tensor-parallel rank (`tp=N`) holds a
//! box of some tensors, as vLLM's loader narrows them (column-parallel rows, row-parallel
//! columns, vocabulary rows): it declares each as a source of one part, that box of the tensor
//! of its name ([`box_source`]); a fused tensor declares its parts in order.

use std::collections::BTreeMap;

use weightsync_common::DType;
use weightsync_common::protocol::{SourceBox, TensorMeta, TensorSource, WorldSpec};
use weightsync_schedules::declared::{EngineDeclaration, check_engines};
use weightsync_schedules::job;
use weightsync_schedules::table::RolloutPlan;

/// What some of a declared model's engine tensors are made of, by tensor name (see
/// [`super::EngineHandle::declare_and_register_sources`]).
pub type EngineSources = BTreeMap<String, TensorSource>;

/// The source of a tensor that is the box `offset .. offset + shape` of the trainers' tensor of
/// the same name (whole shape `global_shape`): a tensor-parallel rank's slice. `None` when the
/// box is the whole tensor (declared without a source, as a whole tensor is).
pub fn box_source(
    tensor: &str,
    global_shape: &[u64],
    offset: &[u64],
    shape: &[u64],
) -> Option<TensorSource> {
    let whole = shape == global_shape && offset.iter().all(|&o| o == 0);
    (!whole).then(|| TensorSource {
        dim: 0,
        parts: vec![SourceBox {
            tensor: tensor.to_string(),
            offset: offset.to_vec(),
            shape: shape.to_vec(),
        }],
    })
}

/// Why an engine's declarations were refused: the tensor, where one is to blame, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The tensor to blame.
    pub tensor: Option<String>,
    /// Why.
    pub reason: String,
}

/// What an engine declares, checked: its registration's declarations (each kept tensor in the
/// layout's dims, with its source) and its own layout.
#[derive(Debug, Clone)]
pub struct Declared {
    /// What the registration sends: the tensors of `planned`, in its order, with their sources.
    pub tensors: Vec<TensorMeta>,
    /// The rank's own layout (what the table will give it).
    pub planned: RolloutPlan,
}

/// Inference rank `rank`'s declarations in job `world`: `held` (name, shape, dtype of every
/// tensor it holds), `skip` and `sources`. Refused, naming the tensor where one is to blame: a
/// source for a tensor not held, a source whose parts cannot fill its tensor, whole tensors
/// only where the job's layout is tensor- or expert-parallel or fused.
pub fn declare(
    world: &WorldSpec,
    rank: u32,
    held: Vec<(String, Vec<u64>, DType)>,
    skip: &[String],
    mut sources: EngineSources,
) -> Result<Declared, Refused> {
    let decls: Vec<TensorMeta> = held
        .into_iter()
        .map(|(name, shape, dtype)| TensorMeta {
            source: sources.remove(&name),
            ..TensorMeta::whole(name, shape, dtype)
        })
        .collect();
    if let Some(stray) = sources.keys().next() {
        return Err(Refused {
            tensor: Some(stray.clone()),
            reason: format!(
                "a source is declared for {stray}, which is not among the tensors given"
            ),
        });
    }
    let refused = |reason: String| Refused {
        tensor: None,
        reason,
    };
    // Whole tensors only can be no tensor-parallel rank's: refused here as the controller
    // would, before anything is registered.
    let spec = job::infer_spec(world).map_err(|e| refused(e.to_string()))?;
    let decl = EngineDeclaration {
        tensors: &decls,
        skip,
    };
    check_engines(&spec, &[decl]).map_err(|e| {
        refused(format!(
            "{e} (a tensor-parallel rank declares its boxes as sources: \
             declare_and_register_sources)"
        ))
    })?;
    let planned = job::declared_rollout_layout(world, rank, &decls, skip)
        .map_err(|e| refused(e.to_string()))?;
    let mut source_of: BTreeMap<String, TensorSource> = decls
        .into_iter()
        .filter_map(|m| Some((m.name, m.source?)))
        .collect();
    let tensors = planned
        .tensors
        .iter()
        .map(|t| {
            let dims = t.shape.dims().iter().map(|&d| u64::from(d)).collect();
            TensorMeta {
                source: source_of.remove(&t.name),
                ..TensorMeta::whole(t.name.clone(), dims, t.dtype)
            }
        })
        .collect();
    Ok(Declared { tensors, planned })
}

#[cfg(test)]
mod tests {
    //! A tensor-parallel engine's declarations, as this module makes them from each rank's
    //! boxes, plan the config path's table byte for byte (what `declared_same_table` shows for
    //! whole-tensor engines at tp=1).

    use super::*;
    use weightsync_schedules::declared::{self, EngineDeclaration};
    use weightsync_schedules::job::same_rollout_layout;

    fn world(model: &str, train: &str, infer: &str) -> WorldSpec {
        WorldSpec {
            model: model.into(),
            train: train.into(),
            infer: infer.into(),
            dtype: DType::BF16,
            verify: true,
        }
    }

    fn dims(d: &[u32]) -> Vec<u64> {
        d.iter().map(|&x| u64::from(x)).collect()
    }

    /// Every inference rank's declarations of the config path's layout, each tensor declared
    /// by its box of the trainers' tensor of its name, as a vLLM worker holding that box does.
    fn rank_declarations(known: &WorldSpec, declared_as: &WorldSpec) -> Vec<Declared> {
        let l = job::layouts(known, None).unwrap();
        (0..l.infer.ranks.len() as u32)
            .map(|rank| {
                let r = &l.infer.ranks[rank as usize];
                let boxes = l.infer.param_boxes(&l.model, rank).unwrap();
                let mut held = Vec::new();
                let mut sources = EngineSources::new();
                for (t, b) in r.tensors.iter().zip(boxes) {
                    let b = b.expect("format=hf: every tensor is one box of one parameter");
                    let shape = dims(t.shape.dims());
                    let n = b.global.ndim as usize;
                    if let Some(s) = box_source(
                        &t.name,
                        &dims(b.global.dims()),
                        &dims(&b.offset[..n]),
                        &shape,
                    ) {
                        sources.insert(t.name.clone(), s);
                    }
                    held.push((t.name.clone(), shape, t.dtype));
                }
                declare(declared_as, rank, held, &[], sources).unwrap()
            })
            .collect()
    }

    #[test]
    fn tensor_parallel_boxes_declared_plan_the_config_paths_table() {
        for infer in ["tp=2,format=hf", "tp=2,dp=2,format=hf,embed=vocab"] {
            let train = "fsdp=2";
            let known = world("qwen3-0.6b", train, infer);
            let declared_as = world("declared:qwen3-0.6b", train, infer);
            let from_config = job::plan_job(&known, None).unwrap();
            let engines = rank_declarations(&known, &declared_as);
            // Sharded tensors declare their boxes; norms (and a whole embedding) none.
            let sourced = engines[1]
                .tensors
                .iter()
                .filter(|m| m.source.is_some())
                .count();
            assert!(sourced > 0 && sourced < engines[1].tensors.len(), "{infer}");
            let l = &from_config.layouts;
            let t = declared::trainer_declarations(&l.model, &l.train);
            let tr: Vec<&[TensorMeta]> = t.iter().map(Vec::as_slice).collect();
            let en: Vec<EngineDeclaration> = engines
                .iter()
                .map(|d| EngineDeclaration {
                    tensors: &d.tensors,
                    skip: &[],
                })
                .collect();
            let declared_job = job::plan_declared_job(&declared_as, &tr, &en).unwrap();
            assert!(
                declared_job.table.to_bincode() == from_config.table.to_bincode(),
                "{infer}: the declared table differs from the config's"
            );
            // Each rank's own layout is the table's for it (engine and local rank included).
            for (rank, d) in engines.iter().enumerate() {
                let planned = declared_job.table.rollout(rank as u32).unwrap();
                assert!(
                    same_rollout_layout(&d.planned, &planned),
                    "{infer} rank {rank}"
                );
            }
            assert_eq!(engines[3 % engines.len()].planned.local_rank, 1);
        }
    }

    #[test]
    fn whole_tensors_at_tp_2_and_stray_or_misfit_sources_are_refused_by_name() {
        let w = world("declared:m", "fsdp=1", "tp=2,format=hf");
        let held = || vec![("w".to_string(), vec![4, 8], DType::BF16)];
        let e = declare(&w, 0, held(), &[], EngineSources::new()).unwrap_err();
        assert!(e.reason.contains("tp=2"), "{e:?}");
        let mut stray = EngineSources::new();
        stray.insert(
            "v".into(),
            box_source("v", &[8, 8], &[0, 0], &[4, 8]).unwrap(),
        );
        let e = declare(&w, 0, held(), &[], stray).unwrap_err();
        assert_eq!(e.tensor.as_deref(), Some("v"), "{e:?}");
        // Two parts of 3 rows cannot fill 4 rows exactly.
        let mut misfit = EngineSources::new();
        let part = |o: u64| SourceBox {
            tensor: "w".into(),
            offset: vec![o, 0],
            shape: vec![3, 8],
        };
        misfit.insert(
            "w".into(),
            TensorSource {
                dim: 0,
                parts: vec![part(0), part(3)],
            },
        );
        let e = declare(&w, 1, held(), &[], misfit).unwrap_err();
        assert!(
            e.reason.contains("tensor w") && e.reason.contains("past the tensor's end"),
            "{e:?}"
        );
    }
}
