//! Lane handshake: both sides prove they know the job token, without sending it.
//!
//! ```text
//! client -> server  ClientHello  magic, version, client nonce (32 B), client instance id
//! server -> client  ServerHello  magic, version, server nonce (32 B), server proof
//! client -> server  client proof (32 B)
//! server -> client  verdict (8 B: accepted or not)
//! ```
//! Proofs are BLAKE3 keyed hashes under a key derived from the token, over a direction label and
//! both nonces (and the instance id), so each is fresh per connection, cannot be replayed or
//! reflected, and reveals nothing about the token. The server proves first so that a client never
//! sends its proof to an impostor; the server accepts frames only after the client's proof
//! checks. Comparisons are constant-time (`blake3::Hash` equality).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::fabric::descriptor::Endpoint;
use crate::fabric::error::{FabricError, Result};

const MAGIC: &[u8; 8] = b"WSFABRIC";
const VERSION: u32 = 1;
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

/// Runs the client side on a freshly connected stream (read timeouts set by the caller).
pub fn client_handshake(
    stream: &mut TcpStream,
    key: &[u8; 32],
    instance: u64,
    peer: &Endpoint,
) -> Result<()> {
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
    Ok(())
}

/// Runs the server side; returns the client's instance id once its proof checked.
pub fn server_handshake(stream: &mut TcpStream, key: &[u8; 32], peer: &Endpoint) -> Result<u64> {
    let after = stream.read_timeout().ok().flatten().unwrap_or_default();
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
    Ok(hello.instance)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn pair(client_token: &str, server_token: &str) -> (Result<()>, Result<u64>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let skey = crate::fabric::JobToken(server_token.into()).handshake_key();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            server_handshake(&mut s, &skey, &"client".into())
        });
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let ckey = crate::fabric::JobToken(client_token.into()).handshake_key();
        let cr = client_handshake(&mut c, &ckey, 42, &addr.into());
        drop(c);
        (cr, server.join().unwrap())
    }

    #[test]
    fn same_token_authenticates_both_ways() {
        let (c, s) = pair("tok", "tok");
        c.unwrap();
        assert_eq!(s.unwrap(), 42);
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
