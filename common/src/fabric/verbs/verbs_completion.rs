//! Reading work completions: which write a completion belongs to, and what its status means.
//!
//! Every send WR carries a 64-bit `wr_id` that comes back in its completion. Ours packs the batch
//! token, the index of the piece inside the batch, and whether the WR is the *final* one of the
//! batch on its lane ([`WrId`]). With selective signalling only some WRs produce a completion when
//! they succeed, but a failed WR always produces one, as do the WRs flushed after it; so an error
//! completion names the exact piece (peer, rkey, offset, length) that failed.
//!
//! [`status_error`] turns a failed completion into a [`FabricError`]. The NIC reports one status
//! for every remote protection failure (`IBV_WC_REM_ACCESS_ERR`): a forged rkey, a deregistered
//! region, a range outside it and a region without remote write look alike on the wire, so the
//! first answer is [`RemoteAccessKind::WrongRkey`]; the writer then asks the peer for the precise
//! reason (see `verbs_registry`). RNR and transport retries exhausted get their
//! own messages, because they point at different fixes.
//!
//! [`classify`] says what a failed completion means for the pieces behind it (see
//! `verbs_batch`): only a NAK from the responder (a refusal, or RNR) proves that what followed
//! on the queue pair did not run.

use ffi::ibv_wc_status as st;
use ibverbs_sys as ffi;

use super::super::descriptor::Endpoint;
use super::super::error::{FabricError, RemoteAccessKind};

/// What the first failing completion of a lane says about the pieces from there on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// The peer refused the first piece (a NAK: remote access, invalid request, remote operation
    /// error). The piece is reported; the peer discarded everything behind it.
    Nak,
    /// The peer had no receive posted through every RNR retry. Neither the piece nor anything
    /// behind it ran, and no receive was consumed.
    ReceiverNotReady,
    /// Flushed behind a NAK of an earlier WR of the lane: did not run.
    FlushedBehindNak,
    /// The first piece itself failed (transport retries exhausted, a local error, ...): it is
    /// reported; whether the pieces behind it ran is unknown.
    Failed,
    /// Flushed by an error that tells nothing about execution (a cut, a reset, an error of an
    /// earlier WR that is not a NAK): each piece may or may not have landed.
    Flushed,
}

impl FailureCause {
    /// Whether the pieces after the first failing one are known not to have run.
    pub fn later_pieces_did_not_run(self) -> bool {
        matches!(
            self,
            FailureCause::Nak | FailureCause::ReceiverNotReady | FailureCause::FlushedBehindNak
        )
    }
}

/// Bits of the `wr_id` used for the piece index.
const PIECE_BITS: u32 = 20;
/// Most pieces one batch token can address.
pub const MAX_PIECES_PER_TOKEN: usize = 1 << PIECE_BITS;

/// The fields packed into a send WR's `wr_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrId {
    /// The batch (one posting call of one write future).
    pub token: u64,
    /// Index of the piece inside the batch.
    pub piece: u32,
    /// Whether this is the last WR of the batch on its lane (its success completes that lane's
    /// share of the batch).
    pub is_final: bool,
}

impl WrId {
    /// Packs into a `wr_id`. `token` must be below 2^43 and `piece` below 2^20.
    pub fn encode(self) -> u64 {
        debug_assert!(self.token < 1 << (63 - PIECE_BITS));
        debug_assert!((self.piece as usize) < MAX_PIECES_PER_TOKEN);
        (self.token << (PIECE_BITS + 1))
            | (u64::from(self.piece & ((1 << PIECE_BITS) - 1)) << 1)
            | u64::from(self.is_final)
    }

    /// Unpacks a `wr_id` written by [`WrId::encode`].
    pub fn decode(raw: u64) -> WrId {
        WrId {
            token: raw >> (PIECE_BITS + 1),
            piece: ((raw >> 1) & ((1 << PIECE_BITS) - 1)) as u32,
            is_final: raw & 1 == 1,
        }
    }
}

/// Where a failed piece was going (for the error message).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceTarget {
    /// The peer.
    pub peer: Endpoint,
    /// Lane index.
    pub lane: usize,
    /// The remote rkey.
    pub rkey: u64,
    /// The lkey of the source registration.
    pub lkey: u32,
    /// Offset in the remote region.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

