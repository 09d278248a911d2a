//! Lane handshake: both sides prove they know the job token, without sending it.
//!
//! ```text
//! client -> server  ClientHello  magic, version, client nonce (32 B), client instance id
//! server -> client  ServerHello  magic, version, server nonce (32 B), server proof
//! client -> server  client proof (32 B)
//! server -> client  verdict (8 B: accepted or not)
//! client -> server  pull offer (32 B: pid, boot id, probe address, shared memory offered; or none)
//! server -> client  pull answer (8 B: yes, no, or shared memory + secret and socket name, 64 B)
//! client -> server  after a shared-memory answer: connected or not (8 B)
//! ```
//! Proofs are BLAKE3 keyed hashes under a key derived from the token, over a direction label and
//! both nonces (and the instance id), so each is fresh per connection, cannot be replayed or
//! reflected, and reveals nothing about the token. The server proves first so that a client never
//! sends its proof to an impostor; the server accepts frames only after the client's proof
//! checks. Comparisons are constant-time (`blake3::Hash` equality).
//!
//! The last exchange, only once both are authenticated, agrees on same-host pulls
//! (`same_host`): the server reads the client's nonce out of the client's memory at the offered
//! address, and pulls that lane's PULL frames only if it read the right bytes. Where the kernel
//! refuses it that read (or the receiver's [`SameHostPath`] says `shared`) and the writer offered
//! shared memory, the receiver answers with a UNIX socket for the writer's descriptors instead
//! (`shared_pulls`).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::same_host::{
    ANSWER_LEN, ANSWER_NO, ANSWER_SHARED, ANSWER_YES, Declined, OFFER_LEN, PullOffer, WriterProcess,
};
use super::shared_pulls::{
    PullMode, SharedInvite, SharedWriter, join_shared, receiver_wants_shared,
};
use crate::fabric::config::SameHostPath;
use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::{FabricError, Result};

const MAGIC: &[u8; 8] = b"WSFABRIC";
// 3: pull offers may offer shared memory, answered with `ANSWER_SHARED` (`shared_pulls`).
const VERSION: u32 = 3;
/// Size of [`ClientHello`] on the wire.
pub const CLIENT_HELLO_LEN: usize = 52;
/// Size of [`ServerHello`] on the wire.
pub const SERVER_HELLO_LEN: usize = 76;
const VERDICT_ACCEPTED: [u8; 8] = *b"ACCEPTED";

/// First message of a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientHello {
    /// Fresh random nonce.
    pub nonce: [u8; 32],
    /// Random id of the writing process (scopes split-write ids).
    pub instance: u64,
}

impl ClientHello {
    /// Encodes the message.
    pub fn encode(&self) -> [u8; CLIENT_HELLO_LEN] {
        let mut b = [0u8; CLIENT_HELLO_LEN];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..44].copy_from_slice(&self.nonce);
        b[44..52].copy_from_slice(&self.instance.to_le_bytes());
        b
    }

    /// Decodes and validates the message.
    pub fn decode(b: &[u8; CLIENT_HELLO_LEN]) -> std::result::Result<ClientHello, String> {
        check_magic(&b[..12])?;
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&b[12..44]);
        let mut id = [0u8; 8];
        id.copy_from_slice(&b[44..52]);
        let instance = u64::from_le_bytes(id);
        Ok(ClientHello { nonce, instance })
    }
}

/// The server's answer: its nonce and its proof.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerHello {
    /// Fresh random nonce.
    pub nonce: [u8; 32],
    /// Keyed hash proving the server knows the token.
    pub proof: [u8; 32],
}

impl ServerHello {
    /// Encodes the message.
    pub fn encode(&self) -> [u8; SERVER_HELLO_LEN] {
        let mut b = [0u8; SERVER_HELLO_LEN];
        b[..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..44].copy_from_slice(&self.nonce);
        b[44..76].copy_from_slice(&self.proof);
        b
    }

    /// Decodes and validates the message.
    pub fn decode(b: &[u8; SERVER_HELLO_LEN]) -> std::result::Result<ServerHello, String> {
        check_magic(&b[..12])?;
        let mut nonce = [0u8; 32];
        nonce.copy_from_slice(&b[12..44]);
        let mut proof = [0u8; 32];
        proof.copy_from_slice(&b[44..76]);
        Ok(ServerHello { nonce, proof })
    }
}

fn check_magic(b: &[u8]) -> std::result::Result<(), String> {
    if &b[..8] != MAGIC {
        return Err("not a weightsync fabric lane (bad magic)".into());
    }
    let version = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
    if version != VERSION {
        return Err(format!(
            "fabric protocol version {version}, expected {VERSION}"
        ));
    }
    Ok(())
}

