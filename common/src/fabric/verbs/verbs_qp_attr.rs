//! The three `ibv_modify_qp` transitions of an RC queue pair, as plain data.
//!
//! A queue pair goes RESET → INIT → RTR (ready to receive) → RTS (ready to send). Each transition
//! has a fixed set of attributes the driver requires for RC (IBA spec, table "QP state transition
//! properties"); passing a wrong mask is either rejected with `EINVAL` or, worse, accepted without
//! the attribute taking effect. So the attributes and masks are built here by pure functions that
//! the unit tests pin to the required sets, and `verbs_qp` only applies them.
//!
//! | transition | required for RC |
//! |---|---|
//! | RESET → INIT | STATE, PKEY_INDEX, PORT, ACCESS_FLAGS |
//! | INIT → RTR | STATE, AV, PATH_MTU, DEST_QPN, RQ_PSN, MAX_DEST_RD_ATOMIC, MIN_RNR_TIMER |
//! | RTR → RTS | STATE, SQ_PSN, TIMEOUT, RETRY_CNT, RNR_RETRY, MAX_QP_RD_ATOMIC |
//! | RTS → RTS | (none; ACCESS_FLAGS is optional) |
//!
//! The RTS → RTS modify ([`set_remote_write`]) is how a receiver opens and closes its write
//! window in the NIC (`verbs_window`): it carries `IBV_QP_ACCESS_FLAGS` alone, so nothing else
//! of the connected queue pair changes. The kernel's table of valid transitions lists
//! `IB_QP_ACCESS_FLAGS` among the optional attributes of RTS → RTS for RC (Linux
//! `drivers/infiniband/core/verbs.c`, `qp_state_table[IB_QPS_RTS][IB_QPS_RTS].opt_param
//! [IB_QPT_RC]`, which `ib_modify_qp_is_ok` checks every user modify against; the IBA spec's
//! "QP state transition properties" table has the same optional set), and without
//! `IBV_QP_STATE` in the mask the driver keeps the current state.

use ffi::ibv_qp_attr_mask as mask;
use ibverbs_sys as ffi;

use super::verbs_endpoint::{PSN_MASK, QpEndpoint, agreed_mtu};
use super::verbs_gid::{Addressing, check_same_gid_family};
use super::verbs_settings::VerbsSettings;

/// Attributes and mask for one `ibv_modify_qp` call.
#[derive(Clone, Copy)]
pub struct QpTransition {
    /// The attributes (only those in `mask` are read by the driver).
    pub attr: ffi::ibv_qp_attr,
    /// Which attributes are set.
    pub mask: ffi::ibv_qp_attr_mask,
}

impl std::fmt::Debug for QpTransition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpTransition")
            .field("qp_state", &self.attr.qp_state)
            .field("mask", &format_args!("{:#x}", self.mask.0))
            .finish()
    }
}

/// Whether a queue pair lets its peer RDMA WRITE through it (the queue pair's own access flags,
/// checked by the NIC before the memory region's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteWrite {
    /// Peers may write (with immediate) into memory registered for remote write.
    On,
    /// Every incoming write is refused by the NIC (NAK), whatever rkey it names.
    Off,
}

/// Access our queue pairs grant to incoming requests: with [`RemoteWrite::On`] peers may RDMA
/// WRITE (with immediate) into memory registered for remote write. Never remote read or atomics:
/// weightsync only pushes.
pub fn qp_access_flags(remote_write: RemoteWrite) -> ffi::ibv_access_flags {
    match remote_write {
        RemoteWrite::On => {
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
        }
        RemoteWrite::Off => ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
    }
}

/// RESET → INIT on `port`, granting `remote_write` to the peer.
pub fn to_init(port: u8, remote_write: RemoteWrite) -> QpTransition {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
        pkey_index: 0,
        port_num: port,
        qp_access_flags: qp_access_flags(remote_write).0,
        ..Default::default()
    };
    QpTransition {
        attr,
        mask: mask::IBV_QP_STATE
            | mask::IBV_QP_PKEY_INDEX
            | mask::IBV_QP_PORT
            | mask::IBV_QP_ACCESS_FLAGS,
    }
}

