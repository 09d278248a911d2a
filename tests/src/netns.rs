//! Several hosts on one machine: network namespaces joined by veth pairs to a bridge (iproute2).
//!
//! A [`Lan`] is one hub namespace holding a bridge, and one namespace per host with an `eth0`
//! whose peer is a port of that bridge; host `i` gets `10.77.0.<i+1>/24`. Every interface is
//! created directly inside its namespace, so nothing appears in (or can collide in) the root
//! namespace, and several lans can exist at once. Processes run in a host with
//! [`Namespace::command`] (`ip netns exec`). A partition is a bridge port set down
//! ([`Lan::set_link`]); delay and loss are `tc qdisc ... netem` on both ends of a host's link
//! ([`Lan::netem`]), when the kernel has `sch_netem`.
//!
//! Needs root (CAP_NET_ADMIN) and the `ip` tool. [`unavailable_reason`] says why not, so tests
//! skip with that message instead of failing on machines that cannot build namespaces.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

static NEXT_LAN: AtomicU32 = AtomicU32::new(0);

fn ip(args: &[&str]) -> Result<String, String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running `ip {}`: {e}", args.join(" ")))?;
    if !out.status.success() {
        return Err(format!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn run_in(ns: &str, program: &str, args: &[&str]) -> Result<String, String> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    ip(&full)
}

/// Why namespaces cannot be built here, or `None` when they can.
pub fn unavailable_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root (CAP_NET_ADMIN); run the suite as root".into());
    }
    if Command::new("ip").arg("-V").output().is_err() {
        return Some(
            "the `ip` tool (iproute2) is not installed: apt-get install -y iproute2".into(),
        );
    }
    // Unique per call: tests in one process probe concurrently.
    static PROBES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    match Namespace::create(&format!("ws-probe-{}-{n}", std::process::id())) {
        Ok(_) => None,
        Err(e) => Some(format!("cannot create a network namespace: {e}")),
    }
}

/// Why `tc qdisc ... netem` cannot be used here, or `None` when it can.
pub fn netem_unavailable_reason() -> Option<String> {
    if let Some(r) = unavailable_reason() {
        return Some(r);
    }
    let lan = match Lan::new(1) {
        Ok(l) => l,
        Err(e) => return Some(e),
    };
    match lan.netem(0, 1, 0.0) {
        Ok(()) => None,
        Err(e) if e.contains("unknown") => Some(format!(
            "this kernel has no sch_netem qdisc (tc says: {e}); delay and loss cannot be emulated"
        )),
        Err(e) => Some(format!("tc netem failed: {e}")),
    }
}

/// A named network namespace, deleted on drop (kill its processes first).
#[derive(Debug)]
pub struct Namespace {
    name: String,
}

impl Namespace {
    /// Creates the namespace and brings its loopback up.
    pub fn create(name: &str) -> Result<Namespace, String> {
        ip(&["netns", "add", name])?;
        let ns = Namespace {
            name: name.to_owned(),
        };
        ns.ip(&["link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Runs `ip <args>` inside the namespace.
    pub fn ip(&self, args: &[&str]) -> Result<String, String> {
        let mut full = vec!["-n", self.name.as_str()];
        full.extend_from_slice(args);
        ip(&full)
    }

    /// Runs `program args` inside the namespace and returns its stdout.
    pub fn run(&self, program: &str, args: &[&str]) -> Result<String, String> {
        run_in(&self.name, program, args)
    }

    /// A command that runs `program` inside the namespace (`ip netns exec` execs it, so the
    /// child's pid is the program's own).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.name]);
    }
}

/// Runs `f` on a new thread whose network namespace is `ns` (by name, as `ip netns` knows it):
/// sockets `f` opens live in that namespace. The test's own threads are not affected.
pub fn run_in_namespace<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).map_err(|e| format!("opening {path}: {e}"))?;
        // SAFETY: setns on a valid namespace fd affects only the calling thread (CLONE_NEWNET on
        // a thread of a multi-threaded process is allowed); the fd stays open during the call.
        let rc = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        if rc != 0 {
            return Err(format!(
                "setns into {path}: {}",
                std::io::Error::last_os_error()
            ));
        }
        Ok(f())
    })
    .join()
    .map_err(|_| "the thread inside the namespace panicked".to_owned())?
}

