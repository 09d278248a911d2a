//! Opening the RDMA device: the one context, protection domain and port of a verbs fabric.
//!
//! The device, port and GID index come from [`VerbsSettings`]. Without a configured device the
//! first device whose port is ACTIVE is taken ([`choose_device`]): on hosts with `mlx5_0..N` the
//! first one is often a down or management port. Opening fails with a message that says what
//! exists instead (the device names found, each port's state) so that a wrong
//! `WEIGHTSYNC_RDMA_DEVICE` or a down port is obvious. The device limits are queried once here
//! (`verbs_limits`). Each owning type frees its verbs object in `Drop` and holds an `Arc` to its
//! parent, so a protection domain can never outlive its context.

use std::ffi::CStr;
use std::sync::Arc;

use ibverbs_sys as ffi;

use super::super::error::FabricError;
use super::verbs_endpoint::{QpEndpoint, random_psn};
use super::verbs_gid::{
    Addressing, Gid, GidType, LinkLayer, choose_addressing, choose_gid, read_gid_table,
};
use super::verbs_limits::DeviceLimits;
use super::verbs_settings::VerbsSettings;

/// Where the kernel lists RDMA devices, their ports and GID tables.
const SYSFS_INFINIBAND: &str = "/sys/class/infiniband";

/// What we learned about the port when opening it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    /// Device name (`mlx5_0`, `rxe0`).
    pub device: String,
    /// 1-based port number.
    pub port: u8,
    /// Link layer.
    pub link: LinkLayer,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// Active MTU (verbs enum value).
    pub active_mtu: u32,
    /// Largest message the port carries.
    pub max_msg_size: u64,
    /// Entries in the GID table.
    pub gid_table_len: usize,
    /// Our GID at the configured index, if any.
    pub gid: Option<Gid>,
    /// The type of `gid` (from sysfs), if known.
    pub gid_type: Option<GidType>,
    /// How queue pairs address peers.
    pub addressing: Addressing,
    /// The device's limits.
    pub limits: DeviceLimits,
}

impl PortInfo {
    /// What a queue pair numbered `qp_num` on this port, posting `recv_depth` receives, tells
    /// its peer, starting at a fresh random PSN.
    pub fn endpoint(&self, qp_num: u32, recv_depth: u32) -> QpEndpoint {
        QpEndpoint {
            qp_num,
            psn: random_psn(),
            lid: self.lid,
            gid: self.gid,
            mtu: self.active_mtu,
            recv_depth,
            max_msg_size: self.max_msg_size,
            gid_type: self.gid_type,
        }
    }
}

/// What opening a device's port found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortProbe {
    /// The port is ACTIVE.
    Active,
    /// The port is in another state (named).
    NotActive(String),
    /// The device or port could not be opened or queried.
    Failed(String),
}