/// The libibverbs name of a status (`"remote access error"`, ...).
pub fn status_name(status: ffi::ibv_wc_status::Type) -> String {
    // SAFETY: ibv_wc_status_str returns a pointer to a static NUL-terminated string for every
    // value (unknown values map to "unknown"), never null.
    let p = unsafe { ffi::ibv_wc_status_str(status) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: p is non-null and points to a static C string owned by libibverbs.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// Whether a status is the flush that follows an earlier error on the same queue pair.
pub fn is_flush(status: ffi::ibv_wc_status::Type) -> bool {
    status == st::IBV_WC_WR_FLUSH_ERR
}

/// Whether a status is a NAK of the responder: it refused the WR (access, invalid request,
/// remote operation error) or had no receive for it (RNR retries exhausted). Behind a NAK the
/// responder discards every later packet of the queue pair, so later WRs did not run.
pub fn is_nak(status: ffi::ibv_wc_status::Type) -> bool {
    matches!(
        status,
        st::IBV_WC_REM_ACCESS_ERR
            | st::IBV_WC_REM_INV_REQ_ERR
            | st::IBV_WC_REM_OP_ERR
            | st::IBV_WC_RNR_RETRY_EXC_ERR
    )
}

/// What a failed send completion with `status` means, given whether the queue pair's first
/// failure (the first error completion seen on it) was a NAK.
pub fn classify(status: ffi::ibv_wc_status::Type, first_failure_was_nak: bool) -> FailureCause {
    match status {
        st::IBV_WC_WR_FLUSH_ERR if first_failure_was_nak => FailureCause::FlushedBehindNak,
        st::IBV_WC_WR_FLUSH_ERR => FailureCause::Flushed,
        st::IBV_WC_RNR_RETRY_EXC_ERR => FailureCause::ReceiverNotReady,
        s if is_nak(s) => FailureCause::Nak,
        _ => FailureCause::Failed,
    }
}

/// Maps a failed send completion to the error the write's caller sees.
pub fn status_error(
    status: ffi::ibv_wc_status::Type,
    vendor_err: u32,
    target: &PieceTarget,
) -> FabricError {
    let peer = target.peer.clone();
    match status {
        st::IBV_WC_REM_ACCESS_ERR => FabricError::RemoteAccess {
            kind: RemoteAccessKind::WrongRkey,
            peer,
            rkey: target.rkey,
            offset: target.offset,
            len: target.len,
        },
        st::IBV_WC_RNR_RETRY_EXC_ERR => FabricError::Disconnected {
            peer,
            lane: target.lane,
            detail: "receiver not ready: the peer had no receive posted for a WRITE_WITH_IMM \
                     through every RNR retry; receive credits keep this from happening while it \
                     runs, so its process is stalled or gone"
                .into(),
        },
        st::IBV_WC_RETRY_EXC_ERR => FabricError::Disconnected {
            peer,
            lane: target.lane,
            detail: "transport retries exhausted: the peer stopped acknowledging (process gone, \
                     link down, or wrong GID/LID/MTU for this path)"
                .into(),
        },
        st::IBV_WC_REM_INV_REQ_ERR => FabricError::Protocol {
            peer,
            detail: format!(
                "the peer's queue pair rejected a write of {} bytes at offset {} of rkey {:#x} as \
                 an invalid request (an opcode it does not allow: remote write is off while the \
                 receiver's write window is closed, i.e. no sync is armed on it; or a length \
                 over its limit; vendor syndrome {vendor_err:#x})",
                target.len, target.offset, target.rkey
            ),
        },
        st::IBV_WC_LOC_PROT_ERR => FabricError::LocalDeregistered {
            what: "write source (local protection error: the source registration, whose lkey is \
                   given as the key, was deregistered)",
            rkey: u64::from(target.lkey),
        },
        _ => FabricError::Disconnected {
            peer,
            lane: target.lane,
            detail: format!(
                "work completion failed: {} (vendor syndrome {vendor_err:#x})",
                status_name(status)
            ),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> PieceTarget {
        PieceTarget {
            peer: "10.0.0.2:4000".into(),
            lane: 1,
            rkey: 0x1234,
            lkey: 0x77,
            offset: 4096,
            len: 100,
        }
    }

    #[test]
    fn wr_id_round_trips() {
        for id in [
            WrId {
                token: 0,
                piece: 0,
                is_final: false,
            },
            WrId {
                token: 7,
                piece: 12345,
                is_final: true,
            },
            WrId {
                token: (1 << 43) - 1,
                piece: (1 << 20) - 1,
                is_final: true,
            },
        ] {
            assert_eq!(WrId::decode(id.encode()), id);
        }
        assert_ne!(
            WrId {
                token: 1,
                piece: 0,
                is_final: false
            }
            .encode(),
            WrId {
                token: 0,
                piece: 1,
                is_final: false
            }
            .encode()
        );
    }

    #[test]
    fn statuses_map_to_typed_errors() {
        let e = status_error(st::IBV_WC_REM_ACCESS_ERR, 0, &target());
        assert_eq!(e.remote_access_kind(), Some(RemoteAccessKind::WrongRkey));
        assert!(e.to_string().contains("10.0.0.2:4000"));

        let e = status_error(st::IBV_WC_RNR_RETRY_EXC_ERR, 0, &target());
        assert!(e.to_string().contains("receiver not ready"), "{e}");
        assert!(matches!(e, FabricError::Disconnected { lane: 1, .. }));

        let e = status_error(st::IBV_WC_RETRY_EXC_ERR, 0, &target());
        assert!(e.to_string().contains("retries exhausted"), "{e}");

        let e = status_error(st::IBV_WC_GENERAL_ERR, 0x51, &target());
        assert!(e.to_string().contains("0x51"), "{e}");

        assert!(is_flush(st::IBV_WC_WR_FLUSH_ERR));
        assert!(!is_flush(st::IBV_WC_REM_ACCESS_ERR));
    }

    /// V19: a local protection error names the source's key (not the remote rkey); an invalid
    /// request is not reported as a missing write permission, and carries the syndrome.
    #[test]
    fn local_protection_and_invalid_request_are_labelled_right() {
        let e = status_error(st::IBV_WC_LOC_PROT_ERR, 0, &target());
        assert!(
            matches!(e, FabricError::LocalDeregistered { rkey: 0x77, .. }),
            "{e:?}"
        );
        let e = status_error(st::IBV_WC_REM_INV_REQ_ERR, 0x2a, &target());
        assert_eq!(e.remote_access_kind(), None, "{e}");
        assert!(e.to_string().contains("0x2a"), "{e}");
        let e = status_error(st::IBV_WC_RNR_RETRY_EXC_ERR, 0, &target());
        assert!(!e.to_string().contains("raise verbs.recv_depth"), "{e}");
    }

    /// V3/V4: a flush is "may have run" unless the queue pair's first failure was a NAK; RNR
    /// means nothing ran.
    #[test]
    fn classification_trusts_only_a_nak() {
        assert_eq!(
            classify(st::IBV_WC_WR_FLUSH_ERR, false),
            FailureCause::Flushed
        );
        assert_eq!(
            classify(st::IBV_WC_WR_FLUSH_ERR, true),
            FailureCause::FlushedBehindNak
        );
        assert_eq!(
            classify(st::IBV_WC_RNR_RETRY_EXC_ERR, false),
            FailureCause::ReceiverNotReady
        );
        assert_eq!(
            classify(st::IBV_WC_REM_ACCESS_ERR, false),
            FailureCause::Nak
        );
        assert_eq!(
            classify(st::IBV_WC_RETRY_EXC_ERR, false),
            FailureCause::Failed
        );
        assert_eq!(
            classify(st::IBV_WC_LOC_PROT_ERR, false),
            FailureCause::Failed
        );
        assert!(is_nak(st::IBV_WC_RNR_RETRY_EXC_ERR) && !is_nak(st::IBV_WC_RETRY_EXC_ERR));
    }

    #[test]
    fn status_names_come_from_libibverbs() {
        assert!(status_name(st::IBV_WC_SUCCESS).contains("success"));
        assert!(status_name(st::IBV_WC_REM_ACCESS_ERR).contains("remote access"));
    }
}
