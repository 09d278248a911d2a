//! `weightsync plan`: compute the static routing table for a model and two layouts, and print
//! what it moves (a readable table, with a progress bar while planning, or one JSON object with
//! `--json`). The planning itself is the pure `weightsync_schedules` library; this module only
//! reads files, draws the bar and formats.

use std::path::PathBuf;

use anyhow::Context;
use weightsync_schedules::{
    CostModel, ExpertForm, InferDType, InferSpec, InferenceLayout, Model, Summary, TrainSpec,
    TrainingLayout, plan_with_progress,
};

/// Arguments of `weightsync plan`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A preset (qwen3-0.6b, qwen3-8b, qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, kimi-k2) or
    /// the path of a Hugging Face config.json.
    #[arg(long)]
    pub model: String,
    /// Training layout, e.g. `pp=2,ep=8,fsdp=16` (keys pp, dp, ep, fsdp, tp, experts=stacked).
    #[arg(long, default_value = "fsdp=8")]
    pub train: String,
    /// Inference layout, e.g. `tp=8,ep=32,dp=4` (keys tp, ep, dp, dtype, format=fused|hf, embed=vocab).
    #[arg(long, default_value = "tp=8")]
    pub infer: String,
    /// Inference weight format: bf16 or fp8 (e4m3, 128x128 block scales).
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also write the routing table (bincode) to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// NIC bandwidth per GPU, Gb/s.
    #[arg(long, default_value_t = 400.0)]
    pub nic_gbps: f64,
    /// Cost of one work request, microseconds.
    #[arg(long, default_value_t = 0.5)]
    pub per_wr_us: f64,
    /// Host-to-device rate per GPU, GB/s.
    #[arg(long, default_value_t = 50.0)]
    pub h2d_gbs: f64,
    /// Preparation rate per GPU, GB/s of input.
    #[arg(long, default_value_t = 1000.0)]
    pub prep_gbs: f64,
}

impl Args {
    /// The cost model these arguments describe.
    pub fn cost_model(&self) -> CostModel {
        CostModel {
            nic_bytes_per_s: self.nic_gbps * 1e9 / 8.0,
            per_wr_s: self.per_wr_us * 1e-6,
            h2d_bytes_per_s: self.h2d_gbs * 1e9,
            prep_bytes_per_s: self.prep_gbs * 1e9,
            ..CostModel::default()
        }
    }
}

/// Loads a model from a preset name or a config.json path.
pub fn load_model(name_or_path: &str, experts: ExpertForm) -> anyhow::Result<Model> {
    let path = std::path::Path::new(name_or_path);
    if path.is_file() {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let name = path
            .parent()
            .and_then(|p| p.file_name())
            .or(path.file_stem())
            .map_or("model".to_string(), |s| s.to_string_lossy().into_owned());
        return Model::from_config_json(&name, &text, experts)
            .with_context(|| format!("parsing {}", path.display()));
    }
    Ok(Model::preset(name_or_path, experts)?)
}

/// Everything `plan` builds, for reuse by other commands.
#[derive(Debug)]
pub struct Planned {
    /// The routing table.
    pub table: weightsync_schedules::RoutingTable,
    /// Its figures.
    pub summary: Summary,
}

/// Parses the layouts and plans, with an optional progress callback.
pub fn build(args: &Args, progress: &mut dyn FnMut(u64, u64)) -> anyhow::Result<Planned> {
    let train: TrainSpec = args.train.parse()?;
    let mut infer: InferSpec = args.infer.parse()?;
    infer.dtype = args.dtype.parse::<InferDType>()?;
    let model = load_model(&args.model, train.experts)?;
    // The two layouts are independent: built at once.
    let (tl, il) = rayon::join(
        || TrainingLayout::build(&model, &train),
        || InferenceLayout::build(&model, &infer),
    );
    let (tl, il) = (tl?, il?);
    let cost = args.cost_model();
    let table = plan_with_progress(&model, &tl, &il, &cost, progress)?;
    let summary = Summary::of(&table, &cost);
    Ok(Planned { table, summary })
}

