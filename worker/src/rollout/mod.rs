//! The rollout receiver: an inference rank's weights, and the certainty that a version landed.
//!
//! An inference rank allocates its destination tensors as the table's
//! [`RolloutPlan`] lays them out (in practice one arena, MR 0) and registers them **once**, when
//! the worker is built: registration is slow and must never sit on the sync path. It publishes
//! the descriptors and its layout to the controller.
//!
//! Per sync, the controller tells it to [`arm`](RolloutWorker::arm) for `(version, epoch)`
//! *before* any trainer writes: that registers one expectation per immediate unit with the
//! fabric's [`ImmCounter`](weightsync_common::fabric::ImmCounter), counting the table's number
//! of writes carrying `imm_for(epoch, unit)`. [`await_landed`](RolloutWorker::await_landed)
//! returns only when every expected write has fully landed; it is the only way a version is
//! reported landed, so a version is never reported while a write is still in flight, and a write
//! of an earlier, aborted epoch can never count (different immediate, retired by
//! [`abort`](RolloutWorker::abort)). Optional verification compares xxh3 checksums of every run
//! against what landed and names the tensor on a mismatch (see [`crate::checksum`]). When the
//! fabric logs what lands (the TCP backend does) and a round was verified, the next rounds'
//! runs are hashed while the rest still lands, and verification uses those hashes for the runs
//! no frame touched since (see `early_check`): committing then costs little more than the
//! control round trips.
//!
//! An engine that lands weights in its own parameters builds the receiver over the regions it
//! registered ([`RolloutWorker::with_regions`]) with a [`Placement`]; the receiver then holds its
//! tensors in those actual coordinates, and reading, coverage and verification work on them
//! unchanged.
//!
//! A destination in device memory behind a fabric that writes host memory (TCP) keeps the
//! regions as pinned bounce buffers and copies them to the device before a version counts as
//! landed ([`RolloutWorker::set_device_landing`], [`DeviceLanding`]).

mod device_landing;
mod early_check;
mod inbox;

pub use device_landing::DeviceLanding;

use early_check::{EarlyCheck, EarlyHashes, RunKey};

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use weightsync_common::fabric::{
    Access, FabricBackend, ImmWait, LandingLog, Region, RegionDescriptor,
};
use weightsync_schedules::job::same_rollout_layout;
use weightsync_schedules::table::{DstTensor, RolloutPlan};

use crate::checksum::{RunChecksum, xxh3_in_region};
use crate::error::{Result, WorkerError};
use crate::imm_tag::imm_for;
use crate::placement::Placement;
use crate::sync::SyncId;
use crate::timeline::{Timeline, TimelineRecorder};
use weightsync_common::protocol::{Stage, WHOLE_SYNC};

/// A sync armed and not yet landed.
struct Armed {
    sync: SyncId,
    rec: TimelineRecorder,
    /// `(unit, writes expected, immediate, expectation)`.
    waits: Vec<(u16, u64, u32, ImmWait)>,
}

impl std::fmt::Debug for Armed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Armed").field("sync", &self.sync).finish()
    }
}

/// What `await_landed` reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Landed {
    /// The sync that landed.
    pub sync: SyncId,
    /// Writes counted.
    pub writes: u64,
    /// The wait (and verification, if any, is appended by [`RolloutWorker::verify`]).
    pub timeline: Timeline,
}

/// What `verify` checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verified {
    /// Runs compared.
    pub runs: u64,
    /// Bytes hashed.
    pub bytes: u64,
    /// Of `bytes`: those hashed while the round was still landing and untouched since (see
    /// `early_check`); the rest were hashed by `verify` itself.
    pub early_bytes: u64,
}

