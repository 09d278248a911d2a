//! Why a driver could not do its part, kept typed across the seam.
//!
//! Why: the worker library's errors say exactly what failed (`WorkerError::ChecksumMismatch`
//! names the rank, the memory region, the run and both hashes). The agent reports a failure to
//! the controller, which tells every worker of the sync and the HTTP API; Python raises it as
//! `SyncFailedError`. Turning the error into text at this seam would leave every later reader
//! parsing prose, so a [`DriverError`] keeps its [`FailureKind`] (decided here, once, by one
//! match per error type) and the tensor to blame beside the text.

use weightsync_common::fabric::FabricError;
use weightsync_common::protocol::{FailureKind, Fault};
use weightsync_schedules::job::JobError;
use weightsync_worker::{SourceError, WorkerError};

/// Why a driver could not do its part: the kind, the cause, and the tensor when one is to
/// blame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{cause}")]
pub struct DriverError {
    /// What kind of failure.
    pub kind: FailureKind,
    /// The tensor involved, when known.
    pub tensor: Option<String>,
    /// What went wrong.
    pub cause: String,
}

impl DriverError {
    /// An error of `kind` with no tensor to blame.
    pub fn new(kind: FailureKind, cause: impl Into<String>) -> Self {
        DriverError {
            kind,
            tensor: None,
            cause: cause.into(),
        }
    }

    /// A message out of protocol order, an undecodable message, an internal error.
    pub fn other(cause: impl Into<String>) -> Self {
        DriverError::new(FailureKind::Other, cause)
    }

    /// A plan, job or layout this worker cannot use.
    pub fn layout(cause: impl Into<String>) -> Self {
        DriverError::new(FailureKind::Layout, cause)
    }

    /// The same error with `context: ` before its cause.
    pub fn context(self, context: &str) -> Self {
        DriverError {
            cause: format!("{context}: {}", self.cause),
            ..self
        }
    }

    /// As the agent sends it (the controller adds the worker).
    pub fn fault(self) -> Fault {
        Fault {
            kind: self.kind,
            tensor: self.tensor,
            cause: self.cause,
        }
    }
}

/// The kind of a fabric failure: a timeout and a cancellation are their own kinds.
fn fabric_kind(e: &FabricError) -> FailureKind {
    match e {
        FabricError::Timeout { .. } => FailureKind::Timeout,
        // An expectation cancelled, or this endpoint's lanes reset by a drain: an abort did it.
        FabricError::Cancelled { .. } | FabricError::ConnectionsReset { .. } => {
            FailureKind::Cancelled
        }
        _ => FailureKind::Fabric,
    }
}

impl From<WorkerError> for DriverError {
    fn from(e: WorkerError) -> Self {
        let cause = e.to_string();
        let (kind, tensor) = match e {
            WorkerError::SourceTooShort { .. } => (FailureKind::Source, None),
            WorkerError::DTypeMismatch { param, .. } => (FailureKind::Source, Some(param)),
            WorkerError::Source(s) => return DriverError::from(s),
            WorkerError::WatermarkTooSmall { param, .. } | WorkerError::Prepare { param, .. } => {
                (FailureKind::Layout, Some(param))
            }
            WorkerError::InvalidPlan(_)
            | WorkerError::MissingDestination(_)
            | WorkerError::Unit(_)
            | WorkerError::Watermark(_)
            | WorkerError::ChecksumCoverage { .. } => (FailureKind::Layout, None),
            WorkerError::Fabric { source, .. } => (fabric_kind(&source), None),
            WorkerError::ChecksumMismatch { tensors, .. } => (FailureKind::Checksum, Some(tensors)),
            WorkerError::Cancelled => (FailureKind::Cancelled, None),
            WorkerError::Protocol(_) | WorkerError::Stage { .. } => (FailureKind::Other, None),
            // A CUDA failure (feature `cuda`), and variants added later.
            _ => (FailureKind::Other, None),
        };
        DriverError {
            kind,
            tensor,
            cause,
        }
    }
}

impl From<SourceError> for DriverError {
    fn from(e: SourceError) -> Self {
        let tensor = match &e {
            SourceError::MissingTensor { name, .. }
            | SourceError::DTypeMismatch { name, .. }
            | SourceError::ShapeMismatch { name, .. } => Some(name.clone()),
            _ => None,
        };
        let kind = match &e {
            SourceError::Torn { .. } | SourceError::BeingWritten { .. } => FailureKind::Modified,
            _ => FailureKind::Source,
        };
        DriverError {
            kind,
            tensor,
            cause: e.to_string(),
        }
    }
}

impl From<FabricError> for DriverError {
    fn from(e: FabricError) -> Self {
        DriverError::new(fabric_kind(&e), e.to_string())
    }
}

