//! Control-channel messages, both directions.
//!
//! Backend-specific things (a fabric endpoint, a memory-region descriptor carrying an rkey, a
//! planner's slice of the routing table) travel as opaque bincode blobs ([`Blob`]): the protocol
//! stays the same whether the fabric is TCP or ibverbs and whatever the planner's types become,
//! and the controller can never print an rkey because it never decodes one.

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::dtype::DType;

// The report vocabulary lives in `report.rs`; named here too so that `protocol::messages::Stage`
// and the like keep naming what they named.
pub use super::report::{
    MAX_ENGINE_STAGE_EVENTS, RunChecksum, Stage, TimeSplit, TimeSplitSeconds, TimelineEvent,
    WHOLE_SYNC, WorkerReport,
};

/// Bytes encoded by another layer (fabric descriptor, plan slice). Its `Debug` prints only the
/// length, so secrets inside (rkeys) never reach a log.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Blob(pub Vec<u8>);

impl fmt::Debug for Blob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Blob({} bytes)", self.0.len())
    }
}

impl Blob {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len()
    }
    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Which side of a sync a worker serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerRole {
    /// Beside a training rank: holds source shards, writes.
    Trainer,
    /// Beside an inference rank: holds the engine's tensors, receives.
    Rollout,
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WorkerRole::Trainer => "trainer",
            WorkerRole::Rollout => "rollout",
        })
    }
}

impl std::str::FromStr for WorkerRole {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "trainer" => Ok(WorkerRole::Trainer),
            "rollout" => Ok(WorkerRole::Rollout),
            other => Err(format!(
                "unknown role {other:?} (expected trainer or rollout)"
            )),
        }
    }
}

/// A worker's identity in the world: its role and its rank within that role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WorkerId {
    /// Trainer or rollout.
    pub role: WorkerRole,
    /// Rank among workers of that role (training rank, or global inference rank).
    pub rank: u32,
}

impl WorkerId {
    /// A trainer's id.
    pub const fn trainer(rank: u32) -> Self {
        WorkerId {
            role: WorkerRole::Trainer,
            rank,
        }
    }
    /// A rollout's id.
    pub const fn rollout(rank: u32) -> Self {
        WorkerId {
            role: WorkerRole::Rollout,
            rank,
        }
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.role, self.rank)
    }
}

impl std::str::FromStr for WorkerId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (role, rank) = s
            .rsplit_once('-')
            .ok_or_else(|| format!("bad worker id {s:?} (expected e.g. trainer-0)"))?;
        let rank = rank
            .parse()
            .map_err(|_| format!("bad rank in worker id {s:?}"))?;
        Ok(WorkerId {
            role: role.parse()?,
            rank,
        })
    }
}

/// What the whole job is: every worker states it, and the controller refuses a worker whose
/// statement contradicts the controller's own, so a mis-launched rank cannot join.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorldSpec {
    /// Model preset name or config path, as given to the planner.
    pub model: String,
    /// Training layout string, e.g. `fsdp=4`.
    pub train: String,
    /// Inference layout string, e.g. `tp=2,dp=2`.
    pub infer: String,
    /// Inference dtype (bf16 or fp8).
    pub dtype: DType,
    /// Whether rollouts verify checksums of what landed.
    pub verify: bool,
}

impl WorldSpec {
    /// The text of the model's `config.json` when [`model`](Self::model) names a file; `None`
    /// when it is a preset name. (The planner is pure: whoever builds the job reads the file.)
    pub fn read_model_config(&self) -> std::io::Result<Option<String>> {
        let path = std::path::Path::new(&self.model);
        if !path.is_file() {
            return Ok(None);
        }
        std::fs::read_to_string(path)
            .map(Some)
            .map_err(|e| std::io::Error::new(e.kind(), format!("reading {}: {e}", self.model)))
    }
}

