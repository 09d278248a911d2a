//! `weightsync bench plan`: planning as users meet it, one whole `weightsync plan --json`
//! process per run, beside a baseline binary (the previous commit's build) run alternately.
//!
//! Why whole processes: a fresh plan pays for building the layouts and for the first touch of
//! every page of the table (a quarter of Kimi-K2's wall is the kernel zero-filling pages), which
//! an in-process loop such as the criterion planner bench amortises away; and the goals users
//! are promised (issue 16: Kimi-K2 256 -> 128 fp8 in < 0.5 s and < 300 MB, 10,240 GPUs in < 2 s
//! and < 1 GB) are set on the process. Why a baseline in the same run: this machine is shared
//! and its speed swings by a third within minutes, so only runs interleaved with the previous
//! build (ABBA order, so neither binary always runs first) compare. Each child's CPU time and
//! peak RSS come from the kernel ([`process`]); both binaries' JSON outputs are compared, so a
//! change that only meant to be faster shows it changed nothing else.
//!
//! The largest trainer slice (what one worker of the job receives) is measured in this
//! process: the case is planned once and every trainer's slice encoded.

use anyhow::bail;
use serde::Serialize;
use weightsync_common::program::Program;
use weightsync_schedules::CostModel;

use crate::e2e::Setup;

pub mod process;

use process::{Measured, run_measured};

/// One planning case, with the goals it is held to.
#[derive(Debug, Clone, Serialize)]
pub struct Case {
    /// Short name (`anchor`, `10240`, `custom`).
    pub name: String,
    /// Model preset or config.json path.
    pub model: String,
    /// Training layout.
    pub train: String,
    /// Inference layout.
    pub infer: String,
    /// Inference weight format.
    pub dtype: String,
    /// Wall-time goal for the whole process (median), seconds.
    pub goal_wall_s: Option<f64>,
    /// Peak-RSS goal (the largest run), bytes.
    pub goal_rss_bytes: Option<u64>,
    /// Goal for the largest trainer slice (bincode), bytes.
    pub goal_slice_bytes: Option<u64>,
}

impl Case {
    /// The named cases: `anchor` (Kimi-K2, 256 training GPUs -> 128 inference GPUs, fp8: the
    /// fabric-lib paper's case) and `10240` (Kimi-K2 on 8,192 training and 2,048 inference
    /// GPUs, fp8).
    pub fn named(name: &str) -> anyhow::Result<Case> {
        let case = |train: &str, infer: &str, wall, rss, slice| Case {
            name: name.to_string(),
            model: "kimi-k2".into(),
            train: train.into(),
            infer: infer.into(),
            dtype: "fp8".into(),
            goal_wall_s: Some(wall),
            goal_rss_bytes: Some(rss),
            goal_slice_bytes: slice,
        };
        Ok(match name {
            "anchor" => case(
                "pp=2,ep=8,fsdp=16",
                "tp=8,ep=32,dp=4",
                0.5,
                300_000_000,
                None,
            ),
            "10240" => case(
                "pp=16,ep=32,fsdp=16",
                "tp=8,ep=32,dp=64",
                2.0,
                1_000_000_000,
                Some(50_000_000),
            ),
            other => bail!("unknown plan case {other:?} (known: anchor, 10240)"),
        })
    }

    /// A case without goals.
    pub fn custom(model: &str, train: &str, infer: &str, dtype: &str) -> Case {
        Case {
            name: "custom".into(),
            model: model.into(),
            train: train.into(),
            infer: infer.into(),
            dtype: dtype.into(),
            goal_wall_s: None,
            goal_rss_bytes: None,
            goal_slice_bytes: None,
        }
    }