impl From<JobError> for DriverError {
    fn from(e: JobError) -> Self {
        DriverError::layout(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use weightsync_common::DType;
    use weightsync_common::fabric::{Endpoint, FabricError};
    use weightsync_common::protocol::FailureKind;
    use weightsync_worker::{SourceError, WatermarkError, WorkerError};

    use super::DriverError;

    fn peer() -> Endpoint {
        Endpoint("tcp://127.0.0.1:1".into())
    }

    fn fabric(source: FabricError) -> WorkerError {
        WorkerError::fabric("rollout-1: version 3 did not land", source)
    }

    /// One error of every variant, and the kind and tensor the seam must give it.
    fn cases() -> Vec<(WorkerError, FailureKind, Option<&'static str>)> {
        vec![
            (
                WorkerError::SourceTooShort {
                    what: "shard".into(),
                    need: 10,
                    have: 4,
                },
                FailureKind::Source,
                None,
            ),
            (
                WorkerError::DTypeMismatch {
                    task: 3,
                    param: "w.q".into(),
                    source_dtype: DType::F32,
                    transform_dtype: DType::BF16,
                },
                FailureKind::Source,
                Some("w.q"),
            ),
            (
                WorkerError::WatermarkTooSmall {
                    task: 1,
                    param: "w.k".into(),
                    min_piece: 4096,
                    unit: "one row".into(),
                    watermark: 1024,
                },
                FailureKind::Layout,
                Some("w.k"),
            ),
            (
                WorkerError::InvalidPlan("write outside".into()),
                FailureKind::Layout,
                None,
            ),
            (
                WorkerError::MissingDestination("rollout-2".into()),
                FailureKind::Layout,
                None,
            ),
            (
                WorkerError::Unit(weightsync_worker::imm_for(0, u32::MAX).unwrap_err()),
                FailureKind::Layout,
                None,
            ),
            (
                WorkerError::Prepare {
                    task: 2,
                    param: "w.v".into(),
                    source: weightsync_worker::PrepareError::Shape("odd".into()),
                },
                FailureKind::Layout,
                Some("w.v"),
            ),
            (
                WorkerError::Watermark(WatermarkError::TooLarge {
                    len: 10,
                    capacity: 5,
                }),
                FailureKind::Layout,
                None,
            ),
            (
                fabric(FabricError::Disconnected {
                    peer: peer(),
                    lane: 0,
                    detail: "reset by peer".into(),
                }),
                FailureKind::Fabric,
                None,
            ),
            (
                fabric(FabricError::Timeout {
                    what: "expected writes".into(),
                    after: Duration::from_secs(1),
                }),
                FailureKind::Timeout,
                None,
            ),
            (
                fabric(FabricError::Cancelled { imm: 7 }),
                FailureKind::Cancelled,
                None,
            ),
            (
                fabric(FabricError::PeerUnreachable {
                    peer: peer(),
                    source: Arc::new(std::io::Error::other("refused")),
                }),
                FailureKind::Fabric,
                None,
            ),
            (
                WorkerError::ChecksumMismatch {
                    tensors: "layers.1.qkv_proj.weight".into(),
                    rank: 1,
                    mr: 0,
                    offset: 64,
                    len: 128,
                    expected: 1,
                    actual: 2,
                },
                FailureKind::Checksum,
                Some("layers.1.qkv_proj.weight"),
            ),
            (
                WorkerError::ChecksumCoverage {
                    rank: 1,
                    covered: 4,
                    expected: 8,
                    detail: "a gap".into(),
                },
                FailureKind::Layout,
                None,
            ),
            (
                WorkerError::Source(SourceError::MissingTensor {
                    path: "w.safetensors".into(),
                    name: "w.o".into(),
                }),
                FailureKind::Source,
                Some("w.o"),
            ),
            (
                WorkerError::Source(SourceError::Layout("duplicate".into())),
                FailureKind::Source,
                None,
            ),
            (
                WorkerError::Protocol("await before arm".into()),
                FailureKind::Other,
                None,
            ),
            (WorkerError::Cancelled, FailureKind::Cancelled, None),
            (
                WorkerError::Stage {
                    stage: "h2d",
                    detail: "panicked".into(),
                },
                FailureKind::Other,
                None,
            ),
        ]
    }

    #[test]
    fn each_worker_error_keeps_its_kind_tensor_and_text_across_the_seam() {
        for (e, kind, tensor) in cases() {
            let text = e.to_string();
            let d = DriverError::from(e);
            assert_eq!(d.kind, kind, "{text}");
            assert_eq!(d.tensor.as_deref(), tensor, "{text}");
            assert_eq!(d.cause, text);
            let fault = d.clone().fault();
            assert_eq!(
                (fault.kind, fault.tensor, fault.cause),
                (d.kind, d.tensor, d.cause)
            );
        }
    }

    #[test]
    fn other_errors_reaching_the_seam_are_typed_too() {
        let shm = SourceError::TooShort {
            what: "/dev/shm/w".into(),
            need: 8,
            have: 4,
        };
        assert_eq!(DriverError::from(shm).kind, FailureKind::Source);
        let down = FabricError::Shutdown;
        assert_eq!(DriverError::from(down).kind, FailureKind::Fabric);
        let e = DriverError::layout("the slice is rank 2's").context("assignment");
        assert_eq!(e.kind, FailureKind::Layout);
        assert_eq!(e.cause, "assignment: the slice is rank 2's");
    }
}
