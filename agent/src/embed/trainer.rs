//! [`TrainerHandle`]: a training rank's shards, registered in place, pushed version by version.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use weightsync_common::DType;
use weightsync_common::fabric::Fabric;
use weightsync_common::protocol::{FromWorker, TensorMeta, WorkerId, WorldSpec};
use weightsync_common::secret::Secret;
use weightsync_schedules::job;
use weightsync_worker::{ArenaTensor, SourceError, SyncReport, TensorSet, shard_names};

use super::session::{End, Ends, LEAVE_WITHIN, Reach, Session, run_session, start};
use super::{DeclaredShard, EmbedError, ShardInfo, SourceTensor, SyncOutcome, sync_failed};
use crate::trainer::{
    HoldingSlot, ReportSlot, SourceSpec, TrainerDriver, TrainerDriverConfig, WriteCheck,
};

/// How a training rank reaches its controller.
#[derive(Debug, Clone, Default)]
pub struct TrainerOptions {
    /// The controller's control-channel address, `host:port`.
    pub controller: String,
    /// Training rank.
    pub rank: u32,
    /// Job token (default: `$WEIGHTSYNC_JOB_TOKEN`, else none).
    pub job_token: Option<Secret>,
    /// The fabric's secret, shared by trainers and engines (default:
    /// `$WEIGHTSYNC_FABRIC_TOKEN`, else `job_token`; needed where each role has its own secret).
    pub fabric_token: Option<Secret>,
    /// Fabric listen address (default `127.0.0.1:0`).
    pub listen: Option<String>,
    /// Worker id (default `trainer-{rank}`).
    pub worker_id: Option<String>,
    /// Keep no delta bases: every sync writes every byte, and same-dtype copies go straight
    /// from the registered tensors, even when the job sends deltas (`weightsync controller
    /// --delta`: the trainer then keeps the bytes it last wrote and sends engines only what
    /// changed; see `weightsync_worker::delta`).
    pub full_syncs: bool,
    /// TLS to the controller: this worker's certificate, key and the CA of the controller's
    /// certificate (default: `WEIGHTSYNC_TLS_CERT`, `_KEY`, `_CA`; none: plain TCP).
    pub tls: Option<weightsync_common::tls::TlsFiles>,
    /// The job's run its versions belong to (default 0; see [`TrainerHandle::begin_run`]).
    pub run: u64,
}

impl TrainerOptions {
    /// Options with every default.
    pub fn new(controller: impl Into<String>, rank: u32) -> TrainerOptions {
        TrainerOptions {
            controller: controller.into(),
            rank,
            ..Default::default()
        }
    }
}

/// Staging for what cannot be written straight from the tensors (casts, fp8, strided boxes).
const WATERMARK_BYTES: u64 = 64 << 20;

/// An in-process trainer (see the module docs of [`super`]).
pub struct TrainerHandle {
    reach: Reach,
    rank: u32,
    world: WorldSpec,
    /// The job's model is declared: this rank registers what it holds
    /// ([`TrainerHandle::declare_and_register`]); `layout` and `expected` are empty.
    declared: bool,
    layout: Vec<ShardInfo>,
    expected: Vec<ArenaTensor>,
    fabric: Fabric,
    rt: Mutex<Option<Runtime>>,
    /// See [`TrainerOptions::full_syncs`].
    full_syncs: bool,
    session: Mutex<Option<(Session, ReportSlot, HoldingSlot)>>,
    /// The job's run this trainer's versions belong to.
    run: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for TrainerHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrainerHandle")
            .field("worker", &self.reach.name)
            .finish_non_exhaustive()
    }
}

