//! The trainer's half of a delta sync: its bases, and the encoding of each piece's runs.
//!
//! **Bases.** With [`DeltaConfig::keep_bases`] the trainer keeps, per task that writes to
//! engines, the task's whole prepared output as it last wrote it (every sync, full or delta,
//! refreshes the bytes it wrote). That costs host memory equal to the trainer's prepared bytes
//! for engines (its shard of the inference weights: a bf16 job's shard in bf16, an fp8 job's in
//! fp8 plus scales), bounded by [`DeltaConfig::base_budget_bytes`]: tasks past the budget keep
//! no base and always go dense. Tasks with a base are staged even when they could be written
//! straight from registered source memory, since their bytes must be compared and kept, unless
//! they went dense (below), or unless they are same-dtype copies of a contiguous box of a shard
//! the host reads: those are compared with the base where the source holds them (no copy into
//! staging but their encodings), and their runs that go dense are written straight from the
//! source as a full sync writes them where it is registered, else copied into staging (only
//! they) and written from there.
//!
//! **Dense tasks.** A task whose last compared sync found more changes than any encoding of it
//! can hold ([`Bases::routes`], above [`dense_above`]) gains nothing from staging and comparing:
//! its next syncs take the full sync's path ([`Route::Dense`]: written straight from registered
//! source memory where the task can be, else prepared into staging; no compare, no base copy)
//! and its base goes *stale*: it no longer holds what the engine holds, so no delta is encoded
//! against it (the engine's own bytes are right: a dense write leaves them equal to the new
//! version). To notice changes thinning out, every [`REFRESH_EVERY`]-th sync of a task that
//! stays dense refreshes its base ([`Route::Refresh`]: staged, base copied, written dense) and the
//! sync after compares again ([`Route::Compare`], sampled); a task found sparse there goes back
//! to deltas.
//!
//! The bases hold version N only when sync N succeeded on this trainer
//! ([`Bases::version`]); a sync that fails or is cancelled leaves them at no version, so the
//! next sync is dense for every engine until one succeeds (the controller makes every engine
//! of a failed sync take a full sync next anyway). A task that went dense keeps a stale base
//! whatever the version says; no delta is encoded against it until it was refreshed (below).
//!
//! **Encoding.** In the prepare stage, once a piece's bytes are prepared (and hashed), every
//! part written to an engine that takes deltas this sync ([`DeltaSync`]) is encoded against the
//! base ([`crate::delta::codec`]) into the tail of the piece's staging lease (sized for it when
//! the piece was planned: [`enc_need`]); replicas of one run share one encoding. A part goes as
//! a delta only if its encoding is at most [`DeltaConfig::max_fraction`] of its dense bytes and
//! fits the run's slot of that engine's inbox; then its write (same immediate, same gating of
//! split writes) goes to the inbox instead of the destination, and a [`DeltaRecord`] tells the
//! receiver where it is. Then the base takes the piece's new bytes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use weightsync_common::fabric::RegionDescriptor;
use weightsync_common::protocol::{DeltaFigures, DeltaRecord};
use weightsync_schedules::table::{TrainerPlan, WriteTarget};

use super::WriteDst;
use super::piece::TaskPiece;
use crate::delta::codec::{Encoded, encode_hashed, refresh_hashed, sample_changes};
use crate::delta::{InboxMap, element_size};

/// How a trainer does delta syncs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeltaConfig {
    /// Keep the prepared bytes of every sync (what a delta is encoded against). Off: every sync
    /// is full, and tasks are written straight from registered source memory where they can be.
    pub keep_bases: bool,
    /// Most bytes of bases kept (tasks in plan order until the budget is spent); `None`: all.
    pub base_budget_bytes: Option<u64>,
    /// Keep bases also of tasks that could be written straight from registered source memory
    /// (same-dtype copies of contiguous boxes), staging them while they are compared (a task
    /// that went dense is written from the source again). Off: those stay zero-copy and
    /// always go dense; deltas pay where the trainer stages anyway (casts from f32 master
    /// weights, fp8 quantisation), which a real RL trainer's tasks are.
    #[serde(default)]
    pub keep_direct: bool,
    /// A run goes as a delta only if its encoding is at most this fraction of its dense bytes.
    pub max_fraction: f64,
}

