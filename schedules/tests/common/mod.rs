//! Shared test harness: small models, a full random model, a reference executor of routing
//! tables, and an independent builder of every inference tensor (slicing and fusing the full
//! tensors directly, without the planner's layout code).
#![allow(dead_code)]

use std::collections::HashMap;

use weightsync_common::DType;
use weightsync_schedules::TrainerSlice;
use weightsync_schedules::layout_infer::InferFormat;
use weightsync_schedules::table::{
    FP8_BLOCK, RolloutPlan, RoutingTable, Source, Task, TrainerPlan, Transform, WriteTarget,
};
use weightsync_schedules::{ExpertForm, InferDType, InferSpec, Model};

/// Dense Qwen3-like: GQA (4 q heads, 2 kv heads of 128), q/k norms.
pub const DENSE: &str = r#"{"model_type":"qwen3","hidden_size":256,"intermediate_size":512,
 "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":128,
 "vocab_size":300,"tie_word_embeddings":false}"#;
/// Qwen2-like with biases and MQA (one kv head of 64).
pub const QWEN2_MQA: &str = r#"{"model_type":"qwen2","hidden_size":256,"intermediate_size":512,
 "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":1,"head_dim":64,
 "vocab_size":301,"tie_word_embeddings":true}"#;
/// Qwen3-MoE-like: layer 0 dense, layer 1 with 4 experts.
pub const MOE: &str = r#"{"model_type":"qwen3_moe","hidden_size":256,"intermediate_size":512,
 "moe_intermediate_size":256,"num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":1,
 "mlp_only_layers":[0],"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
 "head_dim":128,"vocab_size":300}"#;
/// Qwen3-MoE-like with experts 192 wide (not a multiple of the 128 fp8 block): layer 0 dense,
/// layer 1 with 4 experts.
pub const MOE_I192: &str = r#"{"model_type":"qwen3_moe","hidden_size":256,"intermediate_size":512,
 "moe_intermediate_size":192,"num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":1,
 "mlp_only_layers":[0],"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
 "head_dim":128,"vocab_size":300}"#;
/// DeepSeek-V3-like: MLA, first layer dense, shared + 4 routed experts, score bias.
pub const MLA: &str = r#"{"model_type":"deepseek_v3","hidden_size":256,"intermediate_size":512,
 "moe_intermediate_size":256,"n_routed_experts":4,"n_shared_experts":1,"first_k_dense_replace":1,
 "num_experts_per_tok":2,"topk_method":"noaux_tc","num_hidden_layers":2,"num_attention_heads":4,
 "num_key_value_heads":4,"q_lora_rank":256,"kv_lora_rank":128,"qk_nope_head_dim":128,
 "qk_rope_head_dim":64,"v_head_dim":128,"vocab_size":300}"#;

pub fn model(json: &str, experts: ExpertForm) -> Model {
    Model::from_config_json("small", json, experts).unwrap()
}

/// A splitmix-style hash: deterministic pseudo-random values.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e3779b97f4a7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d049bb133111eb);
    x ^ (x >> 31)
}

pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

pub fn f32_to_bf16(x: f32) -> u16 {
    // Round to nearest even (inputs here are finite).
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn f16_to_f32(h: u16) -> f32 {
    let s = ((h >> 15) as u32) << 31;
    let e = ((h >> 10) & 0x1f) as i32;
    let m = (h & 0x3ff) as u32;
    let v = if e == 0 {
        (m as f32) * 2f32.powi(-24)
    } else if e == 31 {
        f32::INFINITY
    } else {
        (1.0 + m as f32 / 1024.0) * 2f32.powi(e - 15)
    };
    f32::from_bits(v.to_bits() | s)
}

/// The element at `i` of a raw buffer as f32.
pub fn get(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    match dtype {
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::F16 => f16_to_f32(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])),
        DType::F32 => f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().unwrap()),
        DType::F8E4M3 => e4m3_decode(bytes[i]),
    }
}

