//! One module per `weightsync` subcommand. Each owns its clap `Args` and a `run` function;
//! `lib.rs` only dispatches.

pub mod bench;
pub mod controller;
pub mod demo;
pub mod plan;
pub mod simulate;
pub mod worker;