/// INIT → RTR from `local` towards `remote`. With [`Addressing::Global`] the address vector
/// carries a GRH (`is_global = 1`, the peer's GID as `dgid`, our `sgid_index`, the configured
/// traffic class); with [`Addressing::Lid`] it uses the peer's LID. The configured service level
/// goes into the address vector either way. A peer whose GID is of another RoCE version or IP
/// family is refused: that pair would never connect.
pub fn to_rtr(
    local: &QpEndpoint,
    remote: &QpEndpoint,
    addressing: Addressing,
    port: u8,
    settings: &VerbsSettings,
) -> Result<QpTransition, String> {
    let mut attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
        path_mtu: agreed_mtu(local.mtu, remote.mtu),
        dest_qp_num: remote.qp_num,
        rq_psn: remote.psn & PSN_MASK,
        max_dest_rd_atomic: 1,
        min_rnr_timer: settings.min_rnr_timer,
        ..Default::default()
    };
    attr.ah_attr.port_num = port;
    attr.ah_attr.sl = settings.service_level;
    attr.ah_attr.src_path_bits = 0;
    match addressing {
        Addressing::Global { sgid_index } => {
            let gid = remote.gid.ok_or_else(|| {
                "this side routes by GID (RoCE or a GID index is set) but the peer sent no GID: \
                 set WEIGHTSYNC_RDMA_GID_INDEX on the peer too"
                    .to_owned()
            })?;
            if let Some(ours) = local.gid {
                check_same_gid_family((ours, local.gid_type), (gid, remote.gid_type))?;
            }
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid.0 };
            attr.ah_attr.grh.sgid_index = sgid_index;
            attr.ah_attr.grh.hop_limit = 64;
            attr.ah_attr.grh.traffic_class = settings.traffic_class;
            attr.ah_attr.grh.flow_label = 0;
            attr.ah_attr.dlid = remote.lid;
        }
        Addressing::Lid => {
            if remote.lid == 0 {
                return Err(
                    "this side routes by LID (InfiniBand without GID index) but the peer has \
                     LID 0; is the peer on RoCE? set WEIGHTSYNC_RDMA_GID_INDEX on both sides"
                        .to_owned(),
                );
            }
            attr.ah_attr.is_global = 0;
            attr.ah_attr.dlid = remote.lid;
        }
    }
    Ok(QpTransition {
        attr,
        mask: mask::IBV_QP_STATE
            | mask::IBV_QP_AV
            | mask::IBV_QP_PATH_MTU
            | mask::IBV_QP_DEST_QPN
            | mask::IBV_QP_RQ_PSN
            | mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | mask::IBV_QP_MIN_RNR_TIMER,
    })
}

/// RTR → RTS, sending from `local_psn`, with finite transport and RNR retries.
pub fn to_rts(local_psn: u32, settings: &VerbsSettings) -> QpTransition {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
        sq_psn: local_psn & PSN_MASK,
        timeout: settings.timeout,
        retry_cnt: settings.retry_cnt,
        rnr_retry: settings.rnr_retry.min(6),
        max_rd_atomic: 1,
        ..Default::default()
    };
    QpTransition {
        attr,
        mask: mask::IBV_QP_STATE
            | mask::IBV_QP_SQ_PSN
            | mask::IBV_QP_TIMEOUT
            | mask::IBV_QP_RETRY_CNT
            | mask::IBV_QP_RNR_RETRY
            | mask::IBV_QP_MAX_QP_RD_ATOMIC,
    }
}

/// RTS → RTS changing only what the peer may do through the queue pair: `IBV_QP_ACCESS_FLAGS`
/// alone in the mask (no state, so the queue pair stays in RTS, its path, PSNs and timers as
/// they are). How a receiver opens ([`RemoteWrite::On`]) and closes ([`RemoteWrite::Off`]) its
/// write window; one firmware command per queue pair.
pub fn set_remote_write(remote_write: RemoteWrite) -> QpTransition {
    let attr = ffi::ibv_qp_attr {
        qp_access_flags: qp_access_flags(remote_write).0,
        ..Default::default()
    };
    QpTransition {
        attr,
        mask: mask::IBV_QP_ACCESS_FLAGS,
    }
}