/// This rank's shards in the job's training layout.
fn rank_shards(
    world: &WorldSpec,
    model_config: Option<&str>,
    rank: u32,
) -> Result<(Vec<ShardInfo>, Vec<ArenaTensor>), String> {
    let layouts = job::layouts(world, model_config).map_err(|e| e.to_string())?;
    if rank >= layouts.train.ranks {
        return Err(format!(
            "training rank {rank} is outside the job's {} ranks ({})",
            layouts.train.ranks, world.train
        ));
    }
    let mine: Vec<_> = layouts
        .train
        .shards
        .iter()
        .filter(|s| s.rank == rank)
        .collect();
    let params = &layouts.model.params;
    let names = shard_names(mine.iter().map(|s| &*params[s.param as usize].name));
    let mut infos = Vec::new();
    let mut arena = Vec::new();
    for (s, name) in mine.iter().zip(names) {
        let n = s.global.ndim as usize;
        let shape: Vec<u64> = s.global.len[..n].iter().map(|&d| d as u64).collect();
        arena.push(ArenaTensor {
            name: name.clone(),
            dtype: s.dtype,
            shape: shape.iter().map(|&d| d as usize).collect(),
            offset: s.offset,
        });
        if shape.iter().product::<u64>() == 0 {
            continue;
        }
        let global = params[s.param as usize].shape;
        infos.push(ShardInfo {
            name,
            dtype: s.dtype,
            global_shape: global.dims().iter().map(|&d| d as u64).collect(),
            offset: s.global.start[..n].iter().map(|&d| d as u64).collect(),
            shape,
        });
    }
    Ok((infos, arena))
}

/// A source error as the embedding's error: a mismatch names the tensor, expected and actual.
pub(crate) fn source_error(worker: &str, e: SourceError) -> EmbedError {
    let worker = worker.to_string();
    match e {
        SourceError::DTypeMismatch {
            name,
            expected,
            found,
        } => EmbedError::LayoutMismatch {
            worker,
            tensor: name,
            expected: match found.parse::<DType>() {
                // The common cause: FSDP2 under mixed precision keeps its shards f32.
                Ok(DType::F32) => format!(
                    "dtype {expected} (shards held in f32, as FSDP2 under mixed precision holds \
                     them, are a job whose training layout says so: e.g. fsdp=8,dtype=f32)"
                ),
                _ => format!("dtype {expected}"),
            },
            actual: format!("dtype {found}"),
        },
        SourceError::ShapeMismatch {
            name,
            expected,
            found,
        } => EmbedError::LayoutMismatch {
            worker,
            tensor: name,
            expected: format!("local shard shape {expected:?}"),
            actual: format!("shape {found:?}"),
        },
        other => EmbedError::Registration {
            worker,
            tensor: None,
            reason: other.to_string(),
        },
    }
}

