//! The lanes to one peer: their slots, and how much each still has to carry.
//!
//! A writer keeps one slot per lane to each peer it writes to. A slot holds the lane (opened on
//! first use, replaced when it broke) and a counter of the bytes posted on it and not yet
//! acknowledged. The counter belongs to the slot rather than the lane so that the scheduler
//! ([`place`](crate::fabric::place)) sees a replaced lane's backlog drain as its failed jobs are
//! answered. The number of lanes is the configured count, raised to one per address of either
//! side so that every NIC carries lanes ([`LaneRoute`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::Shared;
use super::addresses::{LaneRoute, address_count};
use super::lane::{Lane, LaneJob, QueuedBytes};
use crate::fabric::config::FabricConfig;
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::FabricError;

#[derive(Debug)]
pub(super) struct PeerLanes {
    pub endpoint: Endpoint,
    slots: Vec<Mutex<Option<Lane>>>,
    queued: Vec<Arc<AtomicU64>>,
    /// Rotates which lane wins ties between equally loaded lanes.
    next: AtomicUsize,
    /// Addresses the peer advertises.
    remotes: usize,
}

impl PeerLanes {
    pub fn new(endpoint: &Endpoint, shared: &Shared) -> PeerLanes {
        let remotes = address_count(endpoint);
        let expected = shared.expected_peers.load(Ordering::Relaxed);
        let lanes = FabricConfig::lanes_for_peers(
            shared.config.lanes_per_peer,
            shared.local.len(),
            expected,
        )
        .max(remotes)
        .max(shared.local.len());
        PeerLanes {
            endpoint: endpoint.clone(),
            slots: (0..lanes).map(|_| Mutex::new(None)).collect(),
            queued: (0..lanes).map(|_| Arc::default()).collect(),
            next: AtomicUsize::new(0),
            remotes,
        }
    }

    /// Number of lanes to this peer.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Bytes each lane still has to carry, and the lane that wins ties this time.
    pub fn loads(&self) -> (Vec<u64>, usize) {
        let loads = self
            .queued
            .iter()
            .map(|q| q.load(Ordering::Relaxed))
            .collect();
        (loads, self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Counts `bytes` on lane `i`'s queue until the returned guard drops.
    pub fn enqueue(&self, i: usize, bytes: u64) -> QueuedBytes {
        QueuedBytes::count(&self.queued[i], bytes)
    }

    /// The lane in slot `i`, (re)opened if missing or broken.
    pub fn lane(&self, i: usize, shared: &Arc<Shared>) -> Lane {
        let mut slot = self.slots[i].lock();
        match slot.as_ref() {
            Some(lane) if !lane.is_broken() => lane.clone(),
            _ => {
                let route = LaneRoute::of_lane(i, &shared.local, self.remotes);
                let lane = Lane::open(self.endpoint.clone(), i, route, shared.clone());
                *slot = Some(lane.clone());
                lane
            }
        }
    }

    /// The lanes open now (for cutting and resetting them).
    pub fn open_lanes(&self) -> impl Iterator<Item = Lane> + '_ {
        self.slots.iter().filter_map(|s| s.lock().clone())
    }

    /// Takes every open lane out of its slot (the next use opens fresh ones).
    pub fn take_lanes(&self) -> Vec<Lane> {
        self.slots.iter().filter_map(|s| s.lock().take()).collect()
    }

    pub fn submit(&self, i: usize, job: LaneJob, shared: &Arc<Shared>) {
        let Err(job) = self.lane(i, shared).submit(job) else {
            return;
        };
        // The lane's thread exited: replace it once.
        *self.slots[i].lock() = None;
        if let Err(job) = self.lane(i, shared).submit(job) {
            let _ = job.done.send(Err(FabricError::Disconnected {
                peer: self.endpoint.clone(),
                lane: i,
                detail: "lane thread exited".into(),
            }));
        }
    }
}
