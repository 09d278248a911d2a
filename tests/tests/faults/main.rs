//! The fault suite: `cargo test -p weightsync-tests --test faults`.
//!
//! One promise is checked under every fault: **a rollout is told a version is committed only if
//! every byte of it landed and verified**; and after the fault, the next sync commits and
//! verifies. Faults are injected from the outside wherever possible (SIGKILL of a real process,
//! a TCP proxy that cuts or stalls a lane, raw bytes on a socket), never through hooks in the
//! code under test.
//!
//! | module | level | what |
//! |---|---|---|
//! | `lanes` | workers (trainer + rollout libraries, real TCP fabric, proxy) | lane dropped mid-payload; peer that stops reading |
//! | `stale` | workers + a raw writer of the job | stale write of an aborted sync during the next one |
//! | `canary` | fabric (guard pages around registered memory) | wrong rkey, out of bounds, deregistered, unauthenticated, raw frames |
//! | `http_abuse` | controller process (real binary, real sockets) | huge bodies, deep JSON, slow and partial requests, many connections |
//! | `processes` | real `weightsync` processes on loopback | kills, restarts, concurrent and early triggers, bad registrations |
//! | `hosts` | real processes in network namespaces (root) | partition mid-sync; delay and loss (netem) |

mod canary;
mod hosts;
mod http_abuse;
mod lanes;
mod processes;
mod stale;
