//! The training layout: for every training rank, which box of each parameter it holds and at
//! which byte offset of its source arena.
//!
//! A layout is plain data ([`TrainingLayout`]: a list of [`ShardSpec`]), so any trainer's real
//! layout can be described and checked. [`TrainSpec`] builds the common ones from a string such
//! as `pp=2,ep=8,fsdp=16`.
//!
//! # Exact semantics of a [`TrainSpec`]
//! Keys (all default 1): `pp` pipeline stages, `dp` HSDP replica groups, `ep` expert
//! parallelism, `fsdp` FSDP shard degree, `tp` tensor parallelism; plus `experts=` for how
//! routed experts are parameters ([`ExpertForm`]):
//! - `per-expert` (default): `mlp.experts.{e}.{gate,up,down}_proj.weight`, 2-D each (Hugging
//!   Face checkpoints; FSDP of per-expert modules);
//! - `stacked`: `mlp.experts.{gate,up,down}_proj.weight`, `[E, I, H]` / `[E, H, I]`
//!   (grouped-GEMM trainers);
//! - `stacked-gate-up` (alias `transformers`): `mlp.experts.gate_up_proj` `[E, 2I, H]` (per
//!   expert gate rows then up rows) and `mlp.experts.down_proj` `[E, H, I]`, exactly what
//!   `named_parameters()` of a transformers 5.x Qwen3-MoE / DeepSeek-V3 gives; with `fsdp=N`
//!   (and nothing else) every rank's shard is then what FSDP2 `fully_shard` leaves it of that
//!   model's parameters (torch.chunk on dim 0). Training `tp` must be 1 with it: transformers'
//!   own `packed_colwise` split gives a rank its gate rows and its up rows, two boxes per
//!   expert, which one shard cannot describe.
//!
//! And `dtype=` (bf16, f16 or f32) for the dtype the job holds its shards in, where that is not
//! the model's (`torch_dtype`): FSDP2 under mixed precision keeps its sharded parameters f32
//! and casts only what it gathers, so `fsdp=8,dtype=f32` is its layout for a bf16 model. It
//! applies to the parameters in the model's dtype; one the model keeps apart (an f32 router
//! bias) stays as it is. The planner then casts (or quantises from f32) what the engines take.
//!
//! World size `pp*dp*ep*fsdp*tp`; a rank's coordinates are, innermost last,
//! `rank = (((pp_i*dp + dp_i)*ep + ep_i)*fsdp + fsdp_i)*tp + tp_i`.
//!
//! 1. **Pipeline.** Decoder layer `l` of `L` lives on stage `s` where
//!    `s*L/pp <= l < (s+1)*L/pp` (integer division); the embedding is on stage 0, the final
//!    norm and lm_head on stage `pp-1`. Only the ranks of a stage hold its parameters.
//! 2. **Tensor parallelism** (Megatron): column-parallel tensors (q/k/v and their biases,
//!    q_b/kv_b, gate/up of MLPs, shared and routed experts, vocab-parallel embedding and
//!    lm_head) split dim 0 into `tp` equal parts (a stacked expert tensor: dim 1);
//!    row-parallel ones (o_proj, down projections) split dim 1 (stacked: dim 2); everything
//!    else (norms, q_a/kv_a, router) is replicated over tp. `tp` must divide what it splits
//!    (for q/k/v: the head counts), else an error names the tensor.
//! 3. **Expert parallelism.** Routed expert `e` of `E` belongs to ep group `e / (E/ep)`
//!    (`ep` must divide `E`); a stacked tensor's dim 0 (both stacked forms) is split into `ep`
//!    equal parts.
//! 4. **FSDP** (FSDP2 `Shard(0)`, torch.chunk semantics): the tp-local tensor is cut along
//!    dim 0 into chunks of `ceil(n/k)` rows; chunk `i` is rows `[i*c, min(n,(i+1)*c))`, so
//!    tails are short and trailing chunks may be empty. Routed experts are chunked over the
//!    `fsdp` ranks of their ep group (`k = fsdp`, coordinate `fsdp_i`); every other tensor is
//!    chunked over all `ep*fsdp` ranks of the stage (`k = ep*fsdp`, coordinate
//!    `ep_i*fsdp + fsdp_i`), as torchtitan does for non-expert parameters.
//! 5. **HSDP.** The `dp` replica groups hold identical shards: replicas the planner may choose
//!    from (as are tp ranks of replicated tensors).
//! 6. **Arena.** Each rank's shards are placed in parameter order, each at the next 256-byte
//!    aligned offset; empty shards take no space and are not listed.

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use weightsync_common::DType;

