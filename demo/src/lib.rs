//! weightsync-demo: what `weightsync demo` adds to a real job, outside the sync.
//!
//! A demo has no training job and no inference engine, so it brings two things of its own:
//! weights that change every version as an optimizer step would change them, and a check that
//! trusts no part of weightsync's path (routing table, pipeline, gathers, staging, fabric): each
//! rollout recomputes every byte it must hold from the seed and compares it with what landed.
//!
//! Both wrap the agent's production drivers ([`weightsync_agent::trainer::TrainerDriver`],
//! [`weightsync_agent::rollout::RolloutDriver`]) instead of living inside them: the agent is
//! what engines embed, and a sync's own stages stay weightsync's. The trainer writes the next
//! version's weights right after a commit (the training step between two pushes), the rollout
//! checks a committed version right after its commit, and both say what they did and how long
//! it took in a [`progress`] file the demo reads; so the sync the controller times is the sync
//! alone. (`weightsync worker --demo-check-seed` without a progress file checks before the
//! version commits instead, as the process tests want.)
//!
//! A crate of its own, not a module of the CLI: the CLI is a binary, and the engine tests check
//! the in-process path against the same reference (`weights::expected_rollout`).
//!
//! # Layout
//! - [`weights`]: the deterministic weights and the scalar reference of every rollout's bytes.
//! - [`check`]: [`check::DemoCheck`] (every landed byte recomputed, in parallel, streamed
//!   piece by piece) and [`check::CheckedRollout`], the rollout driver wrapped with it.
//! - [`source`]: [`source::DemoSource`] (the weights as a trainer's source) and
//!   [`source::DemoTrainer`], the trainer driver wrapped with the training step.
//! - [`progress`]: the lines the wrapped drivers append for the demo to read.
#![deny(missing_docs)]

pub mod check;
pub mod progress;
pub mod source;
pub mod weights;
