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

use ffi::ibv_wc_status as st;
use ibverbs_sys as ffi;

use super::super::descriptor::Endpoint;
use super::super::error::{FabricError, RemoteAccessKind};

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
                     after every RNR retry (is its fabric running and polling? raise \
                     verbs.recv_depth)"
                .into(),
        },
        st::IBV_WC_RETRY_EXC_ERR => FabricError::Disconnected {
            peer,
            lane: target.lane,
            detail: "transport retries exhausted: the peer stopped acknowledging (process gone, \
                     link down, or wrong GID/LID/MTU for this path)"
                .into(),
        },
        st::IBV_WC_REM_INV_REQ_ERR => FabricError::RemoteAccess {
            kind: RemoteAccessKind::NoWritePermission,
            peer,
            rkey: target.rkey,
            offset: target.offset,
            len: target.len,
        },
        st::IBV_WC_LOC_PROT_ERR => FabricError::LocalDeregistered {
            what: "write source (local protection error: the source was deregistered)",
            rkey: target.rkey,
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

    #[test]
    fn status_names_come_from_libibverbs() {
        assert!(status_name(st::IBV_WC_SUCCESS).contains("success"));
        assert!(status_name(st::IBV_WC_REM_ACCESS_ERR).contains("remote access"));
    }
}