use crate::error::PlanError;
use crate::model::{ExpertForm, LayerKind, Model, Param, Proj, Role};
use crate::table::TensorBox;

/// Alignment of tensors in arenas.
pub const ARENA_ALIGN: u64 = 256;

/// Rounds `x` up to a multiple of [`ARENA_ALIGN`].
pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// One shard held by one training rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ShardSpec {
    /// Training rank.
    pub rank: u32,
    /// Parameter index in the model.
    pub param: u32,
    /// Box of the global tensor held (dense, row-major in the arena).
    pub global: TensorBox,
    /// Element type as stored.
    pub dtype: DType,
    /// Byte offset in the rank's source arena.
    pub offset: u64,
}

/// Every shard of every training rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrainingLayout {
    /// Number of training ranks.
    pub ranks: u32,
    /// All shards, sorted by (rank, offset).
    pub shards: Vec<ShardSpec>,
}

/// A structured training layout (see the module docs for exact semantics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TrainSpec {
    /// Pipeline stages.
    pub pp: u32,
    /// HSDP replica groups.
    pub dp: u32,
    /// Expert parallelism.
    pub ep: u32,
    /// FSDP shard degree.
    pub fsdp: u32,
    /// Tensor parallelism.
    pub tp: u32,
    /// How routed experts are parameters.
    pub experts: ExpertForm,
    /// The dtype the job holds its sharded parameters in, where it differs from the model's
    /// (`dtype=f32`: FSDP2's sharded parameters stay f32 under mixed precision, which casts
    /// only what it gathers); `None`: the model's. See [`TrainSpec::held_dtype`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DType>,
}

impl Default for TrainSpec {
    fn default() -> Self {
        TrainSpec {
            pp: 1,
            dp: 1,
            ep: 1,
            fsdp: 1,
            tp: 1,
            experts: ExpertForm::PerExpert,
            dtype: None,
        }
    }
}

/// Parses `key=value,key=value` with positive integer values into `(key, value)` pairs;
/// `words` are keys whose values are kept as text.
pub(crate) fn parse_kv(spec: &str) -> Result<Vec<(String, String)>, PlanError> {
    let bad = |reason: String| PlanError::BadSpec {
        spec: spec.to_string(),
        reason,
    };
    let mut out: Vec<(String, String)> = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part
            .split_once('=')
            .ok_or_else(|| bad(format!("{part:?} is not key=value")))?;
        let k = k.trim().to_ascii_lowercase();
        if out.iter().any(|(x, _)| *x == k) {
            return Err(bad(format!("{k} given twice")));
        }
        out.push((k, v.trim().to_string()));
    }
    Ok(out)
}

pub(crate) fn parse_degree(spec: &str, k: &str, v: &str) -> Result<u32, PlanError> {
    match v.parse::<u32>() {
        Ok(n) if n >= 1 => Ok(n),
        _ => Err(PlanError::BadSpec {
            spec: spec.to_string(),
            reason: format!("{k}={v:?} is not a positive integer"),
        }),
    }
}

impl std::str::FromStr for TrainSpec {
    type Err = PlanError;
    fn from_str(spec: &str) -> Result<TrainSpec, PlanError> {
        let mut t = TrainSpec::default();
        for (k, v) in parse_kv(spec)? {
            match k.as_str() {
                "pp" => t.pp = parse_degree(spec, &k, &v)?,
                "dp" | "hsdp" | "replicate" => t.dp = parse_degree(spec, &k, &v)?,
                "ep" => t.ep = parse_degree(spec, &k, &v)?,
                "fsdp" | "shard" => t.fsdp = parse_degree(spec, &k, &v)?,
                "tp" => t.tp = parse_degree(spec, &k, &v)?,
                "experts" => {
                    t.experts = match v.to_ascii_lowercase().replace('_', "-").as_str() {
                        "stacked" => ExpertForm::Stacked,
                        "per-expert" => ExpertForm::PerExpert,
                        "stacked-gate-up" | "transformers" => ExpertForm::StackedGateUp,
                        _ => {
                            return Err(PlanError::BadSpec {
                                spec: spec.to_string(),
                                reason: format!(
                                    "experts={v:?}: expected per-expert, stacked or \
                                     stacked-gate-up (transformers' stacked experts)"
                                ),
                            });
                        }
                    }
                }
                "dtype" => t.dtype = Some(parse_held_dtype(spec, &v)?),
                _ => {
                    return Err(PlanError::BadSpec {
                        spec: spec.to_string(),
                        reason: format!(
                            "unknown key {k:?} (known: pp, dp, ep, fsdp, tp, experts, dtype)"
                        ),
                    });
                }
            }
        }
        t.world()?;
        Ok(t)
    }
}

