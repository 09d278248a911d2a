//! The cluster a simulated sync runs on: the planner's [`CostModel`] rates plus what only a
//! timeline can show (node topology, the watermark, per-task overheads, a shared host).
//!
//! Why a separate struct around [`CostModel`]: the planner needs a handful of rates to weigh
//! bytes against work requests; the simulator needs the same rates (so both agree on what a NIC
//! can do) plus the structure that decides *when* things happen: which GPUs share a NIC, how
//! much staging is in flight, how much a task costs beyond its bytes. Keeping the rates in one
//! place means `weightsync plan` and `weightsync simulate` never disagree on a bandwidth.
//!
//! # Topology
//! GPUs are numbered trainers first (`0..T`), then rollouts (`T..T+R`). With
//! [`Placement::Separate`] (a real deployment: training and inference run on their own nodes)
//! trainer `t` is on node `t / gpus_per_node` and rollout `r` on node
//! `ceil(T / gpus_per_node) + r / gpus_per_node`; with [`Placement::Colocated`] GPU `g` is on
//! node `g / gpus_per_node` (the loopback calibration: everything on one machine). Each node has
//! `nics_per_node` NICs, and GPU `g` with local index `l` uses NIC `l * nics_per_node /
//! gpus_per_node` of its node: with fewer NICs than GPUs, GPUs share a NIC. With more (a whole
//! multiple: Kimi-K2 deployments with 2 x 200 Gb/s per GPU), GPU `l` owns NICs
//! `l * k .. (l + 1) * k` for `k = nics_per_node / gpus_per_node`, and its transfers stripe evenly
//! over them, as the fabric's lanes stripe over a worker's devices.
//!
//! # Fixed costs
//! [`FixedCosts`] are what a sync pays whatever its bytes: from the sync's start until the
//! trainers begin (`start_s`: the start message's fan-out, each trainer's per-sync setup) and
//! from the last byte landed until the sync is done (`after_landing_s`: landing notices, the
//! barrier and commit round trips, a verification pass). The per-task cost is
//! [`ClusterModel::task_overhead_s`]. All three default to what a GPU cluster is assumed to pay
//! (0, 0 and 10 us); `weightsync simulate --calibrate` measures them on this machine from
//! near-empty syncs (see `benches/src/e2e/calibrate/fixed.rs`), and `weightsync simulate` takes
//! them as `--sync-start-us`, `--after-landing-us` and `--task-overhead-us`.
//!
//! A NIC is full duplex: it sends at [`CostModel::nic_bytes_per_s`] and receives at the same rate
//! at once. A write costs its NIC `max(bytes / bandwidth, work_requests * per_wr_s)` on each side.

use serde::{Deserialize, Serialize};

use crate::cost::CostModel;
use crate::simulate::SimError;

/// Where training and inference GPUs sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Placement {
    /// Trainers and rollouts on separate nodes (a real cluster).
    #[default]
    Separate,
    /// Trainers then rollouts packed onto the same nodes (one machine on loopback).
    Colocated,
}

/// Preparation rates per transform, bytes of *input* per second on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PrepRates {
    /// Plain copies (strided gathers into contiguous staging).
    pub copy: f64,
    /// Casts between bf16, fp16 and fp32.
    pub cast: f64,
    /// fp8 e4m3 block quantisation (amax per 128x128 block, then scale and round).
    pub fp8: f64,
}

impl PrepRates {
    /// The same rate for every transform.
    pub fn uniform(bytes_per_s: f64) -> PrepRates {
        PrepRates {
            copy: bytes_per_s,
            cast: bytes_per_s,
            fp8: bytes_per_s,
        }
    }
}

/// A host whose CPU every stage shares (the loopback calibration; `None` on a GPU cluster,
/// where copies, kernels and the NIC do not take host cores).
///
/// Costs are in *machine-seconds per byte*: one byte of the stage takes this fraction of a
/// second of the whole node's CPU. A stage measured alone at `R` bytes/s while saturating every
/// core costs `1 / R`; one that runs on one of `c` cores at `R` costs `1 / (R * c)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct HostModel {
    /// Per byte copied into staging (the H2D stage of a CPU build: a memcpy).
    pub h2d_s_per_byte: f64,
    /// Per byte of input prepared, per transform.
    pub prep_s_per_byte: PrepRates,
    /// Per byte written through the fabric (both ends of a loopback transfer together).
    pub net_s_per_byte: f64,
    /// Per write (work request) through the fabric beyond its bytes: posting it, its frame,
    /// its completion and the thread wake-ups around them (0 when not measured).
    #[serde(default)]
    pub net_s_per_write: f64,
}

