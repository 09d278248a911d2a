//! The demo's weights: a deterministic function of (seed, version, parameter, element), and an
//! independent recomputation of what every rollout must hold after a sync.
//!
//! Trainers regenerate their source shards from `(seed, version)` before each sync, as a training
//! step would change them. To check a sync without trusting any part of the path (routing table,
//! pipeline, gathers, staging, fabric), a rollout recomputes its own tensors from the same seed:
//! it generates each logical parameter box straight from the value function, places it with the
//! inference layout's placement, and quantises with the scalar fp8 reference below (the
//! DeepSeek-V3 convention: `amax = max(max|x|, 1e-4)` per 128x128 block of the logical tensor,
//! `weight_scale_inv = amax / 448`, `q = e4m3(x * (448 / amax))` rounded to nearest even,
//! saturating). Every byte of every tensor is then compared with what landed (`crate::check`).

use rayon::prelude::*;
use weightsync_common::DType;
use weightsync_schedules::layout_infer::Piece;
use weightsync_schedules::model::Param;
use weightsync_schedules::table::{
    DstTensor, FP8_BLOCK, LocalShard, MAX_DIMS, ParamRef, Shape, TensorBox, TrainerPlan,
};
use weightsync_schedules::{InferenceLayout, Model};

fn mix(mut x: u64) -> u64 {
    // splitmix64 finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The per-(seed, version, parameter) key of [`value_from_key`].
pub fn param_key(seed: u64, version: u64, param: u32) -> u64 {
    mix(seed
        ^ mix(version.wrapping_add(0x9e37_79b9_7f4a_7c15))
        ^ mix(u64::from(param).wrapping_mul(0xc2b2_ae3d_27d4_eb4f)))
}

/// The demo weight of element `index` (row-major in the logical tensor) of the parameter whose
/// key is `key`. Roughly N(0, 0.02)-sized with a few larger values so fp8 block scales differ.
#[inline]
pub fn value_from_key(key: u64, index: u64) -> f32 {
    let h = mix(key ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
    let scale = if h & 0xff == 0 { 0.5 } else { 0.03 };
    u * scale
}

/// The demo weight of element `index` of parameter `param` for `version`.
pub fn value_f32(seed: u64, version: u64, param: u32, index: u64) -> f32 {
    value_from_key(param_key(seed, version, param), index)
}

fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let round = 0x7fff + ((bits >> 16) & 1);
    (bits.wrapping_add(round) >> 16) as u16
}

/// Rounds `v` to `dtype` and back (what a tensor of that dtype holds).
fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => f32::from_bits(u32::from(bf16_bits(v)) << 16),
        DType::F16 => half::f16::from_f32(v).to_f32(),
        _ => v,
    }
}

fn put(out: &mut Vec<u8>, v: f32, dtype: DType) {
    match dtype {
        DType::BF16 => out.extend_from_slice(&bf16_bits(v).to_le_bytes()),
        DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
        DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
        DType::F8E4M3 => out.push(e4m3(v)),
    }
}

/// float8 e4m3fn encoding, round to nearest even, saturating to ±448; NaN to 0x7f.
#[inline]
pub fn e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    if x.is_nan() {
        return sign | 0x7f;
    }
    let a = x.abs();
    if a >= 448.0 {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormals: multiples of 2^-9 (8 is the smallest normal, code 0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let b = a.to_bits();
    let mut e = ((b >> 23) & 0xff) as i32 - 127;
    let m = b & 0x7f_ffff;
    // Keep 3 mantissa bits, round to nearest even.
    let lsb = (m >> 20) & 1;
    let mut mq = (m + 0x7_ffff + lsb) >> 20;
    if mq == 8 {
        mq = 0;
        e += 1;
    }
    let code = (((e + 7) as u32) << 3) | mq;
    sign | code.min(0x7e) as u8
}

fn box_rows(b: &TensorBox) -> (u64, u32) {
    let nd = b.ndim as usize;
    let rows: u64 = b.len[..nd.saturating_sub(1)]
        .iter()
        .map(|&d| u64::from(d))
        .product();
    (rows, if nd == 0 { 1 } else { b.len[nd - 1] })
}

/// Coordinates (in the box's own dims) of row `r` of a box, last dim at its start.
fn row_coords(b: &TensorBox, mut r: u64) -> [u32; MAX_DIMS] {
    let nd = b.ndim as usize;
    let mut c = b.start;
    for d in (0..nd.saturating_sub(1)).rev() {
        let l = u64::from(b.len[d]);
        c[d] = b.start[d] + (r % l) as u32;
        r /= l;
    }
    c
}

fn flat(shape: &Shape, c: &[u32; MAX_DIMS]) -> u64 {
    let s = shape.strides();
    (0..shape.ndim as usize)
        .map(|d| u64::from(c[d]) * s[d])
        .sum()
}

/// Fills one training shard of `plan` for `version`.
pub fn fill_shard(
    arena_part: &mut [u8],
    shard: &LocalShard,
    param: &ParamRef,
    seed: u64,
    version: u64,
) {
    let (_, row_len) = box_rows(&shard.global);
    let es = shard.dtype.size();
    let row_bytes = row_len as usize * es;
    if row_bytes == 0 {
        return;
    }
    let key = param_key(seed, version, param.id);
    arena_part
        .par_chunks_mut(row_bytes)
        .enumerate()
        .for_each(|(r, out)| {
            let c = row_coords(&shard.global, r as u64);
            let base = flat(&param.shape, &c);
            let mut buf = Vec::with_capacity(row_bytes);
            for i in 0..u64::from(row_len) {
                put(&mut buf, value_from_key(key, base + i), shard.dtype);
            }
            out.copy_from_slice(&buf);
        });
}

/// Fills a trainer's whole source arena for `version`.
pub fn fill_trainer_arena(plan: &TrainerPlan, seed: u64, version: u64, arena: &mut [u8]) {
    for s in &plan.shards {
        let Some(p) = plan.params.get(s.param as usize) else {
            continue;
        };
        let (a, b) = (s.offset as usize, (s.offset + s.bytes()) as usize);
        if let Some(part) = arena.get_mut(a..b) {
            fill_shard(part, s, p, seed, version);
        }
    }
}

/// A run of bytes to place in a rollout's region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placed {
    /// The region (MR) index.
    pub mr: u16,
    /// Byte offset in the region.
    pub offset: u64,
    /// The bytes.
    pub bytes: Vec<u8>,
}

