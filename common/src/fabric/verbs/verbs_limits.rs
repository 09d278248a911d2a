//! The device's limits, queried once when the device is opened, and what the settings ask of
//! them.
//!
//! Beyond `max_qp_wr`, `max_cqe` or `max_mr_size` the verbs calls fail with a bare `EINVAL`
//! (`ibv_create_qp`, `ibv_create_cq`, `ibv_reg_mr`), and a piece longer than the *peer's*
//! `max_msg_sz` fails only at the peer. So the limits are read once (`ibv_query_device`,
//! `ibv_query_port`), the settings are checked against them at start with a message naming the
//! setting and the limit, a registration larger than `max_mr_size` is refused by name, and pieces
//! are split at the smaller of both sides' message limits (exchanged in the queue-pair endpoint).
//! Soft-RoCE's limits have been lower in older kernels; `ibv_devinfo -v` shows them.

use super::verbs_settings::{SettingsError, VerbsSettings};

/// Scatter/gather entries per send WR the backend asks for where the device allows them.
pub const SEND_SGE: u32 = 16;

/// What the device allows (the parts the backend uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceLimits {
    /// Work requests per queue (send or receive) of one queue pair.
    pub max_qp_wr: u32,
    /// Entries of one completion queue.
    pub max_cqe: u32,
    /// Scatter/gather entries per work request.
    pub max_sge: u32,
    /// Bytes of one memory registration.
    pub max_mr_size: u64,
    /// Bytes of one message on the port.
    pub max_msg_size: u64,
}

impl DeviceLimits {
    /// Limits that constrain nothing (a provider that reports zeros is taken at its word only
    /// where it reports something).
    pub const UNKNOWN: DeviceLimits = DeviceLimits {
        max_qp_wr: 0,
        max_cqe: 0,
        max_sge: 0,
        max_mr_size: 0,
        max_msg_size: 0,
    };

    /// Scatter/gather entries a send queue pair asks for: up to [`SEND_SGE`], never more than
    /// the device has (one where it reports none). A write from a strided source gathers this
    /// many runs per WR; more entries per WR cost the NIC a longer WQE fetch for every WR, so
    /// the number stays moderate.
    pub fn send_sge(&self) -> u32 {
        match self.max_sge {
            0 => 1,
            n => n.min(SEND_SGE),
        }
    }

    /// Checks the depths of `settings` against the device: each queue pair has `send_depth` (or
    /// `recv_depth`) WRs and one CQ of `send_depth + recv_depth` entries, with at least one SGE
    /// per WR.
    /// A limit the device reports as 0 is not checked.
    pub fn check(&self, settings: &VerbsSettings, device: &str) -> Result<(), SettingsError> {
        let over = |field: &'static str, value: u64, limit: u64, what: &str| SettingsError {
            field,
            detail: format!(
                "{value} exceeds {device}'s {what} of {limit} (`ibv_devinfo -v`); lower it to \
                 at most {limit}"
            ),
        };
        let qp_wr = u64::from(self.max_qp_wr);
        if qp_wr > 0 && u64::from(settings.send_depth) > qp_wr {
            return Err(over(
                "verbs.send_depth",
                u64::from(settings.send_depth),
                qp_wr,
                "max_qp_wr",
            ));
        }
        if qp_wr > 0 && u64::from(settings.recv_depth) > qp_wr {
            return Err(over(
                "verbs.recv_depth",
                u64::from(settings.recv_depth),
                qp_wr,
                "max_qp_wr",
            ));
        }
        let cqe = u64::from(self.max_cqe);
        let per_cq = u64::from(settings.send_depth) + u64::from(settings.recv_depth);
        if cqe > 0 && per_cq > cqe {
            return Err(over(
                "verbs.send_depth + verbs.recv_depth",
                per_cq,
                cqe,
                "max_cqe (one CQ per queue pair holds both queues)",
            ));
        }
        if self.max_sge == 0 && self.max_qp_wr > 0 {
            return Err(SettingsError {
                field: "device",
                detail: format!("{device} reports max_sge 0; one SGE per WR is needed"),
            });
        }
        Ok(())
    }

    /// Refuses a registration of `len` bytes larger than `max_mr_size`, naming the limit.
    pub fn check_registration(&self, len: u64) -> Result<(), String> {
        if self.max_mr_size > 0 && len > self.max_mr_size {
            return Err(format!(
                "the region of {len} bytes exceeds the device's max_mr_size of {} bytes \
                 (`ibv_devinfo -v`); register it in parts",
                self.max_mr_size
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::VerbsConfig;

    fn settings(send: u32, recv: u32) -> VerbsSettings {
        VerbsSettings::resolve(
            &VerbsConfig {
                send_depth: send,
                recv_depth: recv,
                ..Default::default()
            },
            |_| None,
        )
        .unwrap()
    }

    const RXE_OLD: DeviceLimits = DeviceLimits {
        max_qp_wr: 4096,
        max_cqe: 4096,
        max_sge: 32,
        max_mr_size: 1 << 32,
        max_msg_size: 8 << 20,
    };

    /// V14: depths beyond the device's limits are refused at start with the setting and the
    /// limit named, instead of a bare EINVAL from ibv_create_qp / ibv_create_cq later.
    #[test]
    fn depths_beyond_the_device_limits_are_refused_by_name() {
        RXE_OLD.check(&settings(512, 512), "rxe0").unwrap();
        let err = RXE_OLD.check(&settings(8192, 512), "rxe0").unwrap_err();
        assert_eq!(err.field, "verbs.send_depth");
        assert!(err.to_string().contains("max_qp_wr of 4096"), "{err}");
        let err = RXE_OLD.check(&settings(512, 8192), "rxe0").unwrap_err();
        assert_eq!(err.field, "verbs.recv_depth");
        let err = RXE_OLD.check(&settings(4096, 1024), "rxe0").unwrap_err();
        assert!(err.to_string().contains("max_cqe"), "{err}");
        DeviceLimits::UNKNOWN
            .check(&settings(32_768, 32_768), "x")
            .unwrap();
    }

    #[test]
    fn registrations_beyond_max_mr_size_are_refused_by_name() {
        RXE_OLD.check_registration(1 << 30).unwrap();
        let err = RXE_OLD.check_registration((1 << 32) + 1).unwrap_err();
        assert!(err.contains("max_mr_size"), "{err}");
        DeviceLimits::UNKNOWN.check_registration(u64::MAX).unwrap();
    }
}