impl std::fmt::Display for TrainSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pp={},dp={},ep={},fsdp={},tp={}",
            self.pp, self.dp, self.ep, self.fsdp, self.tp
        )?;
        if self.experts != ExpertForm::PerExpert {
            write!(f, ",experts={}", self.experts.spec_name())?;
        }
        if let Some(d) = self.dtype {
            write!(f, ",dtype={d}")?;
        }
        Ok(())
    }
}

/// `dtype=` of a training spec: a dtype a training job holds parameters in (bf16, f16, f32).
fn parse_held_dtype(spec: &str, v: &str) -> Result<DType, PlanError> {
    let bad = |reason: String| PlanError::BadSpec {
        spec: spec.to_string(),
        reason,
    };
    match v.parse::<DType>().map_err(|e| bad(format!("dtype: {e}")))? {
        DType::F8E4M3 => Err(bad(
            "dtype=fp8: training parameters are held in bf16, f16 or f32 (fp8 is an inference \
             format: dtype=fp8 of the inference layout)"
                .into(),
        )),
        d => Ok(d),
    }
}

/// torch.chunk along one dimension: the `i`-th of `k` chunks of `n` as `(start, len)`.
pub fn torch_chunk(n: u32, k: u32, i: u32) -> (u32, u32) {
    let c = n.div_ceil(k);
    let s = (i as u64 * c as u64).min(n as u64) as u32;
    let e = ((i as u64 + 1) * c as u64).min(n as u64) as u32;
    (s, e - s)
}

/// How tensor parallelism splits a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TpSplit {
    /// Replicated.
    None,
    /// Split along this dimension.
    Dim(usize),
}

/// The tp split of a role on the training side, and the divisor check (what unit must
/// divide evenly: heads for q/k/v).
pub(crate) fn train_tp_split(role: Role) -> TpSplit {
    use LayerKind as K;
    match role {
        Role::Embed | Role::LmHead => TpSplit::Dim(0),
        Role::FinalNorm | Role::Declared { .. } => TpSplit::None,
        Role::Layer { kind, .. } => match kind {
            K::Q | K::K | K::V | K::QBias | K::KBias | K::VBias | K::QB | K::KVB => TpSplit::Dim(0),
            K::O => TpSplit::Dim(1),
            K::Mlp(Proj::Down) | K::Shared(Proj::Down) => TpSplit::Dim(1),
            K::Mlp(_) | K::Shared(_) => TpSplit::Dim(0),
            K::Expert {
                proj: Proj::Down, ..
            } => TpSplit::Dim(1),
            K::Expert { .. } => TpSplit::Dim(0),
            K::Experts(Proj::Down) => TpSplit::Dim(2),
            K::Experts(_) | K::ExpertsGateUp => TpSplit::Dim(1),
            _ => TpSplit::None,
        },
    }
}

/// Most ranks one side of a job may have (training ranks; inference ranks over all engines):
/// a hundred times the largest jobs planned here (10,240 GPUs), and far below what would make
/// the per-rank lists of a layout exhaust memory.
pub const MAX_RANKS: u32 = 1 << 20;

impl TrainSpec {
    /// The dtype shards of `p` are held in: the spec's `dtype` for parameters in the model's
    /// own dtype, each parameter's own otherwise (an f32 router bias stays f32 in a bf16
    /// model, whatever the spec says of the rest).
    pub fn held_dtype(&self, model: &Model, p: &Param) -> DType {
        match self.dtype {
            Some(d) if p.dtype == model.config.dtype => d,
            _ => p.dtype,
        }
    }

