//! An engine tensor made of parts ([`TensorSource`]): boxes of the trainers' tensors
//! concatenated along one dim, with stacking over the dims the parts do not have. Placing them
//! here is what lets a fused engine (vLLM's `qkv_proj`, `gate_up_proj`, `w13_weight`), a
//! tensor-parallel rank (a box of each tensor) and stacked experts (per-expert tensors in one
//! `[E, ...]` tensor) be declared, so the planner needs no model knowledge for them either.
//!
//! Why a concatenation and not a destination offset per part: it is how the engines describe
//! their tensors (a fused tensor *is* its shards one after another), it leaves nothing to agree
//! on but the order, and every way two parts could overlap or leave a hole becomes a part that
//! runs past its place ([`DeclaredError::PartOverlap`]) or parts that stop short
//! ([`DeclaredError::PartGap`]), each named with both sides.

use weightsync_common::protocol::{SourceBox, TensorSource};

use super::DeclaredError;
use crate::declared_error::PartError;
use crate::model::Model;
use crate::table::{DstTensor, MAX_DIMS, TensorBox};

/// One part placed in its engine tensor: a box of a parameter and where its origin lands
/// (the box's dims on the tensor's trailing dims, as [`crate::layout_infer::Piece`]s).
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    pub(super) param: u32,
    pub(super) src: TensorBox,
    pub(super) dst_start: [u32; MAX_DIMS],
}

/// What the placement needs to name the sides: the model, the parameters by name and the
/// first trainer rank holding each.
pub(super) struct Names<'a> {
    pub(super) model: &'a Model,
    pub(super) by_name: &'a rustc_hash::FxHashMap<&'a str, u32>,
    pub(super) holder: &'a [u32],
}