fn proof(
    key: &[u8; 32],
    label: &[u8],
    client: &ClientHello,
    server_nonce: &[u8; 32],
) -> blake3::Hash {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(label);
    h.update(&client.nonce);
    h.update(server_nonce);
    h.update(&client.instance.to_le_bytes());
    h.finalize()
}

fn io_err(peer: &Endpoint, what: &str, e: std::io::Error, stream_timeout: Duration) -> FabricError {
    if matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    ) {
        FabricError::Timeout {
            what: format!("handshake with {peer}: {what}"),
            after: stream_timeout,
        }
    } else {
        FabricError::io(format!("handshake with {peer}: {what}"), e)
    }
}

/// Runs the client side on a freshly connected stream (read timeouts set by the caller),
/// offering no same-host pulls: every frame on the lane carries its payload.
pub fn client_handshake(
    stream: &mut TcpStream,
    key: &[u8; 32],
    instance: u64,
    peer: &Endpoint,
) -> Result<()> {
    client_handshake_offering(stream, key, instance, peer, false).map(|_| ())
}

/// Runs the client side, offering same-host pulls when `offer_pulls`; returns whether the
/// server agreed to pull this lane's PULL frames.
pub fn client_handshake_offering(
    stream: &mut TcpStream,
    key: &[u8; 32],
    instance: u64,
    peer: &Endpoint,
    offer_pulls: bool,
) -> Result<bool> {
    let path = offer_pulls.then_some(SameHostPath::Ptrace);
    client_handshake_same_host(stream, key, instance, peer, path).map(|m| m.pulls())
}

/// Runs the client side, offering same-host pulls when `path` is given (and shared memory
/// unless it is [`SameHostPath::Ptrace`]); returns how the server will read this lane's PULL
/// frames.
pub fn client_handshake_same_host(
    stream: &mut TcpStream,
    key: &[u8; 32],
    instance: u64,
    peer: &Endpoint,
    path: Option<SameHostPath>,
) -> Result<PullMode> {
    let offer_pulls = path.is_some();
    let offer_shared = path.is_some_and(|p| p != SameHostPath::Ptrace);
    let after = stream.read_timeout().ok().flatten().unwrap_or_default();
    let hello = ClientHello {
        nonce: rand::random(),
        instance,
    };
    stream
        .write_all(&hello.encode())
        .map_err(|e| io_err(peer, "sending hello", e, after))?;
    let mut b = [0u8; SERVER_HELLO_LEN];
    stream
        .read_exact(&mut b)
        .map_err(|e| io_err(peer, "reading server hello", e, after))?;
    let server = ServerHello::decode(&b).map_err(|detail| FabricError::Auth {
        peer: peer.clone(),
        detail,
    })?;
    if proof(key, b"server", &hello, &server.nonce) != blake3::Hash::from(server.proof) {
        return Err(FabricError::Auth {
            peer: peer.clone(),
            detail: "peer does not know the job token".into(),
        });
    }
    let mine = proof(key, b"client", &hello, &server.nonce);
    stream
        .write_all(mine.as_bytes())
        .map_err(|e| io_err(peer, "sending proof", e, after))?;
    let mut verdict = [0u8; 8];
    stream
        .read_exact(&mut verdict)
        .map_err(|_| FabricError::Auth {
            peer: peer.clone(),
            detail: "peer refused our proof of the job token".into(),
        })?;
    if verdict != VERDICT_ACCEPTED {
        return Err(FabricError::Auth {
            peer: peer.clone(),
            detail: "peer refused our proof of the job token".into(),
        });
    }
    // The probe is `hello.nonce` itself, which stays where it is until the answer is read.
    let offer = PullOffer::of_this_process(offer_pulls, offer_shared, &hello.nonce);
    stream
        .write_all(&offer.encode())
        .map_err(|e| io_err(peer, "sending the pull offer", e, after))?;
    let mut answer = [0u8; ANSWER_LEN];
    stream
        .read_exact(&mut answer)
        .map_err(|e| io_err(peer, "reading the pull answer", e, after))?;
    match answer {
        ANSWER_YES if offer.offered => Ok(PullMode::Ptrace),
        ANSWER_NO => Ok(PullMode::Payloads),
        ANSWER_SHARED if offer.shared => match join_shared(stream) {
            Ok(Some(exporter)) => Ok(PullMode::Shared(exporter)),
            Ok(None) => Ok(PullMode::Payloads),
            Err(e) => Err(io_err(peer, "agreeing on shared memory", e, after)),
        },
        _ => Err(FabricError::Protocol {
            peer: peer.clone(),
            detail: format!("bad pull answer {answer:?} to offer {offer:?}"),
        }),
    }
}

