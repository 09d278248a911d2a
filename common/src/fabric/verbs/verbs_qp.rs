//! An RC queue pair: created in RESET, moved through INIT → RTR → RTS, posted to. Destroyed on
//! drop.
//!
//! Receive WRs are posted while the QP is still in INIT, before our endpoint is sent to the peer,
//! so that the very first WRITE_WITH_IMM finds a receive waiting. They carry no scatter entry:
//! a WRITE_WITH_IMM puts its payload at the RDMA address and only consumes the receive for its
//! completion, so the receive needs no buffer.

use std::sync::Arc;

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::verbs_cq::VerbsCq;
use super::verbs_device::VerbsPd;
use super::verbs_qp_attr::QpTransition;
use super::verbs_wr::SendChain;

/// A failed `ibv_post_send`: how many WRs of the chain reached the NIC before the one it
/// rejected (`bad_wr`), and why.
#[derive(Debug)]
pub struct PostFailure {
    /// WRs of the chain posted before the rejected one.
    pub posted: usize,
    /// The error.
    pub error: FabricError,
}

/// An owned RC queue pair with its own CQ.
#[derive(Debug)]
pub struct VerbsQp {
    qp: *mut ffi::ibv_qp,
    qp_num: u32,
    cq: Arc<VerbsCq>,
    _pd: Arc<VerbsPd>,
}

// SAFETY: posting and modifying are thread-safe verbs (the provider locks each queue); owned
// pointer, destroyed only in Drop.
unsafe impl Send for VerbsQp {}
// SAFETY: as for Send.
unsafe impl Sync for VerbsQp {}

impl VerbsQp {
    /// Creates an RC QP with `send_depth` send and `recv_depth` receive slots, `send_sge`
    /// scatter/gather entries per send WR, and a CQ for both.
    pub fn new(
        pd: &Arc<VerbsPd>,
        send_depth: u32,
        recv_depth: u32,
        send_sge: u32,
    ) -> Result<Arc<VerbsQp>, FabricError> {
        let cq = VerbsCq::new(pd.context(), send_depth + recv_depth)?;
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: cq.raw(),
            recv_cq: cq.raw(),
            srq: std::ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: send_depth,
                max_recv_wr: recv_depth,
                max_send_sge: send_sge.max(1),
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            // Selective signalling: only WRs flagged IBV_SEND_SIGNALED complete successfully
            // with a CQE.
            sq_sig_all: 0,
        };
        // SAFETY: pd and cq are live (their Arcs are stored in the result); init is valid.
        let qp = unsafe { ffi::ibv_create_qp(pd.raw(), &mut init) };
        if qp.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(FabricError::io(
                format!("ibv_create_qp(RC, send {send_depth}, recv {recv_depth}, sge {send_sge})"),
                e,
            ));
        }
        // SAFETY: qp is a valid QP just returned by ibv_create_qp.
        let qp_num = unsafe { (*qp).qp_num };
        Ok(Arc::new(VerbsQp {
            qp,
            qp_num,
            cq,
            _pd: pd.clone(),
        }))
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The raw QP (to match async events; never dereferenced outside this module tree).
    pub(super) fn raw_ptr(&self) -> *mut ffi::ibv_qp {
        self.qp
    }

    /// The CQ of this QP.
    pub fn cq(&self) -> &Arc<VerbsCq> {
        &self.cq
    }

    /// Applies one state transition.
    pub fn modify(&self, t: &QpTransition, what: &str) -> Result<(), FabricError> {
        let mut attr = t.attr;
        // SAFETY: qp is live; attr is a valid ibv_qp_attr and mask names the fields set in it.
        let rc = unsafe { ffi::ibv_modify_qp(self.qp, &mut attr, t.mask.0 as i32) };
        if rc != 0 {
            return Err(FabricError::io(
                format!("ibv_modify_qp({what}) on QP {:#x}", self.qp_num),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Posts `n` receive WRs without buffers (each absorbs one WRITE_WITH_IMM completion).
    pub fn post_recvs(&self, n: usize) -> Result<(), FabricError> {
        if n == 0 {
            return Ok(());
        }
        let mut wrs: Vec<ffi::ibv_recv_wr> = (0..n)
            .map(|_| ffi::ibv_recv_wr {
                wr_id: 0,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            })
            .collect();
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate().take(n - 1) {
            wr.next = base.wrapping_add(i + 1);
        }
        // SAFETY: qp is live; the provider's ops table was filled when the context opened.
        let post = unsafe { (*(*self.qp).context).ops.post_recv };
        let Some(post) = post else {
            return Err(FabricError::Unsupported(
                "the RDMA provider has no post_recv".into(),
            ));
        };
        let mut bad: *mut ffi::ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the linked list lives in `wrs` for the duration of the call; receive WRs
        // without scatter entries reference no memory, so nothing must outlive the call.
        let rc = unsafe { post(self.qp, wrs.as_mut_ptr(), &mut bad) };
        if rc != 0 {
            return Err(FabricError::io(
                format!("ibv_post_recv({n}) on QP {:#x}", self.qp_num),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// Posts a chain of send WRs with one doorbell.
    ///
    /// # Safety
    /// Every scatter entry of `chain` must lie inside a memory region registered in this QP's
    /// protection domain with the lkey it names, and that memory must stay allocated until the
    /// WR completed or the region was deregistered (after `ibv_dereg_mr` the NIC no longer
    /// touches it).
    pub unsafe fn post_send(&self, chain: &mut SendChain) -> Result<(), PostFailure> {
        if chain.is_empty() {
            return Ok(());
        }
        // SAFETY: qp is live; the provider's ops table was filled when the context opened.
        let post = unsafe { (*(*self.qp).context).ops.post_send };
        let Some(post) = post else {
            return Err(PostFailure {
                posted: 0,
                error: FabricError::Unsupported("the RDMA provider has no post_send".into()),
            });
        };
        let mut bad: *mut ffi::ibv_send_wr = std::ptr::null_mut();
        let head = chain.head();
        // SAFETY: the chain's WRs and SGEs live (and do not move) for the call; the provider
        // copies them into the send queue. The memory they reference is the caller's contract.
        let rc = unsafe { post(self.qp, head, &mut bad) };
        if rc != 0 {
            return Err(PostFailure {
                posted: chain.index_of(bad).unwrap_or(0),
                error: FabricError::io(
                    format!(
                        "ibv_post_send({} WRs) on QP {:#x} (send queue full or bad WR)",
                        chain.len(),
                        self.qp_num
                    ),
                    std::io::Error::from_raw_os_error(rc),
                ),
            });
        }
        Ok(())
    }
}

impl Drop for VerbsQp {
    fn drop(&mut self) {
        // SAFETY: qp came from ibv_create_qp and is destroyed once; the CQ and PD it uses are
        // still alive (we hold their Arcs until after this).
        let rc = unsafe { ffi::ibv_destroy_qp(self.qp) };
        if rc != 0 {
            tracing::warn!(rc, qp_num = self.qp_num, "ibv_destroy_qp failed");
        }
    }
}
