//! Length-prefixed frames for the control channel.
//!
//! ```text
//! +--------+----------+---------+-----------+------------------+
//! | "WSYC" | ver: u16 | 0: u16  | len: u32  | bincode body     |
//! +--------+----------+---------+-----------+------------------+
//!   4 B      2 B LE     2 B       4 B LE      len bytes
//! ```
//!
//! Every check happens before any allocation that depends on the peer: the magic and version are
//! verified first, the length is compared with the reader's maximum, the body buffer grows only
//! as bytes actually arrive (a peer that announces 200 MiB and sends nothing costs a few
//! kilobytes, not 200 MiB), and the body is decoded with a bincode byte limit equal to its length,
//! so a hostile or corrupted frame yields a [`ControlFrameError`], never a panic or an outsized
//! allocation. Before a peer has proved a secret, readers pass [`PREAUTH_MAX_FRAME`].

use bincode::Options;
use serde::{Serialize, de::DeserializeOwned};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// First four bytes of every frame.
pub const MAGIC: [u8; 4] = *b"WSYC";
/// Version of the control-channel protocol; both ends must agree.
///
/// 2: workers answer `Abort` with `Drained`, and the controller waits for it before the next
/// sync (a version-1 worker would never answer and would be dropped after a timeout).
/// 3: a plan's tasks no longer carry what follows from their region (the shard-local box, the
/// gathered shape, the prepared size, the fp8 scale layout).
/// 4: one vocabulary with the worker library: a timeline event carries its piece, a checksum is
/// a `RunChecksum` (memory region as `u16`); trainers learn their peers in a round of their own
/// (`Assign` → `Ready` with the gather arena's descriptor → `Peers`), and no worker plans the
/// whole job.
/// 5: in-process workers: the controller tells a worker the job (`Job`) after its proof; trainers
/// `Push` a version; rollouts whose regions are an engine's own tensors send a placement (also
/// forwarded in `PeerInfo`); `Abort` carries the structured failure.
/// 6: engines report their own stages (`EngineStages`: pause, load, resume) after a version
/// landed; `Stage` gains `Pause`, `Load` and `Resume`.
/// 7: a worker report carries the trainer's `TimeSplit` (wire, idle, overhead of its sync).
/// 8: a failure carries its kind (`FailureKind`); a worker's `Failed` carries a `Fault` (kind,
/// tensor, cause), no longer a `Failure` with a placeholder worker id the controller replaced.
/// Also 8: declared models: a `TensorMeta` carries the box it is of a parameter (`global_shape`,
/// `offset`), a registration the names an engine `skip`s, and the controller tells every worker
/// when planning failed (`PlanFailed`, naming the tensor and both sides).
/// Also 9: versions bound to bytes and runs: `Push`, `Prepare` and `Commit` carry the job's run,
/// and failures may be `superseded`, `stale` or `modified`.
/// Also 9: one secret per role and mutual authentication: `Hello` names its role and carries a
/// nonce of the worker's, `Job` carries the controller's answer to it.
/// 10: delta syncs: `Start` names the engines taking deltas and the version they hold, `Written`
/// carries the trainer's delta records, `Verify` forwards them to the rollouts, and a worker
/// report carries delta figures.
/// 11: a declared engine tensor may say what it is made of (`TensorMeta::source`: boxes of the
/// trainers' tensors concatenated along a dim), so fused and tensor-parallel engines declare.
/// 12: TLS binds the fabric: `Job` carries the fabric key a controller with TLS hands its workers
/// (`FabricKey`), so that only a peer that came through mutual TLS can open a fabric lane.
pub const PROTOCOL_VERSION: u16 = 12;
/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 12;
/// Default maximum body size: 256 MiB (a trainer's plan slice for a 1T-parameter model fits).
pub const DEFAULT_MAX_FRAME: u32 = 256 << 20;
/// Largest frame either side reads before the peer has proved its secret (the challenge, the
/// `Hello` and the controller's answer are under 200 bytes): 4 KiB.
pub const PREAUTH_MAX_FRAME: u32 = 4 << 10;
/// The body buffer grows by at most this much ahead of the bytes that arrived.
const READ_CHUNK: usize = 64 << 10;

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlFrameError {
    /// The stream failed.
    #[error("control channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the stream in the middle of a frame.
    #[error("control channel closed mid-frame")]
    Truncated,
    /// The first bytes are not a weightsync control frame.
    #[error("not a weightsync control frame (bad magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// The peer speaks another protocol version.
    #[error("control protocol version {got} but this build speaks {want}")]
    Version {
        /// Version in the frame.
        got: u16,
        /// Ours.
        want: u16,
    },
    /// The frame is larger than allowed.
    #[error("control frame of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// Allowed maximum.
        max: u32,
    },
    /// The body is not a valid message.
    #[error("malformed control message: {0}")]
    Decode(String),
}

