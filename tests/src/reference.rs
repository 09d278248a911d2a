//! What every inference rank must hold, recomputed from the full logical weights without the
//! routing table: slicing, fusing and quantising by the engine format's own rules.
//!
//! End-to-end tests compare every destination byte with this. It deliberately shares nothing with
//! the planner but the documented engine format (tensor names, tp slicing, fusion order, fp8
//! block scales of the logical tensor; see `weightsync_schedules::layout_infer`), and uses only
//! the whole-tensor fp8 kernel, which the kernel tests pin bit-exact to ml_dtypes. Scope: the
//! dense families (Llama, Qwen2, Qwen3) under tensor parallelism, which is what the suites run.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use weightsync_common::DType;
use weightsync_schedules::layout_train::TrainSpec;
use weightsync_schedules::model::Model;
use weightsync_schedules::table::{DstTensor, TrainerPlan};
use weightsync_worker::f32_to_bf16;
use weightsync_worker::{Fp8Shape, Threads, quantise_fp8};

/// A dense row-major tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dense {
    /// Shape.
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// Little-endian bytes.
    pub bytes: Vec<u8>,
}

impl Dense {
    fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    fn row_bytes(&self) -> usize {
        self.shape[1..].iter().product::<usize>() * self.dtype.size()
    }

    /// Rows `[a, b)` along dim 0.
    pub fn slice_rows(&self, a: usize, b: usize) -> Dense {
        let rb = self.row_bytes();
        let mut shape = self.shape.clone();
        shape[0] = b - a;
        Dense {
            shape,
            dtype: self.dtype,
            bytes: self.bytes[a * rb..b * rb].to_vec(),
        }
    }

    /// Columns `[a, b)` along dim 1 of a 2-D tensor.
    pub fn slice_cols(&self, a: usize, b: usize) -> Dense {
        let (rows, cols, es) = (self.shape[0], self.shape[1], self.dtype.size());
        let mut bytes = Vec::with_capacity(rows * (b - a) * es);
        for r in 0..rows {
            bytes.extend_from_slice(&self.bytes[(r * cols + a) * es..(r * cols + b) * es]);
        }
        Dense {
            shape: vec![rows, b - a],
            dtype: self.dtype,
            bytes,
        }
    }

