//! Host memory handed to the worker: the arena as an owned buffer.
//!
//! The owner (an in-process trainer, a test, a bench) may rewrite it between syncs through
//! [`HostSource::as_mut_slice`]; the borrow checker keeps that out of a running sync, which
//! only ever holds a shared borrow.

/// An owned host arena.
#[derive(Debug, Clone, Default)]
pub struct HostSource {
    bytes: Vec<u8>,
}

impl HostSource {
    /// Takes ownership of `bytes` as the arena.
    pub fn new(bytes: Vec<u8>) -> HostSource {
        HostSource { bytes }
    }
    /// The arena.
    pub fn as_slice(&self) -> &[u8] {
        &self.bytes
    }
    /// The arena, for the owner to write new weights between syncs.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes
    }
    /// Gives the buffer back.
    pub fn into_inner(self) -> Vec<u8> {
        self.bytes
    }
}
