//! `weightsync bench fabric`: one-sided writes between two processes on loopback, beside one
//! plain TCP stream moving the same bytes and a memcpy, all in the same run.
//!
//! The driver spawns itself (`weightsync bench fabric --peer`) as the receiving process: the peer
//! starts a TCP fabric, registers a 128 MiB receive region, opens a plain TCP sink, prints both
//! addresses as one JSON line and serves until its stdin closes. The driver then measures, for
//! each block size (4 KiB, 64 KiB, 1 MiB, 64 MiB) and lane count (1, 2, 4):
//! - throughput: writes of one block each, a window of them in flight, into cycling offsets of
//!   the peer's region; the plain TCP stream sends the same bytes in blocks of the same size into
//!   a buffer of the same size and acknowledges the end;
//! - latency: one write at a time (p50/p99 of the round trip), against a TCP ping-pong of the
//!   same block.
//!
//! Two paths: every lane count is measured twice, once as a same-host deployment gets it (the
//! receiver pulls each large frame out of the writer's memory, one copy: `path` "pull") and once
//! with same-host pulls off, the bytes on the sockets as between two machines (`path`
//! "socket"). `socket_bytes_per_byte` says which path really carried a row's bytes: the bytes
//! the writer handed to its sockets over the bytes it moved (about 1 on the socket path, a
//! header's share on the pull path).
//!
//! Several NICs: the peer also runs a fabric on two loopback addresses (127.0.0.1 and 127.0.0.2,
//! both served by Linux `lo`), and a writer on the same two addresses moves the same blocks to it
//! with 2 and 4 lanes (`multi_address`), counting the bytes each of its addresses sent (same-host
//! pulls off there: pulled bytes cross no address).
//!
//! Throughput is best-of-N, with the fabric and TCP measurements interleaved so that machine
//! noise hits both alike; only the ratios mean anything on a shared machine. The plain stream
//! is the noisier side: on two cores its sender and receiver share a core or not as the
//! scheduler places them, and its rate swings by half from run to run where the fabric's
//! barely moves, so `--rounds N` repeats the whole interleaved measurement N times and reports
//! each row's median round (`ratio_vs_tcp` the median of the rounds' own ratios, every round's
//! in `ratio_vs_tcp_rounds`). `gbps` is GB/s
//! (10^9 bytes per second). `default_lanes` is the lane count a fabric picks on this machine
//! when none is configured.

mod in_process;

pub use in_process::best_rate_gbps;

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};
use serde::{Deserialize, Serialize};
use weightsync_common::fabric::{
    Access, FabricBackend, FabricConfig, Region, RegionDescriptor, TcpFabric, WriteOp,
};
use weightsync_common::program::Program;

/// Command-line words that make `weightsync` run the peer side (see [`run_peer`]).
pub const PEER_ARGS: &[&str] = &["bench", "fabric", "--peer"];
/// Environment variable carrying the job token to the peer process.
pub const TOKEN_ENV: &str = "WEIGHTSYNC_BENCH_FABRIC_TOKEN";

/// Bytes of every source buffer and destination region the fabric bench cycles its blocks
/// through: far larger than the caches, so that each block is read from and written to memory
/// as a sync's weights are (`bench e2e`'s limits use the same, see `e2e::fabric_limit`).
pub const REGION_BYTES: usize = weightsync_common::fabric::limit::REGION_BYTES as usize;
const BLOCKS: [usize; 4] = [4 << 10, 64 << 10, 1 << 20, 64 << 20];
const LANES: [usize; 3] = [1, 2, 4];
/// The second local address of the multi-address rows (any 127/8 address is `lo` on Linux).
const SECOND_ADDRESS: &str = "127.0.0.2:0";
/// Lane counts of the multi-address rows.
const MULTI_ADDRESS_LANES: [usize; 2] = [2, 4];