/// Which device to use: the one named (`wanted`), else the first whose port is ACTIVE. The error
/// lists every device with what was found.
pub fn choose_device(
    probes: &[(String, PortProbe)],
    wanted: Option<&str>,
) -> Result<usize, String> {
    let listing = || {
        probes
            .iter()
            .map(|(n, p)| match p {
                PortProbe::Active => format!("{n} (active)"),
                PortProbe::NotActive(state) => format!("{n} ({state})"),
                PortProbe::Failed(e) => format!("{n} ({e})"),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    match wanted {
        Some(w) => probes.iter().position(|(n, _)| n == w).ok_or_else(|| {
            format!(
                "no device named {w:?} (WEIGHTSYNC_RDMA_DEVICE / verbs.device); found: {}",
                listing()
            )
        }),
        None => probes
            .iter()
            .position(|(_, p)| *p == PortProbe::Active)
            .ok_or_else(|| format!("no device has the port active; found: {}", listing())),
    }
}

/// An open device context. Closed on drop.
#[derive(Debug)]
pub struct VerbsContext {
    ctx: *mut ffi::ibv_context,
    port: PortInfo,
}

// SAFETY: libibverbs contexts are thread-safe (all verbs may be called from any thread); the
// pointer is owned and only freed in Drop.
unsafe impl Send for VerbsContext {}
// SAFETY: as for Send; shared access only calls thread-safe verbs.
unsafe impl Sync for VerbsContext {}

fn device_error(detail: impl Into<String>) -> FabricError {
    FabricError::Unsupported(format!("RDMA device: {}", detail.into()))
}

/// Owns the array from `ibv_get_device_list`.
struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<DeviceList, FabricError> {
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: n is a valid out-pointer; the returned array is freed in Drop.
        let list = unsafe { ffi::ibv_get_device_list(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            return Err(device_error(format!(
                "ibv_get_device_list failed ({e}): this kernel has no RDMA support loaded \
                 (modprobe ib_uverbs, and rdma_rxe for Soft-RoCE)"
            )));
        }
        Ok(DeviceList {
            list,
            len: usize::try_from(n).unwrap_or(0),
        })
    }

    fn devices(&self) -> Vec<(*mut ffi::ibv_device, String)> {
        (0..self.len)
            .map(|i| {
                // SAFETY: i < len, the array holds len valid device pointers while self lives.
                let dev = unsafe { *self.list.add(i) };
                // SAFETY: dev is a valid device; the name is a static C string of the device.
                let name_ptr = unsafe { ffi::ibv_get_device_name(dev) };
                let name = if name_ptr.is_null() {
                    String::from("?")
                } else {
                    // SAFETY: non-null NUL-terminated string owned by the device list.
                    unsafe { CStr::from_ptr(name_ptr) }
                        .to_string_lossy()
                        .into_owned()
                };
                (dev, name)
            })
            .collect()
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: list came from ibv_get_device_list and is freed exactly once; contexts opened
        // from its devices stay valid after the list is freed (libibverbs refcounts devices).
        unsafe { ffi::ibv_free_device_list(self.list) };
    }
}

/// Names of the RDMA devices on this machine (empty without kernel support).
pub fn device_names() -> Vec<String> {
    DeviceList::get()
        .map(|l| l.devices().into_iter().map(|(_, n)| n).collect())
        .unwrap_or_default()
}

fn port_state_name(state: ffi::ibv_port_state::Type) -> String {
    // SAFETY: ibv_port_state_str returns a static string for any value.
    let p = unsafe { ffi::ibv_port_state_str(state) };
    if p.is_null() {
        return format!("state {state}");
    }
    // SAFETY: non-null static C string.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Opens `dev` and queries `port`; the context is closed again unless the caller keeps it.
fn open_and_query(
    dev: *mut ffi::ibv_device,
    name: &str,
    port: u8,
) -> Result<(VerbsContext, ffi::ibv_port_attr), String> {
    // SAFETY: dev is a valid device of a live list; the context is closed in Drop of the
    // VerbsContext built right below.
    let ctx = unsafe { ffi::ibv_open_device(dev) };
    if ctx.is_null() {
        let e = std::io::Error::last_os_error();
        return Err(format!("ibv_open_device({name}) failed: {e}"));
    }
    let owned = VerbsContext {
        ctx,
        port: PortInfo {
            device: name.to_owned(),
            port,
            link: LinkLayer::InfiniBand,
            lid: 0,
            active_mtu: 1,
            max_msg_size: 1 << 30,
            gid_table_len: 0,
            gid: None,
            gid_type: None,
            addressing: Addressing::Lid,
            limits: DeviceLimits::UNKNOWN,
        },
    };
    let mut attr = ffi::ibv_port_attr::default();
    // SAFETY: ctx is open; attr is a valid, zeroed ibv_port_attr (the compat entry point fills a
    // prefix of it, the rest stays zero).
    let rc = unsafe {
        ffi::ibv_query_port(
            ctx,
            port,
            &mut attr as *mut ffi::ibv_port_attr as *mut ffi::_compat_ibv_port_attr,
        )
    };
    if rc != 0 {
        return Err(format!(
            "ibv_query_port({name}, port {port}) failed: {} (WEIGHTSYNC_RDMA_PORT / verbs.port)",
            std::io::Error::from_raw_os_error(rc)
        ));
    }
    Ok((owned, attr))
}

/// `ibv_query_device` of an open context, as the limits the backend uses.
fn query_limits(ctx: *mut ffi::ibv_context, max_msg_size: u64) -> Result<DeviceLimits, String> {
    // SAFETY: ibv_device_attr is plain data; all-zero is a valid value.
    let mut attr: ffi::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is an open context; attr is a valid out-pointer of the right type.
    let rc = unsafe { ffi::ibv_query_device(ctx, &mut attr) };
    if rc != 0 {
        return Err(format!(
            "ibv_query_device failed: {}",
            std::io::Error::from_raw_os_error(rc)
        ));
    }
    let positive = |v: i32| u32::try_from(v).unwrap_or(0);
    Ok(DeviceLimits {
        max_qp_wr: positive(attr.max_qp_wr),
        max_cqe: positive(attr.max_cqe),
        max_sge: positive(attr.max_sge),
        max_mr_size: attr.max_mr_size,
        max_msg_size,
    })
}

impl VerbsContext {
    /// Opens the configured device and checks the configured port and GID.
    pub fn open(settings: &VerbsSettings) -> Result<Arc<VerbsContext>, FabricError> {
        let list = DeviceList::get()?;
        let devices = list.devices();
        if devices.is_empty() {
            return Err(device_error(
                "no RDMA devices found; for Soft-RoCE: `rdma link add rxe0 type rxe netdev \
                 <interface>` (set WEIGHTSYNC_RDMA_DEVICE=rxe0)",
            ));
        }
        // Probe each candidate: the named one, or every device in order until one is active.
        let mut probes: Vec<(String, PortProbe)> = Vec::new();
        let mut opened: Option<(VerbsContext, ffi::ibv_port_attr)> = None;
        for (dev, name) in &devices {
            if settings.device.as_ref().is_some_and(|w| w != name) {
                probes.push((name.clone(), PortProbe::NotActive("not named".into())));
                continue;
            }
            match open_and_query(*dev, name, settings.port) {
                Ok((ctx, attr)) if attr.state == ffi::ibv_port_state::IBV_PORT_ACTIVE => {
                    probes.push((name.clone(), PortProbe::Active));
                    opened = Some((ctx, attr));
                    break;
                }
                Ok((_, attr)) => probes.push((
                    name.clone(),
                    PortProbe::NotActive(format!(
                        "port {} is {}",
                        settings.port,
                        port_state_name(attr.state)
                    )),
                )),
                Err(e) => probes.push((name.clone(), PortProbe::Failed(e))),
            }
        }
        drop(list);
        let chosen = choose_device(&probes, settings.device.as_deref()).map_err(device_error)?;
        let Some((mut owned, attr)) = opened else {
            let (name, probe) = &probes[chosen];
            return Err(device_error(match probe {
                PortProbe::NotActive(state) => format!(
                    "{name} {state}, not ACTIVE (check the cable / `ibv_devinfo`; for Soft-RoCE \
                     the netdev must be up)"
                ),
                PortProbe::Failed(e) => e.clone(),
                PortProbe::Active => format!("{name}: lost while opening"),
            }));
        };
        let name = owned.port.device.clone();
        let ctx = owned.ctx;
        let link = LinkLayer::from_raw(attr.link_layer);
        let gid_table_len = usize::try_from(attr.gid_tbl_len).unwrap_or(0);
        let table = read_gid_table(
            std::path::Path::new(SYSFS_INFINIBAND),
            &name,
            settings.port,
            gid_table_len,
            link,
        );
        let gid_index = match (settings.gid_index, link) {
            (Some(index), _) => Some(index),
            // RoCE without a configured index: the first RoCE v2 entry of the wanted family.
            (None, LinkLayer::Ethernet) => Some(
                choose_gid(&table, settings.gid_family)
                    .map_err(|e| device_error(format!("{name} port {}: {e}", settings.port)))?,
            ),
            (None, LinkLayer::InfiniBand) => None,
        };
        let addressing = choose_addressing(link, attr.lid, gid_table_len, gid_index)
            .map_err(|e| device_error(format!("{name} port {}: {e}", settings.port)))?;
        let mut gid_type = None;
        let gid = match addressing {
            Addressing::Global { sgid_index } => {
                let mut raw = ffi::ibv_gid::default();
                // SAFETY: ctx is open, raw is a valid out-pointer for one GID.
                let rc = unsafe {
                    ffi::ibv_query_gid(ctx, settings.port, i32::from(sgid_index), &mut raw)
                };
                if rc != 0 {
                    return Err(device_error(format!(
                        "ibv_query_gid({name}, port {}, index {sgid_index}) failed: {}",
                        settings.port,
                        std::io::Error::last_os_error()
                    )));
                }
                // SAFETY: ibv_gid is a union of plain bytes; every bit pattern is valid.
                let gid = Gid(unsafe { raw.raw });
                if gid.is_zero() {
                    return Err(device_error(format!(
                        "{name} port {} GID index {sgid_index} is empty; pick a populated RoCE v2 \
                         entry from `ibv_devinfo -v` (WEIGHTSYNC_RDMA_GID_INDEX)",
                        settings.port
                    )));
                }
                gid_type = table
                    .iter()
                    .find(|e| e.index == sgid_index)
                    .and_then(|e| e.kind);
                if link == LinkLayer::Ethernet && gid_type == Some(GidType::RoceV1) {
                    // RoCE v1 routes only inside one L2 domain and many switches drop it.
                    tracing::warn!(
                        device = %name,
                        port = settings.port,
                        gid_index = sgid_index,
                        "the GID index is a RoCE v1 entry (see `ibv_devinfo -v`, \
                         WEIGHTSYNC_RDMA_GID_INDEX); RoCE v1 does not cross IP subnets"
                    );
                }
                Some(gid)
            }
            Addressing::Lid => None,
        };
        // Old providers may leave it 0; 1 GiB is what every RC transport supports.
        let max_msg_size = if attr.max_msg_sz == 0 {
            1 << 30
        } else {
            u64::from(attr.max_msg_sz)
        };
        let limits = query_limits(ctx, max_msg_size).map_err(device_error)?;
        limits
            .check(settings, &name)
            .map_err(|e| FabricError::Config(e.to_string()))?;
        owned.port = PortInfo {
            device: name,
            port: settings.port,
            link,
            lid: attr.lid,
            active_mtu: attr.active_mtu,
            max_msg_size,
            gid_table_len,
            gid,
            gid_type,
            addressing,
            limits,
        };
        tracing::info!(
            device = %owned.port.device,
            port = owned.port.port,
            link = ?owned.port.link,
            lid = owned.port.lid,
            gid = ?owned.port.gid,
            gid_type = ?owned.port.gid_type,
            mtu = super::verbs_endpoint::mtu_bytes(owned.port.active_mtu),
            "opened RDMA device"
        );
        Ok(Arc::new(owned))
    }

    /// The port this context uses.
    pub fn port(&self) -> &PortInfo {
        &self.port
    }

    /// The raw context (for the sibling owning types of this module).
    pub(super) fn raw(&self) -> *mut ffi::ibv_context {
        self.ctx
    }
}

impl Drop for VerbsContext {
    fn drop(&mut self) {
        // SAFETY: ctx was opened by ibv_open_device and is closed exactly once; every child
        // object holds an Arc to this context, so none is alive any more.
        let rc = unsafe { ffi::ibv_close_device(self.ctx) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_close_device failed");
        }
    }
}

/// A protection domain: memory regions and queue pairs of one fabric. Freed on drop.
#[derive(Debug)]
pub struct VerbsPd {
    pd: *mut ffi::ibv_pd,
    ctx: Arc<VerbsContext>,
}

// SAFETY: protection domains are used from any thread through thread-safe verbs; owned pointer.
unsafe impl Send for VerbsPd {}
// SAFETY: as for Send.
unsafe impl Sync for VerbsPd {}

impl VerbsPd {
    /// Allocates a protection domain on `ctx`.
    pub fn new(ctx: &Arc<VerbsContext>) -> Result<Arc<VerbsPd>, FabricError> {
        // SAFETY: ctx is an open context kept alive by the Arc stored in the result.
        let pd = unsafe { ffi::ibv_alloc_pd(ctx.raw()) };
        if pd.is_null() {
            return Err(device_error(format!(
                "ibv_alloc_pd failed: {}",
                std::io::Error::last_os_error()
            )));
        }
        Ok(Arc::new(VerbsPd {
            pd,
            ctx: ctx.clone(),
        }))
    }

    /// The context.
    pub fn context(&self) -> &Arc<VerbsContext> {
        &self.ctx
    }

    pub(super) fn raw(&self) -> *mut ffi::ibv_pd {
        self.pd
    }
}

impl Drop for VerbsPd {
    fn drop(&mut self) {
        // SAFETY: pd came from ibv_alloc_pd and is freed once; every MR and QP holds an Arc to
        // this PD, so none is alive any more.
        let rc = unsafe { ffi::ibv_dealloc_pd(self.pd) };
        if rc != 0 {
            tracing::warn!(rc, "ibv_dealloc_pd failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fabric::VerbsConfig;

    /// V12: without a configured device, the first device whose port is ACTIVE is used, not
    /// the first device.
    #[test]
    fn the_first_active_device_is_chosen() {
        let probes = vec![
            (
                "mlx5_0".to_owned(),
                PortProbe::NotActive("port 1 is DOWN".into()),
            ),
            (
                "mlx5_1".to_owned(),
                PortProbe::Failed("ibv_open_device failed".into()),
            ),
            ("mlx5_2".to_owned(), PortProbe::Active),
        ];
        assert_eq!(choose_device(&probes, None), Ok(2));
        assert_eq!(choose_device(&probes, Some("mlx5_0")), Ok(0));
        let err = choose_device(&probes, Some("rxe0")).unwrap_err();
        assert!(err.contains("mlx5_0 (port 1 is DOWN)"), "{err}");
        let err = choose_device(&probes[..2], None).unwrap_err();
        assert!(err.contains("no device has the port active"), "{err}");
    }

    #[test]
    fn opening_without_a_device_is_a_clear_error() {
        // On machines with a device this test is meaningless: skip it there.
        if !device_names().is_empty() {
            return;
        }
        let settings = VerbsSettings::resolve(
            &VerbsConfig {
                device: Some("rxe0".into()),
                gid_index: Some(1),
                ..Default::default()
            },
            |_| None,
        )
        .unwrap();
        let err = VerbsContext::open(&settings).unwrap_err().to_string();
        assert!(
            err.contains("no RDMA devices") || err.contains("no RDMA support"),
            "{err}"
        );
    }
}
