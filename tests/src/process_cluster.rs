//! A whole job as real `weightsync` processes: one controller, trainers and rollouts.
//!
//! Each process is the real binary (`weightsync controller`, `weightsync worker trainer|rollout`)
//! started with flags and the token environment variables a deployment would use, its output in
//! a log file under a temporary directory. Rollouts run with `--demo-check-seed`, so before a
//! rollout reports a version verified it compares every tensor with an independent
//! recomputation of the demo weights: when the controller reports a sync committed (which is
//! when it tells rollouts `Commit`), every byte was checked twice.
//!
//! Addresses: every process gets its own loopback port, or, in network namespaces, the address
//! of its host ([`Placement`]). Ports are kept across restarts of a process, so workers find a
//! restarted controller where they left it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::http_raw::{self, RawResponse};
use crate::processes::{ChildProcess, free_port, wait_until, weightsync_binary};
use crate::proxied_cluster::TINY_MODEL;

/// Job token of process clusters.
pub const JOB_TOKEN: &str = "process-cluster-job-token";
/// API token for mutating HTTP calls.
pub const API_TOKEN: &str = "process-cluster-api-token";
/// Demo weights seed.
pub const SEED: u64 = 7;

/// The job.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// Model preset, or `None` for the tiny two-layer model (written to a file).
    pub model: Option<String>,
    /// Training layout.
    pub train: String,
    /// Inference layout.
    pub infer: String,
    /// Trainers (must match `train`).
    pub trainers: u32,
    /// Rollouts (must match `infer`).
    pub rollouts: u32,
    /// `bf16` or `fp8`.
    pub dtype: String,
    /// Controller: a silent worker fails the sync after this.
    pub heartbeat_timeout_ms: u64,
    /// Controller: a sync not committed within this fails.
    pub sync_timeout_s: u64,
    /// Rollouts: how long to wait for a version to land.
    pub land_timeout_s: u64,
    /// Trainers: staging watermark.
    pub watermark_mib: u64,
}

impl JobSpec {
    /// The tiny model: 2 trainers (`fsdp=2`) and 2 rollouts (`tp=2`), fp8, short timeouts.
    pub fn tiny() -> JobSpec {
        JobSpec {
            model: None,
            train: "fsdp=2".into(),
            infer: "tp=2".into(),
            trainers: 2,
            rollouts: 2,
            dtype: "fp8".into(),
            heartbeat_timeout_ms: 1_500,
            sync_timeout_s: 20,
            land_timeout_s: 15,
            watermark_mib: 4,
        }
    }
}

/// Where each process listens: loopback ports, or the hosts of a namespace lan.
#[derive(Debug, Clone)]
pub enum Placement {
    /// Everything on 127.0.0.1.
    Loopback,
    /// Processes run through `wrap` (e.g. `ip netns exec NS`) and listen on their host's address.
    Hosts {
        /// Controller host: (command prefix, address).
        controller: (Vec<String>, String),
        /// Namespace of the controller's host (HTTP calls of the test are made from there).
        controller_ns: String,
        /// Trainer `r` host.
        trainers: Vec<(Vec<String>, String)>,
        /// Rollout `r` host.
        rollouts: Vec<(Vec<String>, String)>,
    },
}

/// A running job.
#[derive(Debug)]
pub struct ProcessCluster {
    /// The job.
    pub spec: JobSpec,
    dir: tempfile::TempDir,
    model_arg: String,
    placement: Placement,
    /// HTTP address of the controller.
    pub http: SocketAddr,
    /// Control-channel address of the controller.
    pub control: SocketAddr,
    /// The controller process (`None` while it is down).
    pub controller: Option<ChildProcess>,
    /// Trainer processes by rank.
    pub trainers: Vec<Option<ChildProcess>>,
    /// Rollout processes by rank.
    pub rollouts: Vec<Option<ChildProcess>>,
    restarts: u32,
}

fn prefix_command(prefix: &[String], bin: &Path) -> Command {
    match prefix.split_first() {
        None => Command::new(bin),
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
    }
}

impl ProcessCluster {
    /// Starts the controller and every worker on loopback; does not wait for readiness.
    pub fn start(spec: JobSpec) -> ProcessCluster {
        ProcessCluster::start_placed(spec, Placement::Loopback)
    }

    /// Starts the controller and every worker where `placement` says.
    pub fn start_placed(spec: JobSpec, placement: Placement) -> ProcessCluster {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let model_arg = match &spec.model {
            Some(m) => m.clone(),
            None => {
                let p = dir.path().join("tiny-config.json");
                std::fs::write(&p, TINY_MODEL).expect("writing the tiny model config");
                p.display().to_string()
            }
        };
        let ctl_ip = match &placement {
            Placement::Loopback => "127.0.0.1".to_owned(),
            Placement::Hosts { controller, .. } => controller.1.clone(),
        };
        // Ports are chosen on loopback; in namespaces every host has its own port space, so
        // any free number works there too.
        let http = SocketAddr::new(
            ctl_ip.parse().expect("controller ip"),
            free_port("127.0.0.1"),
        );
        let control = SocketAddr::new(
            ctl_ip.parse().expect("controller ip"),
            free_port("127.0.0.1"),
        );
        let mut c = ProcessCluster {
            trainers: (0..spec.trainers).map(|_| None).collect(),
            rollouts: (0..spec.rollouts).map(|_| None).collect(),
            spec,
            dir,
            model_arg,
            placement,
            http,
            control,
            controller: None,
            restarts: 0,
        };
        c.start_controller();
        for r in 0..c.spec.rollouts {
            c.start_worker("rollout", r);
        }
        for r in 0..c.spec.trainers {
            c.start_worker("trainer", r);
        }
        c
    }