/// One inference rank's receiver (see the module docs).
#[derive(Debug)]
pub struct RolloutWorker<F: FabricBackend> {
    fabric: F,
    name: String,
    /// The layout as planned (what the controller's expectations are compared with).
    planned: RolloutPlan,
    /// The same tensors where they actually are (equal to `planned` without a placement).
    plan: RolloutPlan,
    placement: Option<Placement>,
    regions: Vec<Region>,
    armed: Mutex<Option<Armed>>,
    /// What lands in the regions, when the backend sees writes land.
    landing: Option<Arc<LandingLog>>,
    /// The runs of the last verified round (sorted by region and offset): what the next round's
    /// early check follows. Empty until a round was verified.
    runs: Mutex<Arc<Vec<RunKey>>>,
    /// The round's early check: running, or the hashes it took once `verify` stopped it.
    early: Mutex<Early>,
    /// Where landed bytes go next when the destination is device memory.
    device: Option<Arc<dyn DeviceLanding>>,
    /// Where trainers write deltas, when this receiver takes them (see `inbox`).
    inbox: Option<Region>,
    /// The version held, and this round's deltas (see `inbox`).
    delta: Mutex<inbox::DeltaState>,
}

/// The state of the current round's early check.
#[derive(Debug, Default)]
enum Early {
    /// None (no runs known yet, no log, or aborted).
    #[default]
    Off,
    /// Hashing runs as they land.
    Running(EarlyCheck),
    /// Stopped by `verify`: what it hashed.
    Done(Arc<EarlyHashes>),
}

/// Attaches one landing log to every region (tagged with its index), or `None` when the backend
/// cannot see writes land.
fn log_landings(regions: &[Region]) -> Option<Arc<LandingLog>> {
    let log = LandingLog::new();
    for (i, r) in regions.iter().enumerate() {
        let tag = u16::try_from(i).ok()?;
        if let Err(e) = r.log_landings(&log, tag) {
            tracing::debug!("what lands is checked after each round only: {e}");
            return None;
        }
    }
    Some(log)
}