/// Runs `weightsync plan`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let planned = if args.json {
        build(&args, &mut |_, _| {})?
    } else {
        let bar = indicatif::ProgressBar::new(1);
        bar.set_style(
            indicatif::ProgressStyle::with_template("planning {bar:40} {percent:>3}% {elapsed}")
                .map_err(|e| anyhow::anyhow!("progress bar style: {e}"))?,
        );
        let p = build(&args, &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
        p?
    };
    if let Some(out) = &args.out {
        std::fs::write(out, planned.table.to_bincode())
            .with_context(|| format!("writing {}", out.display()))?;
    }
    let s = &planned.summary;
    if args.json {
        let mut v = serde_json::to_value(s)?;
        v["train"] = args.train.clone().into();
        v["infer"] = args.infer.clone().into();
        v["dtype"] = args.dtype.clone().into();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    print!("{}", format_table(s, &args));
    Ok(())
}

fn gb(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else if b >= 1e6 {
        format!("{:.2} MB", b / 1e6)
    } else {
        format!("{:.0} kB", b / 1e3)
    }
}

/// The readable form of a summary.
pub fn format_table(s: &Summary, args: &Args) -> String {
    let rows: Vec<(&str, String)> = vec![
        ("model", s.model.clone()),
        (
            "layouts",
            format!(
                "train {} ({} ranks) -> infer {} {} ({} ranks)",
                args.train, s.train_ranks, args.infer, args.dtype, s.infer_ranks
            ),
        ),
        (
            "parameters",
            format!("{} tensors, {:.3e} elements", s.params, s.elements as f64),
        ),
        ("bytes to move", gb(s.bytes_to_move as f64)),
        ("routes", s.routes.to_string()),
        ("tasks", s.tasks.to_string()),
        ("work requests", s.work_requests.to_string()),
        (
            "gather",
            format!(
                "{} in {} writes ({} local), largest arena {}",
                gb(s.gather_bytes as f64),
                s.gather_work_requests,
                gb(s.gather_local_bytes as f64),
                gb(s.max_gather_arena_bytes as f64)
            ),
        ),
        (
            "senders",
            format!(
                "{} NICs: max {} / mean {}, max {} / mean {:.0} WRs",
                s.sender.nics,
                gb(s.sender.max_bytes as f64),
                gb(s.sender.mean_bytes),
                s.sender.max_wrs,
                s.sender.mean_wrs
            ),
        ),
        (
            "receivers",
            format!(
                "{} NICs: max {} / mean {}, max {} / mean {:.0} WRs",
                s.receiver.nics,
                gb(s.receiver.max_bytes as f64),
                gb(s.receiver.mean_bytes),
                s.receiver.max_wrs,
                s.receiver.mean_wrs
            ),
        ),
        (
            "predicted",
            format!("{:.3} s ({})", s.predicted_s, s.bottleneck),
        ),
        ("bound", format!("{:.3} s", s.bound_s)),
    ];
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    rows.iter()
        .map(|(k, v)| format!("{k:>w$}  {v}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(json: bool) -> Args {
        Args {
            model: "qwen3-0.6b".into(),
            train: "fsdp=4".into(),
            infer: "tp=2,dp=2".into(),
            dtype: "fp8".into(),
            json,
            out: None,
            nic_gbps: 400.0,
            per_wr_us: 0.5,
            h2d_gbs: 50.0,
            prep_gbs: 1000.0,
        }
    }

    #[test]
    fn plans_a_small_model_and_formats_it() {
        let a = args(false);
        let p = build(&a, &mut |_, _| {}).unwrap();
        assert_eq!(p.summary.train_ranks, 4);
        assert_eq!(p.summary.infer_ranks, 4);
        let text = format_table(&p.summary, &a);
        assert!(
            text.contains("bytes to move") && text.contains("bound"),
            "{text}"
        );
    }

    #[test]
    fn bad_input_is_a_clear_error() {
        let mut a = args(true);
        a.infer = "tp=3".into();
        let e = format!("{:#}", build(&a, &mut |_, _| {}).unwrap_err());
        assert!(e.contains("num_attention_heads"), "{e}");
        a.model = "no-such-model".into();
        let e = format!("{:#}", build(&a, &mut |_, _| {}).unwrap_err());
        assert!(e.contains("no-such-model"), "{e}");
    }
}