/// What the server side learned of an authenticated client.
#[derive(Debug)]
pub struct Accepted {
    /// The client's instance id (scopes its split-write ids).
    pub instance: u64,
    /// The writer to pull PULL frames from with `process_vm_readv`, when both sides agreed on
    /// same-host pulls that way.
    pub writer: Option<WriterProcess>,
    /// The writer's shared memory to pull PULL frames from, when they agreed on that instead.
    pub shared: Option<SharedWriter>,
}

/// Runs the server side; returns what it learned once the client's proof checked. Pulls are
/// agreed only when `allow_pulls` and the client's offer verifies (`process_vm_readv` where the
/// kernel allows it, else shared memory where the client offered it).
pub fn server_handshake(
    stream: &mut TcpStream,
    key: &[u8; 32],
    peer: &Endpoint,
    allow_pulls: bool,
) -> Result<Accepted> {
    server_handshake_same_host(stream, key, peer, allow_pulls.then_some(SameHostPath::Auto))
}

/// Runs the server side, allowing same-host pulls as `path` says (`None`: none).
pub fn server_handshake_same_host(
    stream: &mut TcpStream,
    key: &[u8; 32],
    peer: &Endpoint,
    path: Option<SameHostPath>,
) -> Result<Accepted> {
    let after = stream.read_timeout().ok().flatten().unwrap_or_default();
    serve_handshake(stream, key, peer, path, after)
}

/// [`server_handshake_same_host`] with one deadline for the whole exchange: a peer that
/// trickles its bytes (one every few seconds) is cut when `limit` has passed since the start,
/// however many reads it took, so an unauthenticated peer holds a handshake slot for at most
/// `limit`.
pub fn server_handshake_within(
    stream: &TcpStream,
    key: &[u8; 32],
    peer: &Endpoint,
    path: Option<SameHostPath>,
    limit: Duration,
) -> Result<Accepted> {
    let mut bounded = WithDeadline {
        stream,
        deadline: Instant::now() + limit,
    };
    serve_handshake(&mut bounded, key, peer, path, limit)
}

/// A stream whose every read and write fails once its deadline has passed.
struct WithDeadline<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl WithDeadline<'_> {
    fn remaining(&self) -> std::io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(std::io::ErrorKind::TimedOut.into())
        } else {
            Ok(left)
        }
    }
}

impl Read for WithDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