/// Settings of one run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Fewer bytes and repetitions (a smoke run of a few seconds).
    pub quick: bool,
    /// Block sizes to measure (bytes); empty means 4 KiB, 64 KiB, 1 MiB and 64 MiB.
    pub blocks: Vec<usize>,
    /// Rounds of the whole interleaved measurement per block size (medians reported; at least
    /// 1, at most [`MAX_ROUNDS`]).
    pub rounds: usize,
}

/// The most rounds one run takes (a round of the four block sizes is about 8 s here).
pub const MAX_ROUNDS: usize = 20;

/// How a row's lanes carry the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// Same-host pulls on (the default): the receiver copies large frames out of the writer.
    Pull,
    /// Same-host pulls off: every byte through the sockets, as between machines.
    Socket,
}

impl Path {
    const BOTH: [Path; 2] = [Path::Pull, Path::Socket];

    fn same_host(self) -> bool {
        self == Path::Pull
    }

    fn name(self) -> &'static str {
        match self {
            Path::Pull => "pull",
            Path::Socket => "socket",
        }
    }
}

/// One block size, lane count and path.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// Bytes per write.
    pub block_bytes: usize,
    /// Fabric lanes (connections) to the peer.
    pub lanes: usize,
    /// Whether same-host pulls were on.
    pub path: Path,
    /// Bytes the writer handed to its sockets (headers included) per byte it moved, over the
    /// throughput measurements: which path really carried the bytes.
    pub socket_bytes_per_byte: f64,
    /// Fabric throughput, GB/s (the median round's).
    pub gbps: f64,
    /// One plain TCP stream moving the same bytes, GB/s (the median round's).
    pub tcp_gbps: f64,
    /// The fabric's rate over the plain stream's, measured side by side: the median of the
    /// rounds' own ratios.
    pub ratio_vs_tcp: f64,
    /// Every round's ratio, in order.
    pub ratio_vs_tcp_rounds: Vec<f64>,
    /// memcpy of the same bytes, GB/s.
    pub memcpy_gbps: f64,
    /// Fabric write round trip, microseconds.
    pub p50_us: f64,
    /// Its 99th percentile, microseconds.
    pub p99_us: f64,
    /// TCP ping-pong of one block, microseconds.
    pub tcp_p50_us: f64,
    /// Its 99th percentile, microseconds.
    pub tcp_p99_us: f64,
}

/// Bytes one local address of the writer sent during a measurement.
#[derive(Debug, Clone, Serialize)]
pub struct AddressShare {
    /// The local address.
    pub address: String,
    /// Bytes it sent, headers included.
    pub bytes_sent: u64,
}

/// One block size and lane count with both ends on two local addresses.
#[derive(Debug, Clone, Serialize)]
pub struct AddressRow {
    /// Bytes per write.
    pub block_bytes: usize,
    /// Fabric lanes (connections) to the peer.
    pub lanes: usize,
    /// Fabric throughput, GB/s (the median round's).
    pub gbps: f64,
    /// The one-TCP-stream baseline of the same block size (the same figure as in `rows`).
    pub tcp_gbps: f64,
    /// The median of the rounds' own ratios, as in `rows`.
    pub ratio_vs_tcp: f64,
    /// Every round's ratio, in order.
    pub ratio_vs_tcp_rounds: Vec<f64>,
    /// What each of the writer's addresses sent over the throughput measurements (headers
    /// included), in the endpoint's order.
    pub addresses: Vec<AddressShare>,
}

/// The whole report.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// `fabric`.
    pub bench: &'static str,
    /// The units of the figures.
    pub units: &'static str,
    /// One row per block size and lane count.
    pub rows: Vec<Row>,
    /// The lane count a fabric uses on this machine when none is configured.
    pub default_lanes: usize,
    /// Rounds of the interleaved measurement behind each row.
    pub rounds: usize,
    /// Both ends on two local addresses; empty when the second address could not be used
    /// (`multi_address_error` then says why).
    pub multi_address: Vec<AddressRow>,
    /// Why the second address could not be used, if it could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub multi_address_error: Option<String>,
    /// Wall time of the whole run, seconds.
    pub elapsed_s: f64,
}