/// Full random model: every parameter's bytes in its dtype. Values in about [-2, 2] with some
/// exact zeros and some large outliers, so blocks differ in scale.
pub fn random_model(m: &Model, seed: u64) -> Vec<Vec<u8>> {
    m.params
        .iter()
        .enumerate()
        .map(|(p, param)| {
            let n = param.shape.numel() as usize;
            let mut out = Vec::with_capacity(n * param.dtype.size());
            for i in 0..n {
                let h = mix(seed ^ ((p as u64) << 40) ^ i as u64);
                let mut x = ((h >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32;
                if h.is_multiple_of(97) {
                    x = 0.0;
                }
                if h.is_multiple_of(1013) {
                    x *= 300.0;
                }
                match param.dtype {
                    DType::BF16 => out.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
                    DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
                    other => panic!("test models are bf16/f32, not {other}"),
                }
            }
            out
        })
        .collect()
}

/// float8 e4m3fn decode.
pub fn e4m3_decode(c: u8) -> f32 {
    let s = if c & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((c >> 3) & 0xf) as i32;
    let m = (c & 7) as f32;
    if e == 15 && (c & 7) == 7 {
        return f32::NAN;
    }
    let v = if e == 0 {
        m / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    s * v
}

/// float8 e4m3fn encode, round to nearest even, saturating at 448 (448 = code 0x7e; 0x7f is
/// NaN). A plain arithmetic reference: subnormals are multiples of 2^-9, normals have 3
/// mantissa bits.
pub fn e4m3_encode(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormal (q = 8 rounds up to the smallest normal, code 8).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut e = ((a.to_bits() >> 23) & 0xff) as i32 - 127;
    let m = a / 2f32.powi(e);
    let mut mant = ((m - 1.0) * 8.0).round_ties_even() as i32;
    if mant == 8 {
        mant = 0;
        e += 1;
    }
    let code = (((e + 7) << 3) | mant).min(0x7e);
    sign | code as u8
}

/// Quantises a row-major `[lead..., rows, cols]` array per 128x128 block of the last two dims:
/// (fp8 values, f32 scales `[lead..., ceil(rows/128), ceil(cols/128)]`). Test convention:
/// scale = amax / 448, or 1 for an all-zero block.
pub fn quantise(vals: &[f32], dims: &[u32]) -> (Vec<u8>, Vec<f32>) {
    let n = dims.len();
    let (rows, cols) = (dims[n - 2] as usize, dims[n - 1] as usize);
    let lead: usize = dims[..n - 2].iter().map(|&d| d as usize).product();
    let b = FP8_BLOCK as usize;
    let (br, bc) = (rows.div_ceil(b), cols.div_ceil(b));
    let mut q = vec![0u8; vals.len()];
    let mut scales = vec![0f32; lead * br * bc];
    for l in 0..lead {
        let base = l * rows * cols;
        for i in 0..br {
            for j in 0..bc {
                let mut amax = 0f32;
                for r in i * b..((i + 1) * b).min(rows) {
                    for c in j * b..((j + 1) * b).min(cols) {
                        amax = amax.max(vals[base + r * cols + c].abs());
                    }
                }
                let s = if amax == 0.0 { 1.0 } else { amax / 448.0 };
                scales[(l * br + i) * bc + j] = s;
                for r in i * b..((i + 1) * b).min(rows) {
                    for c in j * b..((j + 1) * b).min(cols) {
                        q[base + r * cols + c] = e4m3_encode(vals[base + r * cols + c] / s);
                    }
                }
            }
        }
    }
    (q, scales)
}

/// Reads box `(start, len)` out of a dense row-major tensor of `dims` with `elem`-byte
/// elements.
pub fn read_box(src: &[u8], dims: &[u32], start: &[u32], len: &[u32], elem: usize) -> Vec<u8> {
    let n = dims.len();
    let total: usize = len.iter().map(|&l| l as usize).product();
    let mut out = Vec::with_capacity(total * elem);
    if total == 0 {
        return out;
    }
    // Innermost rows are contiguous: copy them whole.
    let row = len[n - 1] as usize * elem;
    let mut idx = vec![0u32; n];
    loop {
        let mut off = 0usize;
        for d in 0..n {
            off = off * dims[d] as usize + (start[d] + idx[d]) as usize;
        }
        out.extend_from_slice(&src[off * elem..off * elem + row]);
        let mut d = n - 1;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < len[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// What executing a table produced.
pub struct Landed {
    /// Per inference rank, MR 0 bytes.
    pub arenas: Vec<Vec<u8>>,
    /// Per inference rank, every write as (offset, len).
    pub coverage: Vec<Vec<(u64, u64)>>,
    /// Per inference rank, writes received on unit 0.
    pub received: Vec<u64>,
}

/// Every trainer's explicit plan, as a worker gets it: its slice, through bincode, expanded.
pub fn plans(table: &RoutingTable) -> Vec<TrainerPlan> {
    (0..table.trainers.len() as u32)
        .map(|r| {
            let bytes = table.slice(r).unwrap().to_bincode();
            TrainerSlice::from_bincode(&bytes)
                .unwrap()
                .expand()
                .unwrap()
        })
        .collect()
}

/// Every rollout's plan.
pub fn rollouts(table: &RoutingTable) -> Vec<RolloutPlan> {
    table.rollout_plans().collect()
}

/// Executes a table with plain reference code: fills each trainer's source arena from the full
/// model, runs every mesh group (gather sends of all trainers, check the gather counts, then
/// all other tasks), prepares with the reference cast / fp8, and performs the writes.
pub fn execute(table: &RoutingTable, model: &Model, full: &[Vec<u8>]) -> Landed {
    let trainers = plans(table);
    let nt = trainers.len();
    let mut ex = Execution {
        sources: trainers
            .iter()
            .map(|t| source_arena(t, model, full))
            .collect(),
        gathers: trainers
            .iter()
            .map(|t| vec![0u8; t.gather_arena_bytes as usize])
            .collect(),
        landed: Landed {
            arenas: rollouts(table)
                .iter()
                .map(|r| vec![0u8; r.mr_bytes[0] as usize])
                .collect(),
            coverage: vec![Vec::new(); table.rollouts.len()],
            received: vec![0u64; table.rollouts.len()],
        },
        gather_rx: vec![0u32; nt],
    };
    let ngroups = trainers[0].groups.len();
    for gi in 0..ngroups {
        ex.gather_rx.fill(0);
        for phase in 0..2 {
            for t in &trainers {
                let g = &t.groups[gi];
                let tasks = t.group_tasks(g);
                let (a, b) = if phase == 0 {
                    (0, g.gather_sends as usize)
                } else {
                    assert_eq!(
                        ex.gather_rx[t.rank as usize], g.gather_expect,
                        "trainer {} group {}",
                        t.rank, g.id
                    );
                    (g.gather_sends as usize, tasks.len())
                };
                for (k, task) in tasks[a..b].iter().enumerate() {
                    let k = a + k;
                    if k >= (g.gather_sends + g.local_tasks) as usize {
                        assert!(matches!(task.source, Source::Gather { .. }));
                    } else {
                        assert!(matches!(task.source, Source::Shard { .. }));
                    }
                    ex.run_task(t, g.id, phase, task);
                }
            }
        }
    }
    ex.landed
}

/// A trainer's source arena: each of its shards read from the full model at its offset.
fn source_arena(t: &TrainerPlan, model: &Model, full: &[Vec<u8>]) -> Vec<u8> {
    let mut arena = vec![0u8; t.source_arena_bytes as usize];
    for s in &t.shards {
        let p = &model.params[t.params[s.param as usize].id as usize];
        assert_eq!(s.dtype, p.dtype);
        let bytes = read_box(
            &full[t.params[s.param as usize].id as usize],
            p.shape.dims(),
            &s.global.start[..s.global.ndim as usize],
            &s.global.len[..s.global.ndim as usize],
            p.dtype.size(),
        );
        arena[s.offset as usize..s.offset as usize + bytes.len()].copy_from_slice(&bytes);
    }
    arena
}

/// The memory of a reference execution.
struct Execution {
    /// Per trainer, its source arena.
    sources: Vec<Vec<u8>>,
    /// Per trainer, its gather arena.
    gathers: Vec<Vec<u8>>,
    landed: Landed,
    /// Per trainer, gather writes received in the current group.
    gather_rx: Vec<u32>,
}

impl Execution {
    /// Reads, prepares and writes one task of trainer `t` in group `unit` (phase 0: gather
    /// sends; phase 1: the rest).
    fn run_task(&mut self, t: &TrainerPlan, unit: u16, phase: u32, task: &Task) {
        let input = self.task_input(t, task);
        let prepared = prepare(&input, task.transform, task.region.len, task.region.ndim);
        assert_eq!(prepared.len() as u64, task.prepared_bytes());
        for w in t.task_writes(task) {
            let src = &prepared[w.src_offset as usize..(w.src_offset + w.len as u64) as usize];
            let d = w.dst_offset as usize;
            match w.dst {
                WriteTarget::Rollout(r) => {
                    assert_eq!(w.unit, 0);
                    let l = &mut self.landed;
                    l.arenas[r as usize][d..d + src.len()].copy_from_slice(src);
                    l.coverage[r as usize].push((w.dst_offset, w.len as u64));
                    l.received[r as usize] += 1;
                }
                WriteTarget::Trainer(o) => {
                    assert_eq!(phase, 0, "only gather sends write to trainers");
                    assert_eq!(w.unit, unit);
                    self.gathers[o as usize][d..d + src.len()].copy_from_slice(src);
                    self.gather_rx[o as usize] += 1;
                }
            }
        }
    }

    /// What a task reads: its region of its shard, or its dense gathered region in the
    /// transform's input dtype.
    fn task_input(&self, t: &TrainerPlan, task: &Task) -> Vec<u8> {
        match task.source {
            Source::Shard { shard } => {
                let s = &t.shards[shard as usize];
                assert!(s.global.contains(&task.region), "region outside its shard");
                let sub = task.region.relative_to(&s.global);
                let arena = &self.sources[t.rank as usize]
                    [s.offset as usize..(s.offset + s.bytes()) as usize];
                read_box(
                    arena,
                    &s.global.len[..s.global.ndim as usize],
                    &sub.start[..sub.ndim as usize],
                    &sub.len[..sub.ndim as usize],
                    s.dtype.size(),
                )
            }
            Source::Gather { offset } => {
                let n = task.region.numel() as usize
                    * match task.transform {
                        Transform::Copy { dtype } => dtype.size(),
                        Transform::Cast { from, .. } | Transform::Fp8Block { from, .. } => {
                            from.size()
                        }
                    };
                self.gathers[t.rank as usize][offset as usize..offset as usize + n].to_vec()
            }
        }
    }
}

/// Applies a transform to a dense row-major input box.
fn prepare(
    input: &[u8],
    tr: Transform,
    len: [u32; weightsync_schedules::table::MAX_DIMS],
    ndim: u8,
) -> Vec<u8> {
    let dims = &len[..ndim as usize];
    match tr {
        Transform::Copy { .. } => input.to_vec(),
        Transform::Cast { from, to } => {
            let n = input.len() / from.size();
            let mut out = Vec::with_capacity(n * to.size());
            for i in 0..n {
                let x = get(input, from, i);
                match to {
                    DType::BF16 => out.extend_from_slice(&f32_to_bf16(x).to_le_bytes()),
                    DType::F32 => out.extend_from_slice(&x.to_le_bytes()),
                    other => panic!("reference cast to {other} not needed"),
                }
            }
            out
        }
        Transform::Fp8Block { from, .. } => {
            let n = input.len() / from.size();
            let vals: Vec<f32> = (0..n).map(|i| get(input, from, i)).collect();
            let (q, s) = quantise(&vals, dims);
            // Values, then the scales at the next 16-byte boundary.
            let mut out = q;
            out.resize(n.div_ceil(16) * 16, 0);
            for x in s {
                out.extend_from_slice(&x.to_le_bytes());
            }
            out
        }
    }
}

/// Every destination byte written exactly once, nothing outside tensors, expected counts met:
/// the sorted writes of each rank must tile its tensors exactly.
pub fn check_coverage(table: &RoutingTable, landed: &Landed) {
    for (r, plan) in rollouts(table).iter().enumerate() {
        let mut writes = landed.coverage[r].clone();
        writes.sort_unstable();
        let mut tensors: Vec<_> = plan.tensors.iter().collect();
        tensors.sort_by_key(|t| t.offset);
        let mut w = 0usize;
        for t in tensors {
            let mut pos = t.offset;
            while pos < t.offset + t.len {
                let (o, l) = *writes.get(w).unwrap_or_else(|| {
                    panic!(
                        "rank {r} tensor {} unwritten from byte {}",
                        t.name,
                        pos - t.offset
                    )
                });
                assert_eq!(
                    o,
                    pos,
                    "rank {r} tensor {}: byte {} {}",
                    t.name,
                    pos - t.offset,
                    if o < pos {
                        "written twice"
                    } else {
                        "never written"
                    }
                );
                pos += l;
                w += 1;
            }
            assert_eq!(
                pos,
                t.offset + t.len,
                "rank {r}: a write runs past tensor {}",
                t.name
            );
        }
        assert_eq!(w, writes.len(), "rank {r}: writes outside every tensor");
        assert_eq!(
            landed.received[r], plan.expect[0].writes,
            "rank {r} immediates"
        );
    }
}

/// Independent construction of the inference tensors: the engine format re-derived here from
/// the full tensors by slicing and fusing (not by the planner's layout code). In the fused
/// format fp8 blocks are those of the training tensor (sliced); in hf each destination matrix
/// is quantised as one block grid of its own, as transformers holds it.
pub struct Expected<'a> {
    pub model: &'a Model,
    pub full: &'a [Vec<u8>],
    pub tp: u32,
    pub ep: u32,
    pub fp8: bool,
    /// transformers' tensors (`format=hf`).
    pub hf: bool,
    by_name: HashMap<String, usize>,
    quant_cache: HashMap<usize, (Vec<u8>, Vec<f32>)>,
}

/// A slice of a parameter's 2-D matrix (expert `e` of a stacked 3-D tensor if given).
#[derive(Clone)]
struct Part {
    param: String,
    expert: Option<u32>,
    rows: (u32, u32),
    cols: Option<(u32, u32)>,
}

impl Part {
    /// Rows `rows` of parameter `param`, every column.
    fn rows(param: String, rows: (u32, u32)) -> Part {
        Part {
            param,
            expert: None,
            rows,
            cols: None,
        }
    }
}

impl<'a> Expected<'a> {
    pub fn new(model: &'a Model, full: &'a [Vec<u8>], spec: &InferSpec) -> Self {
        let by_name = model
            .params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.to_string(), i))
            .collect();
        Expected {
            model,
            full,
            tp: spec.tp,
            ep: spec.ep,
            fp8: spec.dtype == InferDType::Fp8,
            hf: spec.format == InferFormat::Hf,
            by_name,
            quant_cache: HashMap::new(),
        }
    }

    fn pid(&self, name: &str) -> usize {
        *self
            .by_name
            .get(name)
            .unwrap_or_else(|| panic!("no param {name}"))
    }

    /// The 2-D matrix view (rows, cols) of a part's parameter.
    fn matrix_dims(&self, p: &Part) -> (u32, u32) {
        let s = self.model.params[self.pid(&p.param)].shape;
        match s.ndim {
            1 => (s.dims[0], 1),
            2 => (s.dims[0], s.dims[1]),
            3 => (s.dims[1], s.dims[2]),
            _ => unreachable!(),
        }
    }

    fn elem_f32(&self, pid: usize, i: usize) -> f32 {
        get(&self.full[pid], self.model.params[pid].dtype, i)
    }

    /// Raw bytes of a part (no quantisation), row-major.
    fn raw(&self, p: &Part) -> Vec<u8> {
        let pid = self.pid(&p.param);
        let param = &self.model.params[pid];
        let es = param.dtype.size();
        let (rows, cols) = self.matrix_dims(p);
        let base = p.expert.map_or(0, |e| (e * rows * cols) as usize);
        let (c0, c1) = p.cols.unwrap_or((0, cols));
        let mut out = Vec::new();
        for r in p.rows.0..p.rows.1 {
            let a = base + (r * cols + c0) as usize;
            let b = base + (r * cols + c1) as usize;
            out.extend_from_slice(&self.full[pid][a * es..b * es]);
        }
        out
    }

    /// fp8 values and scales of a part, from quantising the whole logical matrix per block.
    fn quant(&mut self, p: &Part) -> (Vec<u8>, Vec<u8>) {
        let pid = self.pid(&p.param);
        let (rows, cols) = self.matrix_dims(p);
        if !self.quant_cache.contains_key(&pid) {
            let param = &self.model.params[pid];
            let n = param.shape.numel() as usize;
            let vals: Vec<f32> = (0..n).map(|i| self.elem_f32(pid, i)).collect();
            let q = quantise(&vals, param.shape.dims());
            self.quant_cache.insert(pid, q);
        }
        let (q, s) = &self.quant_cache[&pid];
        let b = FP8_BLOCK;
        let (br, bc) = (rows.div_ceil(b), cols.div_ceil(b));
        let e = p.expert.unwrap_or(0);
        let (c0, c1) = p.cols.unwrap_or((0, cols));
        let mut vals = Vec::new();
        for r in p.rows.0..p.rows.1 {
            let base = (e * rows * cols + r * cols) as usize;
            vals.extend_from_slice(&q[base + c0 as usize..base + c1 as usize]);
        }
        let mut sc = Vec::new();
        for i in p.rows.0 / b..p.rows.1.div_ceil(b) {
            for j in c0 / b..c1.div_ceil(b) {
                sc.extend_from_slice(&s[((e * br + i) * bc + j) as usize].to_le_bytes());
            }
        }
        let _ = br;
        (vals, sc)
    }

    /// Parts of an engine tensor (per leading expert index, outer vec) and whether quantised.
    fn parts(&self, name: &str, local: u32) -> (Vec<Vec<Part>>, bool) {
        let t = local % self.tp;
        let whole = |p: Part| vec![vec![p]];
        if name == "model.embed_tokens.weight" && self.hf {
            // transformers' tp plan does not split the embedding.
            return (whole(self.full_part(name)), false);
        }
        if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
            return (whole(self.vocab_part(name, t)), false);
        }
        if name == "model.norm.weight" {
            return (whole(self.full_part(name)), false);
        }
        let rest = name.strip_prefix("model.layers.").unwrap();
        let (l, what) = rest.split_once('.').unwrap();
        let pre = format!("model.layers.{l}.");
        let q8 = self.fp8;
        match what {
            "input_layernorm.weight"
            | "post_attention_layernorm.weight"
            | "self_attn.q_norm.weight"
            | "self_attn.k_norm.weight"
            | "self_attn.q_a_layernorm.weight"
            | "self_attn.kv_a_layernorm.weight"
            | "mlp.gate.weight"
            | "mlp.gate.e_score_correction_bias" => (whole(self.full_part(name)), false),
            "self_attn.q_a_proj.weight" | "self_attn.kv_a_proj_with_mqa.weight" => {
                (whole(self.full_part(name)), q8)
            }
            "self_attn.q_b_proj.weight"
            | "self_attn.kv_b_proj.weight"
            | "self_attn.q_proj.weight"
            | "mlp.gate_proj.weight"
            | "mlp.up_proj.weight"
            | "mlp.shared_experts.gate_proj.weight"
            | "mlp.shared_experts.up_proj.weight" => {
                (whole(self.row_split(name.to_string(), t)), q8)
            }
            "self_attn.q_proj.bias" => (whole(self.row_split(name.to_string(), t)), false),
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
                let (_, kind) = what.split_once('.').unwrap();
                (whole(self.kv_part(&pre, kind, t)), q8)
            }
            "self_attn.k_proj.bias" | "self_attn.v_proj.bias" => {
                let (_, kind) = what.split_once('.').unwrap();
                (whole(self.kv_part(&pre, kind, t)), false)
            }
            "self_attn.o_proj.weight" => (whole(self.col_split(name.to_string(), t)), q8),
            "self_attn.qkv_proj.weight" => (vec![self.qkv_parts(&pre, "weight", t)], q8),
            "self_attn.qkv_proj.bias" => (vec![self.qkv_parts(&pre, "bias", t)], false),
            "mlp.gate_up_proj.weight" | "mlp.shared_experts.gate_up_proj.weight" => {
                let p = what.strip_suffix("gate_up_proj.weight").unwrap();
                let gate = self.row_split(format!("{pre}{p}gate_proj.weight"), t);
                let up = self.row_split(format!("{pre}{p}up_proj.weight"), t);
                (vec![vec![gate, up]], q8)
            }
            "mlp.down_proj.weight" | "mlp.shared_experts.down_proj.weight" => {
                (whole(self.col_split(name.to_string(), t)), q8)
            }
            "mlp.experts.w13_weight" | "mlp.experts.w2_weight" if !self.hf => {
                let w13 = what == "mlp.experts.w13_weight";
                (self.routed_expert_parts(&pre, w13, local), q8)
            }
            "mlp.experts.gate_up_proj" | "mlp.experts.down_proj" if self.hf => {
                let gate_up = what == "mlp.experts.gate_up_proj";
                (self.routed_expert_parts(&pre, gate_up, local), q8)
            }
            other => panic!("expected-builder does not know tensor {other}"),
        }
    }

    /// (rows, cols) of a parameter, 1-D ones as one column.
    fn dims(&self, name: &str) -> (u32, u32) {
        let s = self.model.params[self.pid(name)].shape;
        (s.dims[0], if s.ndim > 1 { s.dims[1] } else { 1 })
    }

    /// A whole parameter.
    fn full_part(&self, name: &str) -> Part {
        let (r, _) = self.dims(name);
        Part::rows(name.to_string(), (0, r))
    }

    /// Tp rank `t`'s rows of a vocab-parallel parameter: `ceil(V/tp)` each, the last short.
    fn vocab_part(&self, name: &str, t: u32) -> Part {
        let vocab = self.model.config.vocab;
        let ch = vocab.div_ceil(self.tp);
        let s = (t * ch).min(vocab);
        let e = ((t + 1) * ch).min(vocab);
        Part::rows(name.to_string(), (s, e))
    }

    /// Tp rank `t`'s share of the rows.
    fn row_split(&self, name: String, t: u32) -> Part {
        let (r, _) = self.dims(&name);
        let k = r / self.tp;
        Part::rows(name, (t * k, (t + 1) * k))
    }

    /// Tp rank `t`'s share of the columns.
    fn col_split(&self, name: String, t: u32) -> Part {
        let (r, cc) = self.dims(&name);
        let k = cc / self.tp;
        Part {
            cols: Some((t * k, (t + 1) * k)),
            ..Part::rows(name, (0, r))
        }
    }

    /// q rows of tp rank `t`, then its kv head's k and v rows (its share of the kv heads, or
    /// the one it replicates when tp exceeds them), of `q_proj.{suffix}` etc.
    fn qkv_parts(&self, pre: &str, suffix: &str, t: u32) -> Vec<Part> {
        let q = self.row_split(format!("{pre}self_attn.q_proj.{suffix}"), t);
        let k = self.kv_part(pre, &format!("k_proj.{suffix}"), t);
        let v = self.kv_part(pre, &format!("v_proj.{suffix}"), t);
        vec![q, k, v]
    }

    /// Tp rank `t`'s rows of `self_attn.{what}` (`k_proj.weight`, `v_proj.bias`, ...): its
    /// share of the kv heads, or the one it replicates when tp exceeds them.
    fn kv_part(&self, pre: &str, what: &str, t: u32) -> Part {
        let c = &self.model.config;
        let (tp, d) = (self.tp, c.head_dim);
        let kvh = if tp <= c.kv_heads {
            let per = c.kv_heads / tp;
            (t * per * d, (t + 1) * per * d)
        } else {
            let h = t / (tp / c.kv_heads);
            (h * d, (h + 1) * d)
        };
        Part::rows(format!("{pre}self_attn.{what}"), kvh)
    }

    /// Per local expert of engine rank `local`: its gate and up rows (`w13`) or its down
    /// columns, whole experts with ep > 1, the tp share of every expert otherwise.
    fn routed_expert_parts(&self, pre: &str, w13: bool, local: u32) -> Vec<Vec<Part>> {
        let c = &self.model.config;
        let m = c.moe.as_ref().unwrap();
        let (e0, el, i0, il) = if self.ep > 1 {
            let el = m.experts / self.ep;
            (local * el, el, 0, m.intermediate)
        } else {
            let il = m.intermediate / self.tp;
            (0, m.experts, (local % self.tp) * il, il)
        };
        let form = self.model.experts;
        // Packed gate_up of transformers: up rows start at I.
        let up_at = if form == ExpertForm::StackedGateUp {
            m.intermediate
        } else {
            0
        };
        let mk = |e: u32, proj: &str, down: bool| {
            let (param, expert) = match form {
                ExpertForm::Stacked => (format!("{pre}mlp.experts.{proj}.weight"), Some(e)),
                ExpertForm::StackedGateUp => {
                    let packed = if down { "down_proj" } else { "gate_up_proj" };
                    (format!("{pre}mlp.experts.{packed}"), Some(e))
                }
                ExpertForm::PerExpert => (format!("{pre}mlp.experts.{e}.{proj}.weight"), None),
            };
            if down {
                Part {
                    param,
                    expert,
                    rows: (0, c.hidden),
                    cols: Some((i0, i0 + il)),
                }
            } else {
                let at = if proj == "up_proj" { up_at } else { 0 };
                Part {
                    param,
                    expert,
                    rows: (at + i0, at + i0 + il),
                    cols: None,
                }
            }
        };
        (e0..e0 + el)
            .map(|e| {
                if w13 {
                    vec![mk(e, "gate_proj", false), mk(e, "up_proj", false)]
                } else {
                    vec![mk(e, "down_proj", true)]
                }
            })
            .collect()
    }

    /// The expected bytes of an engine tensor (`..._scale_inv` gives the scales).
    pub fn tensor(&mut self, name: &str, local: u32) -> Vec<u8> {
        let (base, scales) = match name.strip_suffix("_scale_inv") {
            Some(b) => (b, true),
            None => (name, false),
        };
        let (lead, quantised) = self.parts(base, local);
        assert!(
            !scales || quantised,
            "{name}: scales of an unquantised tensor"
        );
        let mut out = Vec::new();
        for parts in &lead {
            if quantised && self.hf {
                // transformers: the destination matrix (parts stacked by rows) on its own grid.
                let (v, s) = self.quant_own_grid(parts);
                out.extend(if scales { s } else { v });
                continue;
            }
            for p in parts {
                if quantised {
                    let (v, s) = self.quant(p);
                    out.extend(if scales { s } else { v });
                } else {
                    out.extend(self.raw(p));
                }
            }
        }
        out
    }

    /// fp8 values and scales of the matrix made of `parts` stacked by rows (equal widths),
    /// quantised per 128x128 block of that matrix itself.
    fn quant_own_grid(&self, parts: &[Part]) -> (Vec<u8>, Vec<u8>) {
        let mut vals = Vec::new();
        let mut rows = 0u32;
        let mut width = None;
        for p in parts {
            let pid = self.pid(&p.param);
            let dtype = self.model.params[pid].dtype;
            let raw = self.raw(p);
            let (c0, c1) = p.cols.unwrap_or((0, self.matrix_dims(p).1));
            assert!(width.is_none_or(|w| w == c1 - c0), "parts of unequal width");
            width = Some(c1 - c0);
            rows += p.rows.1 - p.rows.0;
            vals.extend((0..raw.len() / dtype.size()).map(|i| get(&raw, dtype, i)));
        }
        let (q, s) = quantise(&vals, &[rows, width.unwrap_or(0)]);
        (q, s.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Builds every inference rank's tensors independently and compares with what landed.
pub fn compare_all(table: &RoutingTable, landed: &Landed, exp: &mut Expected) -> usize {
    let mut checked = 0;
    for (r, plan) in rollouts(table).iter().enumerate() {
        for t in &plan.tensors {
            let want = exp.tensor(&t.name, plan.local_rank);
            assert_eq!(want.len() as u64, t.len, "rank {r} tensor {} size", t.name);
            let got = &landed.arenas[r][t.offset as usize..(t.offset + t.len) as usize];
            if got != want.as_slice() {
                let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap();
                panic!("rank {r} tensor {} differs first at byte {i}", t.name);
            }
            checked += 1;
        }
    }
    checked
}

#[test]
fn e4m3_reference_rounds_and_saturates() {
    assert_eq!(e4m3_encode(0.0), 0);
    assert_eq!(e4m3_encode(448.0), 0x7e);
    assert_eq!(e4m3_encode(1e9), 0x7e);
    assert_eq!(e4m3_encode(-448.0), 0xfe);
    assert_eq!(e4m3_encode(1.0), 0x38);
    assert_eq!(e4m3_encode(2f32.powi(-9)), 1);
    assert_eq!(e4m3_encode(1.0625), 0x38); // tie between 1.0 and 1.125 -> even mantissa
    assert_eq!(e4m3_encode(1.1875), 0x3a); // tie between 1.125 and 1.25 -> even
    for c in 0..0x7fu8 {
        assert_eq!(e4m3_encode(e4m3_decode(c)), c);
    }
}