    /// Number of training ranks (at most [`MAX_RANKS`]).
    pub fn world(&self) -> Result<u32, PlanError> {
        let world = [self.pp, self.dp, self.ep, self.fsdp, self.tp]
            .iter()
            .try_fold(1u64, |a, &b| a.checked_mul(u64::from(b)))
            .filter(|&w| w <= u64::from(MAX_RANKS))
            .ok_or_else(|| {
                PlanError::TooLarge(format!(
                    "training world of {self}: pp * dp * ep * fsdp * tp is more than the \
                     {MAX_RANKS} ranks a job may have"
                ))
            })?;
        Ok(world as u32)
    }

    /// The stage of a parameter.
    pub fn stage_of(&self, model: &Model, role: Role) -> u32 {
        let l = model.config.layers;
        match role {
            Role::Embed | Role::Declared { .. } => 0,
            Role::FinalNorm | Role::LmHead => self.pp - 1,
            Role::Layer { layer, .. } => {
                // Largest s with s*L/pp <= layer.
                (0..self.pp)
                    .rev()
                    .find(|&s| (s as u64 * l as u64 / self.pp as u64) <= layer as u64)
                    .unwrap_or(0)
            }
        }
    }
}

impl TrainingLayout {
    /// Builds the layout a [`TrainSpec`] describes (see the module docs).
    ///
    /// Rank by rank, in parallel: a rank holds a box of each parameter of its stage (of its ep
    /// group's experts), in parameter order, one after the other in its arena; the ranks'
    /// lists are then joined in rank order.
    pub fn build(model: &Model, spec: &TrainSpec) -> Result<TrainingLayout, PlanError> {
        if model.is_declared() {
            return Err(crate::declared_error::DeclaredError::LayoutFromSpec {
                side: "training layout",
                model: model.name.clone(),
            }
            .into());
        }
        let world = spec.world()?;
        check_spec_fits(model, spec)?;
        let per_stage = spec.dp * spec.ep * spec.fsdp * spec.tp;
        let shardings = model
            .params
            .iter()
            .map(|p| Sharding::of(model, spec, p))
            .collect::<Result<Vec<Sharding>, PlanError>>()?;
        // Per (stage, ep group): the params its ranks may hold, in order.
        let mut held: Vec<Vec<u32>> = vec![Vec::new(); (spec.pp * spec.ep) as usize];
        for (pid, (p, sharding)) in model.params.iter().zip(&shardings).enumerate() {
            let stage = spec.stage_of(model, p.role);
            for ep_i in 0..spec.ep {
                if sharding.expert_group.is_none_or(|g| g == ep_i) {
                    held[(stage * spec.ep + ep_i) as usize].push(pid as u32);
                }
            }
        }
        // A rank's place in the mesh, and its shards (in parameter order) with their arena
        // offsets, as `f(shard)`.
        let for_each_shard = |rank: u32, f: &mut dyn FnMut(ShardSpec)| {
            // rank = stage * per_stage + ((dp_i * ep + ep_i) * fsdp + fsdp_i) * tp + tp_i
            let (stage, within) = (rank / per_stage, rank % per_stage);
            let tp_i = within % spec.tp;
            let fsdp_i = within / spec.tp % spec.fsdp;
            let ep_i = within / (spec.tp * spec.fsdp) % spec.ep;
            let mut next = 0u64;
            for &pid in &held[(stage * spec.ep + ep_i) as usize] {
                let p = &model.params[pid as usize];
                let mut b = TensorBox::full(p.shape);
                shardings[pid as usize].cut(&mut b, spec, ep_i, fsdp_i, tp_i);
                if b.is_empty() {
                    continue;
                }
                let dtype = spec.held_dtype(model, p);
                f(ShardSpec {
                    rank,
                    param: pid,
                    global: b,
                    dtype,
                    offset: next,
                });
                next = align_up(next + b.numel() * dtype.size() as u64);
            }
        };
        // Written in place into one list, allocated once by this thread (a list per rank,
        // allocated by rayon's threads, left their memory fragmented): each rank gets room for
        // a shard of every param its place may hold (a cut may be empty), writes its shards
        // there in parallel, and the ranks' shards are then moved together in rank order. One
        // walk of the shards, where counting them first took two.
        let Some(fill) = (0..world).find_map(|rank| {
            let mut first = None;
            for_each_shard(rank, &mut |s| {
                first.get_or_insert(s);
            });
            first
        }) else {
            return Ok(TrainingLayout {
                ranks: world,
                shards: Vec::new(),
            });
        };
        let room = |rank: u32| {
            let (stage, within) = (rank / per_stage, rank % per_stage);
            let ep_i = within / (spec.tp * spec.fsdp) % spec.ep;
            held[(stage * spec.ep + ep_i) as usize].len()
        };
        let mut shards = vec![fill; (0..world).map(room).sum()];
        let mut mine: Vec<&mut [ShardSpec]> = Vec::with_capacity(world as usize);
        let mut rest = shards.as_mut_slice();
        for rank in 0..world {
            let (a, b) = rest.split_at_mut(room(rank));
            mine.push(a);
            rest = b;
        }
        let counts: Vec<usize> = mine
            .into_par_iter()
            .enumerate()
            .map(|(rank, out)| {
                let mut k = 0;
                for_each_shard(rank as u32, &mut |s| {
                    out[k] = s;
                    k += 1;
                });
                k
            })
            .collect();
        let (mut from, mut to) = (0usize, 0usize);
        for (rank, &n) in counts.iter().enumerate() {
            if from != to {
                shards.copy_within(from..from + n, to);
            }
            from += room(rank as u32);
            to += n;
        }
        shards.truncate(to);
        if shards.capacity() - to > to / 8 {
            // Many empty cuts: give their room back.
            shards.shrink_to_fit();
        }
        Ok(TrainingLayout {
            ranks: world,
            shards,
        })
    }

