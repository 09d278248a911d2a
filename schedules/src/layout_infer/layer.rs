//! The tensors of one decoder layer on one rank: norms, attention (MHA/GQA or MLA), the dense
//! MLP or the MoE block, each in the spec's format (fused or hf), fp8 scales where quantised.

use std::fmt::Write as _;

use super::rank::{Part, RankBuilder, cols, part, rows};
use crate::error::PlanError;
use crate::model::{ExpertForm, LayerKind, MlaConfig, MoeConfig, Proj, Role};
use crate::table::{FP8_BLOCK, MAX_DIMS, Shape, TensorBox};

/// The tensors of decoder layer `l` on one rank, added to its [`RankBuilder`].
pub(super) struct LayerTensors<'b, 'm> {
    pub(super) b: &'b mut RankBuilder<'m>,
    /// `model.layers.{l}.`
    pub(super) pre: String,
    pub(super) l: u32,
}

impl LayerTensors<'_, '_> {
    /// Every tensor of the layer: norms, attention, then the dense MLP or the MoE block.
    pub(super) fn build(&mut self) -> Result<(), PlanError> {
        let c = &self.b.model.config;
        self.full(LayerKind::InputNorm, "input_layernorm.weight")?;
        match &c.mla {
            Some(m) => self.mla_attention(m)?,
            None => self.attention()?,
        }
        self.full(LayerKind::PostAttnNorm, "post_attention_layernorm.weight")?;
        match c.moe.as_ref().filter(|m| m.moe_layers[self.l as usize]) {
            None => self.mlp(LayerKind::Mlp, "mlp"),
            Some(m) => self.moe(m),
        }
    }

    /// The parameter that is `kind` in this layer.
    pub(super) fn param(&self, kind: LayerKind) -> u32 {
        self.b.param(Role::Layer {
            layer: self.l,
            kind,
        })
    }

    pub(super) fn shape(&self, p: u32) -> Shape {
        self.b.shape(p)
    }

    /// Adds tensor `{pre}{name}` of the layout (see [`RankBuilder::add`]).
    pub(super) fn add(
        &mut self,
        name: impl std::fmt::Display,
        shape: &[u32],
        quantise: bool,
        parts: Vec<Part>,
    ) -> Result<(), PlanError> {
        // Sized up front: a `format!` of two arguments would grow the string more than once.
        let mut full = String::with_capacity(self.pre.len() + 48);
        full.push_str(&self.pre);
        write!(full, "{name}").expect("writing to a String cannot fail");
        self.b.add(full, shape, quantise, parts)
    }

    /// The whole parameter, replicated (norms, the router).
    pub(super) fn full(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let p = self.param(kind);
        let s = self.shape(p);
        let at = &[0; MAX_DIMS][..s.ndim as usize];
        self.add(name, s.dims(), false, vec![part(p, TensorBox::full(s), at)])
    }

    /// Whole, but quantised (replicated projections such as q_a_proj).
    pub(super) fn full_q(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let p = self.param(kind);
        let s = self.shape(p);
        self.add(
            name,
            s.dims(),
            true,
            vec![part(p, TensorBox::full(s), &[0, 0])],
        )
    }

    /// Column-parallel: this rank's tp share of the rows.
    pub(super) fn col_split(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let p = self.param(kind);
        let s = self.shape(p);
        let n = s.dims[0] / tp;
        self.add(
            name,
            &[n, s.dims[1]],
            true,
            vec![part(p, rows(s, t * n, n), &[0, 0])],
        )
    }

    /// Row-parallel: this rank's tp share of the columns.
    pub(super) fn row_split(&mut self, kind: LayerKind, name: &str) -> Result<(), PlanError> {
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let p = self.param(kind);
        let s = self.shape(p);
        let n = s.dims[1] / tp;
        self.add(
            name,
            &[s.dims[0], n],
            true,
            vec![part(p, cols(s, t * n, n), &[0, 0])],
        )
    }

