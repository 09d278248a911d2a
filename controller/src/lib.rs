//! weightsync-controller: registration, planning, the HTTP trigger, the barrier, the dashboard
//! and metrics; and the command modules behind the `weightsync` binary.
//!
//! # Layout
//! - [`cmd`]: one module per `weightsync` subcommand; `main.rs` is only the clap front.

pub mod cmd;