/// Shape and size of one tensor a worker holds (a training shard or an inference tensor).
///
/// For a declared model (one the planner knows only from what its workers register: see
/// `weightsync_schedules::declared`) this is the declaration the controller plans from: a
/// trainer's shard is the box `offset .. offset + shape` of the parameter `name` whose whole
/// shape is `global_shape`; an engine's tensor (`global_shape` and `offset` empty) is the
/// trainers' tensor of its name, whole, or what its `source` says it is made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Parameter or engine tensor name.
    pub name: String,
    /// Local shape.
    pub shape: Vec<u64>,
    /// Element type.
    pub dtype: DType,
    /// Byte length in the worker's memory.
    pub bytes: u64,
    /// The whole parameter's shape this tensor is a box of; empty: the tensor is whole.
    #[serde(default)]
    pub global_shape: Vec<u64>,
    /// Where the box starts in the whole parameter, per dim; empty: at its origin.
    #[serde(default)]
    pub offset: Vec<u64>,
    /// An engine's tensor of a declared model: what it is made of (a fused `qkv_proj`, a
    /// tensor-parallel rank's slice, stacked experts). `None`: the trainers' tensor of its name,
    /// whole. Trainers declare `None`.
    #[serde(default)]
    pub source: Option<TensorSource>,
}

/// What an engine tensor is made of: the concatenation along `dim` of boxes of the trainers'
/// tensors, in order.
///
/// Each part's dims map onto the destination's trailing dims (a part of fewer dims than the
/// destination leaves leading *stack* dims). The parts fill the destination along `dim` one
/// after the other; once they fill it, the next part starts the next index of the stack dims
/// (row-major): per-expert `[I, H]` gate and up boxes, `dim` 1, fill a stacked `[E, 2I, H]`
/// expert tensor gate, up, gate, up... In every other dim a part spans the destination whole.
/// How the bytes change is the two dtypes' business, as for a whole tensor (a copy, a cast to
/// bf16, or fp8 block quantisation with its `_scale_inv`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSource {
    /// The destination dim the parts are concatenated along.
    pub dim: u32,
    /// The parts, in order.
    pub parts: Vec<SourceBox>,
}

/// One part of a [`TensorSource`]: the box `offset .. offset + shape` of the trainers' tensor
/// `tensor` (in that tensor's own dims).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceBox {
    /// The trainers' tensor.
    pub tensor: String,
    /// Where the box starts, per dim of that tensor.
    pub offset: Vec<u64>,
    /// The box's shape.
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// A whole tensor (no box): `global_shape` and `offset` empty.
    pub fn whole(name: impl Into<String>, shape: Vec<u64>, dtype: DType) -> TensorMeta {
        let bytes = shape.iter().product::<u64>() * dtype.size() as u64;
        TensorMeta {
            name: name.into(),
            shape,
            dtype,
            bytes,
            global_shape: Vec::new(),
            offset: Vec::new(),
            source: None,
        }
    }
}

/// A worker's registration: the first message after authentication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Registration {
    /// Who it is.
    pub id: WorkerId,
    /// Host name (for the dashboard and error messages).
    pub host: String,
    /// Process id on that host.
    pub pid: u32,
    /// What it believes the job is.
    pub world: WorldSpec,
    /// Its fabric endpoint (backend-encoded, opaque to the controller).
    pub fabric_endpoint: Blob,
    /// Rollouts: the descriptors of the regions registered once at start (backend-encoded;
    /// they contain rkeys and are forwarded only to trainers, over this channel). Trainers
    /// register nothing before their assignment: their regions come with [`FromWorker::Ready`].
    pub regions: Vec<Blob>,
    /// Tensors it holds, for consistency checks and the dashboard.
    pub tensors: Vec<TensorMeta>,
    /// Rollouts whose regions are the engine's own tensors: where each planned tensor lies in
    /// them (backend-neutral, encoded by the worker library; forwarded to trainers with the
    /// regions). `None`: the regions are laid out exactly as planned (the identity).
    pub placement: Option<Blob>,
    /// Rollouts of a declared model: names of tensors the engine takes nothing of (a tensor it
    /// declares that no trainer holds, a trainer tensor it does not hold); empty otherwise.
    #[serde(default)]
    pub skip: Vec<String>,
}

/// A peer a trainer will write to: its endpoint and registered regions (a rollout's tensors, or
/// a trainer's gather arena).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeerInfo {
    /// The rollout.
    pub id: WorkerId,
    /// Its fabric endpoint.
    pub fabric_endpoint: Blob,
    /// Its region descriptors, in the order it registered them.
    pub regions: Vec<Blob>,
    /// Where each planned tensor lies in those regions (see [`Registration::placement`]).
    pub placement: Option<Blob>,
    /// A rollout's delta inbox (backend-encoded; sent in its `Ready`), when it takes deltas.
    pub inbox: Option<Blob>,
}

