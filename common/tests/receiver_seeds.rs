//! The committed seeds of the fabric fuzz targets (`receiver_frames`, `frame_decode`) are
//! frames of the current fabric wire format: a format change that forgets to rewrite them would
//! leave the fuzzer starting from frames refused at the header. Every `receiver_frames` seed is
//! replayed through the receiver's state machine here, with the fuzz target's checks.
//!
//! After a change of the frame format or of the fabric handshake's version, rewrite them with
//! `FUZZ_SEEDS=$PWD/common/fuzz/corpus cargo test -p weightsync-common --test receiver_seeds write_seeds`.

use weightsync_common::fabric::RemoteAccessKind;
use weightsync_common::fabric::tcp::frame::{Completion, FrameHeader, HEADER_LEN, Part};
use weightsync_common::fabric::tcp::handshake::{ClientHello, ServerHello};
use weightsync_common::fabric::tcp::replay::{
    ARMED_EPOCH, FILL, READ_ONLY_BASE, READ_ONLY_RKEY, WRITABLE_BASE, WRITABLE_LEN, WRITABLE_RKEY,
    replay_frames,
};

fn header(rkey: u64, addr: u64, len: u64, epoch: u64) -> FrameHeader {
    FrameHeader {
        signalled: false,
        imm: None,
        part: None,
        rkey,
        addr,
        len,
        source: None,
        stride: None,
        epoch,
    }
}

fn frame(h: FrameHeader) -> Vec<u8> {
    let mut b = h.encode().to_vec();
    b.extend((0..h.len).map(|i| i as u8 ^ 0x3c));
    b
}

/// (name, mode byte 1, frames): byte 0 (the receive size) is varied per seed.
fn scenarios() -> Vec<(&'static str, u8, Vec<u8>)> {
    let armed = 2 << 1;
    let signalled = |h: FrameHeader| FrameHeader {
        signalled: true,
        imm: Some(5),
        ..h
    };
    let w =
        |addr: u64, len: u64, epoch: u64| header(WRITABLE_RKEY, WRITABLE_BASE + addr, len, epoch);
    let part = |addr: u64, id: u64| FrameHeader {
        imm: Some(6),
        part: Some(Part {
            write_id: id,
            parts: 2,
        }),
        ..w(addr, 512, 0)
    };
    vec![
        (
            "open-writes",
            0,
            [frame(w(0, 100, 0)), frame(signalled(w(100, 1000, 0)))].concat(),
        ),
        (
            "open-read-ahead",
            1,
            [
                frame(w(0, 10, 0)),
                frame(w(10, 10, 0)),
                frame(signalled(w(20, 3000, 0))),
            ]
            .concat(),
        ),
        (
            "split-write",
            0,
            [
                frame(part(0, 1)),
                frame(FrameHeader {
                    signalled: true,
                    ..part(512, 1)
                }),
            ]
            .concat(),
        ),
        (
            "armed-stale-epoch",
            armed,
            [
                frame(w(0, 64, ARMED_EPOCH)),
                frame(signalled(w(64, 64, ARMED_EPOCH - 1))),
            ]
            .concat(),
        ),
        ("closed-window", 1 << 1, frame(signalled(w(0, 128, 0)))),
        (
            "refusals",
            0,
            [
                frame(header(READ_ONLY_RKEY, READ_ONLY_BASE, 16, 0)),
                frame(header(99, 0, 8, 0)),
                frame(signalled(w(WRITABLE_LEN as u64 - 4, 8, 0))),
            ]
            .concat(),
        ),
        ("pull-on-a-payload-lane", 0, {
            let h = FrameHeader {
                source: Some(0x1000),
                ..w(0, 16, 0)
            };
            h.encode().to_vec()
        }),
    ]
}

/// Every seed: the scenarios, each with a few receive sizes.
fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for (name, mode, frames) in scenarios() {
        for chunk in [0u8, 40, 255] {
            let mut input = vec![chunk, mode];
            input.extend_from_slice(&frames);
            out.push((format!("{name}-{chunk}"), input));
        }
    }
    out
}

/// The fuzz target's checks, on one replay.
fn check(name: &str, input: &[u8]) -> weightsync_common::fabric::tcp::replay::Replay {
    let r = replay_frames(input);
    assert!(
        r.read_only.iter().all(|&b| b == FILL),
        "{name}: read-only region changed"
    );
    let frames = (input.len().saturating_sub(2) / HEADER_LEN) as u64;
    assert!(
        r.stats.frames_received + r.stats.refused <= frames,
        "{name}"
    );
    let answered: u64 = r.completions.iter().map(|c| u64::from(c.frames)).sum();
    assert!(
        answered <= r.stats.frames_received + r.stats.refused,
        "{name}"
    );
    r
}

