//! Hashing what landed while the rest of the round still lands, so that committing a version
//! does not wait for a pass over every byte after the last write.
//!
//! A rollout checks a version by hashing every run the trainers wrote and comparing with their
//! checksums ([`crate::checksum`]). The runs of a plan are the same every round (the trainers'
//! pieces follow from the plan and the watermark), so once one round was verified the receiver
//! knows them. From then on, a thread armed with the round follows the receiver's
//! [`LandingLog`]: when every byte of a run has landed it reads the log's sequence number and
//! hashes the run, while the bytes are still in the cache and the trainers are still writing
//! other runs. Verification then uses such a hash only if the log shows that no frame touched
//! the run from that sequence number on (a stale write landing after the real one, a frame still
//! landing); any other run, and every run when the runs changed or the backend keeps no log, is
//! hashed after the round as before. The comparison with the trainers' checksums, the coverage
//! check and the error naming the tensor are the same either way.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use parking_lot::Mutex;
use weightsync_common::fabric::{LandingLog, Region};

use crate::checksum::xxh3_in_region;

/// One run: memory region (the receiver's index, also the log's tag), offset, length.
pub(super) type RunKey = (u16, u64, u64);

/// A run's hash and the log's sequence number read just before it was hashed.
pub(super) type EarlyHashes = HashMap<RunKey, (u64, u64)>;

/// The thread hashing one round's runs as they land; dropping it stops the thread.
#[derive(Debug)]
pub(super) struct EarlyCheck {
    stop: Arc<AtomicBool>,
    log: Arc<LandingLog>,
    hashes: Arc<Mutex<EarlyHashes>>,
    thread: Option<JoinHandle<()>>,
}

impl EarlyCheck {
    /// Starts following `log` (restarted by the caller for this round) for `runs`, sorted by
    /// region and offset and not overlapping (the runs of a verified round).
    pub fn start(
        name: &str,
        regions: Vec<Region>,
        log: Arc<LandingLog>,
        runs: Arc<Vec<RunKey>>,
    ) -> std::io::Result<EarlyCheck> {
        let stop = Arc::new(AtomicBool::new(false));
        let hashes = Arc::new(Mutex::new(EarlyHashes::with_capacity(runs.len())));
        let thread = {
            let (stop, log, hashes) = (stop.clone(), log.clone(), hashes.clone());
            std::thread::Builder::new()
                .name(format!("ws-check-{name}"))
                .spawn(move || follow(&regions, &log, &runs, &stop, &hashes))?
        };
        Ok(EarlyCheck {
            stop,
            log,
            hashes,
            thread: Some(thread),
        })
    }

    /// Stops the thread (after the run it is hashing, if any) and hands over the hashes taken.
    pub fn finish(mut self) -> EarlyHashes {
        self.stop_thread();
        std::mem::take(&mut *self.hashes.lock())
    }

    /// Bytes hashed so far.
    #[cfg(test)]
    pub fn hashed_bytes(&self) -> u64 {
        self.hashes.lock().keys().map(|k| k.2).sum()
    }

    fn stop_thread(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.log.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for EarlyCheck {
    fn drop(&mut self) {
        self.stop_thread();
    }
}

/// The thread: counts the landed bytes of each run, hashes each run once all have landed.
fn follow(
    regions: &[Region],
    log: &LandingLog,
    runs: &[RunKey],
    stop: &AtomicBool,
    hashes: &Mutex<EarlyHashes>,
) {
    let mut landed = vec![0u64; runs.len()];
    let mut cursor = 0;
    let mut scratch = Vec::new();
    while let Some(frames) = log.wait_ended(&mut cursor, stop) {
        let mut ready = Vec::new();
        for f in frames {
            let end = f.offset + f.len;
            let first = runs.partition_point(|r| (r.0, r.1 + r.2) <= (f.tag, f.offset));
            for (i, r) in runs.iter().enumerate().skip(first) {
                if (r.0, r.1) >= (f.tag, end) {
                    break;
                }
                let overlap = (r.1 + r.2).min(end).saturating_sub(r.1.max(f.offset));
                let before = landed[i];
                landed[i] += overlap;
                if before < r.2 && landed[i] >= r.2 {
                    ready.push(i);
                }
            }
        }
        for i in ready {
            if stop.load(Ordering::Acquire) {
                return;
            }
            let (mr, offset, len) = runs[i];
            let Some(region) = regions.get(mr as usize) else {
                continue;
            };
            // Read before the bytes: frames that ended by now are wholly in memory.
            let seq = log.seq();
            if let Ok(h) = xxh3_in_region(region, offset, len, &mut scratch) {
                hashes.lock().insert(runs[i], (h, seq));
            }
        }
    }
}