/// What a worker must do each sync, sent once per plan (and again after a re-plan). A worker
/// answers it with [`FromWorker::Ready`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Assignment {
    /// A trainer's slice of the routing table: all it needs to size and register its memory.
    /// Its peers follow in [`ToWorker::Peers`] once every worker is ready.
    Trainer {
        /// Identifies the plan; changes on every re-plan.
        plan_id: u64,
        /// The planner's slice for this trainer (bincode).
        slice: Blob,
        /// The job sends deltas (see [`Assignment::delta`]).
        #[serde(default)]
        delta: bool,
    },
    /// A rollout's expected immediates per sync.
    Rollout {
        /// Identifies the plan.
        plan_id: u64,
        /// The planner's expectations for this rollout (bincode).
        expected: Blob,
        /// Number of writes expected per sync, summed (for progress and the dashboard).
        expected_writes: u64,
        /// Bytes expected per sync.
        expected_bytes: u64,
        /// The job sends deltas (see [`Assignment::delta`]).
        #[serde(default)]
        delta: bool,
    },
}

impl Assignment {
    /// The plan it belongs to.
    pub fn plan_id(&self) -> u64 {
        match self {
            Assignment::Trainer { plan_id, .. } | Assignment::Rollout { plan_id, .. } => *plan_id,
        }
    }

    /// Whether the job sends deltas (the controller opted in, with verification on): a trainer
    /// keeps the bytes it writes (its bases), a rollout registers a delta inbox. Off, both cost
    /// nothing and every sync is full. The controller sets it; planners leave it `false`.
    pub fn delta(&self) -> bool {
        match self {
            Assignment::Trainer { delta, .. } | Assignment::Rollout { delta, .. } => *delta,
        }
    }

    /// Sets [`Assignment::delta`].
    pub fn set_delta(&mut self, on: bool) {
        match self {
            Assignment::Trainer { delta, .. } | Assignment::Rollout { delta, .. } => *delta = on,
        }
    }
}

/// Why a worker failed a sync: the cause, and the tensor when one is to blame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The worker that failed (or that was found silent / disconnected).
    pub worker: WorkerId,
    /// What kind of failure (see [`crate::protocol::FailureKind`]).
    pub kind: crate::protocol::FailureKind,
    /// The tensor involved, when known.
    pub tensor: Option<String>,
    /// Human-readable cause.
    pub cause: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.worker, self.cause)?;
        if let Some(t) = &self.tensor {
            write!(f, " (tensor {t})")?;
        }
        Ok(())
    }
}

