//! The cost model: how long a routing table takes to execute, to first order.
//!
//! Why so simple: a sync is bandwidth-bound on the most loaded NIC unless work requests are tiny,
//! so per NIC `time = max(bytes / bandwidth, work_requests * per_request_cost)`; each trainer also
//! copies its sources host-to-device and prepares them (cast / quantise), in a pipeline whose
//! stages overlap, so a trainer takes the slowest of its stages plus the time to fill the
//! pipeline with its first task. The sync ends when the slowest NIC or trainer is done, plus a
//! barrier. The discrete-event simulator refines this; the planner only needs it to weigh bytes
//! against work requests when it balances replicas.
//!
//! Defaults: 400 Gb/s per GPU NIC (50 GB/s), 2 M work requests/s per NIC (0.5 us each: a
//! host-proxied engine, not the NIC's raw message rate), PCIe 5 x16 host-to-device at 50 GB/s,
//! preparation at 1 TB/s of input (an H100-class GPU's HBM at ~3 TB/s read + write, with
//! headroom), 100 us barrier.

use serde::{Deserialize, Serialize};

/// Rates of the cluster the table will run on. All rates in bytes or requests per second.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    /// Bandwidth of one GPU's NIC, each direction, bytes/s.
    pub nic_bytes_per_s: f64,
    /// Cost of one work request (WRITE) on a NIC, seconds.
    pub per_wr_s: f64,
    /// Host-to-device copy rate per GPU, bytes/s.
    pub h2d_bytes_per_s: f64,
    /// Preparation (cast / quantise) rate per GPU, bytes of input per second.
    pub prep_bytes_per_s: f64,
    /// Latency of the final barrier, seconds.
    pub barrier_s: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        CostModel {
            nic_bytes_per_s: 400e9 / 8.0,
            per_wr_s: 0.5e-6,
            h2d_bytes_per_s: 50e9,
            prep_bytes_per_s: 1e12,
            barrier_s: 100e-6,
        }
    }
}

impl CostModel {
    /// Time one NIC needs for `bytes` in `wrs` work requests.
    pub fn nic_time(&self, bytes: u64, wrs: u64) -> f64 {
        (bytes as f64 / self.nic_bytes_per_s).max(wrs as f64 * self.per_wr_s)
    }

    /// How many bytes one work request is worth on a NIC (`bandwidth * per_wr_s`): the planner
    /// balances `bytes + wrs * this`, an upper bound of the NIC time in bytes.
    pub fn wr_equiv_bytes(&self) -> u64 {
        (self.nic_bytes_per_s * self.per_wr_s).max(0.0) as u64
    }

    /// Pieces of replicated data smaller than this are sent whole by one replica rather than
    /// split across replicas (splitting would cost more in work requests than it balances).
    pub fn min_split_bytes(&self) -> u64 {
        4 * self.wr_equiv_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_time_is_the_larger_of_bandwidth_and_message_rate() {
        let c = CostModel::default();
        assert!((c.nic_time(50_000_000_000, 1) - 1.0).abs() < 1e-9);
        assert!((c.nic_time(1, 2_000_000) - 1.0).abs() < 1e-9);
        assert_eq!(c.wr_equiv_bytes(), 25_000);
    }
}
