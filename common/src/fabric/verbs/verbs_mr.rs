//! A registered memory region. Deregistered on drop.
//!
//! Registration pins the pages and builds the NIC's translation for them, which is slow (tens of
//! milliseconds per GiB) and counts against the memlock limit, so weightsync registers each
//! buffer once at start-up and keeps it for the whole job. The region keeps an `Arc` of the memory
//! it covers, so the bytes cannot be freed while the NIC may still DMA into them; `ibv_dereg_mr`
//! in `Drop` is the point after which the NIC no longer touches them, and only then is the memory
//! released.

use std::sync::Arc;

use ibverbs_sys as ffi;

use super::super::descriptor::Access;
use super::super::error::FabricError;
use super::super::memory::MemoryLocation;
use super::super::region::RegisteredMemory;
use super::verbs_device::VerbsPd;
use super::verbs_memlock::{MemlockPolicy, registration_error};

/// The verbs access flags for a registration with `access`.
///
/// Every registration may be a local source (reads need no flag). Remote write requires local
/// write as well (a verbs rule: `ibv_reg_mr` rejects REMOTE_WRITE without LOCAL_WRITE).
pub fn mr_access_flags(access: Access) -> ffi::ibv_access_flags {
    let mut flags = ffi::ibv_access_flags(0);
    if access.contains(Access::LOCAL_WRITE) || access.contains(Access::REMOTE_WRITE) {
        flags |= ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    }
    if access.contains(Access::REMOTE_WRITE) {
        flags |= ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    }
    flags
}

/// An owned memory registration.
#[derive(Debug)]
pub struct VerbsMr {
    mr: *mut ffi::ibv_mr,
    lkey: u32,
    rkey: u32,
    memory: Arc<RegisteredMemory>,
    _pd: Arc<VerbsPd>,
}

// SAFETY: an MR handle is plain data to the application; dereg is a thread-safe verb and happens
// once, in Drop.
unsafe impl Send for VerbsMr {}
// SAFETY: shared access only reads lkey/rkey/address.
unsafe impl Sync for VerbsMr {}

impl VerbsMr {
    /// Registers `memory` with `access`. Host memory is first checked against the memlock limit,
    /// counting `already_pinned` bytes this fabric registered before.
    pub fn register(
        pd: &Arc<VerbsPd>,
        memory: Arc<RegisteredMemory>,
        access: Access,
        already_pinned: u64,
    ) -> Result<VerbsMr, FabricError> {
        let len = memory.len();
        if len == 0 {
            return Err(FabricError::Registration {
                len: 0,
                detail: "cannot register an empty region with verbs".into(),
                hint: None,
            });
        }
        pd.context()
            .port()
            .limits
            .check_registration(len as u64)
            .map_err(|detail| FabricError::Registration {
                len: len as u64,
                detail,
                hint: None,
            })?;
        let policy =
            MemlockPolicy::current().map_err(|e| FabricError::io("getrlimit(MEMLOCK)", e))?;
        if memory.location() == MemoryLocation::Host {
            policy.check(len as u64, already_pinned)?;
        }
        let flags = mr_access_flags(access);
        // SAFETY: the memory is valid for `len` bytes and stays allocated while this VerbsMr
        // holds its Arc; pd is live (Arc stored below).
        let mr = unsafe { ffi::ibv_reg_mr(pd.raw(), memory.as_ptr().cast(), len, flags.0 as i32) };
        if mr.is_null() {
            let err = registration_error(len as u64, std::io::Error::last_os_error(), policy);
            return Err(match (memory.location(), err) {
                (
                    MemoryLocation::CudaDevice { ordinal },
                    FabricError::Registration { len, detail, .. },
                ) => FabricError::Registration {
                    len,
                    detail: format!("{detail} (CUDA device {ordinal} memory)"),
                    hint: Some(
                        "registering GPU memory needs GPUDirect RDMA: load the nvidia-peermem \
                         kernel module (or use a dma-buf capable driver)"
                            .into(),
                    ),
                },
                (_, err) => err,
            });
        }
        // SAFETY: mr is a valid MR just returned by ibv_reg_mr.
        let (lkey, rkey) = unsafe { ((*mr).lkey, (*mr).rkey) };
        Ok(VerbsMr {
            mr,
            lkey,
            rkey,
            memory,
            _pd: pd.clone(),
        })
    }

    /// The local key (for scatter entries).
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// The remote key (for peers).
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// Address of the first byte.
    pub fn addr(&self) -> u64 {
        self.memory.as_ptr() as u64
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.memory.len() as u64
    }

    /// Whether the region is empty (never: empty registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.memory.is_empty()
    }

    /// Whether the memory is pinned host memory (counts against memlock).
    pub fn is_host(&self) -> bool {
        self.memory.location() == MemoryLocation::Host
    }
}

impl Drop for VerbsMr {
    fn drop(&mut self) {
        // SAFETY: mr came from ibv_reg_mr and is deregistered once; the memory (held by our Arc)
        // is still allocated, and after this call the NIC no longer accesses it.
        let rc = unsafe { ffi::ibv_dereg_mr(self.mr) };
        if rc != 0 {
            tracing::warn!(rc, rkey = self.rkey, "ibv_dereg_mr failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_maps_to_verbs_flags() {
        let src = mr_access_flags(Access::SOURCE);
        assert_eq!(src.0, 0);
        let recv = mr_access_flags(Access::RECEIVE);
        assert_eq!(
            recv.0,
            (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
                .0
        );
        // REMOTE_WRITE alone still gets LOCAL_WRITE, which verbs requires with it.
        assert_eq!(mr_access_flags(Access::REMOTE_WRITE).0, recv.0);
        assert_eq!(
            mr_access_flags(Access::LOCAL_WRITE).0,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
        );
    }
}
