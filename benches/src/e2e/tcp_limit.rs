//! The plain-TCP limit: the same bytes between the same pairs as a sync, over bare loopback TCP
//! streams with nothing else to do (no framing, no preparation, no registration), one stream per
//! (trainer, rollout) pair, every pair at once. No transport on this machine can land the sync's
//! bytes faster, so weightsync's `ratio_vs_tcp_limit` says how much of the wire it uses.
//!
//! It is a kind limit on purpose: each stream sends from and receives into one cache-hot
//! [`CHUNK`], where a sync (and the fabric limit, `fabric_limit`) reads and writes memory far
//! larger than the caches. An upper bound may flatter the wire; it must not flatter weightsync.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use weightsync_schedules::RoutingTable;
use weightsync_schedules::table::WriteTarget;

use super::E2eError;

/// Chunk per `write` / `read` call.
const CHUNK: usize = 1 << 20;

/// Bytes each (trainer, rollout) pair carries per sync, from every trainer's explicit plan.
pub(crate) fn pair_bytes(table: &RoutingTable) -> Result<Vec<(u32, u32, u64)>, E2eError> {
    let plans = table
        .trainer_plans()
        .map_err(|e| E2eError::Setup(format!("expanding the slices: {e}")))?;
    let mut out = Vec::new();
    for t in &plans {
        let mut per = std::collections::BTreeMap::<u32, u64>::new();
        for w in t.all_writes() {
            if let WriteTarget::Rollout(r) = w.dst {
                *per.entry(r).or_default() += w.len as u64;
            }
        }
        out.extend(per.into_iter().map(|(r, b)| (t.rank, r, b)));
    }
    Ok(out)
}

/// Moves `pairs` over plain TCP at once; returns the seconds from the first byte sent to the
/// last byte received.
pub(crate) fn run(pairs: &[(u32, u32, u64)]) -> Result<f64, E2eError> {
    let io = |what: &str, e: std::io::Error| E2eError::Setup(format!("plain TCP {what}: {e}"));
    let mut conns = Vec::new();
    for &(_, _, bytes) in pairs {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| io("bind", e))?;
        let addr = listener.local_addr().map_err(|e| io("address", e))?;
        let tx = TcpStream::connect(addr).map_err(|e| io("connect", e))?;
        let (rx, _) = listener.accept().map_err(|e| io("accept", e))?;
        tx.set_nodelay(true).map_err(|e| io("nodelay", e))?;
        conns.push((tx, rx, bytes));
    }
    let start = std::sync::Barrier::new(conns.len() * 2 + 1);
    let t0 = std::thread::scope(|s| -> Result<Instant, E2eError> {
        let mut handles = Vec::new();
        for (mut tx, mut rx, bytes) in conns {
            let start = &start;
            handles.push(s.spawn(move || -> std::io::Result<()> {
                let buf = vec![0x5au8; CHUNK];
                start.wait();
                let mut left = bytes as usize;
                while left > 0 {
                    let n = left.min(CHUNK);
                    tx.write_all(&buf[..n])?;
                    left -= n;
                }
                Ok(())
            }));
            handles.push(s.spawn(move || -> std::io::Result<()> {
                let mut buf = vec![0u8; CHUNK];
                start.wait();
                let mut left = bytes as usize;
                while left > 0 {
                    let n = rx.read(&mut buf[..left.min(CHUNK)])?;
                    if n == 0 {
                        return Err(std::io::ErrorKind::UnexpectedEof.into());
                    }
                    left -= n;
                }
                Ok(())
            }));
        }
        start.wait();
        let t0 = Instant::now();
        for h in handles {
            h.join()
                .map_err(|_| E2eError::Setup("a plain TCP thread panicked".into()))?
                .map_err(|e| io("transfer", e))?;
        }
        Ok(t0)
    })?;
    Ok(t0.elapsed().as_secs_f64())
}