impl Report {
    /// A human-readable table.
    pub fn human(&self) -> String {
        let rounds = if self.rounds > 1 {
            format!(" (each row its median of {} rounds)", self.rounds)
        } else {
            String::new()
        };
        let mut s = format!(
            "fabric (TCP backend) vs one TCP stream and memcpy, two processes on loopback{rounds}\n"
        );
        s.push_str(
            "block      lanes  path    on wire  fabric GB/s  tcp GB/s  ratio  memcpy GB/s  p50 us  p99 us  tcp p50  tcp p99\n",
        );
        for r in &self.rows {
            s.push_str(&format!(
                "{:>9}  {:>5}  {:<6}  {:>7.3}  {:>11.2}  {:>8.2}  {:>5.2}  {:>11.2}  {:>6.0}  {:>6.0}  {:>7.0}  {:>7.0}\n",
                human_bytes(r.block_bytes),
                r.lanes,
                r.path.name(),
                r.socket_bytes_per_byte,
                r.gbps,
                r.tcp_gbps,
                r.ratio_vs_tcp,
                r.memcpy_gbps,
                r.p50_us,
                r.p99_us,
                r.tcp_p50_us,
                r.tcp_p99_us
            ));
        }
        if !self.multi_address.is_empty() {
            s.push_str(
                "both ends on two addresses (127.0.0.1, 127.0.0.2)\n\
                 block      lanes  fabric GB/s  tcp GB/s  ratio  sent per address (MB)\n",
            );
        }
        for r in &self.multi_address {
            let shares: Vec<String> = r
                .addresses
                .iter()
                .map(|a| format!("{} {:.0}", a.address, a.bytes_sent as f64 / 1e6))
                .collect();
            s.push_str(&format!(
                "{:>9}  {:>5}  {:>11.2}  {:>8.2}  {:>5.2}  {}\n",
                human_bytes(r.block_bytes),
                r.lanes,
                r.gbps,
                r.tcp_gbps,
                r.ratio_vs_tcp,
                shares.join(", ")
            ));
        }
        if let Some(e) = &self.multi_address_error {
            s.push_str(&format!("two addresses: not measured ({e})\n"));
        }
        s.push_str(&format!(
            "default lanes on this machine: {}\ntotal {:.1} s\n",
            self.default_lanes, self.elapsed_s
        ));
        s
    }
}