impl Write for WithDeadline<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.write(buf)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn serve_handshake<S: Read + Write>(
    stream: &mut S,
    key: &[u8; 32],
    peer: &Endpoint,
    path: Option<SameHostPath>,
    after: Duration,
) -> Result<Accepted> {
    let mut b = [0u8; CLIENT_HELLO_LEN];
    stream
        .read_exact(&mut b)
        .map_err(|e| io_err(peer, "reading client hello", e, after))?;
    let hello = ClientHello::decode(&b).map_err(|detail| FabricError::Auth {
        peer: peer.clone(),
        detail,
    })?;
    let nonce: [u8; 32] = rand::random();
    let server = ServerHello {
        nonce,
        proof: *proof(key, b"server", &hello, &nonce).as_bytes(),
    };
    stream
        .write_all(&server.encode())
        .map_err(|e| io_err(peer, "sending server hello", e, after))?;
    let mut theirs = [0u8; 32];
    stream
        .read_exact(&mut theirs)
        .map_err(|e| io_err(peer, "reading client proof", e, after))?;
    if proof(key, b"client", &hello, &nonce) != blake3::Hash::from(theirs) {
        let _ = stream.write_all(b"REFUSED!");
        return Err(FabricError::Auth {
            peer: peer.clone(),
            detail: "client does not know the job token".into(),
        });
    }
    stream
        .write_all(&VERDICT_ACCEPTED)
        .map_err(|e| io_err(peer, "sending verdict", e, after))?;
    let mut b = [0u8; OFFER_LEN];
    stream
        .read_exact(&mut b)
        .map_err(|e| io_err(peer, "reading the pull offer", e, after))?;
    let offer = PullOffer::decode(&b).map_err(|detail| FabricError::Protocol {
        peer: peer.clone(),
        detail,
    })?;
    // (ptrace pulls, try shared memory instead)
    let (writer, try_shared) = match (path, offer.offered) {
        (Some(path), true) => match WriterProcess::verify(&offer, &hello.nonce) {
            Ok(_) if offer.shared && receiver_wants_shared(path, false) => (None, true),
            Ok(w) => (Some(w), false),
            // Between machines this is every lane: nothing to report.
            Err(why @ (Declined::OtherMachine | Declined::NoBootId | Declined::NotOffered)) => {
                tracing::debug!(%peer, %why, "no same-host pulls");
                (None, false)
            }
            Err(why @ Declined::PtraceRefused(_))
                if offer.shared && receiver_wants_shared(path, true) =>
            {
                tracing::info!(%peer, %why, "ptrace access refused; pulling from shared memory");
                (None, true)
            }
            // On one machine pulls were expected: say why they are not used.
            Err(why) => {
                tracing::info!(%peer, %why, "same-host pulls declined; the lane carries payloads");
                (None, false)
            }
        },
        _ => (None, false),
    };
    let invite = try_shared.then(SharedInvite::open).and_then(|opened| match opened {
        Ok(i) => Some(i),
        Err(e) => {
            tracing::info!(%peer, error = %e, "no shared-memory socket; the lane carries payloads");
            None
        }
    });
    let Some(invite) = invite else {
        let answer = if writer.is_some() {
            ANSWER_YES
        } else {
            ANSWER_NO
        };
        stream
            .write_all(&answer)
            .map_err(|e| io_err(peer, "sending the pull answer", e, after))?;
        return Ok(Accepted {
            instance: hello.instance,
            writer,
            shared: None,
        });
    };
    stream
        .write_all(&invite.answer())
        .map_err(|e| io_err(peer, "sending the shared-memory answer", e, after))?;
    let shared = invite
        .accept(stream, after.max(Duration::from_secs(1)))
        .map_err(|e| io_err(peer, "agreeing on shared memory", e, after))?;
    Ok(Accepted {
        instance: hello.instance,
        writer: None,
        shared,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_trickling_client_is_cut_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let key = crate::fabric::JobToken("t".into()).handshake_key();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let start = Instant::now();
            let r = server_handshake_within(
                &s,
                &key,
                &"client".into(),
                None,
                Duration::from_millis(300),
            );
            (r, start.elapsed())
        });
        let mut c = TcpStream::connect(addr).unwrap();
        // One byte every 100 ms: each read is quick, the whole hello would take 5 s.
        for _ in 0..10 {
            if c.write_all(b"W").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let (r, took) = server.join().unwrap();
        assert!(matches!(r, Err(FabricError::Timeout { .. })), "{r:?}");
        assert!(took < Duration::from_millis(900), "took {took:?}");
    }

    fn pair_with(
        client_token: &str,
        server_token: &str,
        offer: bool,
        allow: bool,
    ) -> (Result<bool>, Result<Accepted>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let skey = crate::fabric::JobToken(server_token.into()).handshake_key();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            server_handshake(&mut s, &skey, &"client".into(), allow)
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let ckey = crate::fabric::JobToken(client_token.into()).handshake_key();
        let cr = client_handshake_offering(&mut c, &ckey, 42, &addr.into(), offer);
        drop(c);
        (cr, server.join().unwrap())
    }

    fn pair(client_token: &str, server_token: &str) -> (Result<bool>, Result<Accepted>) {
        pair_with(client_token, server_token, false, true)
    }

    #[test]
    fn same_token_authenticates_both_ways() {
        let (c, s) = pair("tok", "tok");
        assert!(!c.unwrap(), "no offer, no pulls");
        let s = s.unwrap();
        assert_eq!(s.instance, 42);
        assert_eq!(s.writer, None);
    }

    #[test]
    fn pulls_are_agreed_only_when_offered_allowed_and_verified() {
        if super::super::same_host::boot_id().is_none() {
            return; // no boot id here: pulls are never offered
        }
        // Offered and allowed: the server read the client's nonce out of its memory.
        let (c, s) = pair_with("tok", "tok", true, true);
        assert!(c.unwrap());
        assert_eq!(s.unwrap().writer.map(|w| w.pid()), Some(std::process::id()));
        // Offered, not allowed by the server: payloads.
        let (c, s) = pair_with("tok", "tok", true, false);
        assert!(!c.unwrap());
        assert_eq!(s.unwrap().writer, None);
    }

    #[test]
    fn different_tokens_fail_on_both_sides() {
        let (c, s) = pair("tok", "other");
        assert!(matches!(c, Err(FabricError::Auth { .. })), "{c:?}");
        assert!(s.is_err());
    }

    #[test]
    fn hellos_round_trip_and_reject_bad_magic() {
        let h = ClientHello {
            nonce: [7; 32],
            instance: 5,
        };
        assert_eq!(ClientHello::decode(&h.encode()), Ok(h));
        let s = ServerHello {
            nonce: [1; 32],
            proof: [2; 32],
        };
        assert_eq!(ServerHello::decode(&s.encode()), Ok(s));
        let mut b = h.encode();
        b[0] = b'X';
        assert!(ClientHello::decode(&b).is_err());
        let mut b = h.encode();
        b[8] = 9;
        assert!(ClientHello::decode(&b).unwrap_err().contains("version"));
    }
}
