//! Runs only weightsync's loopback syncs, without the baselines `bench e2e` runs beside them,
//! so a profiler sees the sync and its set-up and nothing else:
//!
//! ```text
//! cargo build --release -p weightsync-benches --example sync_only
//! perf record -g target/release/examples/sync_only qwen3-0.6b fsdp=4 tp=2,dp=2 fp8 10 [staged]
//! ```
//!
//! Arguments (all optional, in order): model preset, training layout, inference layout, dtype,
//! timed syncs, and `staged` for the sidecar's all-staged sources.

use weightsync_benches::e2e::{LoopbackCluster, Setup, WorkerOptions};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let (setup, syncs) = Setup::from_example_args(&args)?;
    let staged = match args.get(6).map_or("registered", String::as_str) {
        "staged" => true,
        "registered" => false,
        other => anyhow::bail!("sources must be `staged` or `registered`, not {other:?}"),
    };
    let table = setup.plan(&weightsync_schedules::CostModel::default())?;
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let opts = WorkerOptions {
            registered_sources: !staged,
            ..Default::default()
        };
        let mut cluster = LoopbackCluster::start(&table, &opts).await?;
        cluster.sync().await?;
        let mut times = Vec::with_capacity(syncs);
        for _ in 0..syncs {
            times.push(cluster.sync().await?.seconds);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{}: {syncs} syncs, median {:.3} s",
            setup.label(),
            times.get(syncs / 2).copied().unwrap_or(0.0)
        );
        anyhow::Ok(())
    })
}
