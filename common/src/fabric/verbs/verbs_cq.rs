//! A completion queue, polled by the progress thread. Destroyed on drop.
//!
//! Each queue pair gets its own CQ sized for its send queue plus its receive queue, so the CQ can
//! never overrun (an overrun is a fatal async error that kills every queue pair on the CQ), and a
//! torn-down lane takes its CQ with it.

use std::sync::Arc;

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::verbs_device::VerbsContext;

/// An owned completion queue.
#[derive(Debug)]
pub struct VerbsCq {
    cq: *mut ffi::ibv_cq,
    ctx: Arc<VerbsContext>,
}

// SAFETY: CQs may be polled from any thread (libibverbs locks internally per CQ); owned pointer.
unsafe impl Send for VerbsCq {}
// SAFETY: as for Send; `poll` takes &self and the provider serialises concurrent polls.
unsafe impl Sync for VerbsCq {}

impl VerbsCq {
    /// Creates a CQ with room for at least `entries` completions.
    pub fn new(ctx: &Arc<VerbsContext>, entries: u32) -> Result<Arc<VerbsCq>, FabricError> {
        let entries = i32::try_from(entries).unwrap_or(i32::MAX);
        // SAFETY: ctx is open (kept alive by the Arc stored in the result); no completion
        // channel and no user context are attached.
        let cq = unsafe {
            ffi::ibv_create_cq(
                ctx.raw(),
                entries,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            return Err(FabricError::io(
                format!("ibv_create_cq({entries} entries)"),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(Arc::new(VerbsCq {
            cq,
            ctx: ctx.clone(),
        }))
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub fn poll(&self, out: &mut [ffi::ibv_wc]) -> Result<usize, FabricError> {
        let n = i32::try_from(out.len()).unwrap_or(i32::MAX);
        // SAFETY: cq is a live CQ of a live context (we hold the Arc); the context's ops table is
        // filled by the provider when the context was opened.
        let poll = unsafe { (*(*self.cq).context).ops.poll_cq };
        let Some(poll) = poll else {
            return Err(FabricError::Unsupported(
                "the RDMA provider has no poll_cq".into(),
            ));
        };
        // SAFETY: out is valid for n entries of ibv_wc (the provider writes at most n).
        let got = unsafe { poll(self.cq, n, out.as_mut_ptr()) };
        if got < 0 {
            return Err(FabricError::io(
                "ibv_poll_cq",
                std::io::Error::other(format!("provider returned {got}")),
            ));
        }
        Ok(got as usize)
    }

    pub(super) fn raw(&self) -> *mut ffi::ibv_cq {
        self.cq
    }

    /// The context.
    pub fn context(&self) -> &Arc<VerbsContext> {
        &self.ctx
    }
}

impl Drop for VerbsCq {
    fn drop(&mut self) {
        // SAFETY: cq came from ibv_create_cq and is destroyed once; the QP using it holds an Arc
        // to this CQ, so it was destroyed before.
        let rc = unsafe { ffi::ibv_destroy_cq(self.cq) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_destroy_cq failed");
        }
    }
}