    /// Checks a layout against a model: every shard names a parameter, lies inside its tensor,
    /// shards on one rank do not overlap in the arena. (Coverage is checked by the planner,
    /// which builds the grid of every tensor anyway.)
    pub fn validate(&self, model: &Model) -> Result<(), PlanError> {
        let mut order: Vec<&ShardSpec> = self.shards.iter().collect();
        if !order
            .windows(2)
            .all(|w| (w[0].rank, w[0].offset) <= (w[1].rank, w[1].offset))
        {
            order.sort_by_key(|s| (s.rank, s.offset));
        }
        let mut prev: Option<&ShardSpec> = None;
        for s in order {
            if s.rank >= self.ranks {
                return Err(PlanError::NoSuchRank {
                    side: "training layout",
                    rank: s.rank,
                    ranks: self.ranks,
                });
            }
            let p = model
                .params
                .get(s.param as usize)
                .ok_or(PlanError::NoSuchParam {
                    rank: s.rank,
                    param: s.param,
                    params: model.params.len() as u32,
                })?;
            if !s.global.fits_in(p.shape) {
                return Err(PlanError::BoxOutsideTensor {
                    param: p.name.to_string(),
                    rank: s.rank,
                    region: s.global.to_string(),
                    shape: p.shape.to_string(),
                });
            }
            if let Some(q) = prev
                && q.rank == s.rank
                && q.offset + q.global.numel() * q.dtype.size() as u64 > s.offset
            {
                return Err(PlanError::ArenaOverlap {
                    rank: s.rank,
                    a: model.params[q.param as usize].name.to_string(),
                    b: p.name.to_string(),
                });
            }
            prev = Some(s);
        }
        Ok(())
    }
}

/// Refuses a spec the model cannot be laid out by: another expert form than the model's, more
/// stages than layers, routed experts not divisible by ep, heads not divisible by tp.
fn check_spec_fits(model: &Model, spec: &TrainSpec) -> Result<(), PlanError> {
    if spec.experts != model.experts {
        return Err(PlanError::BadSpec {
            spec: spec.to_string(),
            reason: format!(
                "experts={} but the model was built with experts={}",
                spec.experts.spec_name(),
                model.experts.spec_name()
            ),
        });
    }
    if spec.pp > model.config.layers {
        return Err(PlanError::NotDivisible {
            what: format!("training pipeline of {}", model.name),
            degree_name: "pp",
            degree: spec.pp,
            dividend_name: "num_hidden_layers",
            dividend: model.config.layers as u64,
        });
    }
    if let Some(m) = &model.config.moe
        && m.experts % spec.ep != 0
    {
        return Err(PlanError::NotDivisible {
            what: format!("training routed experts of {}", model.name),
            degree_name: "ep",
            degree: spec.ep,
            dividend_name: "num_experts",
            dividend: m.experts as u64,
        });
    }
    check_train_heads(model, spec.tp)
}

