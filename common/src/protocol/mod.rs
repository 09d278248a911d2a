//! The control channel between workers and the controller.
//!
//! Bulk bytes never travel here: they go over the fabric as one-sided writes. The control channel
//! carries only what decides *which* bytes move and *whether* a version may be used: who is in the
//! world (registration), what each worker must do (assignment), and the version protocol
//! (prepare N, start N, landed N, commit N, abort N), plus heartbeats and failure reports that name
//! the worker and the tensor.
//!
//! Why a persistent TCP stream with bincode frames rather than HTTP: the controller must notice a
//! silent worker within a timeout while a sync runs, and must push "N is not valid" to every
//! rollout the moment a sync fails. One long-lived, authenticated connection per worker gives both.
//!
//! # Layout
//! - [`messages`]: the message types, both directions.
//! - [`failure`]: the kind of a failure ([`FailureKind`]) and a worker's own report of it
//!   ([`Fault`]), which the controller turns into a [`Failure`] naming the worker.
//! - [`report`]: what a worker reports of a sync (stages, spans, checksums, the time split),
//!   carried by one message and stored, drawn and printed elsewhere.
//! - [`frame`]: length-prefixed frames (magic, protocol version, length, bincode body) with a
//!   maximum size, so decoding garbage is an error and never an unbounded allocation.
//! - [`delta`]: what a delta sync's halves tell each other: where each run's encoding lies in
//!   an engine's inbox ([`DeltaRecord`]), and what the deltas came to ([`DeltaFigures`]).
//! - [`auth`]: the job-token challenge: a worker proves it knows the token without sending it.

pub mod auth;
pub mod delta;
pub mod failure;
pub mod frame;
pub mod messages;
pub mod report;

pub use delta::{DeltaBase, DeltaFigures, DeltaKind, DeltaRecord};
pub use failure::{FailureKind, Fault};
pub use frame::{
    ControlFrameError, ControlFrameHeader, DEFAULT_MAX_FRAME, FRAME_HEADER_LEN, MAGIC,
    PREAUTH_MAX_FRAME, PROTOCOL_VERSION, decode_body, decode_frame, encode_frame, read_frame,
    write_frame,
};
pub use messages::*;
pub use report::*;
