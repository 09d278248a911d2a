//! weightsync-tests: shared harness code for the suites under `tests/tests/`.
#![deny(missing_docs)]

pub mod conformance;
pub mod loopback;
// Fault-suite harness (faults engineer): processes, proxy, namespaces, guard pages, raw HTTP.
pub mod canary;
pub mod http_raw;
pub mod netns;
pub mod proc_stats;
pub mod processes;
pub mod proxy;
// Controller harness (controller engineer): in-process controller, registrations, agents.
pub mod controller_harness;
pub mod process_cluster;
pub mod proxied_cluster;
pub mod reference;
