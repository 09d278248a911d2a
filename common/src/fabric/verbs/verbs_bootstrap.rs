//! The bootstrap connection: TCP to the peer's fabric endpoint, mutual proof of the job token,
//! then one queue-pair endpoint each way.
//!
//! Verbs needs an out-of-band channel before the NIC can carry anything: each side must learn the
//! other's QP number, PSN and LID/GID. We use the same endpoint address the TCP backend listens
//! on. Both sides prove knowledge of the job token without sending it (a keyed BLAKE3 MAC over
//! two fresh nonces, with distinct labels per direction so neither side can be used as an oracle
//! for the other's proof); a process without the token gets no queue pair, and so no rkey of ours
//! is any use to it.
//!
//! The writer's proof also covers the serialized request, so a relay on the path cannot swap the
//! requested endpoint or the Diagnose parameters.
//!
//! One bootstrap connection per lane stays open for the life of the lane and then carries
//! [`LaneMsg`]s: the receiver reports the receives it re-posted (the writer's receive credits,
//! see `verbs_credits`), and a writer that resets sends a teardown, which the receiver answers
//! once its queue pair is in the error state (so nothing posted before the reset can land after
//! it). When the writer drops the lane (after an error, or on shutdown) the connection closes and
//! the receiving side moves its queue pair to the error state and destroys it. Messages are
//! length-prefixed (u32 little-endian) bincode.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::verbs_endpoint::QpEndpoint;

/// Protocol version; a peer speaking another is refused with a clear message. 2: endpoints carry
/// the receive depth, the maximum message size and the GID type; lane messages (credits,
/// teardown); the writer's proof covers its request.
pub const BOOTSTRAP_VERSION: u32 = 2;
/// Largest bootstrap message accepted.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// Bootstrap messages.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum BootstrapMsg {
    /// Writer → receiver: start, with the writer's nonce.
    Hello {
        /// [`BOOTSTRAP_VERSION`] of the writer.
        version: u32,
        /// Fresh random nonce.
        nonce: [u8; 32],
    },
    /// Receiver → writer: its nonce and its proof over both nonces.
    Challenge {
        /// Fresh random nonce.
        nonce: [u8; 32],
        /// MAC("receiver", writer nonce, receiver nonce).
        proof: [u8; 32],
    },
    /// Writer → receiver: its proof, and what it asks for.
    Connect {
        /// MAC("writer", receiver nonce, writer nonce).
        proof: [u8; 32],
        /// The request.
        request: Request,
    },
    /// Receiver → writer: the answer.
    Accepted {
        /// The reply.
        reply: Reply,
    },
    /// Either side: why it gives up.
    Refused {
        /// The reason.
        reason: String,
    },
}

/// What an authenticated writer asks the receiver for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// Connect a queue pair of lane `lane` to the writer's `endpoint`.
    Lane {
        /// Lane index (for logs).
        lane: u32,
        /// The writer's queue pair.
        endpoint: QpEndpoint,
    },
    /// Say why a write to `[addr, addr + len)` with `rkey` was refused. The NIC reports every
    /// remote protection failure as the same `IBV_WC_REM_ACCESS_ERR`; only the owner of the
    /// memory can tell a forged key from a deregistered region or a range outside it.
    Diagnose {
        /// The rkey used.
        rkey: u32,
        /// First remote address written.
        addr: u64,
        /// Bytes.
        len: u64,
    },
}

/// The receiver's answer to a [`Request`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The receiver's queue pair, already in RTR with receives posted.
    Lane {
        /// Its endpoint.
        endpoint: QpEndpoint,
    },
    /// Why the write was refused (`None`: it would be accepted now).
    Diagnosis {
        /// The reason.
        kind: Option<RefusalKind>,
    },
}