impl Default for DeltaConfig {
    fn default() -> Self {
        DeltaConfig {
            keep_bases: false,
            base_budget_bytes: None,
            keep_direct: false,
            max_fraction: 0.5,
        }
    }
}

/// What the controller tells a trainer about one sync's deltas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeltaSync {
    /// The version every engine in `rollouts` holds, committed by the same run.
    pub base_version: u64,
    /// The rollout ranks that take deltas this sync (every other rank gets dense writes).
    pub rollouts: BTreeSet<u32>,
}

/// An engine's inbox as a trainer sees it.
#[derive(Debug, Clone)]
pub(crate) struct Inbox {
    pub desc: RegionDescriptor,
    pub map: InboxMap,
}

impl Inbox {
    /// The inbox `desc` of an engine whose regions are `regions`.
    pub(crate) fn new(desc: RegionDescriptor, regions: &[RegionDescriptor]) -> Inbox {
        let lens: Vec<u64> = regions.iter().map(|r| r.len).collect();
        Inbox {
            map: InboxMap::new(&lens, desc.len),
            desc,
        }
    }
}

/// Of every this many syncs of a task that stays dense, one refreshes its base and the next
/// compares; the others are written as a full sync writes them (see the module docs). Higher:
/// less staging while dense, slower to return to deltas when changes thin out.
pub(crate) const REFRESH_EVERY: u32 = 8;

/// How one task goes in one sync (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// Staged, compared with its base (deltas where they fit), base brought up to date.
    Compare,
    /// Staged, its stale base overwritten with what it writes (no compare, no deltas).
    Refresh,
    /// As in a full sync: straight from registered source memory where it can be, no compare,
    /// base left stale (also every task that keeps no base).
    Dense,
}

/// Where a task's base stands between syncs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BaseState {
    /// It holds what the task last wrote (once that sync succeeded: [`Bases::version`]).
    Current,
    /// The task went dense `syncs` syncs in a row: the base holds older bytes.
    Stale { syncs: u32 },
    /// Refreshed by the last sync: the next compares.
    Refreshed,
}

/// The changed fraction above which no encoding of `elem`-byte elements fits in `max_fraction`
/// of their dense bytes: gaps cost `1 + elem` bytes per change, a bitmap `1/8` per element plus
/// `elem` per change.
pub(crate) fn dense_above(elem: usize, max_fraction: f64) -> f64 {
    let (e, m) = (elem as f64, max_fraction.clamp(0.0, 1.0));
    (m * e / (1.0 + e)).max(m - 1.0 / (8.0 * e))
}

/// The trainer's bases (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Bases {
    /// Per task, its prepared output as last written (`None`: no base kept).
    tasks: Vec<Option<Mutex<Vec<u8>>>>,
    /// The version of the last sync, when it succeeded: every base that is not stale holds
    /// what that sync wrote.
    version: Mutex<Option<u64>>,
    /// Bytes kept.
    bytes: u64,
    /// Per task, the changed fraction its runs showed last sync (`f32` bits): what the next
    /// sync's encoding expects (see [`encode_piece`]).
    fractions: Vec<AtomicU32>,
    /// Per task, where its base stands (see [`Bases::routes`]).
    states: Mutex<Vec<BaseState>>,
    /// Per task, the changed fraction above which it goes dense ([`dense_above`]).
    dense: Vec<f64>,
}