    /// Directory of the logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn job_flags(&self) -> Vec<(String, String)> {
        [
            ("--model", self.model_arg.as_str()),
            ("--train", &self.spec.train),
            ("--infer", &self.spec.infer),
            ("--dtype", &self.spec.dtype),
            ("--verify", "true"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
    }

    fn common_env(cmd: &mut Command) {
        cmd.env("WEIGHTSYNC_JOB_TOKEN", JOB_TOKEN)
            .env("RUST_LOG", "info")
            .env("RUST_BACKTRACE", "0")
            .env("RUST_LIB_BACKTRACE", "0")
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env_remove("SLURM_PROCID")
            .env_remove("SLURM_NTASKS")
            .env_remove("LOCAL_RANK");
    }

    /// Starts (or restarts) the controller on its addresses.
    pub fn start_controller(&mut self) {
        let prefix = match &self.placement {
            Placement::Loopback => Vec::new(),
            Placement::Hosts { controller, .. } => controller.0.clone(),
        };
        let mut cmd = prefix_command(&prefix, &weightsync_binary());
        cmd.arg("controller")
            .args(["--http", &self.http.to_string()])
            .args(["--control", &self.control.to_string()])
            .args([
                "--heartbeat-timeout-ms",
                &self.spec.heartbeat_timeout_ms.to_string(),
            ])
            .args(["--sync-timeout-s", &self.spec.sync_timeout_s.to_string()])
            .env("WEIGHTSYNC_API_TOKEN", API_TOKEN);
        for (k, v) in self.job_flags() {
            cmd.arg(k).arg(v);
        }
        Self::common_env(&mut cmd);
        let name = format!("controller-{}", self.restarts);
        self.restarts += 1;
        self.controller = Some(
            ChildProcess::spawn(&name, cmd, self.dir.path()).expect("spawning the controller"),
        );
    }

    /// Starts (or restarts) worker `role` `rank`.
    pub fn start_worker(&mut self, role: &str, rank: u32) {
        self.start_worker_with(role, rank, &[]);
    }

    /// Starts worker `role` `rank` with extra flags (replacing defaults of the same name) in its slot, replacing
    /// (and killing) whatever process held the slot.
    pub fn start_worker_with(
        &mut self,
        role: &str,
        rank: u32,
        extra: &[(&str, &str)],
    ) -> &mut ChildProcess {
        let p = self.spawn_worker(role, rank, extra);
        let slot = if role == "trainer" {
            &mut self.trainers[rank as usize]
        } else {
            &mut self.rollouts[rank as usize]
        };
        *slot = Some(p);
        slot.as_mut().expect("just set")
    }

    /// Spawns a worker process for `role` `rank` that the cluster does not track (an impostor,
    /// a duplicate); the caller owns it.
    pub fn spawn_worker(&self, role: &str, rank: u32, extra: &[(&str, &str)]) -> ChildProcess {
        let (prefix, ip) = match &self.placement {
            Placement::Loopback => (Vec::new(), "127.0.0.1".to_owned()),
            Placement::Hosts {
                trainers, rollouts, ..
            } => {
                let h = if role == "trainer" {
                    &trainers[rank as usize]
                } else {
                    &rollouts[rank as usize]
                };
                (h.0.clone(), h.1.clone())
            }
        };
        let mut flags: Vec<(String, String)> = vec![
            ("--controller".into(), self.control.to_string()),
            ("--rank".into(), rank.to_string()),
            ("--fabric-listen".into(), format!("{ip}:0")),
            ("--reconnect-s".into(), "60".into()),
            ("--host".into(), format!("{role}-{rank}-host")),
        ];
        if role == "trainer" {
            flags.push(("--source".into(), format!("demo:{SEED}")));
            flags.push((
                "--watermark-mib".into(),
                self.spec.watermark_mib.to_string(),
            ));
        } else {
            flags.push(("--demo-check-seed".into(), SEED.to_string()));
            flags.push((
                "--land-timeout-s".into(),
                self.spec.land_timeout_s.to_string(),
            ));
        }
        flags.extend(self.job_flags());
        // `extra` replaces a default flag of the same name (clap refuses repeated flags).
        for (k, v) in extra {
            match flags.iter_mut().find(|(f, _)| f == k) {
                Some(slot) => slot.1 = (*v).to_owned(),
                None => flags.push(((*k).to_owned(), (*v).to_owned())),
            }
        }
        let mut cmd = prefix_command(&prefix, &weightsync_binary());
        cmd.args(["worker", role]);
        for (k, v) in flags {
            cmd.arg(k).arg(v);
        }
        Self::common_env(&mut cmd);
        let n = std::fs::read_dir(self.dir.path())
            .map(|d| d.count())
            .unwrap_or(0);
        let name = format!("{role}-{rank}-{n}");
        ChildProcess::spawn(&name, cmd, self.dir.path()).expect("spawning a worker")
    }

    /// Kills worker `role` `rank` with SIGKILL.
    pub fn kill_worker(&mut self, role: &str, rank: u32) {
        let slot = if role == "trainer" {
            &mut self.trainers[rank as usize]
        } else {
            &mut self.rollouts[rank as usize]
        };
        if let Some(mut p) = slot.take() {
            p.kill();
        }
    }

    /// Kills the controller with SIGKILL.
    pub fn kill_controller(&mut self) {
        if let Some(mut p) = self.controller.take() {
            p.kill();
        }
    }

    /// Pids of every running process (controller first).
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.controller
            .iter()
            .chain(self.trainers.iter().flatten())
            .chain(self.rollouts.iter().flatten())
            .map(|p| (p.name().to_owned(), p.pid()))
            .collect()
    }