    /// MLA attention: q (through a LoRA when `q_lora_rank` is set) and kv_b split by heads, the
    /// compressed kv and its norm replicated, o row-parallel.
    pub(super) fn mla_attention(&mut self, m: &MlaConfig) -> Result<(), PlanError> {
        if m.q_lora_rank.is_some() {
            self.full_q(LayerKind::QA, "self_attn.q_a_proj.weight")?;
            self.full(LayerKind::QANorm, "self_attn.q_a_layernorm.weight")?;
            self.col_split(LayerKind::QB, "self_attn.q_b_proj.weight")?;
        } else {
            self.col_split(LayerKind::Q, "self_attn.q_proj.weight")?;
        }
        self.full_q(LayerKind::KVA, "self_attn.kv_a_proj_with_mqa.weight")?;
        self.full(LayerKind::KVANorm, "self_attn.kv_a_layernorm.weight")?;
        self.col_split(LayerKind::KVB, "self_attn.kv_b_proj.weight")?;
        self.row_split(LayerKind::O, "self_attn.o_proj.weight")
    }

    /// Dense attention: q, k and v (kv heads split, or replicated when tp exceeds them) fused
    /// into `qkv_proj` (hf: `q_proj`, `k_proj`, `v_proj`), biases alike, q/k norms replicated,
    /// o row-parallel.
    pub(super) fn attention(&mut self) -> Result<(), PlanError> {
        let c = &self.b.model.config;
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let (h, d) = (c.hidden, c.head_dim);
        let qn = c.heads / tp * d;
        let (ks, kn) = if tp <= c.kv_heads {
            let per = c.kv_heads / tp;
            (t * per * d, per * d)
        } else {
            ((t / (tp / c.kv_heads)) * d, d)
        };
        let (q, k, v) = (
            self.param(LayerKind::Q),
            self.param(LayerKind::K),
            self.param(LayerKind::V),
        );
        let (qb, kb, vb) = (
            TensorBox::new(&[t * qn], &[qn]),
            TensorBox::new(&[ks], &[kn]),
            TensorBox::new(&[ks], &[kn]),
        );
        if self.b.hf() {
            for (p, start, n, nm) in [
                (q, t * qn, qn, "q_proj"),
                (k, ks, kn, "k_proj"),
                (v, ks, kn, "v_proj"),
            ] {
                let parts = vec![part(p, rows(self.shape(p), start, n), &[0, 0])];
                self.add(format_args!("self_attn.{nm}.weight"), &[n, h], true, parts)?;
            }
            if c.attention_bias {
                for (kind, bx, nm) in [
                    (LayerKind::QBias, qb, "q_proj"),
                    (LayerKind::KBias, kb, "k_proj"),
                    (LayerKind::VBias, vb, "v_proj"),
                ] {
                    let p = self.param(kind);
                    let n = bx.len[0];
                    self.add(
                        format_args!("self_attn.{nm}.bias"),
                        &[n],
                        false,
                        vec![part(p, bx, &[0])],
                    )?;
                }
            }
        } else {
            let parts = vec![
                part(q, rows(self.shape(q), t * qn, qn), &[0, 0]),
                part(k, rows(self.shape(k), ks, kn), &[qn, 0]),
                part(v, rows(self.shape(v), ks, kn), &[qn + kn, 0]),
            ];
            self.add("self_attn.qkv_proj.weight", &[qn + 2 * kn, h], true, parts)?;
            if c.attention_bias {
                let parts = vec![
                    part(self.param(LayerKind::QBias), qb, &[0]),
                    part(self.param(LayerKind::KBias), kb, &[qn]),
                    part(self.param(LayerKind::VBias), vb, &[qn + kn]),
                ];
                self.add("self_attn.qkv_proj.bias", &[qn + 2 * kn], false, parts)?;
            }
        }
        if c.qk_norm {
            self.full(LayerKind::QNorm, "self_attn.q_norm.weight")?;
            self.full(LayerKind::KNorm, "self_attn.k_norm.weight")?;
        }
        self.row_split(LayerKind::O, "self_attn.o_proj.weight")
    }

