//! `weightsync bench ...`: whole-system benchmarks, each beside its baseline in the same run.

use weightsync_common::program::Program;

/// Arguments of `weightsync bench`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub which: Which,
}

/// Which benchmark to run.
#[derive(Debug, clap::Subcommand)]
pub enum Which {
    /// Fabric: one-sided writes between two processes on loopback, beside one TCP stream and
    /// memcpy (4 KiB to 64 MiB blocks, 1, 2 and 4 lanes).
    Fabric {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// A short smoke run (fewer bytes, one repetition).
        #[arg(long)]
        quick: bool,
        /// Block sizes in bytes (comma-separated; default 4 KiB, 64 KiB, 1 MiB, 64 MiB).
        #[arg(long, value_delimiter = ',')]
        blocks: Vec<usize>,
        /// Rounds of the whole interleaved measurement (1 to 20): each row reports its median
        /// round, and its ratio the median of the rounds' ratios.
        #[arg(long, default_value_t = 1)]
        rounds: usize,
        /// Internal: run as the receiving peer process.
        #[arg(long, hide = true)]
        peer: bool,
    },
    /// Trainer pipeline: stages overlapped vs serialised, same tasks, loopback TCP fabric.
    Pipeline {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Number of weight matrices (tasks): a mix of f32->fp8, f32->bf16 and bf16 copies,
        /// calibrated so the three stages take similar time.
        #[arg(long, default_value_t = 16)]
        tasks: u32,
        /// Rows of each matrix.
        #[arg(long, default_value_t = 1024)]
        rows: u32,
        /// Columns of each matrix.
        #[arg(long, default_value_t = 2048)]
        cols: u32,
        /// Staging watermark, MiB.
        #[arg(long, default_value_t = 64)]
        watermark_mib: u64,
        /// Staging per piece, MiB.
        #[arg(long, default_value_t = 4)]
        piece_mib: u64,
        /// Fabric lanes per peer.
        #[arg(long, default_value_t = 2)]
        lanes: usize,
        /// Timed repetitions per mode (median reported).
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Run the prepare kernel on every rayon thread.
        #[arg(long)]
        prepare_all_threads: bool,
    },
    /// End to end on loopback: N trainers to M rollouts with a real model's shapes, beside the
    /// plain-TCP limit and the broadcast baseline run through the same fabric.
    E2e {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Model preset.
        #[arg(long, default_value = "qwen3-0.6b")]
        model: String,
        /// Training layout.
        #[arg(long, default_value = "fsdp=4")]
        train: String,
        /// Inference layout.
        #[arg(long, default_value = "tp=2,dp=2")]
        infer: String,
        /// Inference weight format.
        #[arg(long, default_value = "fp8")]
        dtype: String,
        /// Timed syncs per method (median reported).
        #[arg(long, default_value_t = 3)]
        syncs: usize,
        /// Staging watermark per trainer, MiB.
        #[arg(long, default_value_t = 256)]
        watermark_mib: u64,
        /// Fabric lanes per peer.
        #[arg(long, default_value_t = 2)]
        lanes: usize,
        /// Local addresses (NICs) per worker: 127.0.0.1, 127.0.0.2, ...; lanes stripe over them
        /// and the report counts the bytes each carried. Needs at least as many lanes.
        #[arg(long, default_value_t = 1)]
        addresses: usize,
        /// Bucket size of the broadcast baseline, MiB.
        #[arg(long, default_value_t = 64)]
        bucket_mib: u64,
        /// Trainers compute checksums of what they write.
        #[arg(long)]
        verify: bool,
        /// Trainers hand the pipeline a plain arena of weights (the sidecar's path: everything
        /// staged) instead of registering them with the fabric as the Python package does
        /// (same-dtype copies of contiguous boxes written straight from the weights).
        #[arg(long)]
        staged_sources: bool,
        /// Delta syncs beside full ones instead: the fractions of weights changed before each
        /// delta sync (e.g. `0.01,0.1,0.5`), over sockets and same-host pulls.
        #[arg(long, value_delimiter = ',')]
        changed: Vec<f64>,
    },
    /// Planning as a whole process (`weightsync plan --json`, one fresh process per run): wall,
    /// CPU and peak RSS beside a baseline binary run alternately, against the planning goals.
    Plan {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Timed runs per binary and case (median reported), after one warm-up each.
        #[arg(long, default_value_t = 5)]
        runs: usize,
        /// Another `weightsync` binary to compare with (e.g. the previous commit's build),
        /// run alternately with this one; their JSON outputs are compared too.
        #[arg(long)]
        baseline: Option<std::path::PathBuf>,
        /// Named cases (comma-separated): `anchor` (Kimi-K2 256 -> 128 GPUs fp8), `10240`
        /// (Kimi-K2 on 10,240 GPUs). Ignored with --model.
        #[arg(long, value_delimiter = ',', default_value = "anchor,10240")]
        cases: Vec<String>,
        /// One case of your own instead (with --train, --infer, --dtype; no goals).
        #[arg(long)]
        model: Option<String>,
        /// Training layout of the --model case.
        #[arg(long, default_value = "fsdp=8")]
        train: String,
        /// Inference layout of the --model case.
        #[arg(long, default_value = "tp=8")]
        infer: String,
        /// Inference weight format of the --model case.
        #[arg(long, default_value = "bf16")]
        dtype: String,
        /// Skip measuring the largest trainer slice (planned once more in this process).
        #[arg(long)]
        no_slices: bool,
    },
    /// The controller under N simulated workers that register and heartbeat: `/healthz`
    /// latency (p50, p99, max) loaded beside idle, resident memory, registration time.
    Controller {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Simulated workers (half trainers, half rollouts).
        #[arg(long, default_value_t = 2000)]
        workers: u32,
        /// Seconds of heartbeats measured once all are registered.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    /// Preparation kernels (gather, casts, fp8 block quantisation) beside memcpy.
    Prepare {
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// Input size of each kernel, in MiB.
        #[arg(long, default_value_t = 64)]
        mib: usize,
        /// Timed repetitions per figure (the best is kept).
        #[arg(long, default_value_t = 5)]
        reps: usize,
    },
}

/// Runs `weightsync bench ...`.
pub fn run(args: Args) -> anyhow::Result<()> {
    match args.which {
        Which::Fabric { peer: true, .. } => weightsync_benches::fabric::run_peer(),
        Which::Fabric {
            json,
            quick,
            blocks,
            rounds,
            ..
        } => {
            let cfg = weightsync_benches::fabric::Config {
                quick,
                blocks,
                rounds,
            };
            let report = weightsync_benches::fabric::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
        Which::Pipeline {
            json,
            tasks,
            rows,
            cols,
            watermark_mib,
            piece_mib,
            lanes,
            reps,
            prepare_all_threads,
        } => {
            let cfg = weightsync_benches::pipeline::Config {
                tasks,
                rows,
                cols,
                watermark_mib,
                piece_mib,
                lanes,
                reps,
                prepare_all_threads,
            };
            let report = weightsync_benches::pipeline::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
        Which::E2e {
            json,
            model,
            train,
            infer,
            dtype,
            syncs,
            watermark_mib,
            lanes,
            addresses,
            bucket_mib,
            verify,
            staged_sources,
            changed,
        } => {
            use weightsync_benches::e2e;
            let cfg = e2e::Config {
                setup: e2e::Setup::new(&model, &train, &infer, &dtype),
                syncs,
                workers: e2e::WorkerOptions {
                    watermark_bytes: watermark_mib << 20,
                    lanes_per_peer: lanes,
                    addresses,
                    verify,
                    registered_sources: !staged_sources,
                    ..Default::default()
                },
                bucket_bytes: bucket_mib << 20,
            };
            if !changed.is_empty() {
                let report = e2e::delta::run(&cfg, &changed)?;
                if json {
                    println!("{}", serde_json::to_string(&report)?);
                } else {
                    print!("{}", report.human());
                }
                return Ok(());
            }
            let report = e2e::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
        Which::Plan {
            json,
            runs,
            baseline,
            cases,
            model,
            train,
            infer,
            dtype,
            no_slices,
        } => {
            use weightsync_benches::plan;
            let cases = match model {
                Some(m) => vec![plan::Case::custom(&m, &train, &infer, &dtype)],
                None => cases
                    .iter()
                    .map(|c| plan::Case::named(c.trim()))
                    .collect::<anyhow::Result<_>>()?,
            };
            let cfg = plan::Config {
                exe: Program::this()
                    .map_err(|e| anyhow::anyhow!("locating the weightsync binary: {e}"))?,
                baseline: baseline.map(Program::new),
                cases,
                runs,
                slices: !no_slices,
            };
            let report = plan::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
        Which::Controller {
            json,
            workers,
            seconds,
        } => {
            use weightsync_benches::controller_load;
            let cfg = controller_load::Config {
                exe: Program::this()
                    .map_err(|e| anyhow::anyhow!("locating the weightsync binary: {e}"))?,
                workers,
                seconds,
            };
            let report = controller_load::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
        Which::Prepare { json, mib, reps } => {
            let cfg = weightsync_benches::prepare::Config {
                input_mib: mib,
                reps,
            };
            let report = weightsync_benches::prepare::run(&cfg)?;
            if json {
                println!("{}", serde_json::to_string(&report)?);
            } else {
                print!("{}", report.human());
            }
            Ok(())
        }
    }
}
