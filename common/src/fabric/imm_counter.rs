//! Counting 32-bit immediates: how a receiver learns that writes have landed.
//!
//! One-sided writes give the receiver no per-write notification except the immediate a
//! WRITE_WITH_IMM carries. As in fabric-lib's TransferEngine, the receiver does not care about the
//! order of arrivals (writes are spread over several lanes, and lanes do not order among
//! themselves); it only asks "have `n` writes carrying immediate `imm` fully landed?". So the
//! counter is a map `imm -> arrivals`, and [`ImmCounter::expect`] is a future that resolves once
//! the count reaches `n`, consuming `n` arrivals.
//!
//! Arrivals that come before anyone expects them are kept (a writer may be faster than the
//! receiver's bookkeeping) and count toward a later expectation of the same immediate. A
//! cancelled immediate is *retired*: its pending expectation fails, arrivals already kept and any
//! later ones go to a separate stray count, and a new `expect` of it fails with
//! [`FabricError::ImmRetired`]: late writes of an abandoned round can never satisfy a later
//! round. Callers therefore put a round number (version) into the immediate.
//!
//! Backends call [`ImmCounter::record_arrival`] only after the whole payload is in memory, and
//! [`ImmCounter::record_torn`] for a write whose payload did not fully land (for diagnosis only;
//! it never counts).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;

use super::error::{FabricError, Result};

/// Counters for metrics and diagnosis.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImmStats {
    /// Arrivals recorded in total (including strays).
    pub arrived: u64,
    /// Arrivals consumed by resolved expectations.
    pub claimed: u64,
    /// Arrivals kept, waiting for an expectation.
    pub unclaimed: u64,
    /// Arrivals for retired (cancelled) immediates.
    pub stray_after_cancel: u64,
    /// Writes carrying an immediate whose payload did not fully land (never counted).
    pub torn: u64,
    /// Expectations currently pending.
    pub pending_expectations: usize,
}

#[derive(Debug, Default)]
struct Entry {
    arrived: u64,
    torn: u64,
    waiter: Option<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    n: u64,
    waker: Option<Waker>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<u32, Entry>,
    /// Retired immediates and how many arrivals they got after (or kept before) cancellation.
    retired: HashMap<u32, u64>,
    /// Waiters whose expectation was cancelled and that have not observed it yet.
    cancelled_waiters: HashSet<u64>,
    next_waiter_id: u64,
    arrived: u64,
    claimed: u64,
    stray: u64,
    torn: u64,
}

/// Counts arrivals per immediate; cheap to clone (clones share the counts).
#[derive(Debug, Clone, Default)]
pub struct ImmCounter {
    state: Arc<Mutex<State>>,
}

impl ImmCounter {
    /// A counter with no arrivals.
    pub fn new() -> Self {
        Self::default()
    }

    /// A future that resolves once `n` writes carrying `imm` have fully landed, consuming those
    /// `n` arrivals (arrivals kept from before the call count). It fails with
    /// [`FabricError::ImmBusy`] if `imm` already has a pending expectation, with
    /// [`FabricError::ImmRetired`] if `imm` was cancelled, and with [`FabricError::Cancelled`] if
    /// [`cancel`](Self::cancel) is called while it waits. Dropping the future withdraws the
    /// expectation without consuming anything. `n == 0` resolves at once.
    pub fn expect(&self, imm: u32, n: u64) -> ImmWait {
        let mut st = self.state.lock();
        let early = if st.retired.contains_key(&imm) {
            Some(FabricError::ImmRetired { imm })
        } else if st.entries.get(&imm).is_some_and(|e| e.waiter.is_some()) {
            Some(FabricError::ImmBusy { imm })
        } else {
            None
        };
        let id = st.next_waiter_id;
        st.next_waiter_id += 1;
        if early.is_none() {
            st.entries.entry(imm).or_default().waiter = Some(Waiter { id, n, waker: None });
        }
        ImmWait {
            state: self.state.clone(),
            imm,
            id,
            early,
            finished: false,
        }
    }