    /// gate_up (gate rows then up rows; hf: `gate_proj` and `up_proj`) and down of a dense MLP
    /// or the shared experts, split by tp, named `{prefix}.gate_up_proj.weight` and
    /// `{prefix}.down_proj.weight`.
    pub(super) fn mlp(&mut self, mk: fn(Proj) -> LayerKind, prefix: &str) -> Result<(), PlanError> {
        let h = self.b.model.config.hidden;
        let (tp, t) = (self.b.tp, self.b.tp_rank());
        let (g, u, dn) = (
            self.param(mk(Proj::Gate)),
            self.param(mk(Proj::Up)),
            self.param(mk(Proj::Down)),
        );
        let i = self.shape(g).dims[0] / tp;
        let (gate, up) = (rows(self.shape(g), t * i, i), rows(self.shape(u), t * i, i));
        if self.b.hf() {
            let parts = vec![part(g, gate, &[0, 0])];
            self.add(
                format_args!("{prefix}.gate_proj.weight"),
                &[i, h],
                true,
                parts,
            )?;
            let parts = vec![part(u, up, &[0, 0])];
            self.add(
                format_args!("{prefix}.up_proj.weight"),
                &[i, h],
                true,
                parts,
            )?;
        } else {
            let parts = vec![part(g, gate, &[0, 0]), part(u, up, &[i, 0])];
            self.add(
                format_args!("{prefix}.gate_up_proj.weight"),
                &[2 * i, h],
                true,
                parts,
            )?;
        }
        let parts = vec![part(dn, cols(self.shape(dn), t * i, i), &[0, 0])];
        self.add(
            format_args!("{prefix}.down_proj.weight"),
            &[h, i],
            true,
            parts,
        )
    }

    /// An MoE block: the router and its bias replicated, the shared experts split like a dense
    /// MLP, then the routed experts.
    pub(super) fn moe(&mut self, m: &MoeConfig) -> Result<(), PlanError> {
        self.full(LayerKind::Router, "mlp.gate.weight")?;
        if m.score_bias {
            self.full(LayerKind::RouterBias, "mlp.gate.e_score_correction_bias")?;
        }
        if m.shared > 0 {
            self.mlp(LayerKind::Shared, "mlp.shared_experts")?;
        }
        self.routed_experts(m)
    }

    /// `w13_weight` `[E_local, 2I_local, H]` and `w2_weight` `[E_local, H, I_local]` (hf:
    /// `gate_up_proj` and `down_proj`): with ep > 1 this rank's `E/ep` consecutive experts
    /// whole, else every expert's tp share (its gate rows, then its up rows).
    pub(super) fn routed_experts(&mut self, m: &MoeConfig) -> Result<(), PlanError> {
        let h = self.b.model.config.hidden;
        let i = m.intermediate;
        let (r, t) = (self.b.rank, self.b.tp_rank());
        let (e0, el, i0, il) = if self.b.ep > 1 {
            let el = m.experts / self.b.ep;
            (r * el, el, 0, i)
        } else {
            let il = i / self.b.tp;
            (0, m.experts, t * il, il)
        };
        let (gate_up_name, down_name) = if self.b.hf() {
            ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
        } else {
            ("mlp.experts.w13_weight", "mlp.experts.w2_weight")
        };
        let mut gate_up = Vec::new();
        let mut down = Vec::new();
        match self.b.model.experts {
            ExpertForm::PerExpert => {
                for j in 0..el {
                    let e = e0 + j;
                    let proj = |proj| LayerKind::Expert { expert: e, proj };
                    let pg = self.param(proj(Proj::Gate));
                    let pu = self.param(proj(Proj::Up));
                    let pd = self.param(proj(Proj::Down));
                    gate_up.push(part(pg, rows(self.shape(pg), i0, il), &[j, 0, 0]));
                    gate_up.push(part(pu, rows(self.shape(pu), i0, il), &[j, il, 0]));
                    down.push(part(pd, cols(self.shape(pd), i0, il), &[j, 0, 0]));
                }
            }
            ExpertForm::Stacked => {
                let pg = self.param(LayerKind::Experts(Proj::Gate));
                let pu = self.param(LayerKind::Experts(Proj::Up));
                let pd = self.param(LayerKind::Experts(Proj::Down));
                let half = TensorBox::new(&[e0, i0, 0], &[el, il, h]);
                gate_up.push(part(pg, half, &[0, 0, 0]));
                gate_up.push(part(pu, half, &[0, il, 0]));
                let bx = TensorBox::new(&[e0, 0, i0], &[el, h, il]);
                down.push(part(pd, bx, &[0, 0, 0]));
            }
            ExpertForm::StackedGateUp => {
                let pgu = self.param(LayerKind::ExpertsGateUp);
                let pd = self.param(LayerKind::Experts(Proj::Down));
                if il == i {
                    // Whole experts: the packed rows as they are.
                    let bx = TensorBox::new(&[e0, 0, 0], &[el, 2 * i, h]);
                    gate_up.push(part(pgu, bx, &[0, 0, 0]));
                } else {
                    let gate = TensorBox::new(&[e0, i0, 0], &[el, il, h]);
                    let up = TensorBox::new(&[e0, i + i0, 0], &[el, il, h]);
                    gate_up.push(part(pgu, gate, &[0, 0, 0]));
                    gate_up.push(part(pgu, up, &[0, il, 0]));
                }
                let bx = TensorBox::new(&[e0, 0, i0], &[el, h, il]);
                down.push(part(pd, bx, &[0, 0, 0]));
            }
        }
        if self.b.fp8 {
            self.check_fp8_gate_up(gate_up_name, &gate_up, i, il)?;
        }
        self.add(gate_up_name, &[el, 2 * il, h], true, gate_up)?;
        self.add(down_name, &[el, h, il], true, down)
    }