    /// A box given by per-dimension `[start, start + len)` (any rank).
    pub fn slice_box(&self, start: &[usize], len: &[usize]) -> Dense {
        let es = self.dtype.size();
        let n = self.shape.len();
        let mut out = Vec::with_capacity(len.iter().product::<usize>() * es);
        if n == 0 {
            return self.clone();
        }
        let strides: Vec<usize> = (0..n)
            .map(|d| self.shape[d + 1..].iter().product())
            .collect();
        let count: usize = len[..n - 1].iter().product();
        let mut idx = vec![0usize; n - 1];
        for _ in 0..count {
            let mut at = start[n - 1];
            for d in 0..n - 1 {
                at += (start[d] + idx[d]) * strides[d];
            }
            out.extend_from_slice(&self.bytes[at * es..(at + len[n - 1]) * es]);
            for d in (0..n - 1).rev() {
                idx[d] += 1;
                if idx[d] < len[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        Dense {
            shape: len.to_vec(),
            dtype: self.dtype,
            bytes: out,
        }
    }
}

/// Parts concatenated along dim 0.
fn concat_rows(parts: &[Dense]) -> Dense {
    let mut shape = parts[0].shape.clone();
    shape[0] = parts.iter().map(Dense::rows).sum();
    Dense {
        shape,
        dtype: parts[0].dtype,
        bytes: parts.iter().flat_map(|p| p.bytes.iter().copied()).collect(),
    }
}

/// The full logical weights of a model, by Hugging Face name.
#[derive(Debug, Clone)]
pub struct LogicalWeights {
    /// Tensors by name.
    pub tensors: BTreeMap<String, Dense>,
}

impl LogicalWeights {
    /// Random weights (uniform in [-2, 2), stored in each parameter's dtype), reproducible from
    /// `seed`.
    pub fn random(model: &Model, seed: u64) -> LogicalWeights {
        LogicalWeights::random_held(model, &TrainSpec::default(), seed)
    }

    /// [`Self::random`] stored as a training job of `spec` holds them
    /// ([`TrainSpec::held_dtype`]: `dtype=f32` keeps f32 parameters of a bf16 model).
    pub fn random_held(model: &Model, spec: &TrainSpec, seed: u64) -> LogicalWeights {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut tensors = BTreeMap::new();
        for p in &model.params {
            let shape: Vec<usize> = p.shape.dims().iter().map(|&d| d as usize).collect();
            let n: usize = shape.iter().product();
            let dtype = match spec.held_dtype(model, p) {
                DType::F32 => DType::F32,
                _ => DType::BF16,
            };
            let mut bytes = Vec::with_capacity(n * dtype.size());
            for _ in 0..n {
                let x: f32 = rng.random::<f32>() * 4.0 - 2.0;
                match dtype {
                    DType::F32 => bytes.extend_from_slice(&x.to_le_bytes()),
                    _ => bytes.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
                }
            }
            tensors.insert(
                p.name.to_string(),
                Dense {
                    shape,
                    dtype,
                    bytes,
                },
            );
        }
        LogicalWeights { tensors }
    }

    fn get(&self, name: &str) -> Result<&Dense, String> {
        self.tensors
            .get(name)
            .ok_or_else(|| format!("no logical tensor {name}"))
    }

    /// Fills a trainer's source arena: each shard's box of its parameter at the shard's offset.
    pub fn fill_source(&self, plan: &TrainerPlan, arena: &mut [u8]) -> Result<(), String> {
        for s in &plan.shards {
            let name = &plan.params[s.param as usize].name;
            let full = self.get(name)?;
            if full.dtype != s.dtype {
                return Err(format!("{name}: shard dtype {} vs {}", s.dtype, full.dtype));
            }
            let n = s.global.ndim as usize;
            let start: Vec<usize> = s.global.start[..n].iter().map(|&x| x as usize).collect();
            let len: Vec<usize> = s.global.len[..n].iter().map(|&x| x as usize).collect();
            let part = full.slice_box(&start, &len);
            let at = s.offset as usize;
            arena[at..at + part.bytes.len()].copy_from_slice(&part.bytes);
        }
        Ok(())
    }
}

/// The attention geometry the engine format needs.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Tensor parallelism.
    pub tp: usize,
}

/// The logical parts (in fusion order) that make up destination tensor `name` on tp rank `t`.
fn parts(w: &LogicalWeights, g: Geometry, name: &str, t: usize) -> Result<Vec<Dense>, String> {
    let tp = g.tp;
    let d = g.head_dim;
    let q_rows = |x: &Dense| {
        let per = g.heads / tp * d;
        x.slice_rows(t * per, (t + 1) * per)
    };
    let kv_rows = |x: &Dense| {
        if tp <= g.kv_heads {
            let per = g.kv_heads / tp * d;
            x.slice_rows(t * per, (t + 1) * per)
        } else {
            let h = t / (tp / g.kv_heads);
            x.slice_rows(h * d, (h + 1) * d)
        }
    };
    let split = |x: &Dense, cols: bool| {
        let n = if cols { x.shape[1] } else { x.shape[0] };
        let per = n / tp;
        if cols {
            x.slice_cols(t * per, (t + 1) * per)
        } else {
            x.slice_rows(t * per, (t + 1) * per)
        }
    };
    if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
        let x = w.get(name)?;
        let v = x.shape[0];
        let c = v.div_ceil(tp);
        return Ok(vec![x.slice_rows((t * c).min(v), ((t + 1) * c).min(v))]);
    }
    for (fused, sep, kind) in [
        ("self_attn.qkv_proj.weight", ".weight", 0),
        ("self_attn.qkv_proj.bias", ".bias", 0),
        ("mlp.gate_up_proj.weight", ".weight", 1),
    ] {
        if let Some(prefix) = name.strip_suffix(fused) {
            return Ok(if kind == 0 {
                let get = |p: &str| w.get(&format!("{prefix}self_attn.{p}_proj{sep}"));
                vec![q_rows(get("q")?), kv_rows(get("k")?), kv_rows(get("v")?)]
            } else {
                let get = |p: &str| w.get(&format!("{prefix}mlp.{p}_proj{sep}"));
                vec![split(get("gate")?, false), split(get("up")?, false)]
            });
        }
    }
    if name.ends_with("self_attn.o_proj.weight") {
        let x = w.get(name)?;
        let per = g.heads / tp * d;
        return Ok(vec![x.slice_cols(t * per, (t + 1) * per)]);
    }
    if name.ends_with("mlp.down_proj.weight") {
        return Ok(vec![split(w.get(name)?, true)]);
    }
    // Everything else (norms) is replicated.
    Ok(vec![w.get(name)?.clone()])
}

fn fp8(part: &Dense) -> Result<(Vec<u8>, Vec<u8>), String> {
    let shape = Fp8Shape {
        rows: part.shape[0],
        cols: part.shape[1],
    };
    let mut values = vec![0u8; shape.rows * shape.cols];
    let mut scales = vec![0u8; shape.row_blocks() * shape.col_blocks() * 4];
    quantise_fp8(
        &part.bytes,
        part.dtype,
        shape,
        &mut values,
        &mut scales,
        Threads::One,
    )
    .map_err(|e| e.to_string())?;
    Ok((values, scales))
}

/// One element of `from` as `to`, little-endian, through the `half` crate (round to nearest
/// even), independently of the worker's cast kernels.
fn cast_element(e: &[u8], from: DType, to: DType) -> Vec<u8> {
    let x = match from {
        DType::BF16 => half::bf16::from_le_bytes([e[0], e[1]]).to_f32(),
        DType::F16 => half::f16::from_le_bytes([e[0], e[1]]).to_f32(),
        _ => f32::from_le_bytes([e[0], e[1], e[2], e[3]]),
    };
    match to {
        DType::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
        DType::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
        _ => x.to_le_bytes().to_vec(),
    }
}

/// The bytes tensor `dst` must hold on tp rank `t` (bf16, f16 and f32 destinations of another
/// dtype than the training one cast element by element).
pub fn expected(
    w: &LogicalWeights,
    g: Geometry,
    dst: &DstTensor,
    t: usize,
) -> Result<Vec<u8>, String> {
    if let Some(weight) = dst.name.strip_suffix("_scale_inv") {
        let mut out = Vec::new();
        for p in parts(w, g, weight, t)? {
            out.extend(fp8(&p)?.1);
        }
        return Ok(out);
    }
    let parts = parts(w, g, &dst.name, t)?;
    match dst.dtype {
        DType::F8E4M3 => {
            let mut out = Vec::new();
            for p in &parts {
                out.extend(fp8(p)?.0);
            }
            Ok(out)
        }
        dt if dt == parts[0].dtype => Ok(concat_rows(&parts).bytes),
        dt => {
            let from = parts[0].dtype;
            let whole = concat_rows(&parts);
            Ok(whole
                .bytes
                .chunks_exact(from.size())
                .flat_map(|e| cast_element(e, from, dt))
                .collect())
        }
    }
}