impl TrainerHandle {
    /// Learns the job from the controller and starts this rank's fabric.
    pub fn connect(opts: TrainerOptions) -> Result<TrainerHandle, EmbedError> {
        let id = WorkerId::trainer(opts.rank);
        let reach = Reach::new(
            &opts.controller,
            opts.job_token.as_ref(),
            opts.fabric_token.as_ref(),
            opts.listen.as_deref(),
            id,
            opts.worker_id.as_deref(),
            opts.tls.as_ref(),
        )?;
        let st = start(&reach)?;
        let declared = job::is_declared(&st.world, st.model_config.as_deref());
        let (layout, expected) = if declared {
            let (trainers, _) =
                job::declared_world(&st.world).map_err(|e| reach.connect_error(e))?;
            if opts.rank >= trainers {
                return Err(reach.connect_error(format!(
                    "training rank {} is outside the job's {trainers} ranks ({})",
                    opts.rank, st.world.train
                )));
            }
            (Vec::new(), Vec::new())
        } else {
            rank_shards(&st.world, st.model_config.as_deref(), opts.rank)
                .map_err(|e| reach.connect_error(e))?
        };
        Ok(TrainerHandle {
            reach,
            rank: opts.rank,
            world: st.world,
            declared,
            layout,
            expected,
            fabric: st.fabric,
            rt: Mutex::new(Some(st.rt)),
            session: Mutex::new(None),
            full_syncs: opts.full_syncs,
            run: std::sync::atomic::AtomicU64::new(opts.run),
        })
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &str {
        &self.reach.name
    }

    /// The shards this rank must register (non-empty ones).
    pub fn layout(&self) -> Vec<ShardInfo> {
        self.layout.clone()
    }

    /// Whether the job's model is declared (an architecture the planner does not know, see
    /// `weightsync_schedules::declared`): register with
    /// [`declare_and_register`](Self::declare_and_register); [`layout`](Self::layout) is empty.
    pub fn is_declared(&self) -> bool {
        self.declared
    }

    /// Registers the rank's tensors (once): checks them against the layout (name, dtype, local
    /// shape), registers them with the fabric in place, and joins the job.
    pub fn register(&self, tensors: Vec<SourceTensor>) -> Result<(), EmbedError> {
        self.refuse_if(
            self.declared,
            "declare_and_register (every shard with its box)",
        )?;
        self.join_with(
            |fabric| TensorSet::register(fabric, tensors),
            &self.expected,
            Vec::new(),
        )
    }

    /// Registers the rank's shards of a declared model (once): each tensor it holds with the
    /// box it is of its parameter (`global_shape`, `offset`; FSDP2: the local shard of every
    /// named parameter, empty ones included or not). These are the declarations the controller
    /// plans from once every worker registered: the trainers' boxes must tile each parameter
    /// (replicas declaring the same box), and every engine must take each parameter or skip it;
    /// a disagreement fails the plan naming the tensor and both ranks
    /// ([`wait_plan`](Self::wait_plan), and every push, return it). A tensor of more than three
    /// dims is registered as its first two dims and the rest merged
    /// (`weightsync_schedules::declared::logical_shape`); its box must hold those whole.
    pub fn declare_and_register(&self, shards: Vec<DeclaredShard>) -> Result<(), EmbedError> {
        self.refuse_if(!self.declared, "register (the tensors of layout())")?;
        let name = &self.reach.name;
        let mut decls = Vec::with_capacity(shards.len());
        let mut expected = Vec::with_capacity(shards.len());
        let mut tensors = Vec::with_capacity(shards.len());
        for s in shards {
            let mut t = s.tensor;
            let decl = TensorMeta {
                name: t.name.clone(),
                shape: t.shape.clone(),
                dtype: t.dtype,
                bytes: t.shape.iter().product::<u64>() * t.dtype.size() as u64,
                global_shape: s.global_shape,
                offset: s.offset,
                source: None,
            };
            let (_, bx) = weightsync_schedules::declared::shard_box(&decl).map_err(|reason| {
                EmbedError::Registration {
                    worker: name.clone(),
                    tensor: Some(t.name.clone()),
                    reason: format!("declared {reason}"),
                }
            })?;
            // The box in the table's dims (more than three merged into the third).
            t.shape = bx.len[..bx.ndim as usize]
                .iter()
                .map(|&d| d as u64)
                .collect();
            expected.push(ArenaTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.iter().map(|&d| d as usize).collect(),
                offset: 0,
            });
            decls.push(decl);
            tensors.push(t);
        }
        self.join_with(
            |fabric| TensorSet::register(fabric, tensors),
            &expected,
            decls,
        )
    }

    /// Waits until the controller planned the world this trainer registered in, or says why it
    /// could not ([`EmbedError::PlanFailed`]: for a declared model, the tensor and both sides).
    pub fn wait_plan(&self, timeout: Option<Duration>) -> Result<u64, EmbedError> {
        let session = self.session.lock();
        let Some((s, _, _)) = session.as_ref() else {
            return Err(EmbedError::Registration {
                worker: self.reach.name.clone(),
                tensor: None,
                reason: "wait_plan before register".into(),
            });
        };
        super::session::wait_plan(s, &self.reach.name, timeout)
    }

    /// Refuses a registration of the other kind than the job's model needs.
    fn refuse_if(&self, wrong: bool, instead: &str) -> Result<(), EmbedError> {
        if !wrong {
            return Ok(());
        }
        Err(EmbedError::Registration {
            worker: self.reach.name.clone(),
            tensor: None,
            reason: format!(
                "the job's model {} is {}: register with {instead}",
                self.world.model,
                if self.declared {
                    "declared by its workers"
                } else {
                    "one the planner lays out"
                }
            ),
        })
    }

    /// [`register`](Self::register) for tensors in device memory, all on one GPU (feature
    /// `cuda`): the pipeline copies them by DMA into its pinned staging and prepares casts and
    /// fp8 on that GPU. The caller synchronises the stream that wrote them before each push.
    #[cfg(feature = "cuda")]
    pub fn register_device(
        &self,
        tensors: Vec<weightsync_worker::DeviceTensor>,
    ) -> Result<(), EmbedError> {
        self.refuse_if(
            self.declared,
            "declare_and_register (every shard with its box)",
        )?;
        self.join_with(
            |_| TensorSet::register_device(tensors),
            &self.expected,
            Vec::new(),
        )
    }

