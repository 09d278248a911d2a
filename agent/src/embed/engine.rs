//! [`EngineHandle`]: an inference rank whose own parameter tensors are the destinations.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::runtime::Runtime;
use weightsync_common::fabric::Fabric;
use weightsync_common::protocol::{FromWorker, Stage, TensorMeta, WorkerId, WorldSpec};
use weightsync_common::secret::Secret;
use weightsync_schedules::job;
use weightsync_schedules::layout_infer::ParamBox;
use weightsync_schedules::table::RolloutPlan;
use weightsync_worker::RolloutWorker;

use super::declare::EngineSources;
pub use super::engine_driver::Hook;
use super::engine_driver::{EngineDriver, EngineShared};
use super::engine_stages::sync_events;
use super::regions::{Destinations, place};
use super::session::{LEAVE_WITHIN, Reach, Session, run_session, start};
use super::{DstTensor, DstTensorInfo, EmbedError, EngineState, EngineStatus};
use crate::rollout::{RolloutDriver, RolloutDriverConfig};

/// How an inference rank reaches its controller.
#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    /// The controller's control-channel address, `host:port`.
    pub controller: String,
    /// Global inference rank.
    pub rank: u32,
    /// Job token (default: `$WEIGHTSYNC_JOB_TOKEN`, else none).
    pub job_token: Option<Secret>,
    /// The fabric's secret, shared by trainers and engines (default:
    /// `$WEIGHTSYNC_FABRIC_TOKEN`, else `job_token`; needed where each role has its own secret).
    pub fabric_token: Option<Secret>,
    /// Fabric listen address (default `127.0.0.1:0`).
    pub listen: Option<String>,
    /// Worker id (default `rollout-{rank}`).
    pub worker_id: Option<String>,
    /// TLS to the controller: this worker's certificate, key and the CA of the controller's
    /// certificate (default: `WEIGHTSYNC_TLS_CERT`, `_KEY`, `_CA`; none: plain TCP).
    pub tls: Option<weightsync_common::tls::TlsFiles>,
}

impl EngineOptions {
    /// Options with every default.
    pub fn new(controller: impl Into<String>, rank: u32) -> EngineOptions {
        EngineOptions {
            controller: controller.into(),
            rank,
            ..Default::default()
        }
    }
}

/// An in-process engine (see the module docs of [`super`]).
pub struct EngineHandle {
    reach: Reach,
    rank: u32,
    world: WorldSpec,
    /// The job's model is declared: this rank's layout comes from its own declarations
    /// ([`EngineHandle::declare_and_register`]), `planned` is empty until then.
    declared: bool,
    planned: RolloutPlan,
    /// Each planned tensor's box in its training parameter (`planned.tensors`' order).
    boxes: Vec<Option<ParamBox>>,
    fabric: Fabric,
    shared: Arc<EngineShared>,
    rt: Mutex<Option<Runtime>>,
    session: Mutex<Option<Session>>,
    /// The zero of [`EngineHandle::now_ns`].
    clock: Instant,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("worker", &self.reach.name)
            .finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Learns the job from the controller, lays out this rank's tensors from the inference
    /// layout, and starts the fabric.
    pub fn connect(opts: EngineOptions) -> Result<EngineHandle, EmbedError> {
        let clock = Instant::now();
        let reach = Reach::new(
            &opts.controller,
            opts.job_token.as_ref(),
            opts.fabric_token.as_ref(),
            opts.listen.as_deref(),
            WorkerId::rollout(opts.rank),
            opts.worker_id.as_deref(),
            opts.tls.as_ref(),
        )?;
        let st = start(&reach)?;
        let declared = job::is_declared(&st.world, st.model_config.as_deref());
        let (planned, boxes) = if declared {
            let (_, rollouts) =
                job::declared_world(&st.world).map_err(|e| reach.connect_error(e))?;
            if opts.rank >= rollouts {
                return Err(reach.connect_error(format!(
                    "inference rank {} is outside the job's {rollouts} ranks ({})",
                    opts.rank, st.world.infer
                )));
            }
            let empty = job::declared_rollout_layout(&st.world, opts.rank, &[], &[])
                .map_err(|e| reach.connect_error(e))?;
            (empty, Vec::new())
        } else {
            let (model, infer) = job::inference_layout(&st.world, st.model_config.as_deref())
                .map_err(|e| reach.connect_error(e))?;
            let planned =
                job::rollout_layout(&infer, opts.rank).map_err(|e| reach.connect_error(e))?;
            let boxes = infer
                .param_boxes(&model, opts.rank)
                .map_err(|e| reach.connect_error(e))?;
            (planned, boxes)
        };
        Ok(EngineHandle {
            reach,
            rank: opts.rank,
            world: st.world,
            declared,
            planned,
            boxes,
            fabric: st.fabric,
            shared: Arc::default(),
            rt: Mutex::new(Some(st.rt)),
            session: Mutex::new(None),
            clock,
        })
    }

