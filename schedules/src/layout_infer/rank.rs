//! One inference rank being built: its tensors in arena order and the pieces of logical
//! parameters that land in them. The shared vocabulary of the builders (`add` a destination
//! tensor from parts, `refuse` with an error naming it) lives here; the decoder layers are in
//! `layer`, the walk over a whole rank in `rank_tensors`, the divisibility checks that run before any rank is built in `check`.

use rustc_hash::FxHashMap;

use weightsync_common::DType;

use super::{InferDType, InferFormat, InferSpec, Piece, ScalePlace};
use crate::error::PlanError;
use crate::layout_train::align_up;
use crate::model::{Model, Role};
use crate::table::{DstTensor, FP8_BLOCK, MAX_DIMS, Shape, TensorBox};

/// One part of a destination tensor being built.
pub(super) struct Part {
    pub(super) param: u32,
    pub(super) src: TensorBox,
    pub(super) dst_start: [u32; MAX_DIMS],
}

pub(super) fn part(param: u32, src: TensorBox, dst_start: &[u32]) -> Part {
    let mut d = [0; MAX_DIMS];
    d[..dst_start.len()].copy_from_slice(dst_start);
    Part {
        param,
        src,
        dst_start: d,
    }
}

/// Builds one rank's tensors and pieces.
pub(super) struct RankBuilder<'m> {
    pub(super) model: &'m Model,
    /// Parameter index by role.
    pub(super) index: &'m FxHashMap<Role, u32>,
    /// Rank within the engine.
    pub(super) rank: u32,
    pub(super) tp: u32,
    pub(super) ep: u32,
    pub(super) fp8: bool,
    /// The spec being built (format, and for errors).
    pub(super) spec: InferSpec,
    pub(super) tensors: Vec<DstTensor>,
    pub(super) pieces: Vec<Piece>,
    pub(super) next: u64,
}

impl RankBuilder<'_> {
    pub(super) fn push_tensor(&mut self, name: String, shape: Shape, dtype: DType) -> u32 {
        let len = shape.numel() * dtype.size() as u64;
        self.tensors.push(DstTensor {
            name,
            shape,
            dtype,
            mr: 0,
            offset: self.next,
            len,
        });
        self.next = align_up(self.next + len);
        (self.tensors.len() - 1) as u32
    }

    /// Adds a tensor made of `parts`; `quantise` asks for fp8 (honoured only in fp8 layouts).
    pub(super) fn add(
        &mut self,
        name: String,
        shape: &[u32],
        quantise: bool,
        parts: Vec<Part>,
    ) -> Result<(), PlanError> {
        let shape = Shape::new(shape);
        let pdtype = self.model.params[parts[0].param as usize].dtype;
        let quant = quantise && self.fp8 && shape.ndim >= 2;
        if !quant {
            let t = self.push_tensor(name, shape, pdtype);
            for p in parts {
                self.pieces.push(Piece {
                    param: p.param,
                    src: p.src,
                    rank: self.rank,
                    tensor: t,
                    dst_start: p.dst_start,
                    scale: None,
                });
            }
            return Ok(());
        }
        let nd = shape.ndim as usize;
        let (rd, cd) = (nd - 2, nd - 1);
        if self.hf() {
            self.check_hf_block_grid(&name, &parts, rd, cd)?;
        }
        // Scale rows: per lead coordinate, parts' ceil(rows/128) in row order.
        let mut scale_rows: Vec<(Vec<u32>, u32)> = Vec::new();
        let mut places = Vec::with_capacity(parts.len());
        for p in &parts {
            let param = &self.model.params[p.param as usize];
            let pn = param.shape.ndim as usize;
            let (pr, pc) = (pn - 2, pn - 1);
            for d in [pr, pc] {
                let s = p.src.start[d];
                let e = p.src.end(d);
                if s % FP8_BLOCK != 0 || (e % FP8_BLOCK != 0 && e != param.shape.dims[d]) {
                    return Err(PlanError::Fp8Misaligned {
                        param: param.name.to_string(),
                        rank: self.rank,
                        region: p.src.to_string(),
                        block: FP8_BLOCK,
                    });
                }
            }
            let lead: Vec<u32> = p.dst_start[..rd].to_vec();
            let acc = match scale_rows.iter_mut().find(|(l, _)| *l == lead) {
                Some((_, a)) => a,
                None => {
                    scale_rows.push((lead.clone(), 0));
                    &mut scale_rows.last_mut().expect("just pushed").1
                }
            };
            let mut start = p.dst_start;
            start[rd] = *acc;
            start[cd] = p.dst_start[cd] / FP8_BLOCK;
            *acc += p.src.len[pr].div_ceil(FP8_BLOCK);
            places.push(start);
        }
        let srows = scale_rows.iter().map(|(_, a)| *a).max().unwrap_or(0);
        let mut sdims = shape.dims;
        sdims[rd] = srows;
        sdims[cd] = shape.dims[cd].div_ceil(FP8_BLOCK);
        let sname = format!("{name}_scale_inv");
        let t = self.push_tensor(name, shape, DType::F8E4M3);
        let st = self.push_tensor(
            sname,
            Shape {
                ndim: shape.ndim,
                dims: sdims,
            },
            DType::F32,
        );
        for (p, start) in parts.into_iter().zip(places) {
            self.pieces.push(Piece {
                param: p.param,
                src: p.src,
                rank: self.rank,
                tensor: t,
                dst_start: p.dst_start,
                scale: Some(ScalePlace { tensor: st, start }),
            });
        }
        Ok(())
    }

    /// In hf, transformers' scales are the tensor's own block grid: a part placed off it would
    /// share a block with its neighbour.
    fn check_hf_block_grid(
        &self,
        name: &str,
        parts: &[Part],
        rd: usize,
        cd: usize,
    ) -> Result<(), PlanError> {
        if let Some(p) = parts.iter().find(|p| {
            !p.dst_start[rd].is_multiple_of(FP8_BLOCK) || !p.dst_start[cd].is_multiple_of(FP8_BLOCK)
        }) {
            let param = &self.model.params[p.param as usize];
            return Err(self.refuse(
                name,
                format!(
                    "its {FP8_BLOCK}x{FP8_BLOCK} fp8 blocks are the tensor's own, but the part \
                     from {} starts at row {} / column {}, inside a block it would share with \
                     another training tensor",
                    param.name, p.dst_start[rd], p.dst_start[cd]
                ),
            ));
        }
        Ok(())
    }
}