/// Writes the seeds into `$FUZZ_SEEDS/{receiver_frames,frame_decode}` when it is set.
#[test]
fn write_seeds_when_asked() {
    let Some(dir) = std::env::var_os("FUZZ_SEEDS") else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    let rx = dir.join("receiver_frames");
    std::fs::create_dir_all(&rx).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(rx.join(format!("seed-{name}")), bytes).unwrap();
    }
    let fd = dir.join("frame_decode");
    let w = header(WRITABLE_RKEY, WRITABLE_BASE, 4096, 3);
    let decode_seeds: Vec<(&str, Vec<u8>)> = vec![
        ("seed-write-plain", w.encode().to_vec()),
        (
            "seed-write-signalled-imm",
            FrameHeader {
                signalled: true,
                imm: Some(7),
                ..w
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-write-part",
            FrameHeader {
                imm: Some(7),
                part: Some(Part {
                    write_id: 3,
                    parts: 4,
                }),
                ..w
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-pull-signalled-imm",
            FrameHeader {
                signalled: true,
                imm: Some(7),
                source: Some(0x7f00_0000_1000),
                ..w
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-client-hello",
            ClientHello {
                nonce: [4; 32],
                instance: 77,
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-server-hello",
            ServerHello {
                nonce: [5; 32],
                proof: [6; 32],
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-completion-ok",
            Completion {
                frames: 3,
                error: None,
            }
            .encode()
            .to_vec(),
        ),
        (
            "seed-completion-err",
            Completion {
                frames: 2,
                error: Some((RemoteAccessKind::WrongEpoch, 1, WRITABLE_BASE)),
            }
            .encode()
            .to_vec(),
        ),
    ];
    for (name, bytes) in decode_seeds {
        std::fs::write(fd.join(name), bytes).unwrap();
    }
}

#[test]
fn the_scenarios_do_what_their_names_say() {
    for (name, input) in seeds() {
        let r = check(&name, &input);
        if name.starts_with("open-") || name.starts_with("split-") {
            assert_eq!(r.ended, Ok(()), "{name}");
            assert_eq!(r.stats.refused, 0, "{name}");
            assert!(
                r.writable.iter().any(|&b| b != FILL),
                "{name}: nothing landed"
            );
        }
        if name.starts_with("split-") {
            assert_eq!(r.imm.unclaimed(6), 1, "{name}: a split write counts once");
        }
        if name.starts_with("armed-stale-epoch") {
            assert_eq!(r.stats.outside_window, 1, "{name}");
            assert!(
                r.writable[64..128].iter().all(|&b| b == FILL),
                "{name}: stale bytes landed"
            );
        }
        if name.starts_with("closed-window") {
            assert_eq!(r.stats.outside_window, 1, "{name}");
            assert!(r.writable.iter().all(|&b| b == FILL), "{name}");
        }
        if name.starts_with("refusals") {
            assert_eq!(r.stats.refused, 3, "{name}");
        }
        if name.starts_with("pull-on-a-payload-lane") {
            assert!(r.ended.is_err(), "{name}");
        }
    }
}

#[test]
fn committed_receiver_seeds_replay_at_the_current_version() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/receiver_frames");
    let mut landed = 0;
    let mut count = 0;
    for entry in std::fs::read_dir(dir).expect("seed directory") {
        let path = entry.expect("seed entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).expect("seed readable");
        let r = check(&name, &bytes);
        landed += r.stats.frames_received;
        count += 1;
    }
    assert!(count >= seeds().len(), "only {count} seeds in {dir}");
    assert!(
        landed > 0,
        "no committed seed lands a frame: rewrite them (module docs)"
    );
}

#[test]
fn committed_frame_decode_seeds_decode_at_the_current_version() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/frame_decode");
    for name in [
        "seed-write-plain",
        "seed-write-part",
        "seed-pull-signalled-imm",
    ] {
        let bytes = std::fs::read(format!("{dir}/{name}")).expect("seed readable");
        let b: &[u8; HEADER_LEN] = bytes[..HEADER_LEN].try_into().expect("a whole header");
        FrameHeader::decode(b).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    let name = "seed-client-hello";
    let bytes = std::fs::read(format!("{dir}/{name}")).expect("seed readable");
    let b = bytes[..weightsync_common::fabric::tcp::handshake::CLIENT_HELLO_LEN]
        .try_into()
        .expect("a whole hello");
    ClientHello::decode(b).unwrap_or_else(|e| panic!("{name}: {e}"));
}