/// Any state → ERR: flushes every outstanding WR with `IBV_WC_WR_FLUSH_ERR` (a queue-pair
/// reset as a pulled cable or a NIC error would cause; used by fault tests).
pub fn to_error() -> QpTransition {
    let attr = ffi::ibv_qp_attr {
        qp_state: ffi::ibv_qp_state::IBV_QPS_ERR,
        ..Default::default()
    };
    QpTransition {
        attr,
        mask: mask::IBV_QP_STATE,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::VerbsConfig;
    use crate::fabric::verbs::verbs_gid::{Gid, GidType};

    fn settings() -> VerbsSettings {
        VerbsSettings::resolve(&VerbsConfig::default(), |_| None).unwrap()
    }

    fn bits(names: &[ffi::ibv_qp_attr_mask]) -> u32 {
        names.iter().fold(0, |acc, m| acc | m.0)
    }

    fn remote(gid: Option<Gid>, lid: u16) -> QpEndpoint {
        QpEndpoint {
            qp_num: 0x123,
            psn: 0x1abcdef, // more than 24 bits: must be masked
            lid,
            gid,
            mtu: 3,
            recv_depth: 512,
            max_msg_size: 1 << 30,
            gid_type: gid.map(|_| GidType::RoceV2),
        }
    }

    fn local(gid: Option<Gid>, mtu: u32) -> QpEndpoint {
        QpEndpoint {
            qp_num: 0x77,
            psn: 1,
            mtu,
            ..remote(gid, 9)
        }
    }

    #[test]
    fn init_sets_exactly_the_required_attributes() {
        let t = to_init(2, RemoteWrite::On);
        assert_eq!(
            t.mask.0,
            bits(&[
                mask::IBV_QP_STATE,
                mask::IBV_QP_PKEY_INDEX,
                mask::IBV_QP_PORT,
                mask::IBV_QP_ACCESS_FLAGS
            ])
        );
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_INIT);
        assert_eq!(t.attr.port_num, 2);
        let access = ffi::ibv_access_flags(t.attr.qp_access_flags);
        assert_ne!(
            (access & ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE).0,
            0
        );
        assert_eq!(
            (access & ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ).0,
            0
        );
    }

    /// A queue pair brought up while the receiver's window is closed grants no remote write
    /// from its first packet on; local write stays (receives need it).
    #[test]
    fn init_without_remote_write_grants_only_local_write() {
        let t = to_init(1, RemoteWrite::Off);
        assert_eq!(t.mask.0, to_init(1, RemoteWrite::On).mask.0);
        let access = ffi::ibv_access_flags(t.attr.qp_access_flags);
        assert_eq!(
            access.0,
            ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0,
            "no remote write, read or atomics"
        );
    }

    /// The window toggle is an RTS -> RTS modify of the access flags alone: no state in the
    /// mask (the queue pair stays in RTS), and nothing of its path, PSNs or timers.
    #[test]
    fn toggling_remote_write_modifies_only_the_access_flags() {
        for (toggle, remote) in [(RemoteWrite::On, true), (RemoteWrite::Off, false)] {
            let t = set_remote_write(toggle);
            assert_eq!(t.mask.0, mask::IBV_QP_ACCESS_FLAGS.0, "{toggle:?}");
            let access = ffi::ibv_access_flags(t.attr.qp_access_flags);
            let write = (access & ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE).0 != 0;
            assert_eq!(write, remote, "{toggle:?}");
            assert_ne!(
                (access & ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE).0,
                0,
                "local write stays"
            );
            assert_eq!(
                (access
                    & (ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ
                        | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC))
                    .0,
                0
            );
            // Arming restores exactly what a queue pair connected while armed has.
            if toggle == RemoteWrite::On {
                assert_eq!(
                    t.attr.qp_access_flags,
                    to_init(1, RemoteWrite::On).attr.qp_access_flags
                );
            }
        }
    }

    #[test]
    fn rtr_on_roce_carries_the_remote_gid_in_the_grh() {
        let gid: Gid = "::ffff:192.168.7.9".parse().unwrap();
        let ours: Gid = "::ffff:192.168.7.1".parse().unwrap();
        let t = to_rtr(
            &local(Some(ours), 5),
            &remote(Some(gid), 0),
            Addressing::Global { sgid_index: 1 },
            1,
            &settings(),
        )
        .unwrap();
        assert_eq!(
            t.mask.0,
            bits(&[
                mask::IBV_QP_STATE,
                mask::IBV_QP_AV,
                mask::IBV_QP_PATH_MTU,
                mask::IBV_QP_DEST_QPN,
                mask::IBV_QP_RQ_PSN,
                mask::IBV_QP_MAX_DEST_RD_ATOMIC,
                mask::IBV_QP_MIN_RNR_TIMER
            ])
        );
        let a = t.attr;
        assert_eq!(a.qp_state, ffi::ibv_qp_state::IBV_QPS_RTR);
        assert_eq!(a.ah_attr.is_global, 1);
        // SAFETY: reading the raw bytes of a plain-old-data union we just wrote.
        let dgid = unsafe { a.ah_attr.grh.dgid.raw };
        assert_eq!(dgid, gid.0);
        assert_eq!(a.ah_attr.grh.sgid_index, 1);
        assert!(a.ah_attr.grh.hop_limit > 1);
        assert_eq!(a.ah_attr.port_num, 1);
        assert_eq!(a.dest_qp_num, 0x123);
        assert_eq!(a.rq_psn, 0xabcdef);
        assert_eq!(a.path_mtu, 3, "the smaller of local 5 and remote 3");
        assert_eq!(a.min_rnr_timer, settings().min_rnr_timer);
    }

    #[test]
    fn rtr_on_infiniband_uses_the_lid() {
        let ib = local(None, 4);
        let t = to_rtr(&ib, &remote(None, 17), Addressing::Lid, 1, &settings()).unwrap();
        assert_eq!(t.attr.ah_attr.is_global, 0);
        assert_eq!(t.attr.ah_attr.dlid, 17);
        let err = to_rtr(&ib, &remote(None, 0), Addressing::Lid, 1, &settings()).unwrap_err();
        assert!(err.contains("LID 0"), "{err}");
        let err = to_rtr(
            &ib,
            &remote(None, 5),
            Addressing::Global { sgid_index: 0 },
            1,
            &settings(),
        )
        .unwrap_err();
        assert!(err.contains("no GID"), "{err}");
    }

    /// V6: the configured traffic class reaches the GRH and the service level the address
    /// vector (both were fixed at 0).
    #[test]
    fn rtr_carries_the_configured_traffic_class_and_service_level() {
        let s = VerbsSettings::resolve(
            &VerbsConfig {
                traffic_class: 106,
                service_level: 3,
                ..Default::default()
            },
            |_| None,
        )
        .unwrap();
        let ours: Gid = "::ffff:10.0.0.1".parse().unwrap();
        let theirs: Gid = "::ffff:10.0.0.2".parse().unwrap();
        let t = to_rtr(
            &local(Some(ours), 5),
            &remote(Some(theirs), 0),
            Addressing::Global { sgid_index: 3 },
            1,
            &s,
        )
        .unwrap();
        assert_eq!(t.attr.ah_attr.grh.traffic_class, 106);
        assert_eq!(t.attr.ah_attr.sl, 3);
        let ib = to_rtr(&local(None, 5), &remote(None, 4), Addressing::Lid, 1, &s).unwrap();
        assert_eq!(
            ib.attr.ah_attr.sl, 3,
            "the SL picks the virtual lane on InfiniBand"
        );
    }

    /// V13: the RTR transition refuses a peer whose GID family differs from ours.
    #[test]
    fn rtr_refuses_a_peer_of_another_gid_family() {
        let ours: Gid = "::ffff:10.0.0.1".parse().unwrap();
        let link_local: Gid = "fe80::2".parse().unwrap();
        let err = to_rtr(
            &local(Some(ours), 5),
            &remote(Some(link_local), 0),
            Addressing::Global { sgid_index: 1 },
            1,
            &settings(),
        )
        .unwrap_err();
        assert!(err.contains("family"), "{err}");
    }

    #[test]
    fn error_transition_sets_only_the_state() {
        let t = to_error();
        assert_eq!(t.mask.0, mask::IBV_QP_STATE.0);
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_ERR);
    }

    #[test]
    fn rts_has_finite_retries_and_the_required_mask() {
        let s = settings();
        let t = to_rts(0x1000001, &s);
        assert_eq!(
            t.mask.0,
            bits(&[
                mask::IBV_QP_STATE,
                mask::IBV_QP_SQ_PSN,
                mask::IBV_QP_TIMEOUT,
                mask::IBV_QP_RETRY_CNT,
                mask::IBV_QP_RNR_RETRY,
                mask::IBV_QP_MAX_QP_RD_ATOMIC
            ])
        );
        assert_eq!(t.attr.qp_state, ffi::ibv_qp_state::IBV_QPS_RTS);
        assert_eq!(t.attr.sq_psn, 1);
        assert!(t.attr.rnr_retry < 7, "7 would retry forever");
        assert_eq!(t.attr.rnr_retry, s.rnr_retry);
        assert_eq!(t.attr.timeout, s.timeout);
        assert!(format!("{t:?}").contains("mask"));
    }
}