    /// Registers the set `make_set` builds, checked against `expected`, and joins the job
    /// declaring `declared` (a declared model's shards; empty otherwise).
    fn join_with(
        &self,
        make_set: impl FnOnce(&Fabric) -> Result<TensorSet, weightsync_worker::WorkerError>,
        expected: &[ArenaTensor],
        declared: Vec<TensorMeta>,
    ) -> Result<(), EmbedError> {
        let name = &self.reach.name;
        let rt_guard = self.rt.lock();
        let rt = rt_guard.as_ref().ok_or_else(|| EmbedError::Closed {
            worker: name.clone(),
        })?;
        let mut session = self.session.lock();
        if session.is_some() {
            return Err(EmbedError::Registration {
                worker: name.clone(),
                tensor: None,
                reason: "already registered (register once per handle)".into(),
            });
        }
        let _in_rt = rt.enter();
        let set = make_set(&self.fabric).map_err(|e| match e {
            weightsync_worker::WorkerError::Source(s) => source_error(name, s),
            other => EmbedError::Registration {
                worker: name.clone(),
                tensor: None,
                reason: other.to_string(),
            },
        })?;
        set.check(expected).map_err(|e| source_error(name, e))?;
        let cfg = TrainerDriverConfig {
            world: self.world.clone(),
            rank: self.rank,
            fabric: self.reach.fabric_config(),
            watermark_bytes: WATERMARK_BYTES,
            source: SourceSpec::Tensors(Arc::new(set)),
        };
        let mut driver = TrainerDriver::with_fabric(cfg, self.fabric.clone());
        driver.declare(declared);
        if self.full_syncs {
            driver.full_syncs_only();
        }
        let reports = driver.keep_reports();
        let holding = driver.hold();
        let s = run_session(
            rt,
            &self.reach,
            self.world.clone(),
            driver,
            Duration::from_secs(60),
        )?;
        *session = Some((s, reports, holding));
        Ok(())
    }