/// How one parameter is cut across a stage's ranks.
struct Sharding {
    /// For a per-expert parameter: the ep group holding it (the others hold none of it).
    expert_group: Option<u32>,
    /// Stacked experts (either stacked form): dim 0 split across ep.
    stacked: bool,
    /// The tp split.
    split: TpSplit,
}

impl Sharding {
    /// How `p` is cut, refused when tp does not divide its split dimension.
    fn of(model: &Model, spec: &TrainSpec, p: &Param) -> Result<Sharding, PlanError> {
        let (expert_group, stacked) = match p.role {
            Role::Layer {
                kind: LayerKind::Expert { expert, .. },
                ..
            } => {
                let per = model.config.moe.as_ref().map_or(1, |m| m.experts / spec.ep);
                (Some(expert / per), false)
            }
            Role::Layer {
                kind: LayerKind::Experts(_) | LayerKind::ExpertsGateUp,
                ..
            } => (None, true),
            _ => (None, false),
        };
        let split = train_tp_split(p.role);
        let packed = matches!(
            p.role,
            Role::Layer {
                kind: LayerKind::ExpertsGateUp,
                ..
            }
        );
        if packed && spec.tp > 1 {
            return Err(PlanError::BadSpec {
                spec: spec.to_string(),
                reason: format!(
                    "training tensor {} [E, 2I, H] packs gate and up rows: tp={} would give each \
                     rank its gate rows and its up rows (transformers' packed_colwise), two boxes \
                     per expert that one shard cannot describe; experts=stacked-gate-up needs \
                     training tp=1 (use experts=stacked for a tensor-parallel trainer)",
                    p.name, spec.tp
                ),
            });
        }
        if let TpSplit::Dim(d) = split
            && !p.shape.dims[d].is_multiple_of(spec.tp)
        {
            return Err(PlanError::NotDivisible {
                what: format!("training tensor {}", p.name),
                degree_name: "tp",
                degree: spec.tp,
                dividend_name: "its split dimension",
                dividend: p.shape.dims[d] as u64,
            });
        }
        Ok(Sharding {
            expert_group,
            stacked,
            split,
        })
    }

    /// Cuts `b` (the whole parameter) to its box on the rank at `(ep_i, fsdp_i, tp_i)`: the ep
    /// share of stacked experts, then the tp share, then the FSDP chunk of dim 0 (over fsdp for
    /// experts, over ep x fsdp for the rest; possibly empty). Once per shard: inlined, in place.
    #[inline]
    fn cut(&self, b: &mut TensorBox, spec: &TrainSpec, ep_i: u32, fsdp_i: u32, tp_i: u32) {
        if self.stacked {
            let n = b.len[0] / spec.ep;
            b.start[0] = ep_i * n;
            b.len[0] = n;
        }
        if let TpSplit::Dim(d) = self.split {
            let n = b.len[d] / spec.tp;
            b.start[d] += tp_i * n;
            b.len[d] = n;
        }
        let (k, i) = if self.expert_group.is_some() || self.stacked {
            (spec.fsdp, fsdp_i)
        } else {
            (spec.ep * spec.fsdp, ep_i * spec.fsdp + fsdp_i)
        };
        let (s, n) = torch_chunk(b.len[0], k, i);
        b.start[0] += s;
        b.len[0] = n;
    }
}