/// What travels on a lane's bootstrap connection once the queue pairs are connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LaneMsg {
    /// Receiver → writer: receives re-posted on the lane's queue pair since it was announced, in
    /// total (the writer's credit window is the announced depth plus this).
    Credit {
        /// Running total.
        reposted: u64,
    },
    /// Writer → receiver: the writer reset the lane; move the queue pair to the error state.
    Teardown,
    /// Receiver → writer: the queue pair is in the error state; nothing more lands through it.
    TornDown,
}

/// Why the receiver refuses a write (serde mirror of `RemoteAccessKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalKind {
    /// No registration has this rkey.
    WrongRkey,
    /// The range is not inside the registration.
    OutOfBounds,
    /// The registration does not allow remote writes.
    NoWritePermission,
    /// The registration was removed.
    Deregistered,
}

impl From<RefusalKind> for crate::fabric::RemoteAccessKind {
    fn from(k: RefusalKind) -> Self {
        match k {
            RefusalKind::WrongRkey => crate::fabric::RemoteAccessKind::WrongRkey,
            RefusalKind::OutOfBounds => crate::fabric::RemoteAccessKind::OutOfBounds,
            RefusalKind::NoWritePermission => crate::fabric::RemoteAccessKind::NoWritePermission,
            RefusalKind::Deregistered => crate::fabric::RemoteAccessKind::Deregistered,
        }
    }
}

/// Why a bootstrap exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    /// Socket error.
    #[error("bootstrap I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer sent something that is not a bootstrap message.
    #[error("bootstrap protocol: {0}")]
    Protocol(String),
    /// The token proof did not verify.
    #[error("bootstrap authentication failed: {0}")]
    Auth(String),
    /// The peer refused.
    #[error("peer refused the queue pair: {0}")]
    Refused(String),
}

/// The 32-byte key both sides derive from the job token. `Debug` never prints it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HandshakeKey(pub [u8; 32]);

impl std::fmt::Debug for HandshakeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HandshakeKey(<redacted>)")
    }
}

/// Which side a proof is from (distinct labels keep the two proofs apart).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The side that connects and writes.
    Writer,
    /// The side that accepts and is written to.
    Receiver,
}

/// The proof of `side` over the peer's nonce, its own, and `bound` (the writer binds its
/// serialized request; the receiver binds nothing).
pub fn proof(
    key: &[u8; 32],
    side: Side,
    peer_nonce: &[u8; 32],
    own_nonce: &[u8; 32],
    bound: &[u8],
) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(match side {
        Side::Writer => b"weightsync verbs bootstrap writer v2".as_slice(),
        Side::Receiver => b"weightsync verbs bootstrap receiver v2".as_slice(),
    });
    h.update(peer_nonce);
    h.update(own_nonce);
    h.update(&(bound.len() as u64).to_le_bytes());
    h.update(bound);
    *h.finalize().as_bytes()
}

fn request_bytes(request: &Request) -> Result<Vec<u8>, BootstrapError> {
    bincode::serialize(request).map_err(|e| BootstrapError::Protocol(format!("encode: {e}")))
}

/// Constant-time check of a proof.
pub fn verify(expected: &[u8; 32], got: &[u8; 32]) -> bool {
    blake3::Hash::from(*expected) == blake3::Hash::from(*got)
}

/// Writes one message.
pub async fn send_msg<W: AsyncWrite + Unpin>(
    w: &mut W,
    msg: &BootstrapMsg,
) -> Result<(), BootstrapError> {
    send_frame(w, msg).await
}

/// Reads one message.
pub async fn recv_msg<R: AsyncRead + Unpin>(r: &mut R) -> Result<BootstrapMsg, BootstrapError> {
    recv_frame(r).await
}

