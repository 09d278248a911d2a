//! The fabric: one-sided WRITE with 32-bit immediates, over TCP or ibverbs.
//!
//! Everything weightsync moves goes through this API, modelled on fabric-lib's TransferEngine:
//!
//! 1. **Register once.** Each process registers its memory at start-up
//!    ([`FabricBackend::register`]): an owned page-aligned buffer or a raw range it keeps alive
//!    ([`Memory`]). It gets a [`Region`] handle and a serde [`RegionDescriptor`] (endpoint, base,
//!    length, rkey) that it publishes to the controller. Registration is expensive on real NICs
//!    (pinning, page tables), so it never happens on the data path.
//! 2. **Write one-sided.** A writer posts [`WriteOp`]s: local bytes into a peer's region at an
//!    offset, optionally with an immediate. The receiver's CPU does nothing per write: no receive
//!    call, no copy into place. [`FabricBackend::write_batch`] merges runs contiguous on both sides
//!    and spreads large writes over several *lanes* (queue pairs / TCP connections) per peer,
//!    because one lane rarely fills a link. The returned future resolves when the peer has
//!    acknowledged that every byte landed (or with the error that stopped it).
//! 3. **Count immediates.** The receiver learns of arrivals only through the immediates it counts
//!    in its [`ImmCounter`]; `expect(imm, n)` resolves once `n` such writes have fully landed, in
//!    any order across lanes.
//!
//! Failures are typed ([`FabricError`]): a peer refusing a write (wrong rkey, out of bounds, no
//! permission, deregistered), an unreachable peer, a lane that disconnects (reported to the writes
//! on it and re-established on next use, like a queue pair reset), and timeouts. A writer that
//! abandons work resets its lanes ([`FabricBackend::reset_connections`]) so nothing it queued can
//! land later.
//!
//! # Backends
//! - [`tcp`] (default): a user-space emulation of an RDMA NIC. Frames carry op, rkey, remote
//!   address, length, immediate and payload; the receiver validates against its registration table
//!   before touching memory and reads the payload straight into the region. Lanes authenticate
//!   with a challenge on the job token. Between processes of one machine, a lane's large frames
//!   carry no payload: the receiver copies the bytes out of the writer's memory itself, once
//!   ([`tcp::same_host`]; [`FabricConfig::same_host`]).
//! - `verbs` (feature `rdma`): ibverbs RC queue pairs, bootstrapped through the same endpoint.
//!
//! [`Fabric`] picks one at run time from a [`FabricConfig`]; code that wants to be generic (the
//! conformance suite, the pipeline) takes `B: FabricBackend`.
//!
//! # Layout
//! - `descriptor`: [`Endpoint`], [`Access`], [`RegionDescriptor`].
//! - `memory`: [`Memory`], [`PageAlignedBuffer`], [`RawMemory`].
//! - `region`: [`Region`], [`RegisteredMemory`] (revocable access for backends).
//! - `op`: [`WriteOp`], [`merge_contiguous`], [`stripe`], [`place`].
//! - `stride`: [`Stride`], a write's source as equal runs at a constant stride.
//! - `imm_counter`: [`ImmCounter`].
//! - `landing_log`: [`LandingLog`], what landed when, for backends that see writes land.
//! - `config`: [`FabricConfig`]. `error`: [`FabricError`].

use std::future::Future;

mod config;
mod descriptor;
mod error;
mod imm_counter;
pub mod landing_log;
pub mod limit;
mod memory;
mod op;
mod region;
pub mod shared_memory;
mod stride;
pub mod tcp;
mod transfer_paths;
#[cfg(feature = "rdma")]
pub mod verbs;

