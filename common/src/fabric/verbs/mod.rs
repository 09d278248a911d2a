//! The ibverbs backend (feature `rdma`): the fabric API over RC queue pairs of an RDMA NIC
//! (ConnectX on InfiniBand or RoCE, Soft-RoCE `rxe`).
//!
//! # Why it is built this way
//! - **Register once, at start-up.** `ibv_reg_mr` pins pages and programs the NIC's translation
//!   tables: milliseconds per GiB, and bounded by the memlock limit. Weight buffers are registered
//!   once and written into for the whole job; a registration that would exceed `RLIMIT_MEMLOCK`
//!   fails *before* the kernel call with an error naming `ulimit -l`, unless the process is exempt
//!   (root or `CAP_IPC_LOCK`, as in the usual container setup) ([`verbs_memlock`]). Registrations
//!   are tracked by the identity of their memory, never by rkey: a local-only MR's rkey means
//!   nothing, and old Soft-RoCE gives them all rkey 0 ([`verbs_registry`]).
//! - **Addressing by configuration.** Device, port and GID index come from the config or from
//!   `WEIGHTSYNC_RDMA_DEVICE` / `_PORT` / `_GID_INDEX` ([`verbs_settings`]); without a device the
//!   first one with an active port is used, and on RoCE without a GID index the first RoCE v2
//!   entry of `gid_family` (IPv4 by default). Both sides exchange their GID type, and a pair of
//!   different RoCE versions or IP families is refused at connect. RoCE has no LIDs: the RTR
//!   transition sets `is_global` and puts the peer's GID into the GRH; InfiniBand uses the LID
//!   ([`verbs_gid`], [`verbs_qp_attr`]). The GRH traffic class (IP DSCP/ECN) and the service
//!   level come from `verbs.traffic_class` / `verbs.service_level` (`WEIGHTSYNC_RDMA_TC` / `_SL`),
//!   so weight-sync traffic rides the lossless class of a PFC/ECN fabric.
//! - **Device limits, queried once.** `ibv_query_device` and `ibv_query_port` at open; depths over
//!   `max_qp_wr` / `max_cqe` and registrations over `max_mr_size` are refused by name, and pieces
//!   are split at the smaller of both sides' `max_msg_sz` ([`verbs_limits`]).
//! - **Bootstrap through the fabric endpoint.** Queue-pair numbers, PSNs, GID/LID, receive depth
//!   and message limit travel over a small TCP connection to the peer's endpoint after a mutual
//!   job-token proof that also covers the request ([`verbs_bootstrap`]); the connection has
//!   keepalive, lives as long as the lane, and carries credit reports and the reset's teardown
//!   ([`verbs_lane_session`]), so a writer that goes away takes the peer's queue pair with it.
//! - **No RNR in normal operation: receive credits.** WRITE_WITH_IMM consumes a receive on the
//!   peer. Receives are posted before a queue pair is announced and re-posted on every immediate
//!   completion by the progress thread, which reports the running total to the writer. A writer
//!   lane has at most `recv_depth + reposted` WRITE_WITH_IMMs outstanding in total, so it waits
//!   for credits instead of meeting an RNR NAK, however late the peer's progress thread is
//!   ([`verbs_credits`]). `rnr_retry` is finite (7, "forever", is refused) and the RNR timer is
//!   5 ms, so a receiver that is truly gone surfaces as an error naming "receiver not ready".
//! - **Selective signalling and chained doorbells.** Only the last WR of each posted chunk (and
//!   one every `send_depth/4` to recycle send-queue slots) asks for a completion
//!   ([`verbs_send_queue`]); WRs are linked into one `ibv_post_send` per group
//!   ([`verbs_wr::SendChain`]), one doorbell for many WRs. Inline data is not used (it would save
//!   a DMA read for tiny WRs: latency only).
//! - **Several queue pairs per peer, no ordering assumed across them.** Large writes are striped
//!   over `lanes_per_peer` queue pairs; a striped write's immediate travels on a tail piece posted
//!   only after the body was acknowledged on every lane, so the receiver's
//!   [`ImmCounter`](super::ImmCounter) never counts a write whose bytes are still in flight. (This
//!   relies on data of lane A being visible before the CQE of lane B, which PCIe strong ordering
//!   gives: keep `IBV_ACCESS_RELAXED_ORDERING` off receive registrations unless this is checked
//!   again.)
//! - **One progress thread** polls every CQ in fair rounds, completes write futures and feeds the
//!   `ImmCounter` (`verbs_progress`, whose doc explains the polling and its sleeps); one more
//!   thread reads the device's async events and breaks the lanes they concern
//!   ([`verbs_async_events`]).
//! - **A failed queue pair is replaced; an immediate is never sent twice.** An error completion
//!   moves an RC queue pair to the error state and flushes every WR behind it; each flushed WR
//!   still reports its `wr_id`, so a write learns which of its pieces landed (those before the
//!   failure on that lane), which failed, and which were flushed. A flush does *not* mean the
//!   peer never executed the WR (its ACK may simply not have come back), so flushed pieces are
//!   re-posted on a fresh queue pair only when they carry no immediate, or when the lane's first
//!   failure was a NAK, behind which the peer discarded everything ([`verbs_batch::plan_repost`]).
//!   A flushed piece with an immediate otherwise fails its write: counting an immediate twice
//!   would let a receiver see a version "landed" while a write is still missing. A refused
//!   write's reason is asked from the peer over the bootstrap channel, because the NIC reports a
//!   forged key, a deregistered region and an out-of-bounds range alike
//!   (`IBV_WC_REM_ACCESS_ERR`) ([`verbs_registry`]). A write's sources stay registered until
//!   every WR posted from them completed, even if the write gave up first.
//! - **Broken and posting under one lock.** A lane's send-queue slots, credits and broken flag
//!   live under one lock ([`verbs_lane_state`]), so a lane the progress thread found drained (and
//!   stopped polling) can never take another WR.
//! - **A reset posts nothing more, and fences the peer.** `reset_connections` marks every writer
//!   lane reset, moves its queue pair to the error state (the NIC flushes what it has not
//!   executed), bumps a generation (a write that started before it neither posts new pieces nor
//!   re-posts flushed ones, and fails with `ConnectionsReset`), and asks each peer over the lane's
//!   bootstrap connection to move its end to the error state too, waiting (bounded) for the
//!   answer: packets still on the wire cannot land afterwards. The next write connects fresh
//!   queue pairs. (Only the Soft-RoCE / ConnectX conformance run can confirm this on a device; it
//!   is compiled and unit-tested here.)
//! - **A write window in the NIC.** A receiver that guards its memory (the rollout driver closes
//!   its window at start and arms it per sync, `Fabric::set_write_window`) withdraws remote
//!   write from every inbound queue pair while no sync is armed (an RTS → RTS modify of the
//!   access flags); the NIC then refuses any write with a NAK before a byte lands, and the
//!   refusal's async event is counted as `outside_window` ([`verbs_window`]).
//! - **All `unsafe` lives here**, in owning types whose `Drop` frees the verbs object
//!   ([`verbs_device`], [`verbs_cq`], [`verbs_qp`], [`verbs_mr`]); each holds an `Arc` of its
//!   parent so nothing outlives what it depends on. It uses the raw `ibverbs-sys` bindings: the
//!   safe `ibverbs` 0.9 layer fixes port 1 and PSN 0 and only posts SENDs. GID types are read
//!   from sysfs, so any rdma-core the distribution ships links (`ibv_query_gid_ex` needs 32+).
//!   (Forking after registering memory is safe on kernels ≥ 5.13; older kernels would need
//!   `ibv_fork_init`.)
//!
//! # Testing
//! Everything that needs no device is unit-tested in these files: attribute masks, GID choice and
//! family checks, endpoint serde, WR planning and chaining, signalling, the repost planner, the
//! credit window (a seeded model of writer, NIC and a lagging receiver that must never meet RNR),
//! the one-lock lane state, fair polling, the registry, memlock decisions, device limits, the
//! bootstrap and lane messages, the write window (through a recording stand-in queue pair). The conformance suite runs against this backend in
//! `tests/tests/fabric_verbs.rs` when `WEIGHTSYNC_RDMA_DEVICE` names a device (e.g. Soft-RoCE
//! `rxe0`); `tests/verbs-device-check.sh` runs it with the device checks of the review.

pub mod verbs_async_events;
pub mod verbs_batch;
pub mod verbs_bootstrap;
pub mod verbs_completion;
pub mod verbs_cq;
pub mod verbs_credits;
pub mod verbs_device;
mod verbs_device_checks;
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
pub mod verbs_window;
pub mod verbs_wr;

pub use verbs_device::{PortInfo, device_names};
pub use verbs_endpoint::QpEndpoint;
pub use verbs_fabric::{VerbsFabric, VerbsStats};
pub use verbs_gid::{Addressing, Gid, LinkLayer};
pub use verbs_settings::{
    ENV_DEVICE, ENV_GID_FAMILY, ENV_GID_INDEX, ENV_PORT, ENV_SERVICE_LEVEL, ENV_TRAFFIC_CLASS,
    VerbsSettings,
};
