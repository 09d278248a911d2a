//! weightsync-schedules: the pure planner.
//!
//! `(model, training layout, inference layout, cost model) -> RoutingTable`, with no I/O and no
//! clock, so the same inputs always give the same (byte-identical) table and every rule the
//! table obeys can be checked by tests. Independent work runs on rayon's threads (the layouts'
//! ranks, the planner's params and trainers, the summary's trainers) and is put back together
//! in a fixed order, or summed, so the table does not depend on the number of threads or on
//! which thread did what (see [`planner`]).
//!
//! # Layout
//! - [`table`]: the output ([`RoutingTable`]) and the memory/execution contract with workers;
//!   [`compact`]: a trainer's tasks stored as shapes ([`compact::TaskPattern`]) and
//!   [`packed`] progressions; [`slice`]: one trainer's part ([`TrainerSlice`]) and the explicit
//!   plan it expands to; [`fanout`] reads an explicit plan's write copies back as writes.
//! - [`model`]: logical parameters from a Hugging Face config.json ([`model_config`] reads it,
//!   [`model_bounds`] bounds it); [`presets`] of public ones; [`declared`]: a model known only
//!   from what its workers declare (any architecture, `format=hf`), and [`declared_error`] what
//!   can be wrong with the declarations.
//! - [`layout_train`]: training layouts (`pp=2,ep=8,fsdp=16`) as shard lists.
//! - [`layout_infer`]: inference layouts (`tp=8,ep=32,dp=4`, bf16 or fp8) as engine tensors,
//!   in the engines' fused format or transformers' own (`format=hf`).
//! - [`planner`]: [`plan`] itself; [`balance`] spreads replicated data; [`runs`] merges writes.
//! - [`cost`]: the cost model; [`summary`]: the figures `weightsync plan` prints.
//! - [`job`]: what a job's statement (`WorldSpec`) means: its layouts, its plan, its size, one
//!   rollout's own tensors.
//! - [`error`]: [`PlanError`], what can go wrong.
//!
//! # Example
//! ```
//! use weightsync_schedules::*;
//! let model = Model::preset("qwen3-0.6b", ExpertForm::PerExpert).unwrap();
//! let train = TrainingLayout::build(&model, &"fsdp=4".parse().unwrap()).unwrap();
//! let infer = InferenceLayout::build(&model, &"tp=2,dp=2".parse().unwrap()).unwrap();
//! let table = plan(&model, &train, &infer, &CostModel::default()).unwrap();
//! let mine = table.slice(0).unwrap().expand().unwrap();
//! assert!(!mine.tasks.is_empty());
//! ```
#![deny(missing_docs)]

pub mod balance;
pub mod baseline;
pub mod compact;
pub mod cost;
pub mod declared;
pub mod declared_error;
pub mod error;
pub mod fanout;
pub mod job;
pub mod layout_infer;
pub mod layout_train;
pub mod model;
pub mod model_bounds;
pub mod model_config;
pub mod packed;
pub mod planner;
pub mod presets;
pub mod runs;
pub mod simulate;
pub mod slice;
pub mod summary;
pub mod synthetic;
pub mod table;

pub use cost::CostModel;
pub use error::PlanError;
pub use layout_infer::{
    EmbedLayout, EnginePeriod, InferDType, InferFormat, InferSpec, InferenceLayout,
};
pub use layout_train::{TrainSpec, TrainingLayout};
pub use model::{ExpertForm, Model};
pub use planner::{plan, plan_with_progress};
pub use slice::{ExpandLimits, TrainerSlice};
pub use summary::Summary;
pub use table::RoutingTable;