    /// Like [`expect`](Self::expect) with a deadline. On timeout the immediate is cancelled
    /// (retired, see the module docs) and the error says how many of the `n` writes had landed and
    /// how many were torn.
    pub async fn expect_within(&self, imm: u32, n: u64, timeout: Duration) -> Result<()> {
        match tokio::time::timeout(timeout, self.expect(imm, n)).await {
            Ok(r) => r,
            Err(_) => {
                let (arrived, torn) = {
                    let st = self.state.lock();
                    st.entries
                        .get(&imm)
                        .map(|e| (e.arrived, e.torn))
                        .unwrap_or((0, 0))
                };
                self.cancel(imm);
                Err(FabricError::Timeout {
                    what: format!(
                        "{arrived} of {n} writes with immediate {imm:#010x} landed ({torn} torn)"
                    ),
                    after: timeout,
                })
            }
        }
    }

    /// Cancels `imm`: its pending expectation (if any) fails with [`FabricError::Cancelled`], kept
    /// arrivals move to the stray count, and `imm` is retired (see the module docs).
    pub fn cancel(&self, imm: u32) {
        let waker = {
            let mut st = self.state.lock();
            let entry = st.entries.remove(&imm).unwrap_or_default();
            *st.retired.entry(imm).or_insert(0) += entry.arrived;
            st.stray += entry.arrived;
            entry.waiter.map(|w| {
                st.cancelled_waiters.insert(w.id);
                w.waker
            })
        };
        if let Some(Some(w)) = waker {
            w.wake();
        }
    }

    /// Whether `imm` was cancelled (retired).
    pub fn is_retired(&self, imm: u32) -> bool {
        self.state.lock().retired.contains_key(&imm)
    }