/// The bytes every region of inference rank `rank` must hold for `version`.
pub fn expected_rollout(
    model: &Model,
    infer: &InferenceLayout,
    rank: u32,
    seed: u64,
    version: u64,
) -> Vec<Vec<u8>> {
    let Some(r) = infer.ranks.get(rank as usize) else {
        return Vec::new();
    };
    let pieces: Vec<&Piece> = infer.pieces.iter().filter(|p| p.rank == rank).collect();
    let placed: Vec<Vec<Placed>> = pieces
        .par_iter()
        .map(|p| place_piece(model, r, p, seed, version))
        .collect();
    let mut mrs: Vec<Vec<u8>> = r.mr_bytes.iter().map(|&n| vec![0u8; n as usize]).collect();
    for run in placed.into_iter().flatten() {
        if let Some(mr) = mrs.get_mut(run.mr as usize) {
            let a = run.offset as usize;
            if let Some(dst) = mr.get_mut(a..a + run.bytes.len()) {
                dst.copy_from_slice(&run.bytes);
            }
        }
    }
    mrs
}

fn dst_offset(t: &DstTensor, p: &Piece, lead: usize, src_c: &[u32; MAX_DIMS], nd: usize) -> u64 {
    let mut c = [0u32; MAX_DIMS];
    c[..lead].copy_from_slice(&p.dst_start[..lead]);
    for i in 0..nd {
        c[lead + i] = p.dst_start[lead + i] + (src_c[i] - p.src.start[i]);
    }
    t.offset + flat(&t.shape, &c) * t.dtype.size() as u64
}

/// The demo values of one parameter for one version.
struct ParamValues<'m> {
    param: &'m Param,
    key: u64,
}

impl ParamValues<'_> {
    /// `n` values of the row starting at logical coordinates `c`, rounded to the parameter's
    /// dtype (the last dim is contiguous in the logical tensor: element i is base + i).
    fn row(&self, c: &[u32; MAX_DIMS], n: u32) -> Vec<f32> {
        let base = flat(&self.param.shape, c);
        (0..u64::from(n))
            .map(|i| round_to(value_from_key(self.key, base + i), self.param.dtype))
            .collect()
    }
}

/// The runs of bytes piece `p` of inference rank `r` places for `version`: its rows converted
/// to the tensor's dtype, or its fp8 rows and block scales.
pub fn place_piece(
    model: &Model,
    r: &weightsync_schedules::layout_infer::InferRank,
    p: &Piece,
    seed: u64,
    version: u64,
) -> Vec<Placed> {
    let values = ParamValues {
        param: &model.params[p.param as usize],
        key: param_key(seed, version, p.param),
    };
    let t = &r.tensors[p.tensor as usize];
    if t.dtype == DType::F8E4M3 {
        place_fp8(r, t, p, &values)
    } else {
        place_rows(t, p, &values)
    }
}

/// An unquantised piece: each row of its box, converted to the tensor's dtype.
fn place_rows(t: &DstTensor, p: &Piece, values: &ParamValues) -> Vec<Placed> {
    let nd = p.src.ndim as usize;
    let lead = (t.shape.ndim as usize).saturating_sub(nd);
    let (rows, row_len) = box_rows(&p.src);
    (0..rows)
        .map(|row| {
            let c = row_coords(&p.src, row);
            let mut bytes = Vec::with_capacity(row_len as usize * t.dtype.size());
            for v in values.row(&c, row_len) {
                put(&mut bytes, v, t.dtype);
            }
            Placed {
                mr: t.mr,
                offset: dst_offset(t, p, lead, &c, nd),
                bytes,
            }
        })
        .collect()
}

