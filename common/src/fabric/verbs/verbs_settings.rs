//! The verbs backend's settings: the serde [`VerbsConfig`], overridden by environment variables,
//! plus the queue-pair timers that only matter on real hardware.
//!
//! Which device, port and GID index to use differs per machine (a ConnectX host has `mlx5_0..7`
//! and RoCE v2 at GID index 3; a Soft-RoCE box has `rxe0` with v2 at index 1), while the rest of
//! the job configuration is shared by every worker. So the machine-specific three can be set per
//! process with `WEIGHTSYNC_RDMA_DEVICE`, `WEIGHTSYNC_RDMA_PORT` and `WEIGHTSYNC_RDMA_GID_INDEX`,
//! which win over the config file.
//!
//! The same goes for the fabric's QoS marking (`WEIGHTSYNC_RDMA_TC`, `WEIGHTSYNC_RDMA_SL`) and the
//! GID family (`WEIGHTSYNC_RDMA_GID_FAMILY`), which follow the host's NIC and switch setup.
//!
//! Retry timers: `rnr_retry = 7` means "retry forever" in verbs. With WRITE_WITH_IMM a missing
//! receive buffer on the peer then hangs the writer silently; we refuse 7 so that a peer that
//! stopped replenishing receives surfaces as an error (`IBV_WC_RNR_RETRY_EXC_ERR`) after
//! `rnr_retry` attempts spaced by the peer's `min_rnr_timer`. Receive credits keep writers from
//! meeting RNR at all while the peer runs; the default timer (18: 5.12 ms, so about 30 ms over
//! six retries) leaves a briefly descheduled peer room before the lane fails.

use super::super::config::{GidFamily, VerbsConfig};

/// Environment variable naming the device (e.g. `mlx5_0`, `rxe0`).
pub const ENV_DEVICE: &str = "WEIGHTSYNC_RDMA_DEVICE";
/// Environment variable with the 1-based port number.
pub const ENV_PORT: &str = "WEIGHTSYNC_RDMA_PORT";
/// Environment variable with the GID index (RoCE v2 entry); `none` forces LID addressing, `auto`
/// picks the first RoCE v2 entry of the GID family.
pub const ENV_GID_INDEX: &str = "WEIGHTSYNC_RDMA_GID_INDEX";
/// Environment variable with the GID family of the automatic choice (`ipv4`, `ipv6`).
pub const ENV_GID_FAMILY: &str = "WEIGHTSYNC_RDMA_GID_FAMILY";
/// Environment variable with the RoCE traffic class (the IP DSCP/ECN byte, 0..=255).
pub const ENV_TRAFFIC_CLASS: &str = "WEIGHTSYNC_RDMA_TC";
/// Environment variable with the service level (0..=15).
pub const ENV_SERVICE_LEVEL: &str = "WEIGHTSYNC_RDMA_SL";

/// Resolved settings of one verbs fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerbsSettings {
    /// Device name; `None` takes the first device that has the port active.
    pub device: Option<String>,
    /// 1-based port number.
    pub port: u8,
    /// GID index for global routing; `None` on RoCE picks one of `gid_family` automatically.
    pub gid_index: Option<u8>,
    /// Family of the automatically chosen RoCE GID.
    pub gid_family: GidFamily,
    /// RoCE GRH traffic class (IP DSCP/ECN byte).
    pub traffic_class: u8,
    /// Service level (0..=15).
    pub service_level: u8,
    /// Receive WRs kept posted per queue pair (each WRITE_WITH_IMM consumes one).
    pub recv_depth: u32,
    /// Send WRs outstanding per queue pair at most.
    pub send_depth: u32,
    /// RNR NAK retries before `IBV_WC_RNR_RETRY_EXC_ERR` (0..=6; 7 would be infinite).
    pub rnr_retry: u8,
    /// Transport retries (lost packets / missing ACKs) before `IBV_WC_RETRY_EXC_ERR` (0..=7).
    pub retry_cnt: u8,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout (14 ≈ 67 ms, a common RoCE choice).
    pub timeout: u8,
    /// RNR NAK timer we ask senders to wait before retrying (18 = 5.12 ms).
    pub min_rnr_timer: u8,
    /// Request a completion at least every this many WRs of a lane (send-queue slot reclaim).
    pub signal_interval: u32,
    /// Work requests linked into one `ibv_post_send` call (one doorbell).
    pub wrs_per_doorbell: usize,
}

