//! The ibverbs backend (feature `rdma`): the fabric API over RC queue pairs of an RDMA NIC
//! (ConnectX on InfiniBand or RoCE, Soft-RoCE `rxe`).
//!
//! # Why it is built this way
//! - **Register once, at start-up.** `ibv_reg_mr` pins pages and programs the NIC's translation
//!   tables: milliseconds per GiB, and bounded by the memlock limit. Weight buffers are registered
//!   once and written into for the whole job; a registration that would exceed `RLIMIT_MEMLOCK`
//!   fails *before* the kernel call with an error naming `ulimit -l` ([`verbs_memlock`]).
//! - **Addressing by configuration.** Device, port and GID index come from the config or from
//!   `WEIGHTSYNC_RDMA_DEVICE` / `_PORT` / `_GID_INDEX` ([`verbs_settings`]). RoCE has no LIDs: the
//!   RTR transition sets `is_global` and puts the peer's GID into the GRH; InfiniBand uses the LID
//!   ([`verbs_gid`], [`verbs_qp_attr`]).
//! - **Bootstrap through the fabric endpoint.** Queue-pair numbers, PSNs and GID/LID travel over a
//!   small TCP connection to the peer's endpoint after a mutual job-token proof
//!   ([`verbs_bootstrap`]); the connection lives as long as the lane, so a writer that goes away
//!   takes the peer's queue pair with it.
//! - **No RNR hang.** WRITE_WITH_IMM consumes a receive on the peer. Receives are posted before a
//!   queue pair is announced and re-posted on every immediate completion (`verbs_progress`);
//!   `rnr_retry` is finite (7, "forever", is refused), so a peer that stops polling surfaces as
//!   an error naming "receiver not ready" instead of a silent hang.
//! - **Selective signalling and chained doorbells.** Only a lane's last WR of each write (and one
//!   every `send_depth/4` to recycle send-queue slots) asks for a completion
//!   ([`verbs_send_queue`]); WRs are linked into one `ibv_post_send` per group
//!   ([`verbs_wr::SendChain`]), one doorbell for many WRs.
//! - **Several queue pairs per peer, no ordering assumed across them.** Large writes are striped
//!   over `lanes_per_peer` queue pairs; a striped write's immediate travels on a tail piece posted
//!   only after the body was acknowledged on every lane, so the receiver's
//!   [`ImmCounter`](super::ImmCounter) never counts a write whose bytes are still in flight.
//! - **One progress thread** polls every CQ, completes write futures and feeds the
//!   `ImmCounter` (`verbs_progress`).
//! - **A failed queue pair is replaced, and only what never ran is re-sent.** An error completion
//!   moves an RC queue pair to the error state and flushes every WR behind it; each flushed WR
//!   still reports its `wr_id`, so a write learns exactly which of its pieces landed (those
//!   before the failure on that lane), which failed, and which were only flushed. Flushed pieces
//!   are re-posted on a fresh queue pair ([`verbs_batch::plan_repost`]); a refused write is
//!   reported. A refused write's reason is asked from the peer over the bootstrap channel, because
//!   the NIC reports a forged key, a deregistered region and an out-of-bounds range alike
//!   (`IBV_WC_REM_ACCESS_ERR`) ([`verbs_registry`]).
//! - **A reset posts nothing more.** `reset_connections` moves every writer queue pair to the
//!   error state (the NIC flushes what it has not executed) and bumps a generation: a write that
//!   started before it neither posts new pieces nor re-posts flushed ones, and fails with
//!   `ConnectionsReset`. The next write connects fresh queue pairs. (Only the Soft-RoCE /
//!   ConnectX conformance run can confirm this on a device; it is compiled and unit-tested here.)
//! - **All `unsafe` lives here**, in owning types whose `Drop` frees the verbs object
//!   ([`verbs_device`], [`verbs_cq`], [`verbs_qp`], [`verbs_mr`]); each holds an `Arc` of its
//!   parent so nothing outlives what it depends on. It uses the raw `ibverbs-sys` bindings: the
//!   safe `ibverbs` 0.9 layer fixes port 1 and PSN 0 and only posts SENDs. (Forking after
//!   registering memory is safe on kernels ≥ 5.13; older kernels would need `ibv_fork_init`.)
//!
//! # Testing
//! Everything that needs no device is unit-tested in these files (attribute masks, GID parsing,
//! endpoint serde, WR planning and chaining, signalling, memlock messages, settings). The
//! conformance suite runs against this backend in `tests/tests/fabric_verbs.rs` when
//! `WEIGHTSYNC_RDMA_DEVICE` names a device (e.g. Soft-RoCE `rxe0`).

pub mod verbs_async_events;
pub mod verbs_batch;
pub mod verbs_bootstrap;
pub mod verbs_completion;
pub mod verbs_cq;
pub mod verbs_credits;
pub mod verbs_device;
pub mod verbs_endpoint;
mod verbs_fabric;
pub mod verbs_gid;
mod verbs_lane;
pub mod verbs_lane_session;
pub mod verbs_lane_state;
pub mod verbs_limits;
mod verbs_listener;
pub mod verbs_memlock;
pub mod verbs_mr;
mod verbs_progress;
pub mod verbs_qp;
pub mod verbs_qp_attr;
pub mod verbs_registry;
pub mod verbs_send_queue;
pub mod verbs_settings;
pub mod verbs_wr;

pub use verbs_device::{device_names, PortInfo};
pub use verbs_endpoint::QpEndpoint;
pub use verbs_fabric::VerbsFabric;
pub use verbs_gid::{Addressing, Gid, LinkLayer};
pub use verbs_settings::{
    VerbsSettings, ENV_DEVICE, ENV_GID_FAMILY, ENV_GID_INDEX, ENV_PORT, ENV_SERVICE_LEVEL,
    ENV_TRAFFIC_CLASS,
};