/// A part's box as declared, for errors.
fn declared_box(p: &SourceBox) -> String {
    let parts: Vec<String> = (0..p.shape.len())
        .map(|d| {
            let s = p.offset.get(d).copied().unwrap_or(0);
            format!("{s}..{}", s.saturating_add(p.shape[d]))
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// The part's box in the table's dims (at most three: a box of more has its trailing dims
/// merged, which it must then hold whole; see [`super::logical_shape`]). `Err`: why not.
fn logical_box(p: &SourceBox) -> Result<TensorBox, String> {
    let n = p.shape.len();
    let offset: Vec<u64> = if p.offset.is_empty() {
        vec![0; n]
    } else {
        p.offset.clone()
    };
    if offset.len() != n {
        return Err(format!(
            "an offset of {} dims for a box of {n}",
            offset.len()
        ));
    }
    if n == 0 {
        return Ok(TensorBox::new(&[0], &[1]));
    }
    let fit = |d: u64| u32::try_from(d).map_err(|_| format!("dim {d} is more than {}", u32::MAX));
    let k = n.min(MAX_DIMS);
    let mut start = [0u32; MAX_DIMS];
    let mut len = [0u32; MAX_DIMS];
    for d in 0..k {
        start[d] = fit(offset[d])?;
        len[d] = fit(p.shape[d])?;
    }
    if n > MAX_DIMS {
        if offset[2..].iter().any(|&o| o != 0) {
            return Err(format!(
                "a box of a {n}-D tensor must hold its trailing dims whole, but it starts at \
                 {offset:?}"
            ));
        }
        let merged = p.shape[2..]
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("shape {:?} overflows", p.shape))?;
        len[2] = fit(merged)?;
    }
    start[..k].iter().zip(&len[..k]).try_for_each(|(s, l)| {
        s.checked_add(*l)
            .map(|_| ())
            .ok_or_else(|| "a box past u32".to_string())
    })?;
    Ok(TensorBox::new(&start[..k], &len[..k]))
}

/// Where the parts of a source go, one after another: the geometry [`place`] and
/// [`check_fill`] share (they differ only in what they know of the parts' trainers, and so in
/// how they name a misfit).
struct Fill {
    shape: crate::table::Shape,
    dim: usize,
    /// Dims of every part (set by the first).
    k: Option<usize>,
    /// Leading dims the parts do not have (stacked over), and how many stacked slices they make.
    lead: usize,
    slots: u64,
    /// Where the next part goes: the stack index (row-major over the leading dims) and the
    /// position along `dim`.
    slot: u64,
    pos: u32,
}

/// Why a part does not go where [`Fill::next`] would put it.
enum Misfit {
    /// The part has more dims than the tensor.
    TooManyDims { pk: usize },
    /// `dim` is not one of the dims the parts span.
    DimNotSpanned { pk: usize },
    /// The part has another number of dims than part 0.
    DimsDiffer { pk: usize, k: usize },
    /// The part does not span the tensor's dim `d` whole (`d` is not `dim`).
    NotWhole { d: usize, len: u32 },
    /// The parts before it fill the tensor already (`start`: where it would go).
    PastTheEnd { start: [u32; MAX_DIMS] },
    /// It runs to `end` along `dim`, past the tensor's size there.
    RunsPast { start: [u32; MAX_DIMS], end: u64 },
}

impl Fill {
    fn new(shape: crate::table::Shape, dim: usize) -> Self {
        Fill {
            shape,
            dim,
            k: None,
            lead: 0,
            slots: 0,
            slot: 0,
            pos: 0,
        }
    }

    /// Places the next part (its box `bx`): where its origin lands in the tensor.
    fn next(&mut self, bx: &TensorBox) -> Result<[u32; MAX_DIMS], Misfit> {
        let (n, dim, shape) = (self.shape.ndim as usize, self.dim, self.shape);
        let pk = bx.ndim as usize;
        match self.k {
            None => {
                if pk > n {
                    return Err(Misfit::TooManyDims { pk });
                }
                self.lead = n - pk;
                if dim >= n || dim < self.lead {
                    return Err(Misfit::DimNotSpanned { pk });
                }
                self.slots = shape.dims[..self.lead]
                    .iter()
                    .map(|&d| u64::from(d))
                    .product();
                self.k = Some(pk);
            }
            Some(k) if k != pk => return Err(Misfit::DimsDiffer { pk, k }),
            Some(_) => {}
        }
        let lead = self.lead;
        if let Some(j) = (0..pk).find(|&j| lead + j != dim && bx.len[j] != shape.dims[lead + j]) {
            return Err(Misfit::NotWhole {
                d: lead + j,
                len: bx.len[j],
            });
        }
        let mut start = [0u32; MAX_DIMS];
        let mut rest = self.slot;
        for d in (0..lead).rev() {
            let size = u64::from(shape.dims[d]);
            start[d] = (rest % size) as u32;
            rest /= size;
        }
        start[dim] = self.pos;
        if self.slot >= self.slots {
            return Err(Misfit::PastTheEnd { start });
        }
        let end = u64::from(self.pos) + u64::from(bx.len[dim - lead]);
        if end > u64::from(shape.dims[dim]) {
            return Err(Misfit::RunsPast { start, end });
        }
        self.pos = end as u32;
        if self.pos == shape.dims[dim] {
            self.slot += 1;
            self.pos = 0;
        }
        Ok(start)
    }

    /// Whether the parts placed so far fill the tensor.
    fn filled(&self) -> bool {
        self.slot >= self.slots
    }
}

/// Places the parts of `source` in `t` (inference rank `rank`'s tensor): each a box inside the
/// trainers' tensor it names, as many dims as every other part, spanning `t` whole in every
/// dim but `source.dim`, and all of them filling `t` exactly, in order.
pub(super) fn place(
    names: &Names<'_>,
    rank: u32,
    t: &DstTensor,
    source: &TensorSource,
) -> Result<Vec<Placed>, DeclaredError> {
    let malformed = |reason: String| DeclaredError::Malformed {
        tensor: t.name.clone(),
        side: "inference",
        rank,
        reason,
    };
    if source.parts.is_empty() {
        return Err(malformed(
            "made of no parts (a source needs at least one)".into(),
        ));
    }
    let n = t.shape.ndim as usize;
    let dim = source.dim as usize;
    let shape = t.shape;
    let mut out = Vec::with_capacity(source.parts.len());
    let mut fill = Fill::new(shape, dim);
    for (index, p) in source.parts.iter().enumerate() {
        let Some(&pid) = names.by_name.get(p.tensor.as_str()) else {
            return Err(DeclaredError::from(PartError::NoTrainerHoldsPart {
                tensor: t.name.clone(),
                engine_rank: rank,
                source_tensor: p.tensor.clone(),
                part: declared_box(p),
            }));
        };
        let param = &names.model.params[pid as usize];
        let trainer_rank = names.holder[pid as usize];
        let bx = logical_box(p).map_err(|reason| {
            malformed(format!(
                "made of {} {}: {reason}",
                p.tensor,
                declared_box(p)
            ))
        })?;
        let described = |bx: &str| {
            format!(
                "part {index}, {} {bx} (trainer rank {trainer_rank} holds {} of shape {})",
                p.tensor, p.tensor, param.shape
            )
        };
        let misfit = |reason: String| {
            DeclaredError::from(PartError::PartShape {
                tensor: t.name.clone(),
                engine_rank: rank,
                engine_shape: shape.to_string(),
                dim: source.dim,
                part: described(&declared_box(p)),
                reason,
            })
        };
        if bx.ndim != param.shape.ndim {
            return Err(misfit(format!(
                "has {} dims where {} has {}",
                bx.ndim, p.tensor, param.shape.ndim
            )));
        }
        if !bx.fits_in(param.shape) {
            return Err(DeclaredError::from(PartError::PartOutside {
                tensor: t.name.clone(),
                engine_rank: rank,
                source_tensor: p.tensor.clone(),
                part: bx.to_string(),
                trainer_rank,
                trainer_shape: param.shape.to_string(),
            }));
        }
        if bx.is_empty() {
            return Err(misfit(
                "is empty (a part holds at least one element)".into(),
            ));
        }
        let overlap = |start: [u32; MAX_DIMS], overlaps: String| {
            DeclaredError::from(PartError::PartOverlap {
                tensor: t.name.clone(),
                engine_rank: rank,
                engine_shape: shape.to_string(),
                dim: source.dim,
                part: described(&bx.to_string()),
                overlaps: format!("placed at {:?}, {overlaps}", &start[..n]),
            })
        };
        let dst_start = fill.next(&bx).map_err(|m| match m {
            Misfit::TooManyDims { pk } => {
                misfit(format!("has {pk} dims, more than the tensor's {n}"))
            }
            Misfit::DimNotSpanned { pk } => malformed(format!(
                "made of parts of {pk} dims concatenated along dim {dim}, which is not one of \
                 the dims {}..{n} of its shape {shape} that they span",
                n - pk
            )),
            Misfit::DimsDiffer { pk, k } => misfit(format!(
                "has {pk} dims where part 0 has {k} (every part has as many)"
            )),
            Misfit::NotWhole { d, len } => misfit(format!(
                "spans {len} in dim {d}, where the tensor is {} (a part spans every dim but \
                 the concatenation's whole)",
                shape.dims[d]
            )),
            Misfit::PastTheEnd { start } => overlap(
                start,
                "lies past the tensor's end: the parts before it fill it".into(),
            ),
            Misfit::RunsPast { start, end } => overlap(
                start,
                format!(
                    "runs to {end} along dim {dim}, past the tensor's {}: it overlaps {}",
                    shape.dims[dim],
                    if fill.slot + 1 < fill.slots {
                        "the next stacked slice's place"
                    } else {
                        "the tensor's end"
                    }
                ),
            ),
        })?;
        out.push(Placed {
            param: pid,
            src: bx,
            dst_start,
        });
    }
    if !fill.filled() {
        let (slot, pos, slots, lead) = (fill.slot, fill.pos, fill.slots, fill.lead);
        let last = source.parts.last().expect("at least one part");
        let pid = names.by_name[last.tensor.as_str()];
        let per_slot = shape.numel() / slots.max(1);
        let along_rest = per_slot / u64::from(shape.dims[dim]).max(1);
        let filled = slot * per_slot + u64::from(pos) * along_rest;
        let mut start = [0u32; MAX_DIMS];
        let mut len = shape.dims;
        let mut rest = slot;
        for d in (0..lead).rev() {
            let size = u64::from(shape.dims[d]);
            start[d] = (rest % size) as u32;
            len[d] = 1;
            rest /= size;
        }
        start[dim] = pos;
        len[dim] = shape.dims[dim] - pos;
        let gap = TensorBox {
            ndim: shape.ndim,
            start,
            len,
        };
        return Err(DeclaredError::from(PartError::PartGap {
            tensor: t.name.clone(),
            engine_rank: rank,
            engine_shape: shape.to_string(),
            parts: format!(
                "its {} parts concatenated along dim {} (the last {} {}, trainer rank {})",
                source.parts.len(),
                source.dim,
                last.tensor,
                declared_box(last),
                names.holder[pid as usize]
            ),
            filled,
            total: shape.numel(),
            gap: gap.to_string(),
        }));
    }
    Ok(out)
}

/// Checks, from the engine's side alone (no trainer's declaration needed), that the parts of
/// `source` can fill tensor `name` of (table) shape `shape` on inference rank `rank`: each a
/// well-formed, non-empty box of as many dims as the others, spanning the tensor whole in
/// every dim but `source.dim`, and all of them filling it exactly, in order (see
/// [`TensorSource`]). What an engine checks before it registers; the controller then checks
/// each part against the trainers' tensors ([`place`]).
pub(super) fn check_fill(
    name: &str,
    rank: u32,
    shape: crate::table::Shape,
    source: &TensorSource,
) -> Result<(), DeclaredError> {
    let malformed = |reason: String| DeclaredError::Malformed {
        tensor: name.to_string(),
        side: "inference",
        rank,
        reason,
    };
    if source.parts.is_empty() {
        return Err(malformed(
            "made of no parts (a source needs at least one)".into(),
        ));
    }
    let n = shape.ndim as usize;
    let dim = source.dim as usize;
    let mut fill = Fill::new(shape, dim);
    for (index, p) in source.parts.iter().enumerate() {
        let what = format!("part {index}, {} {}", p.tensor, declared_box(p));
        let bx = logical_box(p).map_err(|reason| malformed(format!("made of {what}: {reason}")))?;
        if bx.is_empty() {
            return Err(malformed(format!(
                "made of {what}, which is empty (a part holds at least one element)"
            )));
        }
        fill.next(&bx).map_err(|m| {
            malformed(match m {
                Misfit::TooManyDims { pk } => format!(
                    "of shape {shape} made of {what}, of {pk} dims, more than the tensor's {n}"
                ),
                Misfit::DimNotSpanned { pk } => format!(
                    "made of parts of {pk} dims concatenated along dim {dim}, which is not one \
                     of the dims {}..{n} of its shape {shape} that they span",
                    n - pk
                ),
                Misfit::DimsDiffer { pk, k } => format!(
                    "made of {what}, of {pk} dims where part 0 has {k} (every part has as many)"
                ),
                Misfit::NotWhole { d, len } => format!(
                    "of shape {shape} made of {what}, which spans {len} in dim {d} (a part spans \
                     every dim but the concatenation's dim {dim} whole)"
                ),
                Misfit::PastTheEnd { .. } | Misfit::RunsPast { .. } => format!(
                    "of shape {shape} made of parts concatenated along dim {dim}: {what} runs \
                     past the tensor's end (the parts before it fill {} of its {} along dim \
                     {dim}{})",
                    if fill.filled() {
                        shape.dims[dim]
                    } else {
                        fill.pos
                    },
                    shape.dims[dim],
                    if fill.slots > 1 {
                        ", in each stacked slice"
                    } else {
                        ""
                    }
                ),
            })
        })?;
    }
    if !fill.filled() {
        let (slot, pos, slots) = (fill.slot, fill.pos, fill.slots);
        let filled = if slots > 1 {
            format!("{slot} of its {slots} stacked slices and {pos} of the next's")
        } else {
            format!("{pos} of its")
        };
        return Err(malformed(format!(
            "of shape {shape} made of {} parts concatenated along dim {dim}, which stop short \
             (a gap): they fill {filled} {} along dim {dim}",
            source.parts.len(),
            shape.dims[dim]
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! [`check_fill`], the engine's own check, names each way parts can misfit (what
    //! [`place`] names with the trainers' side is covered by `tests/declared_fused.rs`).

    use super::*;
    use crate::table::Shape;

    fn part(tensor: &str, shape: &[u64]) -> SourceBox {
        SourceBox {
            tensor: tensor.into(),
            offset: vec![],
            shape: shape.to_vec(),
        }
    }

    fn check(shape: &[u32], dim: u32, parts: Vec<SourceBox>) -> Result<(), String> {
        check_fill("qkv", 0, Shape::new(shape), &TensorSource { dim, parts })
            .map_err(|e| e.to_string())
    }

    #[test]
    fn parts_that_fill_pass_and_every_misfit_is_named() {
        let q = || part("q", &[8, 4]);
        let kv = || part("k", &[4, 4]);
        assert_eq!(check(&[16, 4], 0, vec![q(), kv(), kv()]), Ok(()));
        // Stacked: two [8, 4] parts per slice of a [2, 16, 4] tensor.
        assert_eq!(check(&[2, 16, 4], 1, vec![q(), q(), q(), q()]), Ok(()));
        let err = |shape: &[u32], dim, parts| check(shape, dim, parts).unwrap_err();
        let gap = err(&[16, 4], 0, vec![q(), kv()]);
        assert!(
            gap.contains("stop short (a gap): they fill 12 of its 16"),
            "{gap}"
        );
        let past = err(&[16, 4], 0, vec![q(), q(), kv()]);
        assert!(
            past.contains("part 2, k [0..4, 0..4] runs past the tensor's end"),
            "{past}"
        );
        assert!(past.contains("fill 16 of its 16 along dim 0"), "{past}");
        let over = err(&[16, 4], 0, vec![q(), part("k", &[12, 4])]);
        assert!(over.contains("fill 8 of its 16"), "{over}");
        let whole = err(&[16, 4], 0, vec![part("q", &[8, 2])]);
        assert!(whole.contains("spans 2 in dim 1"), "{whole}");
        let dims = err(&[16, 4], 0, vec![q(), part("k", &[4])]);
        assert!(dims.contains("of 1 dims where part 0 has 2"), "{dims}");
        let more = err(&[16], 0, vec![q()]);
        assert!(
            more.contains("of 2 dims, more than the tensor's 1"),
            "{more}"
        );
        let along = err(&[2, 16, 4], 0, vec![q()]);
        assert!(
            along.contains("which is not one of the dims 1..3"),
            "{along}"
        );
        assert!(err(&[16, 4], 0, vec![]).contains("made of no parts"));
    }
}