/// A setting that cannot be used, naming the field or variable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("verbs setting {field}: {detail}")]
pub struct SettingsError {
    /// The config field or environment variable.
    pub field: &'static str,
    /// What is wrong and what is allowed.
    pub detail: String,
}

fn bad(field: &'static str, detail: impl Into<String>) -> SettingsError {
    SettingsError {
        field,
        detail: detail.into(),
    }
}

impl VerbsSettings {
    /// Resolves `config` with overrides from the process environment.
    pub fn from_config_and_env(config: &VerbsConfig) -> Result<VerbsSettings, SettingsError> {
        Self::resolve(config, |name| std::env::var(name).ok())
    }

    /// Resolves `config` with overrides looked up through `env` (tests pass a map).
    pub fn resolve(
        config: &VerbsConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<VerbsSettings, SettingsError> {
        let nonempty = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let device = match nonempty(ENV_DEVICE) {
            Some(d) => Some(d.trim().to_owned()),
            None => config.device.clone(),
        };
        let port = match nonempty(ENV_PORT) {
            Some(p) => p
                .trim()
                .parse::<u8>()
                .map_err(|_| bad(ENV_PORT, format!("{p:?} is not a port number (1..=255)")))?,
            None => config.port,
        };
        let gid_index = match nonempty(ENV_GID_INDEX) {
            Some(g) if g.trim().eq_ignore_ascii_case("none") => None,
            Some(g) if g.trim().eq_ignore_ascii_case("auto") => None,
            Some(g) => Some(g.trim().parse::<u8>().map_err(|_| {
                bad(
                    ENV_GID_INDEX,
                    format!("{g:?} is not a GID index (0..=255, or `none` for LID addressing)"),
                )
            })?),
            None => config.gid_index,
        };
        let gid_family = match nonempty(ENV_GID_FAMILY) {
            Some(f) => match f.trim().to_ascii_lowercase().as_str() {
                "ipv4" | "v4" => GidFamily::Ipv4,
                "ipv6" | "v6" => GidFamily::Ipv6,
                _ => {
                    return Err(bad(
                        ENV_GID_FAMILY,
                        format!("{f:?} is not `ipv4` or `ipv6`"),
                    ));
                }
            },
            None => config.gid_family,
        };
        let traffic_class = match nonempty(ENV_TRAFFIC_CLASS) {
            Some(t) => t.trim().parse::<u8>().map_err(|_| {
                bad(
                    ENV_TRAFFIC_CLASS,
                    format!("{t:?} is not a traffic class (0..=255, e.g. 106 for DSCP 26 + ECN)"),
                )
            })?,
            None => config.traffic_class,
        };
        let service_level = match nonempty(ENV_SERVICE_LEVEL) {
            Some(l) => l.trim().parse::<u8>().map_err(|_| {
                bad(
                    ENV_SERVICE_LEVEL,
                    format!("{l:?} is not a service level (0..=15)"),
                )
            })?,
            None => config.service_level,
        };
        let settings = VerbsSettings {
            device,
            port,
            gid_index,
            gid_family,
            traffic_class,
            service_level,
            recv_depth: config.recv_depth,
            send_depth: config.send_depth,
            rnr_retry: config.rnr_retry,
            retry_cnt: config.retry_cnt,
            timeout: config.ack_timeout,
            min_rnr_timer: config.min_rnr_timer,
            signal_interval: (config.send_depth / 4).max(1),
            wrs_per_doorbell: 16,
        };
        settings.validate()?;
        Ok(settings)
    }

    /// Checks ranges, naming the first bad field.
    pub fn validate(&self) -> Result<(), SettingsError> {
        if self.port == 0 {
            return Err(bad("verbs.port", "ports are numbered from 1"));
        }
        if let Some(d) = &self.device
            && (d.is_empty() || d.len() > 63)
        {
            return Err(bad("verbs.device", format!("{d:?} is not a device name")));
        }
        if self.rnr_retry > 6 {
            return Err(bad(
                "verbs.rnr_retry",
                format!(
                    "{} is not allowed: 7 means retry forever, which hangs a writer whose peer \
                     has no receive posted; use 0..=6",
                    self.rnr_retry
                ),
            ));
        }
        if self.retry_cnt > 7 {
            return Err(bad("verbs.retry_cnt", "must be 0..=7"));
        }
        if self.timeout > 31 {
            return Err(bad("verbs.ack_timeout", "must be 0..=31"));
        }
        if self.min_rnr_timer > 31 {
            return Err(bad("verbs.min_rnr_timer", "must be 0..=31"));
        }
        if self.service_level > 15 {
            return Err(bad(
                "verbs.service_level",
                format!("{} is outside 0..=15", self.service_level),
            ));
        }
        if !(8..=32_768).contains(&self.recv_depth) {
            return Err(bad(
                "verbs.recv_depth",
                format!("{} is outside 8..=32768", self.recv_depth),
            ));
        }
        if !(8..=32_768).contains(&self.send_depth) {
            return Err(bad(
                "verbs.send_depth",
                format!("{} is outside 8..=32768", self.send_depth),
            ));
        }
        if self.signal_interval == 0 || self.signal_interval > self.send_depth / 2 {
            return Err(bad(
                "signal_interval",
                "must be 1..=send_depth/2 so a completion frees slots before the queue fills",
            ));
        }
        if self.wrs_per_doorbell == 0 {
            return Err(bad("wrs_per_doorbell", "must be at least 1"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn config_fields_are_used_without_env() {
        let cfg = VerbsConfig {
            device: Some("mlx5_0".into()),
            port: 2,
            gid_index: Some(3),
            ..Default::default()
        };
        let s = VerbsSettings::resolve(&cfg, env(&[])).unwrap();
        assert_eq!(s.device.as_deref(), Some("mlx5_0"));
        assert_eq!((s.port, s.gid_index), (2, Some(3)));
        assert_eq!(s.signal_interval, cfg.send_depth / 4);
        assert!(s.rnr_retry <= 6);
    }

    #[test]
    fn env_overrides_config() {
        let cfg = VerbsConfig {
            device: Some("mlx5_0".into()),
            gid_index: Some(3),
            ..Default::default()
        };
        let s = VerbsSettings::resolve(
            &cfg,
            env(&[
                (ENV_DEVICE, "rxe0"),
                (ENV_PORT, " 1 "),
                (ENV_GID_INDEX, "1"),
            ]),
        )
        .unwrap();
        assert_eq!(s.device.as_deref(), Some("rxe0"));
        assert_eq!((s.port, s.gid_index), (1, Some(1)));
        let s = VerbsSettings::resolve(&cfg, env(&[(ENV_GID_INDEX, "none")])).unwrap();
        assert_eq!(s.gid_index, None);
        // Empty variables do not override.
        let s = VerbsSettings::resolve(&cfg, env(&[(ENV_DEVICE, "")])).unwrap();
        assert_eq!(s.device.as_deref(), Some("mlx5_0"));
    }

    #[test]
    fn bad_values_name_the_field() {
        let cfg = VerbsConfig::default();
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_PORT, "one")])).unwrap_err();
        assert_eq!(err.field, ENV_PORT);
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_GID_INDEX, "300")])).unwrap_err();
        assert_eq!(err.field, ENV_GID_INDEX);
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_PORT, "0")])).unwrap_err();
        assert_eq!(err.field, "verbs.port");

        let forever = VerbsConfig {
            rnr_retry: 7,
            ..Default::default()
        };
        let err = VerbsSettings::resolve(&forever, env(&[])).unwrap_err();
        assert_eq!(err.field, "verbs.rnr_retry");
        assert!(err.to_string().contains("retry forever"), "{err}");

        let shallow = VerbsConfig {
            recv_depth: 2,
            ..Default::default()
        };
        let err = VerbsSettings::resolve(&shallow, env(&[])).unwrap_err();
        assert_eq!(err.field, "verbs.recv_depth");
    }

    /// V6: traffic class and SL come from config, overridden by the environment, and are
    /// range-checked.
    #[test]
    fn traffic_class_sl_and_gid_family_are_settings() {
        let cfg = VerbsConfig {
            traffic_class: 104,
            service_level: 3,
            ..Default::default()
        };
        let s = VerbsSettings::resolve(&cfg, env(&[])).unwrap();
        assert_eq!((s.traffic_class, s.service_level), (104, 3));
        assert_eq!(s.gid_family, GidFamily::Ipv4);
        let s = VerbsSettings::resolve(
            &cfg,
            env(&[
                (ENV_TRAFFIC_CLASS, "106"),
                (ENV_SERVICE_LEVEL, "5"),
                (ENV_GID_FAMILY, "IPv6"),
            ]),
        )
        .unwrap();
        assert_eq!((s.traffic_class, s.service_level), (106, 5));
        assert_eq!(s.gid_family, GidFamily::Ipv6);
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_SERVICE_LEVEL, "16")])).unwrap_err();
        assert_eq!(err.field, "verbs.service_level");
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_TRAFFIC_CLASS, "dscp26")])).unwrap_err();
        assert_eq!(err.field, ENV_TRAFFIC_CLASS);
        let err = VerbsSettings::resolve(&cfg, env(&[(ENV_GID_FAMILY, "v5")])).unwrap_err();
        assert_eq!(err.field, ENV_GID_FAMILY);
        let s = VerbsSettings::resolve(&cfg, env(&[(ENV_GID_INDEX, "auto")])).unwrap();
        assert_eq!(s.gid_index, None);
    }

    /// V20 (and V4): the queue-pair timers are settings, not constants; the RNR timer defaults
    /// to 5.12 ms (18) so a briefly descheduled receiver gets ~30 ms over six retries.
    #[test]
    fn queue_pair_timers_are_settings() {
        let s = VerbsSettings::resolve(&VerbsConfig::default(), env(&[])).unwrap();
        assert_eq!((s.min_rnr_timer, s.timeout, s.retry_cnt), (18, 14, 7));
        let cfg = VerbsConfig {
            min_rnr_timer: 20,
            ack_timeout: 16,
            retry_cnt: 5,
            ..Default::default()
        };
        let s = VerbsSettings::resolve(&cfg, env(&[])).unwrap();
        assert_eq!((s.min_rnr_timer, s.timeout, s.retry_cnt), (20, 16, 5));
        let bad_timer = VerbsConfig {
            min_rnr_timer: 32,
            ..Default::default()
        };
        let err = VerbsSettings::resolve(&bad_timer, env(&[])).unwrap_err();
        assert_eq!(err.field, "verbs.min_rnr_timer");
    }

    #[test]
    fn serde_config_round_trips_with_defaults() {
        let cfg: VerbsConfig = serde_json::from_str(r#"{"device":"rxe0","gid_index":1}"#).unwrap();
        let s = VerbsSettings::resolve(&cfg, env(&[])).unwrap();
        assert_eq!(s.device.as_deref(), Some("rxe0"));
        assert_eq!((s.port, s.gid_index), (1, Some(1)));
        let toml_like = serde_json::to_string(&cfg).unwrap();
        assert_eq!(
            serde_json::from_str::<VerbsConfig>(&toml_like).unwrap(),
            cfg
        );
    }
}