pub use config::{BackendKind, FabricConfig, GidFamily, JobToken, SameHostPath, VerbsConfig};
pub use descriptor::{Access, Endpoint, RegionDescriptor};
pub use error::{FabricError, RemoteAccessKind, Result};
pub use imm_counter::{ImmCounter, ImmStats, ImmWait};
pub use landing_log::{LandingLog, LandingTicket, LogSnapshot};
pub use memory::{
    Memory, MemoryLocation, MemoryOwner, PAGE_SIZE, PageAlignedBuffer, PageSize, RawMemory,
};
pub use op::{WriteOp, merge_contiguous, place, stripe};
pub use region::{DeregisterHook, LiveMemory, Region, RegisteredMemory, SourcePin};
pub use stride::{Segments, Stride};
pub use tcp::{TcpFabric, WriteWindow};
pub use transfer_paths::TransferPaths;

/// What every backend offers. Small on purpose: register, write, count.
///
/// Implementations are cheap handles (`Clone`, shared state behind an `Arc`), and their futures
/// are `'static` so callers can spawn them.
///
/// Contract every backend keeps (and the conformance suite in `weightsync-tests` checks):
/// - a write resolves `Ok` only after every byte is in the peer's memory;
/// - the peer counts a write's immediate exactly once, only after all its bytes landed (also when
///   the backend split it over lanes), and never for a write that failed part-way; a write
///   reported failed may still have landed whole (its acknowledgement was lost), and then its
///   immediate is counted once: a backend never re-sends a piece with an immediate that may
///   already have landed, so an immediate is never counted more often than it was written,
///   whatever lanes fail (the conformance suite cuts lanes at random to check this);
/// - a refused write touches no byte outside the region it was checked against, and none inside
///   it either when refused before landing (wrong rkey, bounds, permission, deregistered);
/// - a lane that fails makes the writes on it fail, and the next write reconnects;
/// - after [`FabricBackend::reset_connections`] resolves, nothing posted before it lands later,
///   and writes posted afterwards work as usual.
pub trait FabricBackend: Clone + Send + Sync + std::fmt::Debug + 'static {
    /// This process's bootstrap address, the `endpoint` of its descriptors.
    fn endpoint(&self) -> &Endpoint;

    /// Lanes (connections / queue pairs) used per peer.
    fn lanes_per_peer(&self) -> usize;

    /// Says how many peers this process is about to write to (a trainer once it knows its
    /// destinations), so that a backend whose lanes cost threads spreads the machine's lanes
    /// over them instead of opening `lanes_per_peer` to each: TCP lanes to peers met after the
    /// call ([`FabricConfig::lanes_for_peers`]). The default ignores it (a queue pair costs no
    /// thread).
    fn expect_peers(&self, _peers: usize) {}

    /// Registers memory. The returned region deregisters when its last clone drops.
    fn register(&self, memory: Memory, access: Access) -> Result<Region>;

    /// Allocates and registers a zeroed page-aligned buffer of `len` bytes, on
    /// [`FabricBackend::page_size`]'s pages. A write source is written once before it is
    /// registered: a NIC registration of memory only ever read may pin the shared zero page of
    /// untouched pages (read-only long-term pins of private mappings, on kernels between the
    /// removal of `FOLL_FORCE` and zero-page unsharing), after which later writes through the
    /// page tables never reach what the NIC reads (device review N1). Touching every page
    /// first makes each one the process's own, on every kernel, and moves the first-touch
    /// faults out of the first sync.
    fn alloc(&self, len: usize, access: Access) -> Result<Region> {
        let memory = Memory::alloc_on(len, self.page_size(access))?;
        if access == Access::SOURCE {
            memory.write_touch();
        }
        self.register(memory, access)
    }

    /// The pages [`FabricBackend::alloc`] backs a region of `access` with. The default (the TCP
    /// fabric's): huge pages for write sources, small pages for what peers write into. A
    /// same-host lane copies with `process_vm_readv`, which pins every source page it reads:
    /// huge-page sources made `bench e2e`'s syncs 5-14% faster on the 2-core development VM
    /// (2026-12-07). A CPU copy between two huge-page buffers at different offsets within a
    /// page, though, ran slower than with either side on small pages (see
    /// [`PageAlignedBuffer::with_huge_pages`]), so receive regions keep small pages. A NIC
    /// copies nothing and translates every page it touches: the verbs backend takes huge pages
    /// for every region.
    fn page_size(&self, access: Access) -> PageSize {
        if access == Access::SOURCE {
            PageSize::Huge
        } else {
            PageSize::Small
        }
    }

    /// Writes one op; resolves once it landed (acknowledged by the peer). Backends post the write
    /// when this is called, not when the future is first polled, so a caller can post many
    /// writes and then await them (many in flight, like work requests on a send queue).
    fn write(&self, op: WriteOp) -> impl Future<Output = Result<()>> + Send + 'static;

    /// Writes many ops (merged and striped over lanes); resolves once all landed, or with the
    /// first error (the others may or may not have landed).
    fn write_batch(&self, ops: Vec<WriteOp>) -> impl Future<Output = Result<()>> + Send + 'static;

    /// Establishes the lanes to `peer` ahead of the first write (optional; writes connect lazily).
    fn connect(&self, peer: &Endpoint) -> impl Future<Output = Result<()>> + Send + 'static;

    /// The counter of immediates received by this process.
    fn imm_counter(&self) -> &ImmCounter;

    /// The shortest run for which a write from a strided source ([`WriteOp::with_stride`])
    /// costs this backend less than gathering the runs into contiguous memory first and
    /// writing that. Every backend takes strided sources of any run; this only says which
    /// are worth it (a caller with shorter runs gathers them itself). By default every run is:
    /// a NIC reads each scatter/gather entry as it reads a contiguous source.
    fn min_strided_run(&self) -> u64 {
        1
    }

    /// Bytes this process has written so far, by how they reached their receivers (a caller
    /// takes the difference over a sync to name its path); `None` where the backend does not
    /// count them (one path: its own transport).
    fn transfer_paths(&self) -> Option<TransferPaths> {
        None
    }

    /// Resets every lane this endpoint opened to write, so that nothing it posted before can
    /// land anywhere later: what is still queued (in user space, in the kernel's send queue, in
    /// a send queue of the NIC) is discarded, the writes not yet acknowledged fail with
    /// [`FabricError::ConnectionsReset`], and the next write to a peer opens fresh lanes.
    ///
    /// Why it exists: a write posted for a sync that has since been abandoned (a partition, an
    /// aborted sync) must not land while the *next* sync runs. Its immediate would not be
    /// counted (it carries the old epoch), but its bytes would overwrite the new ones. Callers
    /// first stop posting for the abandoned work, then reset, then start the next; a write
    /// posted concurrently with the reset may go either way. Bytes the peer already received
    /// before the reset are not recalled (nothing can recall them).
    fn reset_connections(&self) -> impl Future<Output = ()> + Send + 'static;
}