impl Bases {
    /// Bases for the tasks of `plan` that write to engines and that `wanted` accepts, within
    /// the budget.
    pub(crate) fn new(
        plan: &TrainerPlan,
        config: &DeltaConfig,
        wanted: impl Fn(u32) -> bool,
    ) -> Bases {
        if !config.keep_bases {
            return Bases::default();
        }
        let mut left = config.base_budget_bytes.unwrap_or(u64::MAX);
        let mut bytes = 0;
        let tasks = plan
            .tasks
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if !wanted(i as u32) {
                    return None;
                }
                let writes = &plan.writes[t.first_write as usize..][..t.num_writes as usize];
                let to_engines = writes
                    .iter()
                    .any(|w| matches!(w.dst, WriteTarget::Rollout(_)));
                let need = t.prepared_bytes();
                if !to_engines || need > left {
                    return None;
                }
                left -= need;
                bytes += need;
                // Zeroed pages are mapped on first touch: a base costs memory once written.
                Some(Mutex::new(vec![0u8; need as usize]))
            })
            .collect();
        Bases {
            fractions: (0..plan.tasks.len()).map(|_| AtomicU32::new(0)).collect(),
            states: Mutex::new(vec![BaseState::Current; plan.tasks.len()]),
            dense: plan
                .tasks
                .iter()
                .map(|t| dense_above(element_size(&t.transform), config.max_fraction))
                .collect(),
            tasks,
            version: Mutex::new(None),
            bytes,
        }
    }

    /// Whether task `t` keeps a base.
    pub(crate) fn kept(&self, t: u32) -> bool {
        self.tasks.get(t as usize).is_some_and(Option::is_some)
    }

    /// Bytes of bases kept.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The version the bases hold (`None` while a sync runs, after a failed one, or before any).
    pub(crate) fn version(&self) -> Option<u64> {
        *self.version.lock()
    }

    /// A sync starts (`None`: the bases are being rewritten) or succeeded (`Some(version)`).
    pub(crate) fn set_version(&self, version: Option<u64>) {
        *self.version.lock() = version;
    }

    /// How each of the plan's `tasks` goes in the sync that starts now, and where its base will stand after it
    /// (see the module docs). Called once per sync, before any piece runs. A sync that fails
    /// leaves the bases at no version, so the next encodes no delta whatever the routes say
    /// (and its compared tasks copy their bases whole).
    pub(crate) fn routes(&self, tasks: usize) -> Vec<Route> {
        let mut states = self.states.lock();
        (0..tasks)
            .map(|t| {
                if !self.kept(t as u32) {
                    return Route::Dense;
                }
                let state = &mut states[t];
                let fraction = f64::from(f32::from_bits(self.fractions[t].load(Ordering::Relaxed)));
                let (route, next) = match *state {
                    BaseState::Current if fraction > self.dense[t] => {
                        (Route::Dense, BaseState::Stale { syncs: 1 })
                    }
                    BaseState::Current | BaseState::Refreshed => {
                        (Route::Compare, BaseState::Current)
                    }
                    BaseState::Stale { syncs } if syncs + 2 < REFRESH_EVERY => {
                        (Route::Dense, BaseState::Stale { syncs: syncs + 1 })
                    }
                    BaseState::Stale { .. } => (Route::Refresh, BaseState::Refreshed),
                };
                *state = next;
                route
            })
            .collect()
    }
}

/// Staging bytes a piece needs for its encodings (0: the piece never goes as a delta).
pub(crate) fn enc_need(
    plan: &TrainerPlan,
    piece: &TaskPiece,
    bases: &Bases,
    config: &DeltaConfig,
) -> u64 {
    if !bases.kept(piece.task) {
        return 0;
    }
    let mut seen = BTreeSet::new();
    let mut need = 0;
    for part in &piece.parts {
        let w = plan.writes[part.write as usize];
        if !matches!(w.dst, WriteTarget::Rollout(_)) {
            continue;
        }
        let po = w.src_offset + (part.dst_offset - w.dst_offset);
        if seen.insert((po, part.len)) {
            need += enc_cap(part.len, config).next_multiple_of(8);
        }
    }
    need
}

fn enc_cap(len: u64, config: &DeltaConfig) -> u64 {
    (len as f64 * config.max_fraction.clamp(0.0, 1.0)) as u64
}

/// How one part of a piece is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PartMode {
    /// Its prepared bytes to its destination.
    Dense,
    /// Its encoding, `enc_len` bytes at `enc_at` of the lease, to `inbox_at` of its engine's
    /// inbox.
    Delta {
        enc_at: u64,
        enc_len: u64,
        inbox_at: u64,
    },
}