/// An fp8 piece: blocks of 128x128 over the box's last two dims, for each index of the others;
/// each block's scale and its quantised rows.
fn place_fp8(
    r: &weightsync_schedules::layout_infer::InferRank,
    t: &DstTensor,
    p: &Piece,
    values: &ParamValues,
) -> Vec<Placed> {
    let nd = p.src.ndim as usize;
    let lead = (t.shape.ndim as usize).saturating_sub(nd);
    let (rows, _) = box_rows(&p.src);
    let rows_dim = nd.saturating_sub(2);
    let (nrows, ncols) = if nd >= 2 {
        (p.src.len[nd - 2], p.src.len[nd - 1])
    } else {
        (1, p.src.len[0])
    };
    let outer = rows / u64::from(nrows.max(1));
    let b = FP8_BLOCK;
    let (rb, cb) = (nrows.div_ceil(b), ncols.div_ceil(b));
    let scale_t = p.scale.map(|s| (&r.tensors[s.tensor as usize], s));
    let mut out = Vec::new();
    for o in 0..outer {
        let first = row_coords(&p.src, o * u64::from(nrows));
        let at_row = |i: u32| {
            let mut c = first;
            if nd >= 2 {
                c[rows_dim] += i;
            }
            c
        };
        let vals: Vec<Vec<f32>> = (0..nrows).map(|i| values.row(&at_row(i), ncols)).collect();
        let mut inv = vec![0f32; (rb * cb) as usize];
        for bi in 0..rb {
            for bj in 0..cb {
                let amax = block_amax(&vals, bi, bj).max(1e-4);
                inv[(bi * cb + bj) as usize] = 448.0 / amax;
                if let Some((st, place)) = scale_t {
                    out.push(scale_placed(st, &place, p, &first, [bi, bj], amax));
                }
            }
        }
        for (i, row) in vals.iter().enumerate() {
            let bi = i as u32 / b;
            let bytes = row
                .iter()
                .enumerate()
                .map(|(j, &v)| e4m3(v * inv[(bi * cb + j as u32 / b) as usize]))
                .collect();
            out.push(Placed {
                mr: t.mr,
                offset: dst_offset(t, p, lead, &at_row(i as u32), nd),
                bytes,
            });
        }
    }
    out
}

/// The largest finite magnitude in block `(bi, bj)` of a matrix's rows.
fn block_amax(vals: &[Vec<f32>], bi: u32, bj: u32) -> f32 {
    let b = FP8_BLOCK as usize;
    let (bi, bj) = (bi as usize, bj as usize);
    let mut amax = 0f32;
    for row in vals.iter().take((bi + 1) * b).skip(bi * b) {
        let cols = &row[bj * b..((bj + 1) * b).min(row.len())];
        for v in cols.iter().filter(|v| v.is_finite()) {
            amax = amax.max(v.abs());
        }
    }
    amax
}

/// Block `bi_bj`'s `weight_scale_inv` (`amax / 448`, f32), placed in the scale tensor.
fn scale_placed(
    st: &DstTensor,
    place: &weightsync_schedules::layout_infer::ScalePlace,
    p: &Piece,
    first: &[u32; MAX_DIMS],
    [bi, bj]: [u32; 2],
    amax: f32,
) -> Placed {
    let nd = p.src.ndim as usize;
    let snd = st.shape.ndim as usize;
    let mut c = place.start;
    // Non-block dims of the box (e.g. the expert index) map one to one.
    let slead = snd.saturating_sub(nd);
    for d in 0..nd.saturating_sub(2) {
        c[slead + d] = place.start[slead + d] + (first[d] - p.src.start[d]);
    }
    c[snd - 2] += bi;
    c[snd - 1] += bj;
    Placed {
        mr: st.mr,
        offset: st.offset + flat(&st.shape, &c) * 4,
        bytes: (amax / 448.0).to_le_bytes().to_vec(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_matches_known_codes() {
        assert_eq!(e4m3(0.0), 0x00);
        assert_eq!(e4m3(-0.0), 0x80);
        assert_eq!(e4m3(448.0), 0x7e);
        assert_eq!(e4m3(1e9), 0x7e);
        assert_eq!(e4m3(f32::INFINITY), 0x7e);
        assert_eq!(e4m3(f32::NAN) & 0x7f, 0x7f);
        assert_eq!(e4m3(1.0), 0x38);
        assert_eq!(e4m3(-2.0), 0xc0);
        assert_eq!(e4m3(2f32.powi(-9)), 0x01); // smallest subnormal
        assert_eq!(e4m3(2f32.powi(-10)), 0x00); // tie to even
        assert_eq!(e4m3(1.0625), 0x38); // halfway 1.0..1.125, ties to even (1.0)
        assert_eq!(e4m3(1.1875), 0x3a); // halfway 1.125..1.25 -> even mantissa 2
        assert_eq!(e4m3(2f32.powi(-6)), 0x08);
    }

    #[test]
    fn values_are_deterministic_and_change_with_version() {
        assert_eq!(value_f32(1, 2, 3, 4), value_f32(1, 2, 3, 4));
        assert_ne!(value_f32(1, 2, 3, 4), value_f32(1, 3, 3, 4));
        assert!(value_f32(9, 9, 9, 9).abs() <= 0.5);
    }
}