/// Writes one length-prefixed bincode frame.
pub async fn send_frame<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> Result<(), BootstrapError> {
    let body =
        bincode::serialize(msg).map_err(|e| BootstrapError::Protocol(format!("encode: {e}")))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one length-prefixed bincode frame.
pub async fn recv_frame<R: AsyncRead + Unpin, T: DeserializeOwned>(
    r: &mut R,
) -> Result<T, BootstrapError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(BootstrapError::Protocol(format!(
            "message of {len} bytes exceeds {MAX_MESSAGE}"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    bincode::deserialize(&body).map_err(|e| BootstrapError::Protocol(format!("decode: {e}")))
}

/// The writer's half: authenticate both ways, send `request`, return the receiver's reply.
pub async fn writer_exchange<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    key: &[u8; 32],
    request: Request,
) -> Result<Reply, BootstrapError> {
    let nonce: [u8; 32] = rand::random();
    send_msg(
        s,
        &BootstrapMsg::Hello {
            version: BOOTSTRAP_VERSION,
            nonce,
        },
    )
    .await?;
    let (peer_nonce, peer_proof) = match recv_msg(s).await? {
        BootstrapMsg::Challenge { nonce, proof } => (nonce, proof),
        BootstrapMsg::Refused { reason } => return Err(BootstrapError::Refused(reason)),
        other => {
            return Err(BootstrapError::Protocol(format!(
                "expected Challenge, got {other:?}"
            )));
        }
    };
    if !verify(
        &proof(key, Side::Receiver, &nonce, &peer_nonce, &[]),
        &peer_proof,
    ) {
        return Err(BootstrapError::Auth(
            "the peer does not know the job token".into(),
        ));
    }
    send_msg(
        s,
        &BootstrapMsg::Connect {
            proof: proof(
                key,
                Side::Writer,
                &peer_nonce,
                &nonce,
                &request_bytes(&request)?,
            ),
            request,
        },
    )
    .await?;
    match recv_msg(s).await? {
        BootstrapMsg::Accepted { reply } => Ok(reply),
        BootstrapMsg::Refused { reason } => Err(BootstrapError::Refused(reason)),
        other => Err(BootstrapError::Protocol(format!(
            "expected Accepted, got {other:?}"
        ))),
    }
}

/// The receiver's half: authenticate the writer, then let `accept` answer its request (create
/// and connect a queue pair, or diagnose a refusal). Returns what `accept` produced besides the
/// reply (e.g. the queue pair to keep alive).
pub async fn receiver_exchange<S, T, F, Fut>(
    s: &mut S,
    key: &[u8; 32],
    accept: F,
) -> Result<T, BootstrapError>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: FnOnce(Request) -> Fut,
    Fut: Future<Output = Result<(Reply, T), String>>,
{
    let peer_nonce = match recv_msg(s).await? {
        BootstrapMsg::Hello { version, nonce } if version == BOOTSTRAP_VERSION => nonce,
        BootstrapMsg::Hello { version, .. } => {
            let reason =
                format!("bootstrap version {version} unsupported (want {BOOTSTRAP_VERSION})");
            send_msg(
                s,
                &BootstrapMsg::Refused {
                    reason: reason.clone(),
                },
            )
            .await?;
            return Err(BootstrapError::Protocol(reason));
        }
        other => {
            return Err(BootstrapError::Protocol(format!(
                "expected Hello, got {other:?}"
            )));
        }
    };
    let nonce: [u8; 32] = rand::random();
    send_msg(
        s,
        &BootstrapMsg::Challenge {
            nonce,
            proof: proof(key, Side::Receiver, &peer_nonce, &nonce, &[]),
        },
    )
    .await?;
    let (peer_proof, request) = match recv_msg(s).await? {
        BootstrapMsg::Connect { proof, request } => (proof, request),
        BootstrapMsg::Refused { reason } => return Err(BootstrapError::Refused(reason)),
        other => {
            return Err(BootstrapError::Protocol(format!(
                "expected Connect, got {other:?}"
            )));
        }
    };
    let bound = request_bytes(&request)?;
    if !verify(
        &proof(key, Side::Writer, &nonce, &peer_nonce, &bound),
        &peer_proof,
    ) {
        // Say nothing useful to a process without the token.
        send_msg(
            s,
            &BootstrapMsg::Refused {
                reason: "authentication failed".into(),
            },
        )
        .await?;
        return Err(BootstrapError::Auth(
            "the writer does not know the job token".into(),
        ));
    }
    match accept(request).await {
        Ok((reply, value)) => {
            send_msg(s, &BootstrapMsg::Accepted { reply }).await?;
            Ok(value)
        }
        Err(reason) => {
            send_msg(
                s,
                &BootstrapMsg::Refused {
                    reason: reason.clone(),
                },
            )
            .await?;
            Err(BootstrapError::Refused(reason))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(qp_num: u32) -> QpEndpoint {
        QpEndpoint {
            qp_num,
            psn: 5,
            lid: 0,
            gid: Some("::ffff:127.0.0.1".parse().unwrap()),
            mtu: 3,
            recv_depth: 64,
            max_msg_size: 1 << 30,
            gid_type: Some(crate::fabric::verbs::verbs_gid::GidType::RoceV2),
        }
    }

    fn lane(lane: u32, qp_num: u32) -> Request {
        Request::Lane {
            lane,
            endpoint: ep(qp_num),
        }
    }

    #[tokio::test]
    async fn diagnosis_round_trips() {
        let key = [4u8; 32];
        let (mut a, mut b) = tokio::io::duplex(4096);
        let ask = Request::Diagnose {
            rkey: 7,
            addr: 4096,
            len: 100,
        };
        let writer = tokio::spawn(async move { writer_exchange(&mut a, &key, ask).await });
        receiver_exchange(&mut b, &key, |request| async move {
            assert!(matches!(request, Request::Diagnose { rkey: 7, .. }));
            Ok((
                Reply::Diagnosis {
                    kind: Some(RefusalKind::OutOfBounds),
                },
                (),
            ))
        })
        .await
        .unwrap();
        assert_eq!(
            writer.await.unwrap().unwrap(),
            Reply::Diagnosis {
                kind: Some(RefusalKind::OutOfBounds)
            }
        );
    }

    #[tokio::test]
    async fn same_token_exchanges_endpoints() {
        let key = [7u8; 32];
        let (mut a, mut b) = tokio::io::duplex(4096);
        let writer = tokio::spawn(async move { writer_exchange(&mut a, &key, lane(2, 10)).await });
        let got = receiver_exchange(&mut b, &key, |request| async move {
            assert_eq!(request, lane(2, 10));
            Ok((Reply::Lane { endpoint: ep(20) }, "qp-guard"))
        })
        .await
        .unwrap();
        assert_eq!(got, "qp-guard");
        assert_eq!(
            writer.await.unwrap().unwrap(),
            Reply::Lane { endpoint: ep(20) }
        );
    }

    #[tokio::test]
    async fn wrong_token_gets_no_queue_pair() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let writer =
            tokio::spawn(async move { writer_exchange(&mut a, &[1u8; 32], lane(0, 10)).await });
        let err = receiver_exchange(&mut b, &[2u8; 32], |_| async {
            if true {
                panic!("accept must not run for an unauthenticated writer");
            }
            Err::<(Reply, ()), String>(String::new())
        })
        .await
        .unwrap_err();
        // The writer detects the receiver's wrong proof first and hangs up; either way the
        // receiver created nothing.
        assert!(
            matches!(err, BootstrapError::Io(_) | BootstrapError::Auth(_)),
            "{err}"
        );
        let werr = writer.await.unwrap().unwrap_err();
        assert!(matches!(werr, BootstrapError::Auth(_)), "{werr}");
    }

    #[tokio::test]
    async fn a_refusal_reaches_the_writer() {
        let key = [3u8; 32];
        let (mut a, mut b) = tokio::io::duplex(4096);
        let writer = tokio::spawn(async move { writer_exchange(&mut a, &key, lane(0, 1)).await });
        let err = receiver_exchange(&mut b, &key, |_| async {
            Err::<(Reply, ()), String>("out of queue pairs".into())
        })
        .await
        .unwrap_err();
        assert!(matches!(err, BootstrapError::Refused(_)));
        let werr = writer.await.unwrap().unwrap_err();
        assert!(werr.to_string().contains("out of queue pairs"), "{werr}");
    }

    #[tokio::test]
    async fn oversized_and_garbage_frames_are_rejected() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        a.write_all(&(1u32 << 30).to_le_bytes()).await.unwrap();
        let err = recv_msg(&mut b).await.unwrap_err();
        assert!(err.to_string().contains("exceeds"), "{err}");
        a.write_all(&3u32.to_le_bytes()).await.unwrap();
        a.write_all(&[0xff, 0xff, 0xff]).await.unwrap();
        let err = recv_msg(&mut b).await.unwrap_err();
        assert!(matches!(err, BootstrapError::Protocol(_)), "{err}");
    }

    #[test]
    fn proofs_differ_by_side_key_and_request() {
        let (n1, n2) = ([1u8; 32], [2u8; 32]);
        let k = [9u8; 32];
        assert_ne!(
            proof(&k, Side::Writer, &n1, &n2, b"r"),
            proof(&k, Side::Receiver, &n1, &n2, b"r")
        );
        assert_ne!(
            proof(&k, Side::Writer, &n1, &n2, b"r"),
            proof(&[8u8; 32], Side::Writer, &n1, &n2, b"r")
        );
        assert_ne!(
            proof(&k, Side::Writer, &n1, &n2, b"lane 1"),
            proof(&k, Side::Writer, &n1, &n2, b"lane 2")
        );
        assert!(verify(
            &proof(&k, Side::Writer, &n1, &n2, b"r"),
            &proof(&k, Side::Writer, &n1, &n2, b"r")
        ));
    }

    /// V16: a relay that swaps the writer's request (here: the endpoint it asks to connect)
    /// after the proofs must be refused, and `accept` must never see the forged request.
    #[tokio::test]
    async fn a_swapped_request_is_refused() {
        let key = [5u8; 32];
        let (mut w, mut relay_w) = tokio::io::duplex(4096);
        let (mut relay_r, mut r) = tokio::io::duplex(4096);
        let writer = tokio::spawn(async move { writer_exchange(&mut w, &key, lane(0, 10)).await });
        // The relay forwards everything, but rewrites the Connect's request.
        let relay = tokio::spawn(async move {
            let hello = recv_msg(&mut relay_w).await.unwrap();
            send_msg(&mut relay_r, &hello).await.unwrap();
            let challenge = recv_msg(&mut relay_r).await.unwrap();
            send_msg(&mut relay_w, &challenge).await.unwrap();
            match recv_msg(&mut relay_w).await.unwrap() {
                BootstrapMsg::Connect { proof, .. } => {
                    let forged = BootstrapMsg::Connect {
                        proof,
                        request: lane(0, 666),
                    };
                    send_msg(&mut relay_r, &forged).await.unwrap();
                }
                other => panic!("expected Connect, got {other:?}"),
            }
            let answer = recv_msg(&mut relay_r).await.unwrap();
            let _ = send_msg(&mut relay_w, &answer).await;
        });
        let err = receiver_exchange(&mut r, &key, |request| async move {
            if true {
                panic!("accept ran for a forged request {request:?}");
            }
            Err::<(Reply, ()), String>(String::new())
        })
        .await
        .unwrap_err();
        assert!(matches!(err, BootstrapError::Auth(_)), "{err}");
        relay.await.unwrap();
        assert!(writer.await.unwrap().is_err());
    }

    #[tokio::test]
    async fn lane_messages_round_trip() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        for msg in [
            LaneMsg::Credit { reposted: 77 },
            LaneMsg::Teardown,
            LaneMsg::TornDown,
        ] {
            send_frame(&mut a, &msg).await.unwrap();
            assert_eq!(recv_frame::<_, LaneMsg>(&mut b).await.unwrap(), msg);
        }
    }
}