impl RankBuilder<'_> {
    /// Whether the rank holds transformers' tensors.
    #[inline]
    pub(super) fn hf(&self) -> bool {
        self.spec.format == InferFormat::Hf
    }

    /// The error for a destination tensor the format cannot be built with: names the tensor,
    /// the spec (with its format) and why.
    pub(super) fn refuse(&self, tensor: &str, why: String) -> PlanError {
        PlanError::BadSpec {
            spec: self.spec.to_string(),
            reason: format!(
                "inference tensor {tensor} (format {}, {}): {why}",
                self.spec.format.name(),
                match self.spec.dtype {
                    InferDType::Bf16 => "bf16",
                    InferDType::Fp8 => "fp8",
                }
            ),
        }
    }
}

pub(super) fn not_div(
    what: String,
    degree_name: &'static str,
    degree: u32,
    dividend_name: &'static str,
    dividend: u32,
) -> PlanError {
    PlanError::NotDivisible {
        what,
        degree_name,
        degree,
        dividend_name,
        dividend: dividend as u64,
    }
}

/// `[start, start+len)` rows of a 2-D parameter, all columns.
pub(super) fn rows(shape: Shape, start: u32, len: u32) -> TensorBox {
    TensorBox::new(&[start, 0], &[len, shape.dims[1]])
}

/// All rows, columns `[start, start+len)`.
pub(super) fn cols(shape: Shape, start: u32, len: u32) -> TensorBox {
    TensorBox::new(&[0, start], &[shape.dims[0], len])
}

impl RankBuilder<'_> {
    /// The rank's tp rank within its engine.
    #[inline]
    pub(super) fn tp_rank(&self) -> u32 {
        self.rank % self.tp
    }

    /// The index of the parameter that is `role`.
    #[inline]
    pub(super) fn param(&self, role: Role) -> u32 {
        self.index[&role]
    }

    pub(super) fn shape(&self, p: u32) -> Shape {
        self.model.params[p as usize].shape
    }

    /// This rank's rows of vocab-parallel parameter `p` (no padding rows), and how many.
    pub(super) fn vocab_rows(&self, p: u32) -> (TensorBox, u32) {
        let (vocab, t) = (self.model.config.vocab, self.tp_rank());
        let ch = vocab.div_ceil(self.tp);
        let s = (t * ch).min(vocab);
        let e = ((t + 1) * ch).min(vocab);
        (rows(self.shape(p), s, e - s), e - s)
    }
}