/// tp must divide the head counts for q/k/v on the training side.
fn check_train_heads(model: &Model, tp: u32) -> Result<(), PlanError> {
    let c = &model.config;
    let mut checks = vec![(c.heads, "num_attention_heads")];
    if c.mla.is_none() {
        checks.push((c.kv_heads, "num_key_value_heads"));
    }
    for (n, name) in checks {
        if n % tp != 0 {
            return Err(PlanError::NotDivisible {
                what: format!("training attention of {}", model.name),
                degree_name: "tp",
                degree: tp,
                dividend_name: name,
                dividend: n as u64,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn torch_chunk_has_short_tails_and_empty_shards() {
        assert_eq!(torch_chunk(10, 4, 0), (0, 3));
        assert_eq!(torch_chunk(10, 4, 3), (9, 1));
        assert_eq!(torch_chunk(5, 4, 3), (5, 0)); // c=2: 0..2, 2..4, 4..5, empty
        assert_eq!(torch_chunk(5, 4, 2), (4, 1));
    }

    #[test]
    fn spec_parses_and_rejects() {
        let s: TrainSpec = "pp=2,ep=8,fsdp=16".parse().unwrap();
        assert_eq!(s.world().unwrap(), 256);
        assert!("pp=0".parse::<TrainSpec>().is_err());
        let e = "xx=2".parse::<TrainSpec>().unwrap_err();
        assert!(e.to_string().contains("xx"), "{e}");
    }

    #[test]
    fn kimi_layout_has_256_ranks_and_bounded_shards() {
        let m = Model::preset("kimi-k2", ExpertForm::PerExpert).unwrap();
        let spec: TrainSpec = "pp=2,ep=8,fsdp=16".parse().unwrap();
        let l = TrainingLayout::build(&m, &spec).unwrap();
        assert_eq!(l.ranks, 256);
        l.validate(&m).unwrap();
        let total: u64 = l.shards.iter().map(|s| s.global.numel()).sum();
        assert_eq!(total, m.num_elements());
    }

    #[test]
    fn ranks_with_empty_cuts_list_only_their_shards() {
        // Non-expert params chunked over ep x fsdp = 256: the 128-long q and k norms leave
        // half the ranks an empty cut (room kept for it, then closed up).
        let m = Model::preset("qwen3-30b-a3b", ExpertForm::PerExpert).unwrap();
        let spec: TrainSpec = "ep=8,fsdp=32".parse().unwrap();
        let l = TrainingLayout::build(&m, &spec).unwrap();
        l.validate(&m).unwrap();
        assert!(l.shards.iter().all(|s| s.global.numel() > 0));
        assert!(
            l.shards
                .windows(2)
                .all(|w| (w[0].rank, w[0].param) < (w[1].rank, w[1].param))
        );
        let total: u64 = l.shards.iter().map(|s| s.global.numel()).sum();
        assert_eq!(total, m.num_elements());
        let norms = m.params.iter().filter(|p| p.shape.dims()[0] == 128).count();
        assert!(norms > 0, "the case has params shorter than 256 rows");
    }

    #[test]
    fn shards_are_held_in_the_specs_dtype_except_what_the_model_keeps_apart() {
        // DeepSeek-V3's router bias is f32 in a bf16 model; dtype=f32 (FSDP2's sharded
        // parameters under mixed precision) makes the rest f32 and leaves it.
        let m = Model::preset("deepseek-v3", ExpertForm::PerExpert).unwrap();
        let plain = TrainingLayout::build(&m, &"fsdp=64".parse().unwrap()).unwrap();
        let spec: TrainSpec = "fsdp=64,dtype=float32".parse().unwrap();
        assert_eq!(spec.dtype, Some(DType::F32));
        assert_eq!(spec.to_string(), "pp=1,dp=1,ep=1,fsdp=64,tp=1,dtype=f32");
        assert_eq!(spec.to_string().parse::<TrainSpec>().unwrap(), spec);
        let held = TrainingLayout::build(&m, &spec).unwrap();
        held.validate(&m).unwrap();
        assert_eq!(held.shards.len(), plain.shards.len());
        let mut kept_apart = 0;
        for (a, b) in plain.shards.iter().zip(&held.shards) {
            assert_eq!((a.rank, a.param, a.global), (b.rank, b.param, b.global));
            assert_eq!(b.dtype, DType::F32);
            kept_apart += usize::from(a.dtype == DType::F32);
        }
        assert!(kept_apart > 0, "the model has f32 parameters of its own");
        let bytes = |l: &TrainingLayout| -> u64 {
            l.shards
                .iter()
                .map(|s| s.global.numel() * s.dtype.size() as u64)
                .sum()
        };
        assert!(
            bytes(&held) > bytes(&plain) * 19 / 10,
            "f32 shards are twice the bytes"
        );

        let fp8 = "fsdp=2,dtype=fp8"
            .parse::<TrainSpec>()
            .unwrap_err()
            .to_string();
        assert!(
            fp8.contains("dtype=fp8") && fp8.contains("inference"),
            "{fp8}"
        );
        let bad = "fsdp=2,dtype=int4"
            .parse::<TrainSpec>()
            .unwrap_err()
            .to_string();
        assert!(bad.contains("int4"), "{bad}");
    }
}