/// Controller to worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ToWorker {
    /// First message on a connection: a nonce the worker must answer with [`FromWorker::Hello`].
    Challenge {
        /// Random bytes.
        nonce: [u8; 32],
    },
    /// Registration accepted; the assignment follows when the world is complete.
    Welcome {
        /// Heartbeat interval the worker should keep, ms.
        heartbeat_ms: u64,
    },
    /// After a correct proof of the job token, before the worker registers: the job as the
    /// controller runs it. An in-process worker learns the job from it; a sidecar launched with a
    /// job of its own checks that it is the same.
    Job {
        /// The job.
        world: WorldSpec,
        /// The text of the model's `config.json` when [`WorldSpec::model`] names a file the
        /// controller read (`None` for a preset).
        model_config: Option<String>,
        /// The controller's proof that it holds the role's secret, over the worker's nonce
        /// ([`crate::protocol::auth::answer`]); the worker checks it before registering.
        proof: [u8; 32],
        /// With TLS: the key every worker of the job proves on its fabric lanes, sent only over
        /// the mutually authenticated channel (`None` in plain mode: the fabric token is the
        /// workers' own, from their environment).
        fabric_key: Option<FabricKey>,
    },
    /// Registration refused; the connection closes.
    Rejected {
        /// Why.
        reason: String,
    },
    /// The worker's part of the (re-)planned world. Answered by [`FromWorker::Ready`].
    Assign(Assignment),
    /// The world is complete but could not be planned (e.g. a declared model whose engines and
    /// trainers disagree on a tensor): no assignment follows until membership changes. Not
    /// answered; the reason names the tensor and both sides.
    PlanFailed {
        /// The plan that failed.
        plan_id: u64,
        /// Why.
        reason: String,
    },
    /// Trainers, once every worker of plan `plan_id` is ready: every other worker's endpoint and
    /// regions (rollouts' tensors, trainers' gather arenas). The plan is then in force.
    Peers {
        /// The plan.
        plan_id: u64,
        /// Every other worker.
        peers: Vec<PeerInfo>,
    },
    /// Get ready for version N: rollouts arm counters (an engine pauses or switches buffers),
    /// trainers make sure their source holds version N. Answered by [`FromWorker::Prepared`].
    Prepare {
        /// Sync id (controller-assigned; also the immediates' epoch, so it never repeats, even
        /// across controller restarts).
        sync_id: u64,
        /// Weight version.
        version: u64,
        /// The job's run the version belongs to (see [`FromWorker::Push`]).
        run: u64,
    },
    /// Trainers: write version N now. Answered by [`FromWorker::Written`].
    Start {
        /// Sync id.
        sync_id: u64,
        /// Weight version.
        version: u64,
        /// The engines that take deltas this sync and the version they hold; `None`: a full
        /// sync.
        delta: Option<super::DeltaBase>,
    },
    /// Version N fully landed (and verified) everywhere: rollouts may use it.
    Commit {
        /// Sync id.
        sync_id: u64,
        /// Weight version.
        version: u64,
        /// The run it belongs to: `(run, version)` only ever grows for an engine.
        run: u64,
    },
    /// Version N is not valid: rollouts must not use it; everybody drops the sync. Answered by
    /// [`FromWorker::Drained`].
    Abort {
        /// Sync id.
        sync_id: u64,
        /// Weight version.
        version: u64,
        /// Why.
        reason: String,
        /// The failure, naming the worker that failed (`None` when no worker is to blame, e.g.
        /// a pushed version that is not newer than the last committed one).
        failure: Option<Failure>,
    },
    /// Rollouts: every trainer wrote and every rollout landed version N; check what landed
    /// against the trainers' checksums of what they prepared. Answered by
    /// [`FromWorker::Verified`] (or [`FromWorker::Failed`] naming the tensor).
    Verify {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// The trainers' checksums of the units written to this rollout.
        checksums: Vec<RunChecksum>,
        /// The runs written to this rollout as deltas: applied before the checksums are
        /// compared (see `weightsync_worker::delta`).
        deltas: Vec<super::DeltaRecord>,
    },
    /// Liveness reply.
    Heartbeat {
        /// Echoed sequence number.
        seq: u64,
    },
    /// Stop the worker process.
    Shutdown,
}

