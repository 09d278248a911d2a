//! The dashboard in a real browser: headless Chromium against a running `weightsync demo`
//! (worker processes, a small Qwen3-shaped model, fp8, verification on). The page must draw the
//! chosen sync's timeline with one lane per worker. Skips, saying why, when Chromium is absent.
//!
//! `WEIGHTSYNC_UPDATE_SCREENSHOT=1` also saves the screenshot to `controller/assets/dashboard.png`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use weightsync_tests::processes::{ChildProcess, weightsync_binary};

const TINY_QWEN3: &str = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
 "torch_dtype": "bfloat16", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 1000,
 "tie_word_embeddings": true, "attention_bias": false, "max_position_embeddings": 4096,
 "rms_norm_eps": 1e-06, "rope_theta": 1000000}"#;

fn chromium() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|n| {
            std::env::var_os("PATH")
                .map(|p| {
                    std::env::split_paths(&p)
                        .map(|d| d.join(n))
                        .collect::<Vec<_>>()
                })
                .unwrap_or_default()
        })
        .find(|p| p.is_file())
}

fn headless(browser: &Path, profile: &Path) -> Command {
    let mut c = Command::new(browser);
    c.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        "--window-size=1500,900",
        "--virtual-time-budget=8000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    c
}

#[test]
fn dashboard_draws_one_lane_per_worker_in_headless_chromium() {
    let Some(browser) = chromium() else {
        eprintln!("SKIPPED: no chromium found (apt-get install chromium, or set CHROMIUM=/path)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny-qwen3.json");
    std::fs::write(&model, TINY_QWEN3).unwrap();
    let mut cmd = Command::new(weightsync_binary());
    cmd.args(["demo", "--model"])
        .arg(&model)
        .args(["--train", "fsdp=2", "--infer", "tp=2,dp=2", "--syncs", "2"])
        .args(["--http", "127.0.0.1:0", "--watermark-mib", "4"]);
    let demo = ChildProcess::spawn("demo", cmd, dir.path()).unwrap();
    let line = demo
        .wait_for_line("(Ctrl-C to stop)", Duration::from_secs(120))
        .unwrap_or_else(|| panic!("demo did not finish its syncs:\n{}", demo.log_text()));
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no URL in {line:?}"))
        .to_string();
    let workers = 2 + 4;

    let profile = dir.path().join("profile-dom");
    std::fs::create_dir_all(&profile).unwrap();
    let out = headless(&browser, &profile)
        .arg("--dump-dom")
        .arg(&url)
        .output()
        .expect("run chromium");
    let dom = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && dom.contains("<svg"),
        "chromium failed ({}): {}\n{dom}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lanes = dom.matches("<g class=\"lane").count();
    assert_eq!(lanes, workers, "one lane per worker expected; DOM:\n{dom}");
    for w in ["trainer-0", "trainer-1", "rollout-3"] {
        assert!(
            dom.contains(&format!("data-worker=\"{w}\"")),
            "no lane for {w}"
        );
    }
    assert!(dom.contains("span-write"), "no WRITE spans drawn");
    assert!(dom.contains("★"), "critical path not marked");
    assert!(dom.contains("committed"), "sync state not shown");

    let shot = dir.path().join("dashboard.png");
    let profile = dir.path().join("profile-shot");
    std::fs::create_dir_all(&profile).unwrap();
    let out = headless(&browser, &profile)
        .arg(format!("--screenshot={}", shot.display()))
        .arg(&url)
        .output()
        .expect("run chromium");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let png = std::fs::read(&shot).expect("screenshot written");
    assert!(
        png.starts_with(b"\x89PNG") && png.len() > 10_000,
        "screenshot too small"
    );
    if std::env::var_os("WEIGHTSYNC_UPDATE_SCREENSHOT").is_some() {
        let dst = Path::new(env!("CARGO_MANIFEST_DIR")).join("../controller/assets/dashboard.png");
        std::fs::copy(&shot, &dst).unwrap();
        eprintln!("saved {}", dst.display());
    }
    // Ctrl-C: the demo tells its workers to exit and stops.
    let mut demo = demo;
    // SAFETY: kill(2) on the pid of a child this test owns; no memory is involved.
    unsafe {
        libc::kill(demo.pid() as i32, libc::SIGINT);
    }
    assert!(
        demo.wait_exit(Duration::from_secs(30)).is_some(),
        "demo did not stop on Ctrl-C"
    );
}
