//! Which way a process's written bytes reached their receivers, so that a sync can say which
//! path it took: the operator of a colocated job needs to know whether the same-host copy ran
//! (and which one: `process_vm_readv`, or memory shared by descriptor where ptrace access is
//! refused) or whether the bytes fell back to the transport's payloads.

use serde::{Deserialize, Serialize};

/// Bytes written, by how they reached their receivers (counted by the writer as it sends).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferPaths {
    /// Carried by the transport itself (a TCP socket's payloads, a NIC's DMA).
    pub payload_bytes: u64,
    /// Copied by a same-host receiver out of this process with `process_vm_readv`.
    pub process_vm_readv_bytes: u64,
    /// Copied by a same-host receiver out of this process's memory shared by file descriptor
    /// (a `memfd` handed over with `SCM_RIGHTS`; see `fabric::shared_memory`).
    pub shared_memory_bytes: u64,
}

impl TransferPaths {
    /// What was written after `earlier` (a snapshot of the same counters).
    pub fn since(&self, earlier: &TransferPaths) -> TransferPaths {
        TransferPaths {
            payload_bytes: self.payload_bytes.saturating_sub(earlier.payload_bytes),
            process_vm_readv_bytes: self
                .process_vm_readv_bytes
                .saturating_sub(earlier.process_vm_readv_bytes),
            shared_memory_bytes: self
                .shared_memory_bytes
                .saturating_sub(earlier.shared_memory_bytes),
        }
    }

    /// Every byte counted.
    pub fn total(&self) -> u64 {
        self.payload_bytes + self.process_vm_readv_bytes + self.shared_memory_bytes
    }

    /// The path's name: `shared_memory`, `process_vm_readv` or `payloads` when every byte took
    /// that one, `mixed` when several carried bytes, `none` when nothing was written.
    pub fn name(&self) -> &'static str {
        let used = [
            (self.payload_bytes, "payloads"),
            (self.process_vm_readv_bytes, "process_vm_readv"),
            (self.shared_memory_bytes, "shared_memory"),
        ];
        let mut carried = used.iter().filter(|(b, _)| *b > 0);
        match (carried.next(), carried.next()) {
            (None, _) => "none",
            (Some((_, name)), None) => name,
            (Some(_), Some(_)) => "mixed",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_path_is_named_by_what_carried_bytes() {
        let mut p = TransferPaths::default();
        assert_eq!(p.name(), "none");
        p.shared_memory_bytes = 10;
        assert_eq!(p.name(), "shared_memory");
        let earlier = p;
        p.payload_bytes = 5;
        assert_eq!(p.name(), "mixed");
        assert_eq!(p.since(&earlier).name(), "payloads");
        assert_eq!(p.total(), 15);
        p.shared_memory_bytes = 0;
        p.payload_bytes = 0;
        p.process_vm_readv_bytes = 1;
        assert_eq!(p.name(), "process_vm_readv");
    }
}
