//! weightsync-common: what every weightsync process shares.
//!
//! # Layout
//! - [`dtype`]: element types of weights on both sides of a sync.
//! - [`fp8_recipe`]: which engine's arithmetic an fp8 block quantisation follows.
//! - [`fabric`]: one API for one-sided RDMA-style WRITE with 32-bit immediates, with a TCP backend
//!   that runs anywhere and an ibverbs backend (feature `rdma`).
//! - [`program`]: how this process starts another copy of itself (the binary, or Python's
//!   `-m weightsync`).
//! - [`protocol`]: the control-channel messages between workers and the controller, and their
//!   length-prefixed bincode framing.
//! - [`secret`]: the [`secret::Secret`] type (never printed) and reading secrets from env or file.
//! - [`tls`]: mutual TLS (rustls) for the control channel and the HTTP API, from PEM files.
//! - [`open_files`]: raising the open-file limit at start (every connection is a descriptor).
#![deny(missing_docs)]

pub mod dtype;
pub mod fabric;
pub mod fp8_recipe;
pub mod open_files;
pub mod program;
pub mod protocol;
pub mod secret;
pub mod tls;

pub use dtype::DType;
pub use fp8_recipe::Fp8Recipe;
