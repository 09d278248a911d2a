//! The committed `control_message` fuzz seeds are frames of the current protocol: a version bump
//! that forgets to rewrite them would leave the fuzzer starting from frames refused at the header.
//!
//! After a change of the messages or of `PROTOCOL_VERSION`, rewrite them with
//! `FUZZ_SEEDS=$PWD/common/fuzz/corpus/control_message cargo test -p weightsync-common --test fuzz_seeds write_seeds`
//! (one frame per message variant, `from-N.bin` and `to-N.bin`, and `from-stream.bin`: every
//! worker message back to back, as a connection carries them).

use weightsync_common::DType;
use weightsync_common::protocol::{
    Assignment, Blob, DEFAULT_MAX_FRAME, FabricKey, Failure, FailureKind, Fault, FromWorker,
    PeerInfo, Registration, RunChecksum, Stage, TensorMeta, TimeSplit, TimelineEvent, ToWorker,
    WHOLE_SYNC, WorkerId, WorkerReport, WorkerRole, WorldSpec, decode_frame, encode_frame,
};

fn world() -> WorldSpec {
    WorldSpec {
        model: "qwen3-0.6b".into(),
        train: "fsdp=4".into(),
        infer: "tp=2,dp=2".into(),
        dtype: DType::F8E4M3,
        verify: true,
    }
}

fn report() -> WorkerReport {
    WorkerReport {
        bytes: 1 << 20,
        writes: 3,
        peak_staging_bytes: 1 << 16,
        staged_bytes: 1 << 19,
        direct_bytes: 1 << 19,
        events: vec![
            TimelineEvent {
                task: 0,
                piece: 1,
                stage: Stage::H2d,
                start_ns: 10,
                end_ns: 20,
                bytes: 4096,
            },
            TimelineEvent {
                task: WHOLE_SYNC,
                piece: 0,
                stage: Stage::Barrier,
                start_ns: 30,
                end_ns: 45,
                bytes: 0,
            },
        ],
        checksums: vec![checksum()],
        split: TimeSplit {
            wall_ns: 100,
            wire_ns: 60,
            idle_ns: 15,
            overhead_ns: 25,
        },
        deltas: Vec::new(),
        delta: weightsync_common::protocol::DeltaFigures {
            dense_bytes: 1 << 20,
            delta_bytes: 1 << 12,
            delta_run_bytes: 1 << 19,
            elements: 1 << 19,
            changed: 300,
            codec_ns: 5000,
        },
    }
}

fn checksum() -> RunChecksum {
    RunChecksum {
        rollout: 1,
        mr: 0,
        offset: 256,
        len: 4096,
        xxh3: 0x0123_4567_89ab_cdef,
    }
}