fn human_bytes(n: usize) -> String {
    if n >= 1 << 20 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{} KiB", n >> 10)
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct PeerHello {
    region: RegionDescriptor,
    /// A region of the peer's two-address fabric, or why it has none.
    two_addresses: Result<RegionDescriptor, String>,
    tcp_sink: String,
}

/// A loopback fabric configuration on 127.0.0.1 and [`SECOND_ADDRESS`], same-host pulls off
/// (these rows count the bytes that cross each address; pulled bytes cross none).
fn two_address_config(token: &str, lanes: usize) -> FabricConfig {
    FabricConfig {
        extra_listen: vec![SECOND_ADDRESS.into()],
        same_host: false,
        ..FabricConfig::loopback(token, lanes)
    }
}

/// The peer side: receive region + TCP sink; prints one JSON line, serves until stdin closes.
pub fn run_peer() -> anyhow::Result<()> {
    let token = std::env::var(TOKEN_ENV).context("the peer needs its job token")?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let fabric = rt.block_on(TcpFabric::start(&FabricConfig::loopback(&token, 1)))?;
    let region = fabric.alloc(REGION_BYTES, Access::RECEIVE)?;
    let two = rt
        .block_on(TcpFabric::start(&two_address_config(&token, 1)))
        .and_then(|f| Ok((f.alloc(REGION_BYTES, Access::RECEIVE)?, f)))
        .map_err(|e| e.to_string());
    let sink = TcpListener::bind("127.0.0.1:0")?;
    let hello = PeerHello {
        region: region.descriptor().clone(),
        two_addresses: two
            .as_ref()
            .map(|(r, _)| r.descriptor().clone())
            .map_err(Clone::clone),
        tcp_sink: sink.local_addr()?.to_string(),
    };
    println!("{}", serde_json::to_string(&hello)?);
    std::io::stdout().flush()?;
    std::thread::spawn(move || {
        for stream in sink.incoming().flatten() {
            std::thread::spawn(move || {
                if let Err(e) = serve_sink(stream) {
                    tracing::debug!(error = %e, "tcp sink connection ended");
                }
            });
        }
    });
    // Serve until the driver closes our stdin (or dies).
    let mut buf = [0u8; 64];
    while std::io::stdin()
        .read(&mut buf)
        .map(|n| n > 0)
        .unwrap_or(false)
    {}
    drop(region);
    drop(fabric);
    drop(two);
    Ok(())
}

/// Plain TCP sink: request = (mode u8, block u64, count u64); mode 0 streams `count` blocks then
/// answers one byte; mode 1 answers one byte after every block (ping-pong).
fn serve_sink(mut s: TcpStream) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    let mut buf = vec![0u8; REGION_BYTES];
    loop {
        let mut req = [0u8; 17];
        s.read_exact(&mut req)?;
        let block = u64::from_le_bytes(req[1..9].try_into().unwrap_or_default()) as usize;
        let count = u64::from_le_bytes(req[9..17].try_into().unwrap_or_default());
        if block == 0 || block > REGION_BYTES {
            return Ok(());
        }
        let slots = (REGION_BYTES / block) as u64;
        for i in 0..count {
            let off = ((i % slots) as usize) * block;
            s.read_exact(&mut buf[off..off + block])?;
            if req[0] == 1 {
                s.write_all(&[1])?;
            }
        }
        if req[0] == 0 {
            s.write_all(&[1])?;
        }
    }
}

struct Peer {
    child: Child,
    hello: PeerHello,
}

impl Peer {
    fn spawn(token: &str) -> anyhow::Result<Peer> {
        let this = Program::this().context("finding the weightsync binary")?;
        let mut child = this
            .command()
            .args(PEER_ARGS)
            .env(TOKEN_ENV, token)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning the peer process")?;
        let stdout = child.stdout.take().ok_or_else(|| anyhow!("peer stdout"))?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let hello: PeerHello = serde_json::from_str(line.trim())
            .with_context(|| format!("peer said {line:?}, expected its addresses as JSON"))?;
        Ok(Peer { child, hello })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9) / 1e9
}

/// The median of `v` (the mean of the middle two for an even count; 0 for none).
fn median(v: &[f64]) -> f64 {
    crate::plan::median(v.iter().copied())
}

/// A row's figures from its rounds: the median rate and the median of the rounds' ratios to
/// the plain stream measured beside them.
fn of_rounds(fabric: &[f64], tcp: &[f64]) -> (f64, f64, Vec<f64>) {
    let ratios: Vec<f64> = fabric.iter().zip(tcp).map(|(f, t)| f / t).collect();
    (median(fabric), median(&ratios), ratios)
}

fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let i = ((samples.len() - 1) as f64 * p).round() as usize;
    samples[i]
}

/// Bytes moved per throughput measurement and latency samples for one block size.
fn plan(block: usize, quick: bool) -> (u64, usize) {
    let (bytes, samples) = match block {
        b if b <= 4 << 10 => (48u64 << 20, 400),
        b if b <= 64 << 10 => (256 << 20, 300),
        b if b <= 1 << 20 => (512 << 20, 100),
        _ => (512 << 20, 6),
    };
    if quick {
        ((bytes / 8).max(block as u64 * 2), (samples / 10).max(3))
    } else {
        (bytes, samples)
    }
}