    /// Records that a write carrying `imm` has fully landed. Backends call this only after the
    /// whole payload is in memory.
    pub fn record_arrival(&self, imm: u32) {
        let waker = {
            let mut st = self.state.lock();
            st.arrived += 1;
            if let Some(stray) = st.retired.get_mut(&imm) {
                *stray += 1;
                st.stray += 1;
                None
            } else {
                let entry = st.entries.entry(imm).or_default();
                entry.arrived += 1;
                match &mut entry.waiter {
                    Some(w) if entry.arrived >= w.n => w.waker.take(),
                    _ => None,
                }
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Records that a write carrying `imm` failed part-way (never counted; shown in diagnosis).
    pub fn record_torn(&self, imm: u32) {
        let mut st = self.state.lock();
        st.torn += 1;
        if !st.retired.contains_key(&imm) {
            st.entries.entry(imm).or_default().torn += 1;
        }
    }

    /// Arrivals for `imm` kept and not yet consumed.
    pub fn unclaimed(&self, imm: u32) -> u64 {
        self.state.lock().entries.get(&imm).map_or(0, |e| e.arrived)
    }

    /// Arrivals counted for `imm` after it was cancelled.
    pub fn stray(&self, imm: u32) -> u64 {
        self.state.lock().retired.get(&imm).copied().unwrap_or(0)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ImmStats {
        let st = self.state.lock();
        ImmStats {
            arrived: st.arrived,
            claimed: st.claimed,
            unclaimed: st.entries.values().map(|e| e.arrived).sum(),
            stray_after_cancel: st.stray,
            torn: st.torn,
            pending_expectations: st.entries.values().filter(|e| e.waiter.is_some()).count(),
        }
    }
}

/// The future returned by [`ImmCounter::expect`].
#[derive(Debug)]
#[must_use = "an expectation does nothing unless awaited"]
pub struct ImmWait {
    state: Arc<Mutex<State>>,
    imm: u32,
    id: u64,
    early: Option<FabricError>,
    finished: bool,
}

impl Future for ImmWait {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if let Some(e) = self.early.take() {
            self.finished = true;
            return Poll::Ready(Err(e));
        }
        if self.finished {
            return Poll::Ready(Err(FabricError::Cancelled { imm: self.imm }));
        }
        let (imm, id) = (self.imm, self.id);
        let mut st = self.state.lock();
        if st.cancelled_waiters.remove(&id) {
            drop(st);
            self.finished = true;
            return Poll::Ready(Err(FabricError::Cancelled { imm }));
        }
        let Some(entry) = st.entries.get_mut(&imm) else {
            drop(st);
            self.finished = true;
            return Poll::Ready(Err(FabricError::Cancelled { imm }));
        };
        match &mut entry.waiter {
            Some(w) if w.id == id => {
                if entry.arrived >= w.n {
                    let n = w.n;
                    entry.arrived -= n;
                    entry.waiter = None;
                    st.claimed += n;
                    drop(st);
                    self.finished = true;
                    Poll::Ready(Ok(()))
                } else {
                    w.waker = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
            _ => {
                drop(st);
                self.finished = true;
                Poll::Ready(Err(FabricError::Cancelled { imm }))
            }
        }
    }
}

impl Drop for ImmWait {
    fn drop(&mut self) {
        if self.finished || self.early.is_some() {
            return;
        }
        let mut st = self.state.lock();
        st.cancelled_waiters.remove(&self.id);
        if let Some(entry) = st.entries.get_mut(&self.imm)
            && entry.waiter.as_ref().is_some_and(|w| w.id == self.id)
        {
            entry.waiter = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;

    #[test]
    fn resolves_after_n_arrivals_in_any_order() {
        let c = ImmCounter::new();
        let mut a = c.expect(1, 3);
        let mut b = c.expect(2, 1);
        c.record_arrival(2);
        c.record_arrival(1);
        assert!((&mut a).now_or_never().is_none());
        c.record_arrival(1);
        assert_eq!((&mut b).now_or_never().map(|r| r.is_ok()), Some(true));
        c.record_arrival(1);
        assert_eq!((&mut a).now_or_never().map(|r| r.is_ok()), Some(true));
        let s = c.stats();
        assert_eq!((s.arrived, s.claimed, s.unclaimed), (4, 4, 0));
    }

    #[test]
    fn unknown_arrivals_are_kept_for_a_later_expectation() {
        let c = ImmCounter::new();
        c.record_arrival(9);
        c.record_arrival(9);
        c.record_arrival(9);
        assert_eq!(c.unclaimed(9), 3);
        assert!(c.expect(9, 2).now_or_never().unwrap().is_ok());
        assert_eq!(c.unclaimed(9), 1);
        let mut w = c.expect(9, 2);
        assert!((&mut w).now_or_never().is_none());
        c.record_arrival(9);
        assert!(w.now_or_never().unwrap().is_ok());
    }

    #[test]
    fn cancel_fails_the_waiter_and_retires_the_imm() {
        let c = ImmCounter::new();
        c.record_arrival(5);
        let mut w = c.expect(5, 3);
        assert!((&mut w).now_or_never().is_none());
        c.cancel(5);
        assert!(matches!(
            w.now_or_never(),
            Some(Err(FabricError::Cancelled { imm: 5 }))
        ));
        // Late arrivals go to the stray count and never satisfy a new expectation.
        c.record_arrival(5);
        c.record_arrival(5);
        assert_eq!(c.stray(5), 3);
        assert_eq!(c.unclaimed(5), 0);
        assert!(matches!(
            c.expect(5, 1).now_or_never(),
            Some(Err(FabricError::ImmRetired { imm: 5 }))
        ));
        assert_eq!(c.stats().stray_after_cancel, 3);
        // Other immediates are unaffected.
        c.record_arrival(6);
        assert!(c.expect(6, 1).now_or_never().unwrap().is_ok());
    }

    #[test]
    fn second_expectation_is_busy_and_drop_withdraws() {
        let c = ImmCounter::new();
        let w = c.expect(1, 2);
        assert!(matches!(
            c.expect(1, 1).now_or_never(),
            Some(Err(FabricError::ImmBusy { imm: 1 }))
        ));
        drop(w);
        c.record_arrival(1);
        assert!(c.expect(1, 1).now_or_never().unwrap().is_ok());
        assert_eq!(c.stats().pending_expectations, 0);
    }

    #[test]
    fn zero_resolves_at_once_and_torn_never_counts() {
        let c = ImmCounter::new();
        assert!(c.expect(3, 0).now_or_never().unwrap().is_ok());
        c.record_torn(3);
        assert_eq!(c.unclaimed(3), 0);
        assert_eq!(c.stats().torn, 1);
    }

    #[tokio::test]
    async fn timeout_reports_progress_and_retires() {
        let c = ImmCounter::new();
        c.record_arrival(7);
        c.record_torn(7);
        let err = c
            .expect_within(7, 4, Duration::from_millis(20))
            .await
            .unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("1 of 4"), "{msg}");
        assert!(msg.contains("1 torn"), "{msg}");
        assert!(c.is_retired(7));
    }

    #[tokio::test]
    async fn wakes_a_waiting_task() {
        let c = ImmCounter::new();
        let w = tokio::spawn({
            let c = c.clone();
            async move { c.expect(11, 2).await }
        });
        tokio::task::yield_now().await;
        let c2 = c.clone();
        std::thread::spawn(move || {
            c2.record_arrival(11);
            c2.record_arrival(11);
        })
        .join()
        .unwrap();
        w.await.unwrap().unwrap();
    }
}