/// What every sync pays beyond its bytes and tasks (see the module docs), seconds.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct FixedCosts {
    /// From the sync's start until the trainers begin their first piece: a latency before
    /// every trainer's first op.
    pub start_s: f64,
    /// From the last write landed until the sync is done: added to the final barrier's
    /// latency (`cost.barrier_s`).
    pub after_landing_s: f64,
}

/// Everything the simulator assumes about a cluster.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ClusterModel {
    /// NIC bandwidth and message cost, H2D rate, barrier latency (shared with the planner).
    pub cost: CostModel,
    /// Preparation rates per transform (each defaults to `cost.prep_bytes_per_s`).
    pub prep: PrepRates,
    /// GPUs per node.
    pub gpus_per_node: u32,
    /// NICs per node (fewer than GPUs: GPUs share NICs).
    pub nics_per_node: u32,
    /// Where trainers and rollouts sit.
    pub placement: Placement,
    /// Staging bytes a trainer may have in flight (source copy plus prepared output).
    pub watermark_bytes: u64,
    /// Staging bytes per pipeline piece (default: a quarter of the watermark, as the worker).
    pub piece_bytes: Option<u64>,
    /// Fixed cost of one task in the prepare stage (a kernel launch, a scheduler hop), seconds.
    pub task_overhead_s: f64,
    /// Per-sync fixed costs (start, after landing).
    #[serde(default)]
    pub fixed: FixedCosts,
    /// Pieces whose writes a trainer keeps in flight at once (0: as many as the watermark
    /// allows, as the worker does).
    pub writes_in_flight: u32,
    /// The shared host CPU, when stages compete for it (loopback); `None` on a GPU cluster.
    pub host: Option<HostModel>,
}

impl Default for ClusterModel {
    fn default() -> Self {
        ClusterModel::from_cost(CostModel::default())
    }
}

impl ClusterModel {
    /// A GPU cluster (8 GPUs and 8 NICs per node, separate training and inference nodes,
    /// 2 GiB watermark, 10 us per task) with the rates of `cost`.
    pub fn from_cost(cost: CostModel) -> ClusterModel {
        ClusterModel {
            prep: PrepRates::uniform(cost.prep_bytes_per_s),
            cost,
            gpus_per_node: 8,
            nics_per_node: 8,
            placement: Placement::Separate,
            watermark_bytes: 2 << 30,
            piece_bytes: None,
            task_overhead_s: 10e-6,
            fixed: FixedCosts::default(),
            writes_in_flight: 0,
            host: None,
        }
    }

    /// The same cluster with NICs of `gbit` Gb/s.
    pub fn with_nic_gbit(mut self, gbit: f64) -> ClusterModel {
        self.cost.nic_bytes_per_s = gbit * 1e9 / 8.0;
        self
    }

    /// Staging bytes per piece.
    pub fn piece_budget(&self) -> u64 {
        self.piece_bytes
            .unwrap_or(self.watermark_bytes / 4)
            .clamp(1, self.watermark_bytes.max(1))
    }