/// What encoding one piece gave.
#[derive(Debug, Default)]
pub(crate) struct PieceDelta {
    /// Per part of the piece, in order.
    pub modes: Vec<PartMode>,
    /// Per part of the piece, in order: the xxh3 of its prepared bytes, for every part written
    /// to a rollout (taken in the pass that compared them or copied them into the base).
    pub hashes: Vec<Option<u64>>,
    pub records: Vec<DeltaRecord>,
    pub figures: DeltaFigures,
}

/// What [`encode_piece`] reads of the trainer.
pub(crate) struct EncodeCtx<'a> {
    pub plan: &'a TrainerPlan,
    pub write_dst: &'a [WriteDst],
    pub inboxes: &'a BTreeMap<u32, Inbox>,
    pub bases: &'a Bases,
    pub config: &'a DeltaConfig,
    /// This sync's deltas, when the bases hold its base version and the piece's task is
    /// compared ([`Route::Compare`]; a refreshed task's base is stale: `None`).
    pub active: Option<&'a DeltaSync>,
}

/// Encodes the parts of piece `piece` (its prepared bytes `prepared`, in staging or where the
/// source holds them; encodings going to `enc_area`, which lies at `enc_at` of the piece's
/// lease) and refreshes the task's base (see the module docs).
pub(crate) fn encode_piece(
    ctx: &EncodeCtx<'_>,
    piece: &TaskPiece,
    prepared: &[u8],
    enc_area: &mut [u8],
    enc_at: u64,
) -> PieceDelta {
    let mut out = PieceDelta {
        modes: vec![PartMode::Dense; piece.parts.len()],
        hashes: vec![None; piece.parts.len()],
        ..PieceDelta::default()
    };
    let Some(Some(base)) = ctx.bases.tasks.get(piece.task as usize) else {
        return out;
    };
    let start = Instant::now();
    let elem = element_size(&ctx.plan.tasks[piece.task as usize].transform);
    let total = enc_at;
    let mut base = base.lock();
    let fraction = &ctx.bases.fractions[piece.task as usize];
    let expected = f64::from(f32::from_bits(fraction.load(Ordering::Relaxed)));
    let (mut scanned, mut changed) = (0u64, 0u64);
    // Per distinct run of the task's output whose base is up to date: where its encoding is
    // (`None`: it goes dense).
    let mut encoded: Vec<(Run, Option<(u64, Encoded)>)> = Vec::new();
    // Per distinct run compared or copied into the base: the hash of its prepared bytes.
    let mut hashed: Vec<(Run, u64)> = Vec::new();
    let mut cursor = 0usize;
    for (i, part) in piece.parts.iter().enumerate() {
        let w = ctx.plan.writes[part.write as usize];
        let WriteTarget::Rollout(rollout) = w.dst else {
            continue;
        };
        let po = w.src_offset + (part.dst_offset - w.dst_offset);
        let inbox = ctx.inboxes.get(&rollout);
        let wanted = ctx.active.is_some_and(|a| a.rollouts.contains(&rollout));
        let aligned = po.is_multiple_of(elem as u64) && part.len.is_multiple_of(elem as u64);
        let (Some(active), Some(inbox), true, true) = (ctx.active, inbox, wanted, aligned) else {
            continue;
        };
        let dst = &ctx.write_dst[part.write as usize];
        let dst_offset = dst.offset + (part.dst_offset - w.dst_offset);
        let Some((inbox_at, slot)) = inbox.map.slot(dst.mr, dst_offset, part.len) else {
            continue;
        };
        let run = (po, part.len);
        // A run overlapping one already compared (not a replica of it) would compare against
        // a base brought up to date: it goes dense.
        let overlaps = |&((a, l), _): &((u64, u64), _)| a < po + part.len && po < a + l;
        let entry = match encoded.iter().position(|e| e.0 == run) {
            Some(at) => encoded[at].1,
            None if encoded.iter().any(overlaps) => continue,
            None => {
                let from = part.staging_offset as usize;
                let new = &prepared[from..from + part.len as usize];
                let old = &mut base[po as usize..(po + part.len) as usize];
                let cap = (enc_cap(part.len, ctx.config) as usize)
                    .min(slot as usize)
                    .min(enc_area.len() - cursor);
                let got = encode_run(
                    old,
                    new,
                    elem,
                    &mut enc_area[cursor..cursor + cap],
                    expected,
                );
                scanned += got.scanned;
                changed += got.changed;
                hashed.push((run, got.hash));
                let entry = got.encoded.map(|enc| {
                    let at = cursor;
                    cursor += enc.len.next_multiple_of(8);
                    (total + at as u64, enc)
                });
                encoded.push((run, entry));
                entry
            }
        };
        let Some((enc_at, enc)) = entry else {
            continue;
        };
        // An empty encoding still travels as one byte: the write carries the immediate.
        let enc_len = enc.len as u64;
        if enc_len.max(1) > slot || enc_at + enc_len.max(1) > total + enc_area.len() as u64 {
            continue;
        }
        out.modes[i] = PartMode::Delta {
            enc_at,
            enc_len,
            inbox_at,
        };
        out.figures.delta_bytes += enc_len.max(1);
        out.figures.delta_run_bytes += part.len;
        out.records.push(DeltaRecord {
            rollout,
            mr: dst.mr,
            offset: dst_offset,
            len: part.len,
            inbox_offset: inbox_at,
            enc_len,
            kind: enc.kind,
            elem: elem as u8,
            base_version: active.base_version,
        });
    }
    out.figures.elements += scanned;
    out.figures.changed += changed;
    if scanned > 0 {
        fraction.store(
            (changed as f32 / scanned as f32).to_bits(),
            Ordering::Relaxed,
        );
    }
    // The base takes what this sync wrote (the runs compared above are up to date already),
    // hashed in the same pass.
    for (i, part) in piece.parts.iter().enumerate() {
        let w = ctx.plan.writes[part.write as usize];
        if matches!(w.dst, WriteTarget::Rollout(_)) {
            let po = w.src_offset + (part.dst_offset - w.dst_offset);
            let run = (po, part.len);
            let hash = match hashed.iter().find(|h| h.0 == run) {
                Some(&(_, h)) => h,
                None => {
                    let (po, from) = (po as usize, part.staging_offset as usize);
                    let h = refresh_hashed(
                        &mut base[po..po + part.len as usize],
                        &prepared[from..from + part.len as usize],
                    );
                    hashed.push((run, h));
                    h
                }
            };
            out.hashes[i] = Some(hash);
        }
    }
    out.figures.codec_ns += start.elapsed().as_nanos() as u64;
    out
}

