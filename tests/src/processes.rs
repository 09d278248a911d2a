//! The real `weightsync` binary, run as child processes.
//!
//! Fault scenarios kill processes with SIGKILL, so they need real processes, not tasks in the
//! test's runtime. An integration test of the `weightsync-tests` package cannot use
//! `env!("CARGO_BIN_EXE_weightsync")` (that exists only for the binary's own package), so
//! [`weightsync_binary`] finds the binary next to the test executable
//! (`<target>/<profile>/deps/<test>` → `<target>/<profile>/weightsync`) and, once per test process,
//! runs `cargo build -p weightsync-cli --bin weightsync` with the same target directory and
//! profile so the binary is never stale. `WEIGHTSYNC_BIN=/path/to/weightsync` skips both.
//!
//! [`ChildProcess`] owns one child: stdout and stderr go to a log file (shown when a test fails),
//! and drop kills it with SIGKILL, so a failing test leaves no process behind.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Path of the `weightsync` binary, built if needed (see the module docs). Panics with the
/// build's output when it cannot be built: every process-level test needs it.
pub fn weightsync_binary() -> PathBuf {
    static BIN: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BIN.get_or_init(locate_or_build)
        .clone()
        .unwrap_or_else(|e| panic!("cannot get the weightsync binary: {e}"))
}

fn locate_or_build() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("WEIGHTSYNC_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("WEIGHTSYNC_BIN={} is not a file", p.display()))
        };
    }
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let deps = exe.parent().ok_or("test executable has no parent")?;
    let profile_dir = if deps.file_name().is_some_and(|n| n == "deps") {
        deps.parent().ok_or("deps has no parent")?
    } else {
        deps
    };
    let target_dir = profile_dir.parent().ok_or("profile dir has no parent")?;
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or("bad profile dir")?;
    let bin = profile_dir.join("weightsync");
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| env!("CARGO").to_owned());
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--quiet",
        "-p",
        "weightsync-cli",
        "--bin",
        "weightsync",
    ])
    .arg("--manifest-path")
    .arg(&manifest)
    .arg("--target-dir")
    .arg(target_dir);
    match profile {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    match cmd.output() {
        Ok(out) if out.status.success() => {}
        Ok(out) if bin.is_file() => {
            eprintln!(
                "warning: rebuilding weightsync failed, using the existing {}: {}",
                bin.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(out) => {
            return Err(format!(
                "cargo build -p weightsync-cli --bin weightsync failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Err(e) if bin.is_file() => {
            eprintln!(
                "warning: cannot run cargo ({e}), using the existing {}",
                bin.display()
            );
        }
        Err(e) => return Err(format!("cannot run cargo to build weightsync: {e}")),
    }
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} does not exist after the build", bin.display()))
    }
}

/// One child process, killed (SIGKILL) on drop, with its output in a log file.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Child,
    log: PathBuf,
    exited: Option<ExitStatus>,
}

impl ChildProcess {
    /// Spawns `cmd` with stdout and stderr appended to `<log_dir>/<name>.log`.
    pub fn spawn(name: &str, mut cmd: Command, log_dir: &Path) -> std::io::Result<ChildProcess> {
        let log = log_dir.join(format!("{name}.log"));
        let out = File::options().create(true).append(true).open(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()?;
        Ok(ChildProcess {
            name: name.to_owned(),
            child,
            log,
            exited: None,
        })
    }

    /// Its name in the test.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Kills it with SIGKILL (no chance to say goodbye) and reaps it.
    pub fn kill(&mut self) {
        if self.exited.is_none() {
            let _ = self.child.kill();
            self.exited = self.child.wait().ok();
        }
    }

    /// Stops it with SIGSTOP: it holds its sockets but reads, writes and heartbeats nothing
    /// (a frozen peer), until [`resume`](Self::resume).
    pub fn pause(&self) {
        // SAFETY: kill(2) on our own child's pid with a valid signal number.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGSTOP) };
    }

    /// Continues it after [`pause`](Self::pause) (SIGCONT).
    pub fn resume(&self) {
        // SAFETY: kill(2) on our own child's pid with a valid signal number.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGCONT) };
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        match self.child.try_wait() {
            Ok(Some(s)) => {
                self.exited = Some(s);
                false
            }
            _ => true,
        }
    }

    /// Waits up to `timeout` for it to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.is_running() {
                return self.exited;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Its output so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Path of its log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Waits until a line of its output contains `needle`, returning that line.
    pub fn wait_for_line(&self, needle: &str, timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Ok(f) = File::open(&self.log)
                && let Some(l) = BufReader::new(f)
                    .lines()
                    .map_while(Result::ok)
                    .find(|l| l.contains(needle))
            {
                return Some(l);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Polls `f` every 20 ms until it returns `Some` or `timeout` passes.
pub fn wait_until<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A free TCP port on `ip` (bound and released; racy in principle, fine on a test machine).
pub fn free_port(ip: &str) -> u16 {
    std::net::TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port on {ip}: {e}"))
}
