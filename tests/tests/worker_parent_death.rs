//! `weightsync worker --die-with-parent`: a sidecar ends when the process that started it dies,
//! even by `kill -9` (a training rank torchrun restarts), instead of living on as an orphan that
//! holds its rank. The parent here is a shell that starts the worker in the background; the
//! worker keeps trying to reach a controller that is not there, so only the parent-death signal
//! can end it within the test's few seconds.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use weightsync_tests::processes::{free_port, weightsync_binary};

/// Whether `pid` is gone (or a zombie nobody reaped yet).
fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

#[test]
fn a_sidecar_started_with_die_with_parent_ends_when_its_parent_is_killed() {
    let bin = weightsync_binary();
    let nowhere = format!("127.0.0.1:{}", free_port("127.0.0.1"));
    let script = format!(
        "'{}' worker trainer --die-with-parent --controller {nowhere} --reconnect-s 60 \
         --rank 0 --model qwen3-0.6b --train fsdp=1 --infer tp=1 --source demo:1 \
         >/dev/null 2>&1 & echo $!; sleep 60",
        bin.display()
    );
    let mut parent = Command::new("sh")
        .args(["-c", &script])
        .env("WEIGHTSYNC_JOB_TOKEN", "parent-death-token")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawning the parent shell");
    let mut line = String::new();
    BufReader::new(parent.stdout.take().unwrap())
        .read_line(&mut line)
        .expect("the worker's pid");
    let worker: u32 = line.trim().parse().expect("a pid");
    // The worker is up (past its flag parsing) and trying to connect.
    std::thread::sleep(Duration::from_millis(500));
    assert!(!gone(worker), "the worker ended before its parent");
    parent.kill().expect("kill -9 the parent");
    let _ = parent.wait();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !gone(worker) {
        if Instant::now() > deadline {
            // Do not leave it behind.
            let _ = Command::new("kill")
                .args(["-9", &worker.to_string()])
                .status();
            panic!("the worker {worker} outlived its parent by 10 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
