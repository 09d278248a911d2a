//! The watermark: a byte budget that bounds the staging memory in flight during a sync.
//!
//! A trainer GPU has little memory to spare beside its training state, so the pipeline may not
//! stage a whole model version at once. The staging arena is allocated and registered once, with
//! exactly `watermark` bytes, and every task piece borrows a contiguous range of it for its whole
//! life (H2D input, prepared output, until its writes completed). A piece starts only when its
//! range fits; when every range is taken the scheduler waits for a piece to finish. So the bytes
//! in flight can never exceed the watermark, by construction; [`Watermark::peak`] measures what
//! was actually used, so tests and benches can show it.
//!
//! The allocator is first-fit over a free list of ranges kept merged; ranges come back in any
//! order (writes complete out of order). A request no larger than the capacity always succeeds
//! eventually, because once every lease is returned the whole arena is one free range. A request
//! larger than the capacity is refused at once ([`WatermarkError::TooLarge`]); the planner side of
//! the pipeline splits tasks so that this never happens, and refuses a watermark below one task's
//! smallest piece before anything is written.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Every lease starts on a multiple of this (so f32 and vector loads stay aligned).
pub const LEASE_ALIGN: u64 = 64;

/// Rounds `len` up to [`LEASE_ALIGN`].
pub const fn aligned(len: u64) -> u64 {
    len.div_ceil(LEASE_ALIGN) * LEASE_ALIGN
}

/// Why a lease was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WatermarkError {
    /// The request can never fit.
    #[error("staging request of {len} bytes exceeds the watermark of {capacity} bytes")]
    TooLarge {
        /// Bytes asked for (aligned).
        len: u64,
        /// The watermark.
        capacity: u64,
    },
}

#[derive(Debug)]
struct State {
    /// Free ranges: offset -> length, never adjacent (merged on release).
    free: BTreeMap<u64, u64>,
    in_flight: u64,
    peak: u64,
    leases: u64,
}

/// The byte budget and first-fit allocator over `[0, capacity)`.
#[derive(Debug)]
pub struct Watermark {
    capacity: u64,
    state: Mutex<State>,
    released: Notify,
}

/// A contiguous range of the staging arena, returned on drop.
#[derive(Debug)]
pub struct Lease {
    owner: Arc<Watermark>,
    offset: u64,
    len: u64,
}

impl Lease {
    /// Offset of the range in the arena.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the range (aligned up to [`LEASE_ALIGN`]).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the lease was handed out by `watermark`.
    pub fn is_from(&self, watermark: &Arc<Watermark>) -> bool {
        Arc::ptr_eq(&self.owner, watermark)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.owner.release(self.offset, self.len);
    }
}

impl Watermark {
    /// A budget of `capacity` bytes (the staging arena's size).
    pub fn new(capacity: u64) -> Arc<Watermark> {
        let mut free = BTreeMap::new();
        if capacity > 0 {
            free.insert(0, capacity);
        }
        Arc::new(Watermark {
            capacity,
            state: Mutex::new(State {
                free,
                in_flight: 0,
                peak: 0,
                leases: 0,
            }),
            released: Notify::new(),
        })
    }

    /// The budget in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes leased right now.
    pub fn in_flight(&self) -> u64 {
        self.state.lock().in_flight
    }

    /// The most bytes leased at once since creation (or the last [`reset_peak`](Self::reset_peak)).
    pub fn peak(&self) -> u64 {
        self.state.lock().peak
    }

    /// Number of leases handed out since creation.
    pub fn leases(&self) -> u64 {
        self.state.lock().leases
    }

    /// Starts measuring the peak afresh (e.g. at the start of a sync).
    pub fn reset_peak(&self) {
        let mut st = self.state.lock();
        st.peak = st.in_flight;
    }

    /// Leases `len` bytes (rounded up to [`LEASE_ALIGN`]) if a contiguous range is free now.
    pub fn try_acquire(self: &Arc<Self>, len: u64) -> Result<Option<Lease>, WatermarkError> {
        let len = aligned(len.max(1));
        if len > self.capacity {
            return Err(WatermarkError::TooLarge {
                len,
                capacity: self.capacity,
            });
        }
        let mut st = self.state.lock();
        let found = st
            .free
            .iter()
            .find(|&(_, &free_len)| free_len >= len)
            .map(|(&off, &free_len)| (off, free_len));
        let Some((off, free_len)) = found else {
            return Ok(None);
        };
        st.free.remove(&off);
        if free_len > len {
            st.free.insert(off + len, free_len - len);
        }
        st.in_flight += len;
        st.peak = st.peak.max(st.in_flight);
        st.leases += 1;
        Ok(Some(Lease {
            owner: self.clone(),
            offset: off,
            len,
        }))
    }

    /// Leases `len` bytes, waiting until a contiguous range is free.
    pub async fn acquire(self: &Arc<Self>, len: u64) -> Result<Lease, WatermarkError> {
        loop {
            let released = self.released.notified();
            tokio::pin!(released);
            // Register interest before checking, so a release between the check and the await
            // is not missed.
            released.as_mut().enable();
            if let Some(lease) = self.try_acquire(len)? {
                return Ok(lease);
            }
            released.await;
        }
    }

    fn release(&self, offset: u64, len: u64) {
        {
            let mut st = self.state.lock();
            st.in_flight -= len;
            let mut start = offset;
            let mut end = offset + len;
            // Merge with the free range just before.
            if let Some((&prev_off, &prev_len)) = st.free.range(..offset).next_back()
                && prev_off + prev_len == offset
            {
                st.free.remove(&prev_off);
                start = prev_off;
            }
            // Merge with the free range just after.
            if let Some(&next_len) = st.free.get(&end) {
                st.free.remove(&end);
                end += next_len;
            }
            st.free.insert(start, end - start);
        }
        self.released.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_merges_on_release_in_any_order() {
        let w = Watermark::new(1024);
        let a = w.try_acquire(256).unwrap().unwrap();
        let b = w.try_acquire(256).unwrap().unwrap();
        let c = w.try_acquire(500).unwrap().unwrap();
        assert_eq!((a.offset(), b.offset(), c.offset()), (0, 256, 512));
        assert_eq!(c.len(), 512);
        assert!(w.try_acquire(1).unwrap().is_none());
        assert_eq!(w.peak(), 1024);
        drop(b);
        drop(a);
        // a and b merged: a 512-byte request fits at 0.
        let d = w.try_acquire(512).unwrap().unwrap();
        assert_eq!(d.offset(), 0);
        drop(c);
        drop(d);
        assert_eq!(w.in_flight(), 0);
        assert_eq!(w.try_acquire(1024).unwrap().unwrap().len(), 1024);
    }

    #[test]
    fn refuses_what_can_never_fit() {
        let w = Watermark::new(1000);
        let err = w.try_acquire(1000).unwrap_err();
        assert_eq!(
            err,
            WatermarkError::TooLarge {
                len: 1024,
                capacity: 1000
            }
        );
        assert!(err.to_string().contains("watermark"), "{err}");
    }

    #[tokio::test]
    async fn waits_for_a_release() {
        let w = Watermark::new(128);
        let a = w.acquire(128).await.unwrap();
        let w2 = w.clone();
        let waiter = tokio::spawn(async move { w2.acquire(64).await.map(|l| l.offset()) });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(a);
        assert_eq!(waiter.await.unwrap().unwrap(), 0);
        assert_eq!(w.peak(), 128);
    }
}