    /// The `weightsync` arguments that plan it.
    fn args(&self) -> Vec<String> {
        [
            "plan",
            "--model",
            &self.model,
            "--train",
            &self.train,
            "--infer",
            &self.infer,
            "--dtype",
            &self.dtype,
            "--json",
        ]
        .map(String::from)
        .to_vec()
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// The `weightsync` program measured (this one, normally: [`Program::this`]).
    pub exe: Program,
    /// The binary it is compared with, run alternately (none: no comparison).
    pub baseline: Option<Program>,
    /// The cases.
    pub cases: Vec<Case>,
    /// Timed runs per binary and case (after one untimed warm-up each).
    pub runs: usize,
    /// Also measure the largest trainer slice (where a case has a goal for it).
    pub slices: bool,
}

/// One binary's runs of one case.
#[derive(Debug, Clone, Serialize)]
pub struct Runs {
    /// The binary.
    pub exe: String,
    /// Median wall seconds.
    pub wall_s: f64,
    /// Median CPU seconds (user + system).
    pub cpu_s: f64,
    /// Median system seconds.
    pub sys_s: f64,
    /// The largest peak RSS over the runs, bytes.
    pub peak_rss_bytes: u64,
    /// Every run's wall seconds, in order.
    pub all_wall_s: Vec<f64>,
    /// Every run's peak RSS, bytes.
    pub all_peak_rss_bytes: Vec<u64>,
}

impl Runs {
    fn of(exe: &Program, runs: &[Measured]) -> Runs {
        Runs {
            exe: exe.to_string(),
            wall_s: median(runs.iter().map(|m| m.wall_s)),
            cpu_s: median(runs.iter().map(|m| m.user_s + m.sys_s)),
            sys_s: median(runs.iter().map(|m| m.sys_s)),
            peak_rss_bytes: runs.iter().map(|m| m.peak_rss_bytes).max().unwrap_or(0),
            all_wall_s: runs.iter().map(|m| m.wall_s).collect(),
            all_peak_rss_bytes: runs.iter().map(|m| m.peak_rss_bytes).collect(),
        }
    }
}

/// Which goals a case met (absent: no goal, or not measured).
#[derive(Debug, Clone, Serialize)]
pub struct Met {
    /// Median wall under the goal.
    pub wall: Option<bool>,
    /// Every run's peak RSS under the goal.
    pub rss: Option<bool>,
    /// The largest trainer slice within the goal.
    pub slice: Option<bool>,
}

/// One case's figures.
#[derive(Debug, Clone, Serialize)]
pub struct CaseReport {
    /// The case and its goals.
    pub case: Case,
    /// This binary's runs.
    pub weightsync: Runs,
    /// The baseline's runs.
    pub baseline: Option<Runs>,
    /// Median wall / the baseline's median wall (below 1: faster).
    pub wall_vs_baseline: Option<f64>,
    /// Median CPU / the baseline's.
    pub cpu_vs_baseline: Option<f64>,
    /// Whether both binaries printed the same JSON in every run.
    pub outputs_identical: Option<bool>,
    /// The largest trainer slice in bincode, bytes.
    pub largest_slice_bytes: Option<u64>,
    /// Goals met.
    pub met: Met,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `"plan"`.
    pub bench: &'static str,
    /// Timed runs per binary and case.
    pub runs: usize,
    /// The 1-minute load average before and after (the machine is shared).
    pub load_before: Option<f64>,
    /// See `load_before`.
    pub load_after: Option<f64>,
    /// Cores this machine has.
    pub cores: usize,
    /// Per case.
    pub cases: Vec<CaseReport>,
}

/// Runs every case.
pub fn run(cfg: &Config) -> anyhow::Result<Report> {
    if cfg.runs == 0 {
        bail!("--runs must be at least 1");
    }
    if cfg.cases.is_empty() {
        bail!("no plan case to run");
    }
    if let Some(b) = &cfg.baseline
        && !b.path.is_file()
    {
        bail!("baseline binary {} does not exist", b.path.display());
    }
    let load_before = load_average();
    let mut cases = Vec::with_capacity(cfg.cases.len());
    for case in &cfg.cases {
        cases.push(run_case(cfg, case)?);
    }
    Ok(Report {
        bench: "plan",
        runs: cfg.runs,
        load_before,
        load_after: load_average(),
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        cases,
    })
}

fn run_case(cfg: &Config, case: &Case) -> anyhow::Result<CaseReport> {
    let args = case.args();
    let mut binaries = vec![cfg.exe.clone()];
    binaries.extend(cfg.baseline.iter().cloned());
    // One untimed run each: binaries and the model's config in the page cache, and a case
    // the planner refuses is refused before any timing.
    for exe in &binaries {
        run_measured(exe, &args)?;
    }
    let mut measured: Vec<Vec<Measured>> = vec![Vec::with_capacity(cfg.runs); binaries.len()];
    for i in 0..cfg.runs {
        // ABBA: the binaries take turns at running first.
        let order: Vec<usize> = if i % 2 == 0 {
            (0..binaries.len()).collect()
        } else {
            (0..binaries.len()).rev().collect()
        };
        for b in order {
            measured[b].push(run_measured(&binaries[b], &args)?);
        }
    }
    let weightsync = Runs::of(&cfg.exe, &measured[0]);
    let baseline = cfg.baseline.as_ref().map(|b| Runs::of(b, &measured[1]));
    let outputs_identical = baseline.as_ref().map(|_| {
        measured[0]
            .iter()
            .zip(&measured[1])
            .all(|(a, b)| a.stdout == b.stdout)
    });
    let ratio = |a: f64, b: f64| (b > 0.0).then_some(a / b);
    let largest_slice_bytes = if cfg.slices && case.goal_slice_bytes.is_some() {
        Some(largest_slice(case)?)
    } else {
        None
    };
    let met = Met {
        wall: case.goal_wall_s.map(|g| weightsync.wall_s < g),
        rss: case.goal_rss_bytes.map(|g| weightsync.peak_rss_bytes < g),
        slice: case
            .goal_slice_bytes
            .zip(largest_slice_bytes)
            .map(|(g, s)| s <= g),
    };
    Ok(CaseReport {
        case: case.clone(),
        wall_vs_baseline: baseline
            .as_ref()
            .and_then(|b| ratio(weightsync.wall_s, b.wall_s)),
        cpu_vs_baseline: baseline
            .as_ref()
            .and_then(|b| ratio(weightsync.cpu_s, b.cpu_s)),
        weightsync,
        baseline,
        outputs_identical,
        largest_slice_bytes,
        met,
    })
}

/// Plans the case here and encodes every trainer's slice: the largest, in bytes.
fn largest_slice(case: &Case) -> anyhow::Result<u64> {
    let setup = Setup::new(&case.model, &case.train, &case.infer, &case.dtype);
    let table = setup.plan(&CostModel::default())?;
    let mut largest = 0u64;
    for r in 0..table.trainers.len() as u32 {
        largest = largest.max(table.slice(r)?.to_bincode().len() as u64);
    }
    Ok(largest)
}

/// The median of `xs` (the mean of the middle two for an even count; 0 for none).
pub(crate) fn median(xs: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = xs.collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The 1-minute load average (Linux), if readable.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

impl Report {
    /// The readable form.
    pub fn human(&self) -> String {
        let mut s = format!(
            "plan: whole `weightsync plan --json` processes, {} timed runs per binary and case \
             (load {} -> {}, {} cores)\n",
            self.runs,
            self.load_before.map_or("?".into(), |l| format!("{l:.2}")),
            self.load_after.map_or("?".into(), |l| format!("{l:.2}")),
            self.cores
        );
        let mb = |b: u64| format!("{:.0} MB", b as f64 / 1e6);
        let yes = |m: Option<bool>| match m {
            Some(true) => " (met)",
            Some(false) => " (NOT met)",
            None => "",
        };
        for c in &self.cases {
            let k = &c.case;
            s += &format!(
                "{}: {} {} -> {} {}\n",
                k.name, k.model, k.train, k.infer, k.dtype
            );
            let goals = format!(
                "{}{}",
                k.goal_wall_s
                    .map_or(String::new(), |g| format!(" goal < {g} s")),
                k.goal_rss_bytes
                    .map_or(String::new(), |g| format!(", < {}", mb(g)))
            );
            s += &format!(
                "  weightsync  wall {:.3} s{}  cpu {:.3} s (sys {:.3})  peak {}{}{}\n",
                c.weightsync.wall_s,
                yes(c.met.wall),
                c.weightsync.cpu_s,
                c.weightsync.sys_s,
                mb(c.weightsync.peak_rss_bytes),
                yes(c.met.rss),
                goals
            );
            if let Some(b) = &c.baseline {
                s += &format!(
                    "  baseline    wall {:.3} s  cpu {:.3} s (sys {:.3})  peak {}  ({})\n",
                    b.wall_s,
                    b.cpu_s,
                    b.sys_s,
                    mb(b.peak_rss_bytes),
                    b.exe
                );
                s += &format!(
                    "  wall_vs_baseline {:.2}  cpu_vs_baseline {:.2}  outputs identical: {}\n",
                    c.wall_vs_baseline.unwrap_or(f64::NAN),
                    c.cpu_vs_baseline.unwrap_or(f64::NAN),
                    c.outputs_identical.unwrap_or(false)
                );
            }
            if let Some(sl) = c.largest_slice_bytes {
                s += &format!(
                    "  largest trainer slice {:.2} MB{}\n",
                    sl as f64 / 1e6,
                    yes(c.met.slice)
                );
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use weightsync_schedules::{InferSpec, TrainSpec};

    #[test]
    fn the_named_cases_are_the_issues_and_others_are_refused() {
        let a = Case::named("anchor").expect("anchor");
        assert_eq!(
            (a.train.as_str(), a.infer.as_str(), a.dtype.as_str()),
            ("pp=2,ep=8,fsdp=16", "tp=8,ep=32,dp=4", "fp8")
        );
        assert_eq!(a.goal_wall_s, Some(0.5));
        let big = Case::named("10240").expect("10240");
        let train: TrainSpec = big.train.parse().expect("train spec");
        let infer: InferSpec = big.infer.parse().expect("infer spec");
        // 8,192 training ranks; 64 engines of 32 ranks (ep 32 over tp 8 within an engine).
        let engine = infer.tp.max(infer.ep);
        assert_eq!(train.world().expect("world") + engine * infer.dp, 10_240);
        let e = Case::named("huge").expect_err("unknown");
        assert!(format!("{e}").contains("huge"), "{e}");
    }

    #[test]
    fn medians_of_odd_and_even_counts() {
        assert_eq!(median([3.0, 1.0, 2.0].into_iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 2.0, 3.0].into_iter()), 2.5);
        assert_eq!(median(std::iter::empty()), 0.0);
    }

    #[test]
    fn a_missing_baseline_is_refused_before_anything_runs() {
        let cfg = Config {
            exe: Program::new("/bin/true"),
            baseline: Some(Program::new("/nonexistent/weightsync-main")),
            cases: vec![Case::custom("qwen3-0.6b", "fsdp=2", "tp=1", "bf16")],
            runs: 1,
            slices: false,
        };
        let e = run(&cfg).expect_err("no baseline");
        assert!(
            format!("{e}").contains("/nonexistent/weightsync-main"),
            "{e}"
        );
    }
}
