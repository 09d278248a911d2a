//! The bench's hand-built plans: one trainer and one rollout holding a chosen mix of matrix kinds
//! ([`Kind`]), laid out without the planner.
//!
//! Why by hand: the bench needs a mix of task kinds it picks itself (the one that balances the
//! stages on this machine, see `best_mix`), which no model's plan has; building the plans here
//! keeps that away from the measuring code in `mod.rs`.

use weightsync_common::DType;
use weightsync_schedules::table::{
    DstTensor, LocalShard, MeshGroup, ParamRef, RolloutPlan, Shape, Source, Task, TensorBox,
    TrainerPlan, Transform, UnitExpect, Write, WriteTarget,
};

use super::{BenchError, Config, Kind};

/// Where one matrix lands on the rollout: its transform, its writes (`src_offset`, `dst_offset`,
/// `len`), its tensors, and the next free offset.
struct Landing {
    transform: Transform,
    writes: Vec<(u64, u64, u64)>,
    tensors: Vec<DstTensor>,
    next: u64,
}

/// Lays out matrix `i` (`kind`, of `shape`) on the rollout from offset `at`.
fn landing(kind: Kind, i: u32, shape: Shape, at: u64) -> Landing {
    let align = |x: u64| x.div_ceil(256) * 256;
    let numel = shape.numel();
    let name = format!("layers.{i}.weight");
    let from = kind.source_dtype();
    let tensor = |name: String, shape, dtype, offset, len| DstTensor {
        name,
        shape,
        dtype,
        mr: 0,
        offset,
        len,
    };
    match kind {
        Kind::Fp8FromF32 => {
            let dims = shape.dims();
            let scale_shape = Shape::new(&[dims[0].div_ceil(128), dims[1].div_ceil(128)]);
            let scales = scale_shape.numel() * 4;
            let scales_at = align(at + numel);
            Landing {
                transform: Transform::Fp8Block {
                    from,
                    recipe: weightsync_common::Fp8Recipe::Vllm,
                },
                writes: vec![(0, at, numel), (numel.div_ceil(16) * 16, scales_at, scales)],
                tensors: vec![
                    tensor(name, shape, DType::F8E4M3, at, numel),
                    tensor(
                        format!("layers.{i}.weight_scale_inv"),
                        scale_shape,
                        DType::F32,
                        scales_at,
                        scales,
                    ),
                ],
                next: align(scales_at + scales),
            }
        }
        Kind::CastF32ToBf16 | Kind::CopyBf16 => {
            let len = numel * 2;
            Landing {
                transform: if kind == Kind::CopyBf16 {
                    Transform::Copy { dtype: DType::BF16 }
                } else {
                    Transform::Cast {
                        from,
                        to: DType::BF16,
                    }
                },
                writes: vec![(0, at, len)],
                tensors: vec![tensor(name, shape, DType::BF16, at, len)],
                next: align(at + len),
            }
        }
    }
}

/// The synthetic plans: one matrix per entry of `kinds` (each `rows x cols`), all written into
/// one rollout rank.
pub fn plans(cfg: &Config, kinds: &[Kind]) -> Result<(TrainerPlan, RolloutPlan), BenchError> {
    if kinds.is_empty() || cfg.rows == 0 || cfg.cols == 0 {
        return Err(BenchError::Config(
            "tasks, rows and cols must be positive".into(),
        ));
    }
    let n = kinds.len() as u32;
    let shape = Shape::new(&[cfg.rows, cfg.cols]);
    let mut tp = TrainerPlan {
        rank: 0,
        params: Vec::new(),
        shards: Vec::new(),
        source_arena_bytes: 0,
        gather_arena_bytes: 0,
        groups: vec![MeshGroup {
            id: 0,
            name: "all".into(),
            first_task: 0,
            num_tasks: n,
            gather_sends: 0,
            local_tasks: n,
            gather_expect: 0,
        }],
        tasks: Vec::new(),
        writes: Vec::new(),
        copies: Vec::new(),
    };
    let mut tensors = Vec::new();
    let mut dst = 0u64;
    for (i, &kind) in (0u32..).zip(kinds) {
        let from = kind.source_dtype();
        tp.params.push(ParamRef {
            id: i,
            name: format!("layers.{i}.weight").into(),
            shape,
        });
        tp.shards.push(LocalShard {
            param: i,
            global: TensorBox::full(shape),
            dtype: from,
            offset: tp.source_arena_bytes,
        });
        tp.source_arena_bytes += shape.numel() * from.size() as u64;
        let first_write = tp.writes.len() as u32;
        let l = landing(kind, i, shape, dst);
        dst = l.next;
        tensors.extend(l.tensors);
        tp.writes.extend(
            l.writes
                .into_iter()
                .map(|(src_offset, dst_offset, len)| Write {
                    dst: WriteTarget::Rollout(0),
                    mr: 0,
                    unit: 0,
                    len: len as u32,
                    src_offset,
                    dst_offset,
                }),
        );
        tp.tasks.push(Task {
            param: i,
            region: TensorBox::full(shape),
            source: Source::Shard { shard: i },
            transform: l.transform,
            first_write,
            num_writes: tp.writes.len() as u32 - first_write,
            first_copy: 0,
            num_copies: 0,
        });
    }
    let rp = RolloutPlan {
        rank: 0,
        engine: 0,
        local_rank: 0,
        mr_bytes: vec![dst],
        tensors,
        expect: vec![UnitExpect {
            unit: 0,
            writes: tp.writes.len() as u64,
        }],
    };
    Ok((tp, rp))
}

/// Deterministic, non-trivial weights for every shard of `tp`, in each shard's dtype.
pub(super) fn source_for(tp: &TrainerPlan) -> Vec<u8> {
    let mut source = Vec::with_capacity(tp.source_arena_bytes as usize);
    let mut x = 0x9e37_79b9_u32;
    for shard in &tp.shards {
        let end = shard.offset + shard.bytes();
        while (source.len() as u64) < end {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let v = (x as f32 / u32::MAX as f32 - 0.5) * 8.0;
            match shard.dtype {
                DType::BF16 => {
                    source.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes())
                }
                _ => source.extend_from_slice(&v.to_le_bytes()),
            }
        }
    }
    source
}
