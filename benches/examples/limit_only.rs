//! Runs only `bench e2e`'s fabric limit for a job's (trainer, rollout) bytes: the fabric alone
//! moving what a sync moves, in large blocks, so that a profiler can set it beside
//! `sync_only`'s profile of the same job (same kernel copy, same page types: where the two
//! differ per byte is what the pipeline adds to its wire):
//!
//! ```text
//! cargo build --release -p weightsync-benches --example limit_only --example sync_only
//! perf record target/release/examples/limit_only qwen3-0.6b fsdp=4 tp=1,dp=4 bf16 20
//! perf record target/release/examples/sync_only qwen3-0.6b fsdp=4 tp=1,dp=4 bf16 20
//! ```
//!
//! Arguments: `sync_only`'s first five (`Setup::from_example_args`), the count being timed
//! passes. Two lanes per peer, same-host pulls on (the bench's defaults).

use std::collections::BTreeMap;

use weightsync_benches::e2e::Setup;
use weightsync_common::fabric::{FabricConfig, limit::FabricLimit};
use weightsync_schedules::table::WriteTarget;

fn main() -> anyhow::Result<()> {
    let (setup, passes) = Setup::from_example_args(&std::env::args().collect::<Vec<_>>())?;
    let table = setup.plan(&weightsync_schedules::CostModel::default())?;
    let mut bytes: BTreeMap<(u32, u32), u64> = BTreeMap::new();
    for t in 0..table.trainers.len() as u32 {
        for w in &table.trainer_plan(t)?.writes {
            if let WriteTarget::Rollout(r) = w.dst {
                *bytes.entry((t, r)).or_default() += u64::from(w.len);
            }
        }
    }
    let pairs: Vec<(u32, u32, u64)> = bytes.into_iter().map(|((t, r), b)| (t, r, b)).collect();
    let moved: u64 = pairs.iter().map(|p| p.2).sum();
    let rt = tokio::runtime::Runtime::new()?;
    rt.block_on(async {
        let limit = FabricLimit::start(&pairs, &FabricConfig::loopback("limit-only", 2)).await?;
        limit.sync().await?;
        let mut times = Vec::with_capacity(passes);
        for _ in 0..passes {
            times.push(limit.sync().await?);
        }
        times.sort_by(f64::total_cmp);
        let median = times.get(passes / 2).copied().unwrap_or(f64::NAN);
        println!(
            "{}: fabric limit, {passes} passes, median {median:.3} s, {:.2} GB/s",
            setup.label(),
            moved as f64 / median / 1e9
        );
        anyhow::Ok(())
    })
}