    /// Refuses, by the tensor's name, an fp8 gate_up whose block grid the format cannot give:
    /// - fused: the engines' w13 keeps gate and up on separate block grids, so a packed training
    ///   tensor kept whole must have `I % 128 == 0`;
    /// - hf: one `[2I_local, H]` grid per expert, which parts from separate gate and up tensors
    ///   (or the tp halves of the packed one) fill only when `I_local % 128 == 0`, and whose
    ///   transformers scale tensor has a padding row when `2I_local <= 128`.
    pub(super) fn check_fp8_gate_up(
        &self,
        name: &str,
        parts: &[Part],
        i: u32,
        il: u32,
    ) -> Result<(), PlanError> {
        let full = format!("{}{name}", self.pre);
        let whole_packed = parts.len() == 1;
        let training = |p: &Part| self.b.model.params[p.param as usize].name.to_string();
        if !self.b.hf() {
            if whole_packed && !i.is_multiple_of(FP8_BLOCK) {
                return Err(self.b.refuse(
                    &full,
                    format!(
                        "engines quantise w13's gate and up rows on separate {FP8_BLOCK}-row block \
                         grids, but the training tensor {} packs them with \
                         moe_intermediate_size={i}, not a multiple of {FP8_BLOCK}, so a block of it \
                         mixes gate and up rows; use format=hf (one grid over the packed rows, as \
                         transformers) or dtype=bf16",
                        training(&parts[0])
                    ),
                ));
            }
            return Ok(());
        }
        if !whole_packed && !il.is_multiple_of(FP8_BLOCK) {
            let (from, fix) = if parts[0].param == parts[1].param {
                (
                    format!(
                        "the tp={} halves of {} ({il} gate rows, {il} up rows per expert)",
                        self.b.tp,
                        training(&parts[0])
                    ),
                    "hold whole experts (ep > 1, or tp=1)",
                )
            } else {
                (
                    format!(
                        "separate training tensors ({} and {}, {il} rows each)",
                        training(&parts[0]),
                        training(&parts[1])
                    ),
                    "train with experts=stacked-gate-up (transformers' packed tensor) and hold \
                     whole experts (ep > 1, or tp=1)",
                )
            };
            return Err(self.b.refuse(
                &full,
                format!(
                    "transformers quantises it as one [2I, H] grid of {FP8_BLOCK}x{FP8_BLOCK} \
                     blocks per expert; its gate and up rows come from {from}, and {il} is not a \
                     multiple of {FP8_BLOCK}, so a block would mix them; {fix}, or use dtype=bf16"
                ),
            ));
        }
        if 2 * il <= FP8_BLOCK {
            return Err(self.b.refuse(
                &full,
                format!(
                    "transformers allocates {full}_scale_inv with 2 block rows per expert when \
                     2*I = {} <= {FP8_BLOCK}, one more than its block grid has; weightsync writes \
                     every byte it plans and cannot leave that row, so fp8 in format hf needs \
                     moe_intermediate_size > {} (per tp rank)",
                    2 * il,
                    FP8_BLOCK / 2
                ),
            ));
        }
        Ok(())
    }
}