/// A parsed frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlFrameHeader {
    /// Protocol version.
    pub version: u16,
    /// Body length.
    pub len: u32,
}

impl ControlFrameHeader {
    /// Parses and checks a header against the maximum body size.
    pub fn parse(bytes: &[u8; FRAME_HEADER_LEN], max: u32) -> Result<Self, ControlFrameError> {
        let magic = [bytes[0], bytes[1], bytes[2], bytes[3]];
        if magic != MAGIC {
            return Err(ControlFrameError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != PROTOCOL_VERSION {
            return Err(ControlFrameError::Version {
                got: version,
                want: PROTOCOL_VERSION,
            });
        }
        let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if len > max {
            return Err(ControlFrameError::TooLarge {
                len: len.into(),
                max,
            });
        }
        Ok(ControlFrameHeader { version, len })
    }
}

fn options(limit: u64) -> impl Options {
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .with_limit(limit)
        .reject_trailing_bytes()
}

/// Encodes one message as a whole frame (header + body).
pub fn encode_frame<T: Serialize>(msg: &T, max: u32) -> Result<Vec<u8>, ControlFrameError> {
    let body = options(max.into()).serialize(msg).map_err(|e| match *e {
        bincode::ErrorKind::SizeLimit => ControlFrameError::TooLarge {
            len: u64::from(max) + 1,
            max,
        },
        other => ControlFrameError::Decode(other.to_string()),
    })?;
    let len = u32::try_from(body.len()).map_err(|_| ControlFrameError::TooLarge {
        len: body.len() as u64,
        max,
    })?;
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + body.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Decodes a frame body (without header). Never reads past `body`, never panics.
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, ControlFrameError> {
    options(body.len() as u64)
        .deserialize(body)
        .map_err(|e| ControlFrameError::Decode(e.to_string()))
}

/// Decodes one whole frame from a byte slice (header + body); for fuzzing and tests.
pub fn decode_frame<T: DeserializeOwned>(bytes: &[u8], max: u32) -> Result<T, ControlFrameError> {
    let header: &[u8; FRAME_HEADER_LEN] = bytes
        .get(..FRAME_HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(ControlFrameError::Truncated)?;
    let h = ControlFrameHeader::parse(header, max)?;
    let body = bytes
        .get(FRAME_HEADER_LEN..)
        .ok_or(ControlFrameError::Truncated)?;
    if body.len() != h.len as usize {
        return Err(ControlFrameError::Truncated);
    }
    decode_body(body)
}

/// Writes one message as a frame and flushes.
pub async fn write_frame<W, T>(w: &mut W, msg: &T, max: u32) -> Result<(), ControlFrameError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let bytes = encode_frame(msg, max)?;
    w.write_all(&bytes).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame. `Ok(None)` on a clean end of stream at a frame boundary.
pub async fn read_frame<R, T>(r: &mut R, max: u32) -> Result<Option<T>, ControlFrameError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < FRAME_HEADER_LEN {
        let n = r.read(&mut header[got..]).await?;
        if n == 0 {
            return if got == 0 {
                Ok(None)
            } else {
                Err(ControlFrameError::Truncated)
            };
        }
        got += n;
    }
    let h = ControlFrameHeader::parse(&header, max)?;
    let len = h.len as usize;
    // Grown as bytes arrive, never ahead of them by more than one chunk.
    let mut body = Vec::with_capacity(len.min(READ_CHUNK));
    while body.len() < len {
        let want = (len - body.len()).min(READ_CHUNK);
        let n = (&mut *r)
            .take(want as u64)
            .read_to_end(&mut body)
            .await
            .map_err(ControlFrameError::Io)?;
        if n == 0 {
            return Err(ControlFrameError::Truncated);
        }
    }
    decode_body(&body).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::protocol::messages::*;

    fn registration() -> FromWorker {
        FromWorker::Register(Box::new(Registration {
            id: WorkerId::rollout(3),
            host: "h".into(),
            pid: 7,
            world: WorldSpec {
                model: "qwen3-0.6b".into(),
                train: "fsdp=4".into(),
                infer: "tp=2,dp=2".into(),
                dtype: DType::F8E4M3,
                verify: true,
            },
            fabric_endpoint: Blob(vec![1, 2, 3]),
            regions: vec![Blob(vec![9; 40])],
            tensors: vec![TensorMeta {
                name: "w".into(),
                shape: vec![4, 4],
                dtype: DType::BF16,
                bytes: 32,
                global_shape: Vec::new(),
                offset: Vec::new(),
                source: None,
            }],
            placement: None,
            skip: Vec::new(),
        }))
    }

    #[test]
    fn round_trips() {
        let msg = registration();
        let bytes = encode_frame(&msg, DEFAULT_MAX_FRAME).unwrap();
        let back: FromWorker = decode_frame(&bytes, DEFAULT_MAX_FRAME).unwrap();
        assert_eq!(back, msg);
    }

    #[tokio::test]
    async fn round_trips_over_a_stream() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        let msg = ToWorker::Abort {
            sync_id: 1,
            version: 2,
            reason: "x".into(),
            failure: None,
        };
        write_frame(&mut a, &msg, DEFAULT_MAX_FRAME).await.unwrap();
        drop(a);
        let got: Option<ToWorker> = read_frame(&mut b, DEFAULT_MAX_FRAME).await.unwrap();
        assert_eq!(got, Some(msg));
        let end: Option<ToWorker> = read_frame(&mut b, DEFAULT_MAX_FRAME).await.unwrap();
        assert_eq!(end, None);
    }

    #[tokio::test]
    async fn an_announced_body_is_not_allocated_before_it_arrives() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let mut header = MAGIC.to_vec();
        header.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        header.extend_from_slice(&[0, 0]);
        header.extend_from_slice(&(200u32 << 20).to_le_bytes());
        a.write_all(&header).await.unwrap();
        a.write_all(&[7u8; 1000]).await.unwrap();
        drop(a);
        let err = read_frame::<_, FromWorker>(&mut b, DEFAULT_MAX_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(err, ControlFrameError::Truncated), "{err}");
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        a.write_all(&header).await.unwrap();
        let err = read_frame::<_, FromWorker>(&mut b, PREAUTH_MAX_FRAME)
            .await
            .unwrap_err();
        assert!(matches!(err, ControlFrameError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn rejects_bad_magic_version_and_size() {
        let mut bytes = encode_frame(&FromWorker::Heartbeat { seq: 1 }, 1024).unwrap();
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(matches!(
            decode_frame::<FromWorker>(&wrong, 1024),
            Err(ControlFrameError::BadMagic(_))
        ));
        let mut wrong = bytes.clone();
        let next = PROTOCOL_VERSION + 1;
        wrong[4..6].copy_from_slice(&next.to_le_bytes());
        let err = decode_frame::<FromWorker>(&wrong, 1024).unwrap_err();
        assert!(
            err.to_string().contains(&format!("version {next}")),
            "{err}"
        );
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let err = decode_frame::<FromWorker>(&bytes, 1024).unwrap_err();
        assert!(matches!(err, ControlFrameError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn oversized_message_is_refused_on_encode() {
        let msg = FromWorker::Register(Box::new(Registration {
            regions: vec![Blob(vec![0; 4096])],
            ..match registration() {
                FromWorker::Register(r) => *r,
                _ => unreachable!(),
            }
        }));
        assert!(matches!(
            encode_frame(&msg, 1024),
            Err(ControlFrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn huge_length_prefix_inside_body_is_an_error_not_an_allocation() {
        // A Register whose string length claims 2^60 bytes.
        let mut body = vec![1u8, 0, 0, 0]; // enum variant 1 = Register
        body.extend_from_slice(&[0, 0, 0, 0]); // role Trainer
        body.extend_from_slice(&[0, 0, 0, 0]); // rank
        body.extend_from_slice(&(1u64 << 60).to_le_bytes()); // host length
        assert!(decode_body::<FromWorker>(&body).is_err());
        // A Vec<Blob> claiming 2^60 elements.
        assert!(decode_body::<Vec<Blob>>(&(1u64 << 60).to_le_bytes()).is_err());
    }

    #[test]
    fn truncated_frames_are_errors() {
        let bytes = encode_frame(&registration(), DEFAULT_MAX_FRAME).unwrap();
        for cut in [0, 5, FRAME_HEADER_LEN, bytes.len() - 1] {
            assert!(decode_frame::<FromWorker>(&bytes[..cut], DEFAULT_MAX_FRAME).is_err());
        }
    }

    mod prop {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #[test]
            fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
                let _ = decode_body::<FromWorker>(&bytes);
                let _ = decode_body::<ToWorker>(&bytes);
                let _ = decode_frame::<FromWorker>(&bytes, 1 << 20);
            }

            #[test]
            fn garbage_with_valid_header_never_panics(body in proptest::collection::vec(any::<u8>(), 0..512)) {
                let mut bytes = MAGIC.to_vec();
                bytes.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
                bytes.extend_from_slice(&[0, 0]);
                bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
                bytes.extend_from_slice(&body);
                let _ = decode_frame::<FromWorker>(&bytes, 1 << 20);
                let _ = decode_frame::<ToWorker>(&bytes, 1 << 20);
            }
        }
    }
}