    /// Checks that every rate is positive and finite and the topology is consistent.
    pub fn validate(&self) -> Result<(), SimError> {
        let rates = [
            ("nic_bytes_per_s", self.cost.nic_bytes_per_s),
            ("h2d_bytes_per_s", self.cost.h2d_bytes_per_s),
            ("prep.copy", self.prep.copy),
            ("prep.cast", self.prep.cast),
            ("prep.fp8", self.prep.fp8),
        ];
        for (name, v) in rates {
            if !(v.is_finite() && v > 0.0) {
                return Err(SimError::BadCluster(format!(
                    "{name} must be a positive rate, got {v}"
                )));
            }
        }
        let times = [
            ("per_wr_s", self.cost.per_wr_s),
            ("barrier_s", self.cost.barrier_s),
            ("task_overhead_s", self.task_overhead_s),
            ("fixed.start_s", self.fixed.start_s),
            ("fixed.after_landing_s", self.fixed.after_landing_s),
        ];
        for (name, v) in times {
            if !(v.is_finite() && v >= 0.0) {
                return Err(SimError::BadCluster(format!(
                    "{name} must be a non-negative time, got {v}"
                )));
            }
        }
        if let Some(h) = &self.host {
            let costs = [
                ("host.h2d_s_per_byte", h.h2d_s_per_byte),
                ("host.prep.copy", h.prep_s_per_byte.copy),
                ("host.prep.cast", h.prep_s_per_byte.cast),
                ("host.prep.fp8", h.prep_s_per_byte.fp8),
                ("host.net_s_per_byte", h.net_s_per_byte),
                ("host.net_s_per_write", h.net_s_per_write),
            ];
            for (name, v) in costs {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(SimError::BadCluster(format!(
                        "{name} must be a non-negative cost, got {v}"
                    )));
                }
            }
        }
        if self.gpus_per_node == 0 || self.nics_per_node == 0 {
            return Err(SimError::BadCluster(format!(
                "gpus_per_node ({}) and nics_per_node ({}) must be at least 1",
                self.gpus_per_node, self.nics_per_node
            )));
        }
        if self.nics_per_node > self.gpus_per_node
            && !self.nics_per_node.is_multiple_of(self.gpus_per_node)
        {
            return Err(SimError::BadCluster(format!(
                "nics_per_node ({}) above gpus_per_node ({}) must be a whole multiple of it \
                 (each GPU owns the same number of NICs)",
                self.nics_per_node, self.gpus_per_node
            )));
        }
        if self.watermark_bytes == 0 {
            return Err(SimError::BadCluster(
                "watermark_bytes must be positive".into(),
            ));
        }
        Ok(())
    }

    /// The node of GPU `gpu` when there are `trainers` training GPUs (numbering in the module
    /// docs).
    pub fn node_of(&self, gpu: u32, trainers: u32) -> u32 {
        let g = self.gpus_per_node;
        match self.placement {
            Placement::Colocated => gpu / g,
            Placement::Separate if gpu < trainers => gpu / g,
            Placement::Separate => trainers.div_ceil(g) + (gpu - trainers) / g,
        }
    }

    /// The global index of the (first) NIC GPU `gpu` uses.
    pub fn nic_of(&self, gpu: u32, trainers: u32) -> u32 {
        self.nics_of(gpu, trainers).start
    }

    /// NICs per GPU: 1 unless the node has a whole multiple of its GPUs.
    pub fn nics_per_gpu(&self) -> u32 {
        if self.nics_per_node > self.gpus_per_node {
            self.nics_per_node / self.gpus_per_node
        } else {
            1
        }
    }

    /// The global indices of the NICs GPU `gpu` stripes over (one, possibly shared, unless the
    /// node has several NICs per GPU).
    pub fn nics_of(&self, gpu: u32, trainers: u32) -> std::ops::Range<u32> {
        let g = self.gpus_per_node;
        let local = match self.placement {
            Placement::Colocated => gpu % g,
            Placement::Separate if gpu < trainers => gpu % g,
            Placement::Separate => (gpu - trainers) % g,
        };
        let k = self.nics_per_gpu();
        let first = self.node_of(gpu, trainers) * self.nics_per_node
            + (local as u64 * self.nics_per_node as u64 / g as u64) as u32;
        first..first + k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_map_onto_nodes_and_shared_nics() {
        let mut c = ClusterModel::default();
        // 12 trainers (nodes 0, 1), rollouts start on node 2.
        assert_eq!(c.node_of(11, 12), 1);
        assert_eq!(c.node_of(12, 12), 2);
        assert_eq!(c.nic_of(12, 12), 16);
        assert_eq!(c.nic_of(9, 12), 9);
        c.nics_per_node = 2;
        assert_eq!(c.nic_of(3, 16), 0);
        assert_eq!(c.nic_of(4, 16), 1);
        assert_eq!(c.nic_of(8, 16), 2);
        c.placement = Placement::Colocated;
        c.gpus_per_node = 6;
        c.nics_per_node = 1;
        assert!((0..6).all(|g| c.nic_of(g, 4) == 0));
        c.gpus_per_node = 8;
        c.nics_per_node = 16;
        assert_eq!(c.nics_per_gpu(), 2);
        assert_eq!(c.nics_of(3, 16), 6..8);
        assert_eq!(c.nics_of(9, 16), 18..20);
    }

    #[test]
    fn bad_rates_are_named() {
        let mut c = ClusterModel::default();
        c.cost.nic_bytes_per_s = 0.0;
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("nic_bytes_per_s"), "{e}");
        let c = ClusterModel {
            nics_per_node: 9,
            ..Default::default()
        };
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .contains("nics_per_node")
        );
        let mut c = ClusterModel::default();
        c.fixed.after_landing_s = -1.0;
        let e = c.validate().unwrap_err();
        assert!(e.to_string().contains("fixed.after_landing_s"), "{e}");
        assert!(ClusterModel::default().validate().is_ok());
    }
}