/// Worker to controller.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FromWorker {
    /// Answer to the challenge: the role the worker claims, a nonce of its own for the
    /// controller to answer, and a keyed hash of the controller's nonce under the role's secret.
    Hello {
        /// The role whose secret the proof is under; the registration must be of this role.
        role: WorkerRole,
        /// Random bytes the controller must answer (mutual authentication).
        nonce: [u8; 32],
        /// blake3 keyed MAC, see [`crate::protocol::auth`].
        proof: [u8; 32],
    },
    /// Who the worker is and what it holds.
    Register(Box<Registration>),
    /// Answer to [`ToWorker::Assign`]: the worker built what its assignment needs (a trainer
    /// attached its source and registered its staging and gather arenas) and is ready for
    /// plan `plan_id`.
    Ready {
        /// The plan.
        plan_id: u64,
        /// Regions registered for this plan that peers write into (a trainer's gather arena;
        /// backend-encoded, with rkeys); for a rollout, whose tensors' regions came with its
        /// registration, its delta inbox if it takes deltas (else empty).
        regions: Vec<Blob>,
        /// Tensors it holds under this plan (a trainer's shards), for the dashboard; empty when
        /// its registration said them already.
        tensors: Vec<TensorMeta>,
    },
    /// Ready for version N (armed, source refreshed).
    Prepared {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// Work done while preparing (arming, source refresh).
        report: WorkerReport,
    },
    /// Trainer: every write of version N was posted and confirmed.
    Written {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// Timeline and counts.
        report: WorkerReport,
    },
    /// Rollout: every expected write of version N landed (and was verified when on).
    Landed {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// `Some(true)` when verification ran and passed locally; `None` when off.
        verified: Option<bool>,
        /// Timeline, counts and checksums.
        report: WorkerReport,
    },
    /// Rollout: what landed matches the trainers' checksums.
    Verified {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// The verification span and the bytes checked.
        report: WorkerReport,
    },
    /// The worker could not do its part.
    Failed {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// Its kind and cause, naming the tensor when one is to blame (the controller names the
        /// worker: the connection it came on).
        failure: crate::protocol::Fault,
    },
    /// Liveness.
    Heartbeat {
        /// Increasing sequence number.
        seq: u64,
    },
    /// A trainer's tensors hold version N and stay put until N ends: the controller starts the
    /// sync of N once every trainer pushed it on its current connection (idempotent, like
    /// `POST /v1/syncs`; a push is dropped when its connection goes). Answered by the sync's
    /// `Commit` or `Abort` (an `Abort` with sync id 0 when N cannot be synced: superseded by a
    /// newer version, or stale).
    Push {
        /// Version.
        version: u64,
        /// The run this trainer's version belongs to. A run newer than the controller's starts
        /// it (a job restarted from a checkpoint declares one, after which versions may restart
        /// below the last committed one); an older one is refused as superseded.
        run: u64,
    },
    /// Answer to [`ToWorker::Abort`]: the worker stopped its part of sync N and reset its fabric
    /// connections, so nothing it posted for N can still land. The controller starts the next
    /// sync only once every trainer of an aborted sync that had started writing said so.
    Drained {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
    },
    /// An engine's own stages of a sync it took part in ([`Stage::Pause`], [`Stage::Load`],
    /// [`Stage::Resume`]), measured by the engine around the version's landing and commit, so
    /// sent after `Landed` (usually after `Commit`). Times are relative to the instant this
    /// worker received the sync's `Prepare`, like every other span. Not answered: the controller
    /// adds them to this worker's lane of the sync, or refuses them with a logged reason (a sync
    /// it does not know or that failed, a worker that is not one of its engines, a stage an
    /// engine does not report, a span that ends before it starts, more than
    /// [`MAX_ENGINE_STAGE_EVENTS`]).
    EngineStages {
        /// Sync id.
        sync_id: u64,
        /// Version.
        version: u64,
        /// The spans (task [`WHOLE_SYNC`]).
        events: Vec<TimelineEvent>,
    },
}

#[cfg(test)]
mod tests {
    use super::Stage;

    #[test]
    fn every_stage_is_listed_once_and_parses_back_from_its_name() {
        // Adding a variant must list it in `Stage::ALL`: this match stops compiling until the
        // count below is updated too.
        let listed = |s: Stage| match s {
            Stage::H2d
            | Stage::Prepare
            | Stage::Write
            | Stage::Barrier
            | Stage::Arm
            | Stage::Land
            | Stage::Verify
            | Stage::Source
            | Stage::GatherSend
            | Stage::GatherWait
            | Stage::Pause
            | Stage::Load
            | Stage::Resume => Stage::ALL.contains(&s),
        };
        assert_eq!(Stage::ALL.len(), 13);
        for s in Stage::ALL {
            assert!(listed(s));
            assert_eq!(s.name().parse::<Stage>(), Ok(s));
            // JSON (the views, the dashboard) says the same name as traces.
            assert_eq!(
                serde_json::to_string(&s).unwrap(),
                format!("\"{}\"", s.name())
            );
        }
        let mut names: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Stage::ALL.len(), "two stages share a name");
        let engine: Vec<Stage> = Stage::ALL.into_iter().filter(|s| s.is_engine()).collect();
        assert_eq!(engine, [Stage::Pause, Stage::Load, Stage::Resume]);
        let err = "pauses".parse::<Stage>().unwrap_err();
        assert!(
            err.contains("\"pauses\"") && err.contains("resume"),
            "{err}"
        );
    }
}

/// The fabric key a controller with TLS hands its workers in [`ToWorker::Job`]: the lanes'
/// handshake proves it (as the token of [`crate::fabric::JobToken`]), so a fabric peer must have
/// come through the TLS control channel. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FabricKey(pub [u8; 32]);

impl std::fmt::Debug for FabricKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FabricKey(<redacted>)")
    }
}

impl FabricKey {
    /// The key as the fabric's job token (hex).
    pub fn token(&self) -> crate::fabric::JobToken {
        crate::fabric::JobToken(self.0.iter().map(|b| format!("{b:02x}")).collect())
    }
}