/// One host of a [`Lan`].
#[derive(Debug)]
pub struct Host {
    /// Its namespace.
    pub ns: Namespace,
    /// Its address on the lan.
    pub addr: Ipv4Addr,
    /// Name of its bridge port in the hub namespace.
    port: String,
}

/// Hosts on one bridge, each in its own namespace.
#[derive(Debug)]
pub struct Lan {
    // Hosts before the hub: their veths go when their namespaces go.
    hosts: Vec<Host>,
    hub: Namespace,
}

impl Lan {
    /// Builds a lan of `hosts` hosts.
    pub fn new(hosts: usize) -> Result<Lan, String> {
        assert!(hosts < 250, "at most 249 hosts");
        let tag = format!(
            "ws-{}-{}",
            std::process::id(),
            NEXT_LAN.fetch_add(1, Ordering::SeqCst)
        );
        let hub = Namespace::create(&format!("{tag}-hub"))?;
        hub.ip(&["link", "add", "br0", "type", "bridge"])?;
        hub.ip(&["link", "set", "br0", "up"])?;
        let mut lan = Lan {
            hosts: Vec::new(),
            hub,
        };
        for i in 0..hosts {
            let ns = Namespace::create(&format!("{tag}-h{i}"))?;
            let port = format!("p{i}");
            ip(&[
                "link",
                "add",
                &port,
                "netns",
                lan.hub.name(),
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns.name(),
            ])?;
            lan.hub.ip(&["link", "set", &port, "master", "br0"])?;
            lan.hub.ip(&["link", "set", &port, "up"])?;
            let addr = Ipv4Addr::new(10, 77, 0, i as u8 + 1);
            ns.ip(&["addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            ns.ip(&["link", "set", "eth0", "up"])?;
            lan.hosts.push(Host { ns, addr, port });
        }
        Ok(lan)
    }

    /// Host `i`.
    pub fn host(&self, i: usize) -> &Host {
        &self.hosts[i]
    }

    /// Number of hosts.
    pub fn len(&self) -> usize {
        self.hosts.len()
    }

    /// Whether the lan has no hosts.
    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty()
    }

    /// Connects (`up`) or partitions (`!up`) host `i` by setting its bridge port up or down.
    pub fn set_link(&self, i: usize, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        self.hub
            .ip(&["link", "set", &self.hosts[i].port, state])
            .map(|_| ())
    }

    /// Adds `delay_ms` of delay and `loss_pct` % loss to both directions of host `i`'s link
    /// (netem on its `eth0` and on its bridge port, each with half the delay and the loss).
    pub fn netem(&self, i: usize, delay_ms: u32, loss_pct: f64) -> Result<(), String> {
        let h = &self.hosts[i];
        let delay = format!("{}us", delay_ms * 500);
        let loss = format!("{}%", loss_pct / 2.0);
        for (ns, dev) in [(&h.ns, "eth0"), (&self.hub, h.port.as_str())] {
            run_in(
                ns.name(),
                "tc",
                &[
                    "qdisc", "replace", "dev", dev, "root", "netem", "delay", &delay, "loss", &loss,
                ],
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_hosts_talk_over_the_bridge_and_partition() {
        if let Some(why) = unavailable_reason() {
            eprintln!("skipping: {why}");
            return;
        }
        let lan = Lan::new(2).unwrap();
        let a = lan.host(0).addr;
        // Host 1 can reach host 0's address; the root namespace has no route to it.
        let out = lan
            .host(1)
            .ns
            .ip(&["route", "get", &a.to_string()])
            .unwrap();
        assert!(out.contains("dev eth0"), "{out}");
        lan.set_link(1, false).unwrap();
        lan.set_link(1, true).unwrap();
    }
}
