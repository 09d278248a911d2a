//! The fabric's one error type.
//!
//! Errors on the data path are values, never panics: a refused remote write, a lane that died or a
//! peer that stopped reading all come back to the caller that awaited the write, with enough
//! context (peer, rkey, offset, length) to say which transfer failed and why. The type is `Clone`
//! because one failure (a lane going down) completes many waiting writes at once.

use std::sync::Arc;
use std::time::Duration;

use super::descriptor::Endpoint;

/// Why a remote peer refused a write (the remote side of an RDMA "remote access error").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RemoteAccessKind {
    /// No registration with this rkey exists on the peer (never registered, or a forged key).
    WrongRkey,
    /// The write's remote address range is not inside the registered region.
    OutOfBounds,
    /// The region exists but was registered without [`Access::REMOTE_WRITE`](super::Access::REMOTE_WRITE).
    NoWritePermission,
    /// The region was deregistered before (or while) the write landed; nothing more landed.
    Deregistered,
    /// The receiver guards its regions and no sync is armed on it
    /// ([`WriteWindow`](super::WriteWindow)): nothing landed.
    OutsideWindow,
}

impl std::fmt::Display for RemoteAccessKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RemoteAccessKind::WrongRkey => "unknown rkey",
            RemoteAccessKind::OutOfBounds => "range outside the registered region",
            RemoteAccessKind::NoWritePermission => "region not registered for remote write",
            RemoteAccessKind::Deregistered => "region deregistered",
            RemoteAccessKind::OutsideWindow => {
                "no sync armed on the receiver (write outside the window)"
            }
        })
    }
}

/// Every way a fabric operation can fail.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The peer refused the write; no byte outside its registered region was touched.
    #[error(
        "peer {peer} refused write (rkey {rkey:#018x}, remote offset {offset}, len {len}): {kind}"
    )]
    RemoteAccess {
        /// Why the peer refused it, as precisely as the backend can tell.
        kind: RemoteAccessKind,
        /// The peer that refused.
        peer: Endpoint,
        /// The remote key the write named.
        rkey: u64,
        /// Offset of the refused write inside the remote region (as the writer computed it).
        offset: u64,
        /// Length of the refused write in bytes.
        len: u64,
    },
    /// A local argument is outside a local region (a source range, a read or fill range).
    #[error("{what}: range [{offset}, {offset}+{len}) is outside a region of {region_len} bytes")]
    LocalOutOfBounds {
        /// The operation and argument that was out of range.
        what: &'static str,
        /// Start of the range in the local region.
        offset: u64,
        /// Length of the range in bytes.
        len: u64,
        /// Size of the local region.
        region_len: u64,
    },
    /// A local region was used after it was deregistered.
    #[error("{what}: local region (rkey {rkey:#018x}) is deregistered")]
    LocalDeregistered {
        /// The operation that used it.
        what: &'static str,
        /// The region's key.
        rkey: u64,
    },
    /// The peer could not be reached (connect refused, no route, connect timeout).
    #[error("peer {peer} unreachable: {source}")]
    PeerUnreachable {
        /// The peer.
        peer: Endpoint,
        /// The connect error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// An established lane to the peer broke; writes in flight on it failed (and were not counted
    /// by the peer unless their payload had fully landed). The lane is re-established on next use.
    #[error("lane {lane} to peer {peer} disconnected: {detail}")]
    Disconnected {
        /// The peer.
        peer: Endpoint,
        /// The lane (connection) that broke.
        lane: usize,
        /// What broke it.
        detail: String,
    },
    /// This endpoint reset its connections ([`FabricBackend::reset_connections`]) before the
    /// peer acknowledged the write: whatever of it was still queued was discarded and never lands
    /// (bytes the peer had already received before the reset may have landed; the immediate is
    /// counted only if the whole write had landed).
    ///
    /// [`FabricBackend::reset_connections`]: super::FabricBackend::reset_connections
    #[error(
        "lane {lane} to peer {peer} was reset by this endpoint before the write was acknowledged"
    )]
    ConnectionsReset {
        /// The peer.
        peer: Endpoint,
        /// The lane the write was on.
        lane: usize,
    },
    /// Something did not happen in time: a peer that stopped reading, a connect, an expectation.
    #[error("timed out after {after:?}: {what}")]
    Timeout {
        /// What did not happen.
        what: String,
        /// How long it was waited for.
        after: Duration,
    },
    /// The connection handshake failed: one side does not know the job token.
    #[error("authentication with peer {peer} failed: {detail}")]
    Auth {
        /// The peer.
        peer: Endpoint,
        /// What did not match.
        detail: String,
    },
    /// Registering memory failed. `hint` says what to change (e.g. `ulimit -l` for memlock).
    #[error("registering {len} bytes failed: {detail}{}", hint.as_deref().map(|h| format!(" (hint: {h})")).unwrap_or_default())]
    Registration {
        /// Bytes that were to be registered.
        len: u64,
        /// The backend's error.
        detail: String,
        /// What to change, when known.
        hint: Option<String>,
    },
    /// The peer sent bytes that are not a valid frame; the lane is dropped.
    #[error("protocol violation on a lane with {peer}: {detail}")]
    Protocol {
        /// The peer.
        peer: Endpoint,
        /// What was wrong with the bytes.
        detail: String,
    },
    /// An operating-system I/O error with what we were doing.
    #[error("{context}: {source}")]
    Io {
        /// What we were doing.
        context: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// `ImmCounter::expect` on an immediate whose earlier expectation was cancelled. Cancelled
    /// immediates are retired so that late writes can never satisfy a new expectation.
    #[error("immediate {imm:#010x} was cancelled earlier and is retired")]
    ImmRetired {
        /// The immediate.
        imm: u32,
    },
    /// `ImmCounter::expect` on an immediate that already has a pending expectation.
    #[error("immediate {imm:#010x} already has a pending expectation")]
    ImmBusy {
        /// The immediate.
        imm: u32,
    },
    /// The expectation was cancelled with [`ImmCounter::cancel`](super::ImmCounter::cancel).
    #[error("expectation for immediate {imm:#010x} was cancelled")]
    Cancelled {
        /// The immediate.
        imm: u32,
    },
    /// The configuration is invalid (names the field).
    #[error("invalid fabric configuration: {0}")]
    Config(String),
    /// The backend cannot do this (e.g. TCP cannot register device memory).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The fabric was shut down.
    #[error("fabric is shut down")]
    Shutdown,
}

impl FabricError {
    /// Wraps an I/O error with what we were doing.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        FabricError::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// The kind of remote access error, if this is one.
    pub fn remote_access_kind(&self) -> Option<RemoteAccessKind> {
        match self {
            FabricError::RemoteAccess { kind, .. } => Some(*kind),
            _ => None,
        }
    }
}

/// Result alias for the fabric.
pub type Result<T, E = FabricError> = std::result::Result<T, E>;