    /// This worker's id.
    pub fn worker_id(&self) -> &str {
        &self.reach.name
    }

    /// Every tensor of this inference rank, as planned, with its place in the training
    /// parameter it is cut from where it is one box of one (see [`DstTensorInfo`]).
    pub fn layout(&self) -> Vec<DstTensorInfo> {
        let dims = |d: &[u32]| d.iter().map(|&d| d as u64).collect::<Vec<u64>>();
        self.planned
            .tensors
            .iter()
            .zip(&self.boxes)
            .map(|(t, b)| DstTensorInfo {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: dims(t.shape.dims()),
                global_shape: b.map(|b| dims(b.global.dims())),
                offset: b.map(|b| dims(&b.offset[..b.global.ndim as usize])),
            })
            .collect()
    }

    /// Sets the hooks (replacing earlier ones): `before_landing(N)` before any byte of N lands,
    /// `after_commit(N)` once N is committed.
    pub fn set_hooks(&self, before_landing: Option<Hook>, after_commit: Option<Hook>) {
        let mut h = self.shared.hooks.lock();
        h.before_landing = before_landing.map(Arc::new);
        h.after_commit = after_commit.map(Arc::new);
    }

    /// Whether the job's model is declared (an architecture the planner does not know, see
    /// `weightsync_schedules::declared`): register with
    /// [`declare_and_register`](Self::declare_and_register), not [`register`](Self::register).
    pub fn is_declared(&self) -> bool {
        self.declared
    }

    /// Registers the engine's tensors (once): checks them against the planned layout (name,
    /// shape, dtype), merges adjacent ones into regions, registers those, and joins the job.
    pub fn register(&self, tensors: Vec<DstTensor>) -> Result<(), EmbedError> {
        self.register_layout(Destinations::Host(tensors))
    }

    fn register_layout(&self, tensors: Destinations) -> Result<(), EmbedError> {
        if self.declared {
            return Err(EmbedError::Registration {
                worker: self.reach.name.clone(),
                tensor: None,
                reason: format!(
                    "the job's model {} is declared by its workers: register with \
                     declare_and_register (every tensor this engine holds, and what it skips)",
                    self.world.model
                ),
            });
        }
        self.register_planned(&self.planned, tensors, Vec::new(), None)
    }

    /// Registers the engine's tensors in CUDA device memory of one GPU (once; feature `cuda`),
    /// as [`register`](Self::register) does host tensors: the fabric writes host staging
    /// regions standing in for them, and each landed version is copied to them (one
    /// host-to-device copy per merged range, waited for) before it counts as landed. Refused
    /// by name without a CUDA driver.
    #[cfg(feature = "cuda")]
    pub fn register_device(&self, tensors: Vec<super::DeviceDstTensor>) -> Result<(), EmbedError> {
        self.register_layout(Destinations::Device(tensors))
    }