/// One message of every variant a worker sends.
fn from_worker() -> Vec<FromWorker> {
    let (sync_id, version) = (7, 42);
    let msgs = vec![
        FromWorker::Hello {
            role: WorkerRole::Rollout,
            nonce: [4; 32],
            proof: [3; 32],
        },
        FromWorker::Register(Box::new(Registration {
            id: WorkerId::rollout(1),
            host: "host-b".into(),
            pid: 4242,
            world: world(),
            fabric_endpoint: Blob(b"10.0.0.2:5000".to_vec()),
            regions: vec![Blob(vec![9; 24])],
            tensors: vec![TensorMeta {
                name: "model.embed_tokens.weight".into(),
                shape: vec![8, 16],
                dtype: DType::BF16,
                bytes: 256,
                global_shape: Vec::new(),
                offset: Vec::new(),
                source: None,
            }],
            placement: Some(Blob(vec![6; 32])),
            skip: vec!["model.rotary_emb.inv_freq".into()],
        })),
        FromWorker::Ready {
            plan_id: 1,
            regions: vec![Blob(vec![8; 24])],
            tensors: vec![TensorMeta {
                name: "model.layers.0.mlp.gate_proj.weight".into(),
                shape: vec![4, 16],
                dtype: DType::BF16,
                bytes: 128,
                global_shape: vec![12, 16],
                offset: vec![4, 0],
                source: None,
            }],
        },
        FromWorker::Prepared {
            sync_id,
            version,
            report: WorkerReport::default(),
        },
        FromWorker::Written {
            sync_id,
            version,
            report: report(),
        },
        FromWorker::Landed {
            sync_id,
            version,
            verified: None,
            report: report(),
        },
        FromWorker::Verified {
            sync_id,
            version,
            report: report(),
        },
        FromWorker::Failed {
            sync_id,
            version,
            failure: Fault {
                kind: FailureKind::Fabric,
                tensor: Some("model.layers.0.mlp.down_proj.weight".into()),
                cause: "write to rollout-1 failed".into(),
            },
        },
        FromWorker::Heartbeat { seq: 9 },
        FromWorker::Drained { sync_id, version },
        FromWorker::Push { version, run: 1 },
        FromWorker::EngineStages {
            sync_id,
            version,
            events: vec![
                TimelineEvent {
                    task: WHOLE_SYNC,
                    piece: 0,
                    stage: Stage::Pause,
                    start_ns: 1_000,
                    end_ns: 9_000,
                    bytes: 0,
                },
                TimelineEvent {
                    task: WHOLE_SYNC,
                    piece: 0,
                    stage: Stage::Load,
                    start_ns: 2_000,
                    end_ns: 7_000,
                    bytes: 1 << 20,
                },
                TimelineEvent {
                    task: WHOLE_SYNC,
                    piece: 0,
                    stage: Stage::Resume,
                    start_ns: 7_000,
                    end_ns: 9_000,
                    bytes: 0,
                },
            ],
        },
    ];
    // Adding a variant must add a sample here (and a seed): this match stops compiling.
    for m in &msgs {
        match m {
            FromWorker::Hello { .. }
            | FromWorker::Register(_)
            | FromWorker::Ready { .. }
            | FromWorker::Prepared { .. }
            | FromWorker::Written { .. }
            | FromWorker::Landed { .. }
            | FromWorker::Verified { .. }
            | FromWorker::Failed { .. }
            | FromWorker::Heartbeat { .. }
            | FromWorker::Drained { .. }
            | FromWorker::Push { .. }
            | FromWorker::EngineStages { .. } => {}
        }
    }
    msgs
}

/// One message of every variant the controller sends (both kinds of assignment).
fn to_worker() -> Vec<ToWorker> {
    let (sync_id, version) = (7, 42);
    let msgs = vec![
        ToWorker::Challenge { nonce: [5; 32] },
        ToWorker::Welcome { heartbeat_ms: 1000 },
        ToWorker::Rejected {
            reason: "trainer-0 is already registered".into(),
        },
        ToWorker::Assign(Assignment::Trainer {
            plan_id: 1,
            slice: Blob(vec![1, 2, 3, 4]),
            delta: true,
        }),
        ToWorker::Assign(Assignment::Rollout {
            plan_id: 1,
            expected: Blob(vec![5, 6, 7]),
            expected_writes: 12,
            expected_bytes: 1 << 20,
            delta: true,
        }),
        ToWorker::Peers {
            plan_id: 1,
            peers: vec![
                PeerInfo {
                    id: WorkerId::rollout(0),
                    fabric_endpoint: Blob(b"10.0.0.2:5000".to_vec()),
                    regions: vec![Blob(vec![9; 24])],
                    placement: Some(Blob(vec![7; 16])),
                    inbox: Some(Blob(vec![6; 24])),
                },
                PeerInfo {
                    id: WorkerId::trainer(1),
                    fabric_endpoint: Blob(b"10.0.0.1:5001".to_vec()),
                    regions: vec![Blob(vec![8; 24])],
                    placement: None,
                    inbox: None,
                },
            ],
        },
        ToWorker::Prepare {
            sync_id,
            version,
            run: 2,
        },
        ToWorker::Start {
            sync_id,
            version,
            delta: Some(weightsync_common::protocol::DeltaBase {
                base_version: version - 1,
                rollouts: [0, 2].into(),
            }),
        },
        ToWorker::Commit {
            sync_id,
            version,
            run: 2,
        },
        ToWorker::Abort {
            sync_id,
            version,
            reason: "rollout-1: connection closed".into(),
            failure: Some(Failure {
                worker: WorkerId::rollout(1),
                kind: FailureKind::PeerLost,
                tensor: None,
                cause: "connection closed".into(),
            }),
        },
        ToWorker::Job {
            world: world(),
            model_config: Some("{\"hidden_size\": 128}".into()),
            proof: [6; 32],
            fabric_key: Some(FabricKey([7; 32])),
        },
        ToWorker::Verify {
            sync_id,
            version,
            checksums: vec![checksum()],
            deltas: vec![weightsync_common::protocol::DeltaRecord {
                rollout: 0,
                mr: 1,
                offset: 4096,
                len: 8192,
                inbox_offset: 512,
                enc_len: 100,
                kind: weightsync_common::protocol::DeltaKind::Gaps,
                elem: 2,
                base_version: version - 1,
            }],
        },
        ToWorker::Heartbeat { seq: 9 },
        ToWorker::Shutdown,
        ToWorker::PlanFailed {
            plan_id: 2,
            reason: "tensor w: inference rank 1 declares it (bf16 [4]) but no trainer holds it"
                .into(),
        },
    ];
    for m in &msgs {
        match m {
            ToWorker::Challenge { .. }
            | ToWorker::Welcome { .. }
            | ToWorker::Rejected { .. }
            | ToWorker::Assign(_)
            | ToWorker::Peers { .. }
            | ToWorker::Prepare { .. }
            | ToWorker::Start { .. }
            | ToWorker::Commit { .. }
            | ToWorker::Abort { .. }
            | ToWorker::Job { .. }
            | ToWorker::Verify { .. }
            | ToWorker::Heartbeat { .. }
            | ToWorker::PlanFailed { .. }
            | ToWorker::Shutdown => {}
        }
    }
    msgs
}

