//! weightsync-tests: shared harness code for the suites under `tests/tests/`.
//!
//! # Layout
//! - Fabric: [`conformance`] (every backend obeys the fabric contract), [`canary`] (guard pages).
//! - Worker library: [`loopback`] and [`proxied_cluster`] (trainers and rollouts in one process,
//!   a lane proxy that cuts or stalls), [`reference`] (expected bytes computed without weightsync).
//! - Controller: [`controller_harness`] (a served controller, registrations fed straight in,
//!   scripted agents), [`embed_fixture`] (what the in-process embed suites share), [`tls_certs`]
//!   (a job's CA and a stranger's, for the TLS suites).
//! - Processes: [`processes`], [`process_cluster`] (the real binary as a whole job),
//!   [`netns`] (one network namespace per host), [`proxy`], [`http_raw`], [`proc_stats`].
//! - Suites (`tests/tests/`): `fabric_*`, `worker_e2e`, `controller_*`, `faults/`, `dashboard`,
//!   `load` and `sidecar_startup` (measurements, ignored), `replan_responsiveness`.
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
pub mod embed_fixture;
pub mod process_cluster;
pub mod proxied_cluster;
pub mod reference;
// TLS suites: certificates made with rcgen.
pub mod tls_certs;