    /// [`declare_and_register`](Self::declare_and_register) of CUDA tensors (feature `cuda`;
    /// see [`register_device`](Self::register_device)).
    #[cfg(feature = "cuda")]
    pub fn declare_and_register_device(
        &self,
        tensors: Vec<super::DeviceDstTensor>,
        skip: Vec<String>,
        sources: EngineSources,
    ) -> Result<(), EmbedError> {
        self.declare_and_register_any(Destinations::Device(tensors), skip, sources)
    }

    /// Registers the engine's tensors of a declared model (once): every tensor it holds, whole
    /// (name, dtype, shape: the declarations the controller plans from), and `skip`, the names
    /// it takes nothing of (a buffer no trainer holds, a trainer tensor it does not hold). Its
    /// layout is laid out from these alone (`weightsync_schedules::job::declared_rollout_layout`:
    /// skipped and empty tensors left out, more than three dims merged into the third), then
    /// registered as [`register`](Self::register) does. A tensor no trainer holds, a trainer
    /// tensor it neither declares nor skips, a shape or dtype the two sides disagree on: the
    /// plan fails naming the tensor and both ranks ([`wait_plan`](Self::wait_plan) returns it).
    pub fn declare_and_register(
        &self,
        tensors: Vec<DstTensor>,
        skip: Vec<String>,
    ) -> Result<(), EmbedError> {
        self.declare_and_register_any(Destinations::Host(tensors), skip, EngineSources::new())
    }

    /// [`declare_and_register`](Self::declare_and_register), with what some tensors are made
    /// of (`sources`, by tensor name): a fused tensor (`qkv_proj` from the trainers' q, k and
    /// v), a tensor-parallel rank's box of a tensor (a source of one part: that box of the
    /// tensor of its name, as vLLM's loader narrows it), stacked experts. A tensor without a
    /// source is the trainers' tensor of its name, whole. Refused by name before anything is
    /// registered: a source for a tensor not given, or parts that cannot fill their tensor
    /// (see [`weightsync_common::protocol::TensorSource`]); the rest (a part no trainer holds, a box outside its tensor, a
    /// dtype the sides disagree on) the plan refuses by name ([`wait_plan`](Self::wait_plan)).
    pub fn declare_and_register_sources(
        &self,
        tensors: Vec<DstTensor>,
        skip: Vec<String>,
        sources: EngineSources,
    ) -> Result<(), EmbedError> {
        self.declare_and_register_any(Destinations::Host(tensors), skip, sources)
    }