impl<F: FabricBackend> RolloutWorker<F> {
    /// Allocates and registers every MR of `plan` (zeroed host memory), once.
    ///
    /// Give each receiver its own fabric (its own process in a deployment): rollout immediates
    /// use unit 0, so two receivers sharing one immediate counter would count each other's writes
    /// (the counter refuses a second pending expectation of one immediate as busy, so the
    /// second receiver's `await_landed` fails).
    pub fn new(fabric: F, name: impl Into<String>, plan: RolloutPlan) -> Result<RolloutWorker<F>> {
        for t in &plan.tensors {
            let mr_len = plan.mr_bytes.get(t.mr as usize).copied().ok_or_else(|| {
                WorkerError::InvalidPlan(format!(
                    "tensor {} names MR {} that does not exist",
                    t.name, t.mr
                ))
            })?;
            if t.offset + t.len > mr_len || t.len != t.shape.numel() * t.dtype.size() as u64 {
                return Err(WorkerError::InvalidPlan(format!(
                    "tensor {} ({} {}, {} bytes at {}) does not fit MR {} of {mr_len} bytes",
                    t.name, t.dtype, t.shape, t.len, t.offset, t.mr
                )));
            }
        }
        let regions = plan
            .mr_bytes
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                fabric.alloc(len as usize, Access::RECEIVE).map_err(|e| {
                    WorkerError::fabric(format!("registering MR {i} ({len} bytes)"), e)
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RolloutWorker {
            fabric,
            name: name.into(),
            planned: plan.clone(),
            plan,
            placement: None,
            landing: log_landings(&regions),
            regions,
            armed: Mutex::new(None),
            runs: Mutex::default(),
            early: Mutex::default(),
            device: None,
            inbox: None,
            delta: Mutex::default(),
        })
    }

    /// A receiver over memory the caller owns (an engine's own tensors): registers each of
    /// `regions` once, and holds `plan`'s tensors where `placement` says they are. Every planned
    /// tensor must be placed inside one region.
    pub fn with_regions(
        fabric: F,
        name: impl Into<String>,
        plan: RolloutPlan,
        regions: Vec<crate::HostMemory>,
        placement: Placement,
    ) -> Result<RolloutWorker<F>> {
        let name = name.into();
        let lens: Vec<u64> = regions.iter().map(|r| r.len() as u64).collect();
        let mut actual = plan.clone();
        actual.mr_bytes = lens.clone();
        for t in &mut actual.tensors {
            let placed = placement
                .relocate(t.mr, t.offset, t.len)
                .filter(|&(r, off)| lens.get(r as usize).is_some_and(|&l| off + t.len <= l));
            let Some((region, offset)) = placed else {
                return Err(WorkerError::InvalidPlan(format!(
                    "{name}: tensor {} ({} bytes at MR {} offset {}) is not placed inside one                      registered region",
                    t.name, t.len, t.mr, t.offset
                )));
            };
            (t.mr, t.offset) = (region, offset);
        }
        actual.tensors.sort_by_key(|t| (t.mr, t.offset));
        let regions = regions
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let len = m.len();
                fabric
                    .register(m.into_memory(), Access::RECEIVE)
                    .map_err(|e| {
                        WorkerError::fabric(
                            format!("{name}: registering region {i} ({len} bytes)"),
                            e,
                        )
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RolloutWorker {
            fabric,
            name,
            planned: plan,
            plan: actual,
            placement: Some(placement),
            landing: log_landings(&regions),
            regions,
            armed: Mutex::new(None),
            runs: Mutex::default(),
            early: Mutex::default(),
            device: None,
            inbox: None,
            delta: Mutex::default(),
        })
    }

    /// Where the planned tensors are, when not where planned (see [`Placement`]).
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// Takes the controller's expectations (how many writes land per unit per sync): `plan`
    /// must lay out exactly the tensors this receiver registered (same rank, regions and
    /// tensors); only its `expect` is new. Refused while a sync is armed.
    pub fn set_expectations(&mut self, plan: RolloutPlan) -> Result<()> {
        if !same_rollout_layout(&self.planned, &plan) {
            return Err(WorkerError::InvalidPlan(format!(
                "{}: the expectations are for another layout (rank {}, {} tensors in {:?} bytes) \
                 than the one registered (rank {}, {} tensors in {:?} bytes)",
                self.name,
                plan.rank,
                plan.tensors.len(),
                plan.mr_bytes,
                self.planned.rank,
                self.planned.tensors.len(),
                self.planned.mr_bytes
            )));
        }
        if let Some(a) = self.armed.get_mut().as_ref() {
            return Err(WorkerError::Protocol(format!(
                "{}: expectations cannot change while version {} is armed",
                self.name, a.sync.version
            )));
        }
        self.plan.expect = plan.expect.clone();
        self.planned = plan;
        // A new plan may cut the trainers' runs differently: learn them again.
        *self.runs.get_mut() = Arc::default();
        *self.early.get_mut() = Early::Off;
        Ok(())
    }

    /// Descriptors of the MRs, indexed by MR id (what trainers write into).
    pub fn descriptors(&self) -> Vec<RegionDescriptor> {
        self.regions
            .iter()
            .map(|r| r.descriptor().clone())
            .collect()
    }

    /// The tensors and where they live (actual coordinates: the regions registered).
    pub fn layout(&self) -> &[DstTensor] {
        &self.plan.tensors
    }

    /// The plan this receiver follows.
    pub fn plan(&self) -> &RolloutPlan {
        &self.plan
    }

    /// The registered region of MR `mr` (an engine reads its weights from here).
    pub fn region(&self, mr: u16) -> Option<&Region> {
        self.regions.get(mr as usize)
    }

    /// Copies one tensor out (by its engine-format name).
    pub fn read_tensor(&self, name: &str) -> Result<Vec<u8>> {
        let t = self
            .plan
            .tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| {
                WorkerError::Protocol(format!("no tensor named {name} on {}", self.name))
            })?;
        self.regions[t.mr as usize]
            .copy_to_vec(t.offset, t.len as usize)
            .map_err(|e| WorkerError::fabric(format!("reading {name}"), e))
    }

    /// Arms the counters for `sync`: must be called before any trainer writes for it.
    pub fn arm(&self, sync: SyncId) -> Result<()> {
        let mut armed = self.armed.lock();
        if let Some(a) = armed.as_ref() {
            return Err(WorkerError::Protocol(format!(
                "{}: cannot arm version {} (epoch {}): version {} (epoch {}) is still armed",
                self.name, sync.version, sync.epoch, a.sync.version, a.sync.epoch
            )));
        }
        let counter = self.fabric.imm_counter();
        let mut waits = Vec::new();
        for e in &self.plan.expect {
            if e.writes == 0 {
                continue;
            }
            let imm = imm_for(sync.epoch, e.unit as u32)?;
            waits.push((e.unit, e.writes, imm, counter.expect(imm, e.writes)));
        }
        *armed = Some(Armed {
            sync,
            rec: TimelineRecorder::start(&self.name),
            waits,
        });
        self.delta_armed(sync.version);
        self.start_early_check();
        Ok(())
    }

    /// Starts this round's early check (see `early_check`) when the backend logs landings and
    /// a verified round taught the runs; stops the previous round's first.
    fn start_early_check(&self) {
        let mut early = self.early.lock();
        *early = Early::Off;
        let Some(log) = &self.landing else {
            return;
        };
        log.restart();
        let runs = self.runs.lock().clone();
        if runs.is_empty() {
            return;
        }
        match EarlyCheck::start(&self.name, self.regions.clone(), log.clone(), runs) {
            Ok(check) => *early = Early::Running(check),
            Err(e) => tracing::warn!(
                "{}: no early check this round (cannot start its thread: {e})",
                self.name
            ),
        }
    }

    /// The hashes the round's early check took (stopping it if it still runs).
    fn early_hashes(&self) -> Option<Arc<EarlyHashes>> {
        let mut early = self.early.lock();
        if let Early::Running(_) = &*early {
            let Early::Running(check) = std::mem::take(&mut *early) else {
                unreachable!("matched just above");
            };
            *early = Early::Done(Arc::new(check.finish()));
        }
        match &*early {
            Early::Done(h) => Some(h.clone()),
            _ => None,
        }
    }

    /// Bytes the running early check hashed so far (tests wait for it).
    #[cfg(test)]
    pub(crate) fn early_hashed_bytes(&self) -> u64 {
        match &*self.early.lock() {
            Early::Running(c) => c.hashed_bytes(),
            Early::Done(h) => h.keys().map(|k| k.2).sum(),
            Early::Off => 0,
        }
    }

    /// The sync currently armed, if any.
    pub fn armed(&self) -> Option<SyncId> {
        self.armed.lock().as_ref().map(|a| a.sync)
    }

    /// Copies every landed sync to device memory before it counts as landed (see
    /// [`DeviceLanding`]); the regions stay the bounce buffers the fabric writes.
    pub fn set_device_landing(&mut self, device: Arc<dyn DeviceLanding>) {
        self.device = Some(device);
    }

    /// The receiver's regions, in MR order (for binding a [`DeviceLanding`] to them).
    pub fn regions(&self) -> &[Region] {
        &self.regions
    }

    /// Waits until every expected write of the armed sync has landed (and, with a
    /// [`DeviceLanding`], was copied to the device). On timeout the sync is
    /// aborted (its immediates retired) and the error says which unit got how many writes.
    pub async fn await_landed(&self, timeout: Duration) -> Result<Landed> {
        let armed = self.armed.lock().take().ok_or_else(|| {
            WorkerError::Protocol(format!("{}: await_landed without arm", self.name))
        })?;
        let Armed { sync, rec, waits } = armed;
        let start = rec.now_ns();
        let expected: u64 = waits.iter().map(|w| w.1).sum();
        let meta: Vec<(u16, u64, u32)> = waits.iter().map(|w| (w.0, w.1, w.2)).collect();
        let all = futures::future::try_join_all(waits.into_iter().map(|w| w.3));
        let outcome = tokio::time::timeout(timeout, all).await;
        let counter = self.fabric.imm_counter();
        match outcome {
            Ok(Ok(_)) => {
                rec.record(WHOLE_SYNC, 0, Stage::Barrier, start, expected);
                if let Some(device) = &self.device {
                    let start = rec.now_ns();
                    let (device, regions) = (device.clone(), self.regions.clone());
                    let bytes: u64 = regions.iter().map(Region::len).sum();
                    tokio::task::spawn_blocking(move || device.landed(&regions))
                        .await
                        .map_err(|e| WorkerError::Stage {
                            stage: "device landing",
                            detail: e.to_string(),
                        })??;
                    rec.record(WHOLE_SYNC, 0, Stage::H2d, start, bytes);
                }
                Ok(Landed {
                    sync,
                    writes: expected,
                    timeline: rec.finish(),
                })
            }
            Ok(Err(e)) => {
                for &(_, _, imm) in &meta {
                    counter.cancel(imm);
                }
                Err(WorkerError::fabric(
                    format!(
                        "{}: waiting for version {} (epoch {})",
                        self.name, sync.version, sync.epoch
                    ),
                    e,
                ))
            }
            Err(_) => {
                let detail: Vec<String> = meta
                    .iter()
                    .map(|&(unit, n, imm)| {
                        format!(
                            "unit {unit}: {} of {n} writes",
                            counter.unclaimed(imm).min(n)
                        )
                    })
                    .collect();
                for &(_, _, imm) in &meta {
                    counter.cancel(imm);
                }
                Err(WorkerError::fabric(
                    format!(
                        "{}: version {} (epoch {}) did not land ({})",
                        self.name,
                        sync.version,
                        sync.epoch,
                        detail.join(", ")
                    ),
                    weightsync_common::fabric::FabricError::Timeout {
                        what: "expected writes".into(),
                        after: timeout,
                    },
                ))
            }
        }
    }

    /// Aborts the armed sync (if any): its immediates are retired, so writes of it that are
    /// still in flight can never count toward a later sync.
    pub fn abort(&self) -> Option<SyncId> {
        *self.early.lock() = Early::Off;
        self.delta_aborted();
        let armed = self.armed.lock().take()?;
        let counter = self.fabric.imm_counter();
        for (_, _, imm, wait) in armed.waits {
            drop(wait);
            counter.cancel(imm);
        }
        Some(armed.sync)
    }

    /// Compares the trainers' checksums with what landed. Records for other ranks are ignored;
    /// the records for this rank must tile its tensors exactly (so verification is never
    /// vacuous). A mismatch names the tensor(s) of the run.
    pub fn verify(&self, checksums: &[RunChecksum]) -> Result<Verified> {
        let rank = self.plan.rank;
        let mut mine: Vec<RunChecksum> = checksums
            .iter()
            .filter(|c| c.rollout == rank)
            .copied()
            .collect();
        mine.sort();
        self.check_coverage(&mine)?;
        let runs: Vec<RunKey> = mine.iter().map(|c| (c.mr, c.offset, c.len)).collect();
        if **self.runs.lock() != runs {
            *self.runs.lock() = Arc::new(runs);
        }
        // A run hashed while the round landed counts only if no frame touched it since (see
        // `early_check`); every other run is read now where it landed, through a chunk buffer
        // each rayon thread keeps (see `crate::checksum`).
        let early = self.early_hashes();
        let log = self.landing.as_ref().map(|l| l.snapshot());
        let early_hash = |c: &RunChecksum| {
            // A run the apply rewrote counts with the hash the apply took of it, on the same
            // terms as an early hash: no frame touched it since.
            if let Some((h, seq)) = self.delta_applied(&(c.mr, c.offset, c.len)) {
                return log
                    .as_ref()?
                    .unchanged_since(c.mr, c.offset, c.len, seq?)
                    .then_some(h);
            }
            let (h, seq) = *early.as_ref()?.get(&(c.mr, c.offset, c.len))?;
            log.as_ref()?
                .unchanged_since(c.mr, c.offset, c.len, seq)
                .then_some(h)
        };
        thread_local! {
            static SCRATCH: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
        }
        let early_bytes = AtomicU64::new(0);
        let mismatch = mine.par_iter().find_map_first(|c| {
            let actual = if let Some(h) = early_hash(c) {
                early_bytes.fetch_add(c.len, Ordering::Relaxed);
                h
            } else {
                let region = self.regions.get(c.mr as usize)?;
                let hashed = SCRATCH
                    .with_borrow_mut(|scratch| xxh3_in_region(region, c.offset, c.len, scratch));
                match hashed {
                    Ok(h) => h,
                    Err(_) => return Some((*c, 0)),
                }
            };
            (actual != c.xxh3).then_some((*c, actual))
        });
        if let Some((c, actual)) = mismatch {
            self.delta_lost();
            return Err(WorkerError::ChecksumMismatch {
                tensors: self.tensors_in(c.mr, c.offset, c.len),
                rank,
                mr: c.mr,
                offset: c.offset,
                len: c.len,
                expected: c.xxh3,
                actual,
            });
        }
        self.delta_held();
        Ok(Verified {
            runs: mine.len() as u64,
            bytes: mine.iter().map(|c| c.len).sum(),
            early_bytes: early_bytes.into_inner(),
        })
    }

    /// Names of the tensors overlapping `[offset, offset + len)` of `mr`.
    fn tensors_in(&self, mr: u16, offset: u64, len: u64) -> String {
        let names: Vec<&str> = self
            .plan
            .tensors
            .iter()
            .filter(|t| t.mr == mr && t.offset < offset + len && offset < t.offset + t.len)
            .map(|t| t.name.as_str())
            .collect();
        if names.is_empty() {
            "no tensor".into()
        } else {
            names.join(", ")
        }
    }

    fn check_coverage(&self, sorted: &[RunChecksum]) -> Result<()> {
        let rank = self.plan.rank;
        let expected: u64 = self.plan.tensors.iter().map(|t| t.len).sum();
        let covered: u64 = sorted.iter().map(|c| c.len).sum();
        let fail = |detail: String| WorkerError::ChecksumCoverage {
            rank,
            covered,
            expected,
            detail,
        };
        // Tensor bytes per MR, adjacent tensors merged.
        let mut spans: BTreeMap<u16, Vec<(u64, u64)>> = BTreeMap::new();
        let mut tensors: Vec<&DstTensor> = self.plan.tensors.iter().collect();
        tensors.sort_by_key(|t| (t.mr, t.offset));
        for t in tensors {
            let v = spans.entry(t.mr).or_default();
            match v.last_mut() {
                Some(last) if last.1 == t.offset => last.1 += t.len,
                _ => v.push((t.offset, t.offset + t.len)),
            }
        }
        for w in sorted.windows(2) {
            if w[0].mr == w[1].mr && w[0].offset + w[0].len > w[1].offset {
                return Err(fail(format!(
                    "runs at {} and {} of MR {} overlap",
                    w[0].offset, w[1].offset, w[0].mr
                )));
            }
        }
        for c in sorted {
            let inside = spans.get(&c.mr).is_some_and(|v| {
                v.iter()
                    .any(|&(a, b)| c.offset >= a && c.offset + c.len <= b)
            });
            if !inside {
                return Err(fail(format!(
                    "run {}..{} of MR {} is not inside the tensors",
                    c.offset,
                    c.offset + c.len,
                    c.mr
                )));
            }
        }
        if covered != expected {
            return Err(fail("some tensor bytes have no checksum".into()));
        }
        Ok(())
    }
}
