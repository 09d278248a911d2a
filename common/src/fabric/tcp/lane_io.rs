//! What an inbound lane needs of its socket, as a trait, so that the receiver's frame state
//! machine (header checks, refusals, payload copies into registered memory, split writes,
//! completions) can also be driven from bytes in memory: the `receiver_frames` fuzz target and
//! its seed replay test run the very code a lane runs, without sockets or threads.
//!
//! [`LaneSocket`] is the real thing; [`ReplayIo`] serves a byte string in chunks of a chosen
//! size, as a socket would hand them out, and collects what the receiver answers.

use std::io;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use parking_lot::Mutex;

use super::socket::{IoFail, LaneSocket, Readiness};

/// The socket calls of an inbound lane.
pub(super) trait LaneIo {
    /// Receives up to `len` bytes into `ptr` without blocking.
    ///
    /// # Safety
    /// `ptr` must be valid for writes of `len` bytes for the duration of the call.
    unsafe fn recv_raw(&self, ptr: *mut u8, len: usize) -> io::Result<usize>;

    /// Receives into `first`, then `second`, in one call without blocking.
    ///
    /// # Safety
    /// Both ranges must be valid for writes of their lengths for the duration of the call.
    unsafe fn recv_two_raw(
        &self,
        first: (*mut u8, usize),
        second: (*mut u8, usize),
    ) -> io::Result<usize>;

    /// Waits until the socket is ready.
    fn wait(
        &self,
        what: Readiness,
        limit: Option<Duration>,
        stop: &AtomicBool,
    ) -> Result<(), IoFail>;

    /// Whether the writer reset the connection.
    fn reset_by_peer(&self) -> bool;

    /// Sets the wake threshold (`SO_RCVLOWAT`).
    fn set_rcvlowat(&self, bytes: usize) -> io::Result<()>;

    /// Reads exactly `buf.len()` bytes (see [`LaneSocket::read_exact`]).
    fn read_exact(
        &self,
        buf: &mut [u8],
        idle: Option<Duration>,
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<(), IoFail>;

    /// Writes all of `buf`.
    fn write_all(&self, buf: &[u8], timeout: Duration, stop: &AtomicBool) -> Result<(), IoFail>;
}

impl LaneIo for LaneSocket {
    unsafe fn recv_raw(&self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        // SAFETY: forwarded from the caller.
        unsafe { LaneSocket::recv_raw(self, ptr, len) }
    }

    unsafe fn recv_two_raw(
        &self,
        first: (*mut u8, usize),
        second: (*mut u8, usize),
    ) -> io::Result<usize> {
        // SAFETY: forwarded from the caller.
        unsafe { LaneSocket::recv_two_raw(self, first, second) }
    }

    fn wait(
        &self,
        what: Readiness,
        limit: Option<Duration>,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        LaneSocket::wait(self, what, limit, stop)
    }

    fn reset_by_peer(&self) -> bool {
        LaneSocket::reset_by_peer(self)
    }

    fn set_rcvlowat(&self, bytes: usize) -> io::Result<()> {
        LaneSocket::set_rcvlowat(self, bytes)
    }

    fn read_exact(
        &self,
        buf: &mut [u8],
        idle: Option<Duration>,
        timeout: Duration,
        stop: &AtomicBool,
    ) -> Result<(), IoFail> {
        LaneSocket::read_exact(self, buf, idle, timeout, stop)
    }

    fn write_all(&self, buf: &[u8], timeout: Duration, stop: &AtomicBool) -> Result<(), IoFail> {
        LaneSocket::write_all(self, buf, timeout, stop)
    }
}

/// A lane's bytes from memory: `input` handed out at most `chunk` bytes per receive call, then
/// end of stream; whatever the receiver sends is kept.
#[derive(Debug)]
pub(super) struct ReplayIo<'a> {
    input: Mutex<&'a [u8]>,
    chunk: usize,
    /// Bytes the receiver sent back (encoded completions).
    pub sent: Mutex<Vec<u8>>,
}

impl<'a> ReplayIo<'a> {
    /// Serves `input` in receives of at most `chunk` bytes (at least 1).
    pub fn new(input: &'a [u8], chunk: usize) -> Self {
        ReplayIo {
            input: Mutex::new(input),
            chunk: chunk.max(1),
            sent: Mutex::new(Vec::new()),
        }
    }

    /// Takes up to `len` bytes off the front of the input.
    fn take(&self, len: usize) -> &'a [u8] {
        let mut input = self.input.lock();
        let n = len.min(self.chunk).min(input.len());
        let (head, rest) = input.split_at(n);
        *input = rest;
        head
    }
}

impl LaneIo for ReplayIo<'_> {
    unsafe fn recv_raw(&self, ptr: *mut u8, len: usize) -> io::Result<usize> {
        let got = self.take(len);
        // SAFETY: the caller guarantees ptr is writable for len bytes, got.len() <= len, and
        // the input is a separate borrowed slice.
        unsafe { std::ptr::copy_nonoverlapping(got.as_ptr(), ptr, got.len()) };
        Ok(got.len())
    }

    unsafe fn recv_two_raw(
        &self,
        first: (*mut u8, usize),
        second: (*mut u8, usize),
    ) -> io::Result<usize> {
        // SAFETY: forwarded from the caller, range by range.
        let a = unsafe { self.recv_raw(first.0, first.1) }?;
        if a < first.1 {
            return Ok(a);
        }
        // SAFETY: as above.
        let b = unsafe { self.recv_raw(second.0, second.1) }?;
        Ok(a + b)
    }

    fn wait(&self, _: Readiness, _: Option<Duration>, _: &AtomicBool) -> Result<(), IoFail> {
        // Never asked: a receive never reports WouldBlock here.
        Ok(())
    }

    fn reset_by_peer(&self) -> bool {
        false
    }

    fn set_rcvlowat(&self, _: usize) -> io::Result<()> {
        Ok(())
    }

    fn read_exact(
        &self,
        buf: &mut [u8],
        _: Option<Duration>,
        _: Duration,
        _: &AtomicBool,
    ) -> Result<(), IoFail> {
        let mut done = 0;
        while done < buf.len() {
            let got = self.take(buf.len() - done);
            if got.is_empty() {
                return Err(if done == 0 {
                    IoFail::Closed
                } else {
                    IoFail::Eof
                });
            }
            buf[done..done + got.len()].copy_from_slice(got);
            done += got.len();
        }
        Ok(())
    }

    fn write_all(&self, buf: &[u8], _: Duration, _: &AtomicBool) -> Result<(), IoFail> {
        self.sent.lock().extend_from_slice(buf);
        Ok(())
    }
}
