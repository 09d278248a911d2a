//! weightsync-common: what every weightsync process shares.
//!
//! # Layout
//! - [`dtype`]: element types of weights on both sides of a sync.
//! - [`fabric`]: one API for one-sided RDMA-style WRITE with 32-bit immediates, with a TCP backend
//!   that runs anywhere and an ibverbs backend (feature `rdma`).
//! - [`protocol`]: the control-channel messages between workers and the controller, and their
//!   length-prefixed bincode framing.
#![deny(missing_docs)]

pub mod dtype;
pub mod fabric;
pub mod protocol;

pub use dtype::DType;