    /// Every log, for a failure message.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let mut paths: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .map(|d| d.flatten().map(|e| e.path()).collect())
            .unwrap_or_default();
        paths.sort();
        for p in paths
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == "log"))
        {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            out.push_str(&format!(
                "==== {} (last {} lines)\n",
                p.display(),
                tail.len()
            ));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }

    /// Sends one request to the controller (from the controller's namespace when placed).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        token: Option<&str>,
        body: &[u8],
    ) -> std::io::Result<RawResponse> {
        let (http, method, path) = (self.http, method.to_owned(), path.to_owned());
        let (token, body) = (token.map(str::to_owned), body.to_vec());
        let call = move || http_raw::send(http, &method, &path, token.as_deref(), &body);
        match &self.placement {
            Placement::Loopback => call(),
            Placement::Hosts { controller_ns, .. } => {
                crate::netns::run_in_namespace(controller_ns, call)
                    .map_err(std::io::Error::other)?
            }
        }
    }

    /// `GET path` on the controller.
    pub fn get(&self, path: &str) -> std::io::Result<RawResponse> {
        self.request("GET", path, None, b"")
    }

    /// `POST /v1/syncs` with `version` (and `?wait=true` when `wait`).
    pub fn trigger(&self, version: u64, wait: bool) -> std::io::Result<RawResponse> {
        let path = if wait {
            "/v1/syncs?wait=true"
        } else {
            "/v1/syncs"
        };
        self.request(
            "POST",
            path,
            Some(API_TOKEN),
            format!("{{\"version\": {version}}}").as_bytes(),
        )
    }

    /// `/healthz` as JSON, if the controller answers.
    pub fn health(&self) -> Option<serde_json::Value> {
        self.get("/healthz").ok().and_then(|r| r.json())
    }

    /// Waits until the world is complete, planned and idle.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        wait_until(timeout, || {
            self.health()
                .filter(|h| h["ready"] == serde_json::Value::Bool(true))
                .map(|_| ())
        })
        .is_some()
    }

    /// `GET /v1/syncs/{id}` as JSON.
    pub fn sync_view(&self, id: u64) -> Option<serde_json::Value> {
        self.get(&format!("/v1/syncs/{id}"))
            .ok()
            .filter(|r| r.status == 200)
            .and_then(|r| r.json())
    }

    /// Waits until sync `id` is committed or failed; returns its view.
    pub fn wait_end(&self, id: u64, timeout: Duration) -> Option<serde_json::Value> {
        wait_until(timeout, || {
            self.sync_view(id)
                .filter(|v| v["state"] == "committed" || v["state"] == "failed")
        })
    }

    /// Triggers `version`, waits for the end, and returns the view (panics with logs on an
    /// HTTP failure).
    pub fn sync(&self, version: u64, timeout: Duration) -> serde_json::Value {
        let r = self
            .trigger(version, false)
            .unwrap_or_else(|e| panic!("trigger {version}: {e}\n{}", self.logs()));
        assert!(
            r.status == 202 || r.status == 200,
            "trigger {version}: {} {}\n{}",
            r.status,
            r.text(),
            self.logs()
        );
        let id = r
            .json()
            .and_then(|j| j["sync_id"].as_u64())
            .expect("sync_id");
        self.wait_end(id, timeout)
            .unwrap_or_else(|| panic!("sync {id} did not end in {timeout:?}\n{}", self.logs()))
    }
}

/// Asserts the promise on a sync view: committed implies verified.
pub fn assert_committed_and_verified(
    view: &serde_json::Value,
    what: &str,
    logs: &dyn Fn() -> String,
) {
    assert_eq!(view["state"], "committed", "{what}: {view}\n{}", logs());
    assert_eq!(
        view["verified"], true,
        "{what}: committed without verification: {view}"
    );
}