fn frame<T: serde::Serialize>(m: &T) -> Vec<u8> {
    encode_frame(m, DEFAULT_MAX_FRAME).expect("a sample message encodes")
}

/// Writes the seeds into `$FUZZ_SEEDS` when it is set (see the module docs).
#[test]
fn write_seeds_when_asked() {
    let Some(dir) = std::env::var_os("FUZZ_SEEDS") else {
        return;
    };
    let dir = std::path::Path::new(&dir);
    for entry in std::fs::read_dir(dir).expect("seed directory") {
        let path = entry.expect("seed entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.starts_with("from-") || name.starts_with("to-") {
            std::fs::remove_file(&path).expect("old seed removable");
        }
    }
    let mut stream = Vec::new();
    for (i, m) in from_worker().iter().enumerate() {
        let bytes = frame(m);
        stream.extend_from_slice(&bytes);
        std::fs::write(dir.join(format!("from-{i}.bin")), bytes).unwrap();
    }
    std::fs::write(dir.join("from-stream.bin"), stream).unwrap();
    for (i, m) in to_worker().iter().enumerate() {
        std::fs::write(dir.join(format!("to-{i}.bin")), frame(m)).unwrap();
    }
}

#[test]
fn every_sample_round_trips() {
    for m in from_worker() {
        assert_eq!(
            decode_frame::<FromWorker>(&frame(&m), DEFAULT_MAX_FRAME).unwrap(),
            m
        );
    }
    for m in to_worker() {
        assert_eq!(
            decode_frame::<ToWorker>(&frame(&m), DEFAULT_MAX_FRAME).unwrap(),
            m
        );
    }
}

#[test]
fn control_message_seeds_decode_at_the_current_version() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz/corpus/control_message");
    let mut checked = 0;
    for entry in std::fs::read_dir(dir).expect("seed directory") {
        let path = entry.expect("seed entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).expect("seed readable");
        // Single-frame seeds are named after the direction; the stream seed holds several.
        if name.starts_with("from-") && name != "from-stream.bin" {
            decode_frame::<FromWorker>(&bytes, DEFAULT_MAX_FRAME)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            checked += 1;
        } else if name.starts_with("to-") {
            decode_frame::<ToWorker>(&bytes, DEFAULT_MAX_FRAME)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            checked += 1;
        }
    }
    assert!(
        checked >= from_worker().len() + to_worker().len(),
        "only {checked} seeds found in {dir}"
    );
}