    /// The job's run this trainer's versions belong to.
    pub fn run(&self) -> u64 {
        self.run.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Declares that this trainer's versions from now on belong to `run` (larger than the
    /// current one): a job restarted from a checkpoint does so, after which its versions may
    /// restart below the last committed one. The controller begins the run with the first push
    /// of it.
    pub fn begin_run(&self, run: u64) -> Result<(), EmbedError> {
        let current = self.run();
        if run <= current {
            return Err(EmbedError::Registration {
                worker: self.reach.name.clone(),
                tensor: None,
                reason: format!("run {run} is not newer than this trainer's run {current}"),
            });
        }
        self.run.store(run, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }

    /// Says that the registered tensors hold `version` and stay put until it ends: the sync
    /// starts once every trainer pushed it. Wait on the handle for its end. Refused
    /// ([`EmbedError::Busy`]) while the sync of the previous push is running here.
    pub fn push(&self, version: u64) -> Result<PushHandle, EmbedError> {
        self.push_checked(version, None)
    }

    /// [`push`](Self::push) with a check of the tensors: `unchanged`, when given, is asked once the sync read every byte whether a registered tensor was written
    /// since this push (it names the tensor); a sync that saw a write fails naming it.
    ///
    /// Refused ([`EmbedError::Busy`]) while the sync of the previous push is running here: its
    /// bytes are being read.
    pub fn push_checked(
        &self,
        version: u64,
        unchanged: Option<WriteCheck>,
    ) -> Result<PushHandle, EmbedError> {
        let name = self.reach.name.clone();
        let session = self.session.lock();
        let Some((s, reports, holding)) = session.as_ref() else {
            return Err(EmbedError::Registration {
                worker: name,
                tensor: None,
                reason: "push before register".into(),
            });
        };
        let run = self.run();
        {
            let mut ends = s.ends.state.lock();
            let mut h = holding.lock();
            if let Some((_, running)) = h.syncing
                && !ends.by_version.contains_key(&running)
            {
                return Err(EmbedError::Busy {
                    worker: name,
                    version,
                    running,
                });
            }
            h.held = Some((run, version));
            h.unchanged = unchanged;
            // A retried version waits for its new attempt, not the old end.
            ends.by_version.remove(&version);
            ends.outstanding = Some((version, run));
        }
        s.outbox
            .try_send(FromWorker::Push { version, run })
            .map_err(|_| EmbedError::Closed {
                worker: name.clone(),
            })?;
        Ok(PushHandle {
            version,
            worker: name,
            pushed: Instant::now(),
            ends: s.ends.clone(),
            reports: reports.clone(),
        })
    }

    /// Leaves the job: the session and the fabric stop (idempotent; also on drop).
    pub fn close(&self) {
        let session = self.session.lock().take();
        if let Some(session) = session {
            session.0.leave(LEAVE_WITHIN);
        }
        if let Some(rt) = self.rt.lock().take() {
            // Waits (a bounded time) until the session's tasks are dropped, so the registrations
            // go and the tensors' owners are released.
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}

impl Drop for TrainerHandle {
    fn drop(&mut self) {
        self.close();
    }
}

/// The sync of one pushed version.
#[derive(Debug)]
pub struct PushHandle {
    version: u64,
    worker: String,
    pushed: Instant,
    ends: Arc<Ends>,
    reports: ReportSlot,
}

/// Per stage, the span from its first start to its last end, seconds.
fn stage_spans(r: &SyncReport) -> Vec<(String, f64)> {
    let mut spans: BTreeMap<&'static str, (u64, u64)> = BTreeMap::new();
    for e in &r.timeline.events {
        let s = spans
            .entry(e.stage.name())
            .or_insert((e.start_ns, e.end_ns));
        s.0 = s.0.min(e.start_ns);
        s.1 = s.1.max(e.end_ns);
    }
    spans
        .into_iter()
        .map(|(k, (a, b))| (k.to_string(), b.saturating_sub(a) as f64 / 1e9))
        .collect()
}

impl PushHandle {
    /// The version pushed.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Waits until the sync of the version committed (its outcome) or failed (the failure,
    /// naming the worker that failed). [`EmbedError::Timeout`] when `timeout` passes first; it
    /// may be called again.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<SyncOutcome, EmbedError> {
        let v = self.version;
        let end = self.ends.wait(timeout, |st| match st.by_version.get(&v) {
            Some(end) => Some(Ok(end.clone())),
            None => st.stopped.clone().map(Err),
        });
        match end {
            None => Err(EmbedError::Timeout {
                what: format!("version {v} on {}", self.worker),
            }),
            Some(Err(_)) => Err(EmbedError::Closed {
                worker: self.worker.clone(),
            }),
            Some(Ok(End::Aborted {
                failure: Some(f), ..
            })) if f.kind == weightsync_common::protocol::FailureKind::Superseded => {
                Ok(SyncOutcome {
                    version: v,
                    bytes: 0,
                    staged_bytes: 0,
                    direct_bytes: 0,
                    seconds: self.pushed.elapsed().as_secs_f64(),
                    stages: Vec::new(),
                    superseded: Some(f.cause),
                    paths: None,
                })
            }
            Some(Ok(End::Aborted { reason, failure })) => {
                Err(sync_failed(v, &reason, failure.as_ref()))
            }
            Some(Ok(End::Committed { at })) => Ok(self.outcome(at)),
        }
    }

    fn outcome(&self, at: Instant) -> SyncOutcome {
        let v = self.version;
        let mut out = SyncOutcome {
            version: v,
            bytes: 0,
            staged_bytes: 0,
            direct_bytes: 0,
            seconds: at.saturating_duration_since(self.pushed).as_secs_f64(),
            stages: Vec::new(),
            superseded: None,
            paths: None,
        };
        if let Some((rv, r)) = self.reports.lock().as_ref()
            && *rv == v
        {
            out.bytes = r.bytes_written;
            out.staged_bytes = r.staged_bytes;
            out.direct_bytes = r.direct_bytes;
            out.stages = stage_spans(r);
            out.paths = r.paths;
        }
        out
    }
}
