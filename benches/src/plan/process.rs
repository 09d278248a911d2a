//! One child process run to its end, with what the kernel counted for it alone.
//!
//! Why `wait4`: a process's peak resident memory and CPU time are only known once it has
//! exited, and only the parent's wait sees them per child (`getrusage(RUSAGE_CHILDREN)` keeps
//! a running maximum over every child, which mixes the two binaries being compared). The one
//! `unsafe` call is here, behind [`run_measured`].

use std::io::Read;
use std::process::Stdio;
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use weightsync_common::program::Program;

/// What one run of a child cost, and what it printed.
#[derive(Debug, Clone)]
pub struct Measured {
    /// From spawn to reaped, seconds.
    pub wall_s: f64,
    /// User CPU seconds (every thread).
    pub user_s: f64,
    /// System CPU seconds (mostly first-touch page faults, for the planner).
    pub sys_s: f64,
    /// Peak resident set, bytes.
    pub peak_rss_bytes: u64,
    /// Its standard output.
    pub stdout: String,
}

/// Runs `exe args...` to its end; an error (naming the command, with its stderr) when it
/// cannot start or does not exit with status 0.
pub fn run_measured(exe: &Program, args: &[String]) -> anyhow::Result<Measured> {
    let what = || format!("{exe} {}", args.join(" "));
    let t0 = Instant::now();
    let mut child = exe
        .command()
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting `{}`", what()))?;
    let mut err_pipe = child.stderr.take().ok_or_else(|| anyhow!("child stderr"))?;
    // Both pipes are drained at once, so neither can fill and stall the child.
    let stderr = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err_pipe.read_to_string(&mut s);
        s
    });
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        out.read_to_string(&mut stdout)
            .with_context(|| format!("reading the output of `{}`", what()))?;
    }
    let pid = libc::pid_t::try_from(child.id()).context("child pid")?;
    let mut status: libc::c_int = 0;
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `pid` is our own child, not yet reaped (std's `Child` only reaps in `wait`, which
    // is never called on it); `status` and `usage` are valid, writable and live for the call,
    // and wait4 writes nothing else.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, usage.as_mut_ptr()) };
    let wall_s = t0.elapsed().as_secs_f64();
    if rc != pid {
        bail!(
            "waiting for `{}`: {}",
            what(),
            std::io::Error::last_os_error()
        );
    }
    // SAFETY: wait4 returned the child's pid, so it filled `usage` (zeroed before anyway).
    let usage = unsafe { usage.assume_init() };
    let stderr = stderr.join().unwrap_or_default();
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!(
            "`{}` failed (wait status {status}): {}",
            what(),
            stderr.trim()
        );
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok(Measured {
        wall_s,
        user_s: secs(usage.ru_utime),
        sys_s: secs(usage.ru_stime),
        // Linux counts ru_maxrss in KiB.
        peak_rss_bytes: (usage.ru_maxrss.max(0) as u64) * 1024,
        stdout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_measured_and_its_output_kept() {
        let m = run_measured(
            &Program::new("/bin/sh"),
            &["-c".into(), "echo hello".into()],
        )
        .expect("sh runs");
        assert_eq!(m.stdout, "hello\n");
        assert!(m.wall_s > 0.0);
        assert!(m.peak_rss_bytes > 0, "the kernel counts a resident set");
    }

    #[test]
    fn a_failing_child_is_an_error_naming_it_with_its_stderr() {
        let e = run_measured(
            &Program::new("/bin/sh"),
            &["-c".into(), "echo broken >&2; exit 3".into()],
        )
        .expect_err("exit 3 fails");
        let msg = format!("{e:#}");
        assert!(msg.contains("/bin/sh -c"), "{msg}");
        assert!(msg.contains("broken"), "{msg}");
    }

    #[test]
    fn a_missing_binary_is_an_error_naming_it() {
        let e = run_measured(&Program::new("/nonexistent/weightsync"), &[]).expect_err("no binary");
        assert!(
            format!("{e:#}").contains("/nonexistent/weightsync"),
            "{e:#}"
        );
    }
}