/// The backend chosen at run time.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Fabric {
    /// User-space RDMA emulation over TCP.
    Tcp(TcpFabric),
    /// ibverbs.
    #[cfg(feature = "rdma")]
    Verbs(verbs::VerbsFabric),
}

impl Fabric {
    /// Sets when this process accepts writes into its regions (see [`WriteWindow`]). The TCP
    /// backend checks it on every frame (window and epoch); the verbs backend withdraws remote
    /// write from every inbound queue pair while it is closed, so the NIC refuses writes
    /// (`verbs::verbs_window`; it cannot check epochs). Returns once the new window is in
    /// force; with verbs that takes one firmware command per inbound queue pair, so async
    /// callers run it on the blocking pool.
    pub fn set_write_window(&self, window: WriteWindow) {
        match self {
            Fabric::Tcp(t) => t.set_write_window(window),
            #[cfg(feature = "rdma")]
            Fabric::Verbs(v) => v.set_write_window(window),
        }
    }

    /// Writes refused because this receiver's write window was closed (with TCP also those of
    /// another sync's epoch): `TcpStats::outside_window` or `VerbsStats::outside_window`.
    pub fn writes_outside_window(&self) -> u64 {
        match self {
            Fabric::Tcp(t) => t.stats().outside_window,
            #[cfg(feature = "rdma")]
            Fabric::Verbs(v) => v.stats().outside_window,
        }
    }