async fn fabric_throughput(
    fabric: &TcpFabric,
    src: &Region,
    dst: &RegionDescriptor,
    block: usize,
    total: u64,
) -> anyhow::Result<Duration> {
    let count = (total / block as u64).max(1);
    let window = ((16usize << 20) / block).clamp(2, 256);
    let slots = (REGION_BYTES / block) as u64;
    let mut in_flight = VecDeque::with_capacity(window);
    let start = Instant::now();
    for i in 0..count {
        let off = (i % slots) * block as u64;
        if in_flight.len() == window {
            let f: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> =
                in_flight.pop_front().expect("window is full");
            f.await?;
        }
        in_flight.push_back(Box::pin(fabric.write(WriteOp::new(
            src,
            off,
            dst,
            off,
            block as u64,
        ))));
    }
    for f in in_flight {
        f.await?;
    }
    Ok(start.elapsed())
}

async fn fabric_latency(
    fabric: &TcpFabric,
    src: &Region,
    dst: &RegionDescriptor,
    block: usize,
    samples: usize,
) -> anyhow::Result<Vec<f64>> {
    let slots = (REGION_BYTES / block) as u64;
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples as u64 {
        let off = (i % slots) * block as u64;
        let t = Instant::now();
        fabric
            .write(WriteOp::new(src, off, dst, off, block as u64))
            .await?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(out)
}

fn tcp_throughput(
    s: &mut TcpStream,
    data: &[u8],
    block: usize,
    total: u64,
) -> anyhow::Result<Duration> {
    let count = (total / block as u64).max(1);
    let slots = (data.len() / block) as u64;
    let start = Instant::now();
    let mut req = [0u8; 17];
    req[1..9].copy_from_slice(&(block as u64).to_le_bytes());
    req[9..17].copy_from_slice(&count.to_le_bytes());
    s.write_all(&req)?;
    for i in 0..count {
        let off = ((i % slots) as usize) * block;
        s.write_all(&data[off..off + block])?;
    }
    let mut ack = [0u8; 1];
    s.read_exact(&mut ack)?;
    Ok(start.elapsed())
}

fn tcp_latency(
    s: &mut TcpStream,
    data: &[u8],
    block: usize,
    samples: usize,
) -> anyhow::Result<Vec<f64>> {
    let mut req = [0u8; 17];
    req[0] = 1;
    req[1..9].copy_from_slice(&(block as u64).to_le_bytes());
    req[9..17].copy_from_slice(&(samples as u64).to_le_bytes());
    s.write_all(&req)?;
    let slots = data.len() / block;
    let mut out = Vec::with_capacity(samples);
    let mut ack = [0u8; 1];
    for i in 0..samples {
        let off = (i % slots) * block;
        let t = Instant::now();
        s.write_all(&data[off..off + block])?;
        s.read_exact(&mut ack)?;
        out.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(out)
}

fn memcpy_gbps(src: &[u8], dst: &mut [u8], block: usize, total: u64) -> f64 {
    let count = (total / block as u64).max(1);
    let slots = (src.len() / block) as u64;
    let start = Instant::now();
    for i in 0..count {
        let off = ((i % slots) as usize) * block;
        dst[off..off + block].copy_from_slice(&src[off..off + block]);
    }
    std::hint::black_box(&dst[..]);
    gbps(count * block as u64, start.elapsed())
}

/// Runs the benchmark (spawns the peer process).
pub fn run(cfg: &Config) -> anyhow::Result<Report> {
    if cfg.rounds == 0 || cfg.rounds > MAX_ROUNDS {
        bail!("rounds must be 1..={MAX_ROUNDS}, not {}", cfg.rounds);
    }
    let started = Instant::now();
    let token = format!("bench-fabric-{:016x}", rand::random::<u64>());
    let peer = Peer::spawn(&token)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let reps = if cfg.quick { 1 } else { 3 };
    let mut data = vec![0u8; REGION_BYTES];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
    }
    let mut scratch = vec![0u8; REGION_BYTES];
    let mut tcp = TcpStream::connect(&peer.hello.tcp_sink).context("connecting the TCP sink")?;
    tcp.set_nodelay(true)?;
    let (rows, multi_address, multi_address_error) = rt.block_on(async {
        let mut fabrics = Vec::new();
        for lanes in LANES {
            for path in Path::BOTH {
                let config = FabricConfig {
                    same_host: path.same_host(),
                    ..FabricConfig::loopback(&token, lanes)
                };
                let f = TcpFabric::start(&config).await?;
                f.connect(&peer.hello.region.endpoint).await?;
                let src = f.alloc(REGION_BYTES, Access::SOURCE)?;
                src.write_at(0, &data)?;
                fabrics.push(((lanes, path), f, src));
            }
        }
        let (multi, multi_error) = match two_address_writers(&peer.hello, &token, &data).await {
            Ok(m) => (m, None),
            Err(e) => (Vec::new(), Some(format!("{e:#}"))),
        };
        let dst = &peer.hello.region;
        let mut rows = Vec::new();
        let mut multi_rows = Vec::new();
        let blocks = if cfg.blocks.is_empty() {
            BLOCKS.to_vec()
        } else {
            cfg.blocks.clone()
        };
        for block in blocks {
            if block == 0 || block > REGION_BYTES {
                bail!("block size {block} must be 1..={REGION_BYTES} bytes");
            }
            let (total, samples) = plan(block, cfg.quick);
            let moved = total / block as u64 * block as u64;
            // Per round: the best of `reps` interleaved runs of each.
            let mut tcp_rounds = Vec::with_capacity(cfg.rounds);
            let mut fabric_rounds = vec![Vec::with_capacity(cfg.rounds); fabrics.len()];
            let mut multi_rounds = vec![Vec::with_capacity(cfg.rounds); multi.len()];
            let mut best_memcpy: f64 = 0.0;
            let before: Vec<Vec<u64>> = multi.iter().map(|w| w.sent()).collect();
            let sent_before: Vec<u64> = fabrics.iter().map(|f| f.1.stats().bytes_sent).collect();
            let mut fabric_moved = 0u64;
            for _ in 0..cfg.rounds {
                let mut best_tcp = Duration::MAX;
                let mut best = vec![Duration::MAX; fabrics.len()];
                let mut best_multi = vec![Duration::MAX; multi.len()];
                for _ in 0..reps {
                    best_tcp = best_tcp.min(tcp_throughput(&mut tcp, &data, block, total)?);
                    for (k, (_, f, src)) in fabrics.iter().enumerate() {
                        let t = fabric_throughput(f, src, dst, block, total).await?;
                        best[k] = best[k].min(t);
                    }
                    fabric_moved += moved;
                    for (k, w) in multi.iter().enumerate() {
                        let t = fabric_throughput(&w.fabric, &w.src, &w.dst, block, total).await?;
                        best_multi[k] = best_multi[k].min(t);
                    }
                    best_memcpy = best_memcpy.max(memcpy_gbps(&data, &mut scratch, block, total));
                }
                tcp_rounds.push(gbps(moved, best_tcp));
                for (r, d) in fabric_rounds.iter_mut().zip(&best) {
                    r.push(gbps(moved, *d));
                }
                for (r, d) in multi_rounds.iter_mut().zip(&best_multi) {
                    r.push(gbps(moved, *d));
                }
            }
            let tcp_gbps = median(&tcp_rounds);
            for ((w, before), rounds) in multi.iter().zip(&before).zip(&multi_rounds) {
                let (g, ratio, ratios) = of_rounds(rounds, &tcp_rounds);
                let addresses = w
                    .fabric
                    .address_stats()
                    .into_iter()
                    .zip(before)
                    .map(|(a, b)| AddressShare {
                        address: a.address,
                        bytes_sent: a.bytes_sent - b,
                    })
                    .collect();
                multi_rows.push(AddressRow {
                    block_bytes: block,
                    lanes: w.lanes,
                    gbps: g,
                    tcp_gbps,
                    ratio_vs_tcp: ratio,
                    ratio_vs_tcp_rounds: ratios,
                    addresses,
                });
            }
            let mut tcp_lat = tcp_latency(&mut tcp, &data, block, samples)?;
            for (((lanes, path), f, src), (rounds, sent_before)) in
                fabrics.iter().zip(fabric_rounds.iter().zip(&sent_before))
            {
                let on_wire = (f.stats().bytes_sent - sent_before) as f64 / fabric_moved as f64;
                let mut lat = fabric_latency(f, src, dst, block, samples).await?;
                let (g, ratio, ratios) = of_rounds(rounds, &tcp_rounds);
                rows.push(Row {
                    block_bytes: block,
                    lanes: *lanes,
                    path: *path,
                    socket_bytes_per_byte: on_wire,
                    gbps: g,
                    tcp_gbps,
                    ratio_vs_tcp: ratio,
                    ratio_vs_tcp_rounds: ratios,
                    memcpy_gbps: best_memcpy,
                    p50_us: percentile(&mut lat, 0.5),
                    p99_us: percentile(&mut lat, 0.99),
                    tcp_p50_us: percentile(&mut tcp_lat, 0.5),
                    tcp_p99_us: percentile(&mut tcp_lat, 0.99),
                });
            }
        }
        anyhow::Ok((rows, multi_rows, multi_error))
    })?;
    let mut req = [0u8; 17];
    req[0] = 0;
    tcp.write_all(&req)?; // block 0 ends the sink connection
    drop(peer);
    if rows.is_empty() {
        bail!("no measurements");
    }
    Ok(Report {
        bench: "fabric",
        units: "gbps = GB/s (1e9 bytes/s); latencies in microseconds",
        rows,
        default_lanes: FabricConfig::machine_lanes_per_peer(1),
        rounds: cfg.rounds,
        multi_address,
        multi_address_error,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

/// A writer on two local addresses, connected to the peer's two-address fabric.
struct TwoAddressWriter {
    lanes: usize,
    fabric: TcpFabric,
    src: Region,
    dst: RegionDescriptor,
}

impl TwoAddressWriter {
    /// Bytes sent so far from each local address.
    fn sent(&self) -> Vec<u64> {
        self.fabric
            .address_stats()
            .iter()
            .map(|a| a.bytes_sent)
            .collect()
    }
}

async fn two_address_writers(
    peer: &PeerHello,
    token: &str,
    data: &[u8],
) -> anyhow::Result<Vec<TwoAddressWriter>> {
    let dst = peer
        .two_addresses
        .clone()
        .map_err(|e| anyhow!("the peer has no two-address fabric: {e}"))?;
    let mut writers = Vec::new();
    for lanes in MULTI_ADDRESS_LANES {
        let fabric = TcpFabric::start(&two_address_config(token, lanes)).await?;
        fabric.connect(&dst.endpoint).await?;
        let src = fabric.alloc(REGION_BYTES, Access::SOURCE)?;
        src.write_at(0, data)?;
        writers.push(TwoAddressWriter {
            lanes,
            fabric,
            src,
            dst: dst.clone(),
        });
    }
    Ok(writers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_take_the_median_round_and_the_median_of_paired_ratios() {
        assert_eq!(median(&[]), 0.0);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        // Each round's ratio is taken first, so a round is compared with the stream measured
        // beside it: the median of those (2.0) is not the ratio of the medians (5 / 3).
        let (g, ratio, ratios) = of_rounds(&[4.0, 6.0, 5.0], &[1.0, 3.0, 5.0]);
        assert_eq!(g, 5.0);
        assert_eq!(ratios, vec![4.0, 2.0, 1.0]);
        assert_eq!(ratio, 2.0);
    }

    #[test]
    fn rounds_out_of_range_are_refused_by_name_before_anything_starts() {
        for rounds in [0, MAX_ROUNDS + 1] {
            let cfg = Config {
                quick: true,
                blocks: Vec::new(),
                rounds,
            };
            let err = run(&cfg).unwrap_err().to_string();
            assert!(err.contains("rounds must be 1..=20"), "{err}");
        }
    }
}