    fn declare_and_register_any(
        &self,
        tensors: Destinations,
        skip: Vec<String>,
        sources: EngineSources,
    ) -> Result<(), EmbedError> {
        let name = &self.reach.name;
        if !self.declared {
            return Err(EmbedError::Registration {
                worker: name.clone(),
                tensor: None,
                reason: format!(
                    "the job's model {} is one the planner lays out: register the tensors of \
                     layout() with register",
                    self.world.model
                ),
            });
        }
        let declared =
            super::declare::declare(&self.world, self.rank, tensors.metas(), &skip, sources)
                .map_err(|r| EmbedError::Registration {
                    worker: name.clone(),
                    tensor: r.tensor,
                    reason: r.reason,
                })?;
        let planned = declared.planned;
        // What the layout holds, in its dims: skipped and empty tensors are not registered.
        let kept: std::collections::BTreeMap<&str, Vec<u64>> = planned
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.as_str(),
                    t.shape.dims().iter().map(|&d| d as u64).collect(),
                )
            })
            .collect();
        let tensors = tensors.keep(|name| kept.get(name).cloned());
        self.register_planned(&planned, tensors, skip, Some(declared.tensors))
    }

    /// Waits until the controller planned the world this engine registered in (every worker
    /// registered, the plan made and this worker's part sent), or says why it could not:
    /// [`EmbedError::PlanFailed`], naming the tensor and both sides for a declared model that
    /// its workers disagree on. [`EmbedError::Timeout`] when `timeout` passes first.
    pub fn wait_plan(&self, timeout: Option<Duration>) -> Result<u64, EmbedError> {
        let session = self.session.lock();
        let Some(s) = session.as_ref() else {
            return Err(EmbedError::Registration {
                worker: self.reach.name.clone(),
                tensor: None,
                reason: "wait_plan before register".into(),
            });
        };
        super::session::wait_plan(s, &self.reach.name, timeout)
    }

    fn register_planned(
        &self,
        planned: &RolloutPlan,
        tensors: Destinations,
        skip: Vec<String>,
        declared: Option<Vec<TensorMeta>>,
    ) -> Result<(), EmbedError> {
        let name = self.reach.name.clone();
        let rt_guard = self.rt.lock();
        let rt = rt_guard.as_ref().ok_or_else(|| EmbedError::Closed {
            worker: name.clone(),
        })?;
        let mut session = self.session.lock();
        if session.is_some() {
            return Err(EmbedError::Registration {
                worker: name,
                tensor: None,
                reason: "already registered (register once per handle)".into(),
            });
        }
        #[cfg(feature = "cuda")]
        let mut staged = None;
        let placed = match tensors {
            Destinations::Host(ts) => place(&name, planned, ts)?,
            #[cfg(feature = "cuda")]
            Destinations::Device(ts) => {
                let d = super::device_regions::place_device(&name, planned, ts)?;
                staged = Some(d.staged);
                d.placed
            }
        };
        let _in_rt = rt.enter();
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut worker = RolloutWorker::with_regions(
            self.fabric.clone(),
            name.clone(),
            planned.clone(),
            placed.regions,
            placed.placement,
        )
        .map_err(|e| EmbedError::Registration {
            worker: name.clone(),
            tensor: None,
            reason: e.to_string(),
        })?;
        #[cfg(feature = "cuda")]
        if let Some(staged) = staged {
            // The staging is registered: page-lock it and bind the device ranges to it.
            let landing = staged
                .bind(worker.regions())
                .map_err(|e| EmbedError::Registration {
                    worker: name.clone(),
                    tensor: None,
                    reason: format!("binding the CUDA tensors to their staging: {e}"),
                })?;
            worker.set_device_landing(Arc::new(landing));
        }
        let cfg = RolloutDriverConfig {
            world: self.world.clone(),
            rank: self.rank,
            fabric: self.reach.fabric_config(),
            land_timeout: Duration::from_secs(120),
        };
        let driver = EngineDriver {
            inner: RolloutDriver::over(cfg, self.fabric.clone(), worker),
            shared: self.shared.clone(),
            name: name.clone(),
            abort_cause: None,
            hooked: None,
            declared,
            skip,
        };
        let within = Duration::from_secs(60);
        *session = Some(run_session(
            rt,
            &self.reach,
            self.world.clone(),
            driver,
            within,
        )?);
        Ok(())
    }

    /// The engine's state now.
    pub fn state(&self) -> EngineState {
        self.shared.state.lock().state.clone()
    }

    /// Blocks until a version `>= version` committed (its state), or the engine turned invalid
    /// for one (`SyncFailed` naming the worker that failed it, this engine when its own hook
    /// raised, and the failure's kind), or `timeout` passed (`Timeout`, retryable).
    pub fn wait_for_version(
        &self,
        version: u64,
        timeout: Option<Duration>,
    ) -> Result<EngineState, EmbedError> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut w = self.shared.state.lock();
        loop {
            if w.state.version.is_some_and(|v| v >= version)
                && w.state.status == EngineStatus::Committed
            {
                return Ok(w.state.clone());
            }
            if let (EngineStatus::Invalid, Some((f, blame))) = (w.state.status, &w.failed)
                && *f >= version
            {
                return Err(EmbedError::SyncFailed {
                    version: *f,
                    worker: blame.worker.clone(),
                    kind: blame.kind,
                    tensor: blame.tensor.clone(),
                    cause: w.state.cause.clone().unwrap_or_default(),
                });
            }
            match deadline {
                Some(d) => {
                    if self.shared.changed.wait_until(&mut w, d).timed_out() {
                        return Err(EmbedError::Timeout {
                            what: format!("version {version} on {}", self.reach.name),
                        });
                    }
                }
                None => self.shared.changed.wait(&mut w),
            }
        }
    }

    /// Nanoseconds on this engine's clock: monotonic, zero when the handle connected. Stamp the
    /// spans of [`EngineHandle::report_stages`] with it.
    pub fn now_ns(&self) -> u64 {
        ns_between(self.clock, Instant::now())
    }

    /// Reports this engine's own stages of `version` ([`Stage::Pause`], [`Stage::Load`],
    /// [`Stage::Resume`]) as `(stage, start_ns, end_ns)` on the [`now_ns`](Self::now_ns)
    /// clock: the controller adds them to this engine's lane of the version's sync, so the
    /// dashboard's timeline and the trace show them beside the landing. Call it once the spans
    /// are known (usually after the version committed); it does not wait for the controller.
    ///
    /// The spans are moved to the sync's time base here (ns since this engine received the
    /// sync's `Prepare`; one that began earlier starts there). Refused at once, sending
    /// nothing ([`EmbedError::InvalidStageReport`], naming the span): a version this engine
    /// was never told to prepare (or that many versions ago), a stage other than those three, a
    /// span that ends before it starts, after now, or before the sync's `Prepare` arrived, more
    /// than [`weightsync_common::protocol::MAX_ENGINE_STAGE_EVENTS`] spans. The controller
    /// refuses (and logs) a report for a version whose sync failed. With no spans it does
    /// nothing.
    pub fn report_stages(
        &self,
        version: u64,
        spans: &[(Stage, u64, u64)],
    ) -> Result<(), EmbedError> {
        let name = &self.reach.name;
        let now_ns = self.now_ns();
        let sync = self.shared.syncs.lock().get(&version).copied();
        let Some(sync) = sync else {
            let known: Vec<u64> = self.shared.syncs.lock().keys().copied().collect();
            return Err(EmbedError::InvalidStageReport {
                worker: name.clone(),
                version,
                reason: format!(
                    "this engine was never told to prepare version {version} (recent versions: \
                     {known:?})"
                ),
            });
        };
        let events = sync_events(
            name,
            version,
            ns_between(self.clock, sync.reference),
            now_ns,
            spans,
        )?;
        if events.is_empty() {
            return Ok(());
        }
        let session = self.session.lock();
        let s = session.as_ref().ok_or_else(|| EmbedError::Closed {
            worker: name.clone(),
        })?;
        s.outbox
            .try_send(FromWorker::EngineStages {
                sync_id: sync.sync_id,
                version,
                events,
            })
            .map_err(|e| match e {
                tokio::sync::mpsc::error::TrySendError::Full(_) => EmbedError::Timeout {
                    what: format!("room in {name}'s queue of messages to the controller"),
                },
                tokio::sync::mpsc::error::TrySendError::Closed(_) => EmbedError::Closed {
                    worker: name.clone(),
                },
            })
    }

    /// Leaves the job: the session and the fabric stop (idempotent; also on drop); the
    /// controller sees this engine leave (a running sync fails naming it).
    pub fn close(&self) {
        let session = self.session.lock().take();
        if let Some(session) = session {
            session.leave(LEAVE_WITHIN);
        }
        if let Some(rt) = self.rt.lock().take() {
            // Waits (a bounded time) until the session's tasks are dropped, so the registrations
            // go and the tensors' owners are released.
            rt.shutdown_timeout(Duration::from_millis(500));
        }
    }
}

/// Nanoseconds from `from` to `to` (zero when `to` is earlier).
fn ns_between(from: Instant, to: Instant) -> u64 {
    u64::try_from(to.saturating_duration_since(from).as_nanos()).unwrap_or(u64::MAX)
}

impl Drop for EngineHandle {
    fn drop(&mut self) {
        self.close();
    }
}