    /// Sets the epoch (the sync's `sync_id`) stamped on the frames this process writes from now
    /// on, so that a guarded TCP receiver lands them only while that sync is armed on it. With
    /// verbs a one-sided WRITE carries no epoch the receiver could check (see
    /// `docs/security.md`), so there it changes nothing.
    pub fn set_send_epoch(&self, epoch: u64) {
        match self {
            Fabric::Tcp(t) => t.set_send_epoch(epoch),
            #[cfg(feature = "rdma")]
            Fabric::Verbs(_) => {}
        }
    }

    /// Starts the backend named by `config` (binds its listener, opens devices).
    pub async fn start(config: &FabricConfig) -> Result<Fabric> {
        config.validate()?;
        match config.backend {
            BackendKind::Tcp => Ok(Fabric::Tcp(TcpFabric::start(config).await?)),
            #[cfg(feature = "rdma")]
            BackendKind::Verbs => Ok(Fabric::Verbs(verbs::VerbsFabric::start(config).await?)),
            #[cfg(not(feature = "rdma"))]
            BackendKind::Verbs => Err(FabricError::Unsupported(
                "the verbs backend needs weightsync built with the `rdma` feature".into(),
            )),
        }
    }
}

macro_rules! dispatch {
    ($self:ident, $f:ident => $e:expr_2021) => {
        match $self {
            Fabric::Tcp($f) => $e,
            #[cfg(feature = "rdma")]
            Fabric::Verbs($f) => $e,
        }
    };
}

impl FabricBackend for Fabric {
    fn endpoint(&self) -> &Endpoint {
        dispatch!(self, f => f.endpoint())
    }

    fn lanes_per_peer(&self) -> usize {
        dispatch!(self, f => f.lanes_per_peer())
    }

    fn expect_peers(&self, peers: usize) {
        dispatch!(self, f => f.expect_peers(peers))
    }

    fn register(&self, memory: Memory, access: Access) -> Result<Region> {
        dispatch!(self, f => f.register(memory, access))
    }

    // The backend's own allocation (the TCP backend's sources are shared memory, see
    // `tcp::shared_pulls`), not the trait's default over `register`.
    fn alloc(&self, len: usize, access: Access) -> Result<Region> {
        dispatch!(self, f => f.alloc(len, access))
    }

    fn page_size(&self, access: Access) -> PageSize {
        dispatch!(self, f => f.page_size(access))
    }

    fn transfer_paths(&self) -> Option<TransferPaths> {
        dispatch!(self, f => f.transfer_paths())
    }

    fn write(&self, op: WriteOp) -> impl Future<Output = Result<()>> + Send + 'static {
        let this = self.clone();
        async move { dispatch!(this, f => f.write(op).await) }
    }

    fn write_batch(&self, ops: Vec<WriteOp>) -> impl Future<Output = Result<()>> + Send + 'static {
        let this = self.clone();
        async move { dispatch!(this, f => f.write_batch(ops).await) }
    }

    fn connect(&self, peer: &Endpoint) -> impl Future<Output = Result<()>> + Send + 'static {
        let this = self.clone();
        let peer = peer.clone();
        async move { dispatch!(this, f => f.connect(&peer).await) }
    }

    fn imm_counter(&self) -> &ImmCounter {
        dispatch!(self, f => f.imm_counter())
    }

    fn min_strided_run(&self) -> u64 {
        dispatch!(self, f => f.min_strided_run())
    }

    fn reset_connections(&self) -> impl Future<Output = ()> + Send + 'static {
        let this = self.clone();
        async move { dispatch!(this, f => f.reset_connections().await) }
    }
}