/// A run of a task's prepared output: `(offset, length)`.
type Run = (u64, u64);

/// What encoding one run came to.
struct RunEncoding {
    encoded: Option<Encoded>,
    /// The xxh3 of the run's new bytes.
    hash: u64,
    /// Elements compared, and of those changed (all of them, a prefix, or a sample).
    scanned: u64,
    changed: u64,
}

/// Of the 64-byte blocks of a run expected to go dense, one in this many is compared (to
/// notice when its changes thin out again).
const SAMPLE_STRIDE: usize = 16;

/// Encodes one run into `out` (its capacity) and brings `base` up to date, guided by the
/// changed fraction its task showed last sync (`expected`): a run whose encoding would not fit
/// at that fraction is not scanned (its base is copied, a sample of its blocks compared).
fn encode_run(
    base: &mut [u8],
    new: &[u8],
    elem: usize,
    out: &mut [u8],
    expected: f64,
) -> RunEncoding {
    let elems = (new.len() / elem) as f64;
    let changes = expected * elems;
    let gaps = changes * (1 + elem) as f64;
    let bitmap = elems / 8.0 + changes * elem as f64;
    if gaps.min(bitmap) > out.len() as f64 {
        let (scanned, changed) = sample_changes(base, new, elem, SAMPLE_STRIDE);
        let hash = refresh_hashed(base, new);
        return RunEncoding {
            encoded: None,
            hash,
            scanned,
            changed,
        };
    }
    match encode_hashed(base, new, elem, out) {
        (Ok(enc), hash) => RunEncoding {
            encoded: Some(enc),
            hash,
            scanned: elems as u64,
            changed: enc.changed,
        },
        (Err(over), hash) => RunEncoding {
            encoded: None,
            hash,
            scanned: over.scanned,
            changed: over.changed,
        },
    }
}
