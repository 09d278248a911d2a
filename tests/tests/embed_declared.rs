//! A declared model end to end: a `config.json` of an architecture the planner does not know
//! (`gemma3_text`), three uneven FSDP trainers and two `format=hf` engines, all in process
//! against a real controller on loopback. The trainers declare their shards (boxes of odd
//! tensors: a 1-D bias, an odd-sized embedding, a 3-D tensor, a 4-D convolution, an f32 norm the
//! engines take in bf16), the engines their tensors and a skipped buffer; the controller plans
//! from the registrations, and every engine tensor equals the trainers' whole tensor byte for
//! byte, version after version. An engine that disagrees on a tensor's shape gets the plan's
//! failure naming the tensor and both ranks, as does every trainer's push and `GET /v1/plan`.

use std::time::Duration;

use weightsync_agent::embed::{
    DeclaredShard, DstTensor, EmbedError, EngineHandle, EngineOptions, SourceTensor, TrainerHandle,
    TrainerOptions,
};
use weightsync_common::DType;
use weightsync_schedules::layout_train::torch_chunk;
use weightsync_tests::controller_harness::{JOB_TOKEN, ServedController};
use weightsync_tests::embed_fixture::{Buffer, bf16_value, serve_job};
use weightsync_tests::http_raw;

const WAIT: Option<Duration> = Some(Duration::from_secs(20));

/// The tensors of the model: name, whole shape, the trainers' dtype.
const TENSORS: &[(&str, &[u64], DType)] = &[
    ("model.embed_tokens.weight", &[101, 16], DType::BF16),
    (
        "model.vision.patch_embed.weight",
        &[4, 3, 2, 2],
        DType::BF16,
    ),
    ("model.layers.0.self_attn.q_proj.bias", &[7], DType::BF16),
    (
        "model.layers.0.self_attn.q_proj.weight",
        &[24, 16],
        DType::BF16,
    ),
    (
        "model.layers.0.mlp.experts.gate_up_proj",
        &[3, 10, 16],
        DType::BF16,
    ),
    (
        "model.layers.1.post_feedforward_layernorm.weight",
        &[16],
        DType::F32,
    ),
    ("model.norm.weight", &[16], DType::BF16),
];

/// Element `flat` of tensor `name` at `version`, as a value of `dtype` (small, exactly
/// representable in bf16, so an f32 -> bf16 cast keeps it).
fn value(name: &str, flat: u64, version: u64, dtype: DType) -> Vec<u8> {
    let bf16 = bf16_value(name, flat, version);
    match dtype {
        DType::BF16 => bf16.to_le_bytes().to_vec(),
        DType::F32 => (f32::from_bits(u32::from(bf16) << 16))
            .to_le_bytes()
            .to_vec(),
        other => panic!("{other}"),
    }
}

/// Trainer `rank`'s torch.chunk of dim 0 of a tensor (offset, rows).
fn rows(global: &[u64], rank: u32, of: u32) -> (u64, u64) {
    let (s, n) = torch_chunk(global[0] as u32, of, rank);
    (s as u64, n as u64)
}

/// A shard's bytes at `version`: rows `start..start+n` of the whole tensor (dims past the
/// first whole).
fn shard_bytes(name: &str, global: &[u64], start: u64, n: u64, version: u64, d: DType) -> Vec<u8> {
    let row: u64 = global[1..].iter().product();
    (start * row..(start + n) * row)
        .flat_map(|i| value(name, i, version, d))
        .collect()
}

struct Trainer {
    handle: TrainerHandle,
    shards: Vec<(usize, u64, u64, Buffer)>,
}

impl Trainer {
    fn join(control: &str, rank: u32) -> Trainer {
        let handle = TrainerHandle::connect(TrainerOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..TrainerOptions::new(control, rank)
        })
        .unwrap();
        assert!(handle.is_declared() && handle.layout().is_empty());
        let mut shards = Vec::new();
        let mut declared = Vec::new();
        for (i, (name, global, dtype)) in TENSORS.iter().enumerate() {
            let (start, n) = rows(global, rank, 3);
            let mut shape = global.to_vec();
            shape[0] = n;
            let mut offset = vec![0; global.len()];
            offset[0] = start;
            let b = Buffer::zeroed((shape.iter().product::<u64>() as usize) * dtype.size());
            declared.push(DeclaredShard {
                tensor: SourceTensor {
                    name: name.to_string(),
                    dtype: *dtype,
                    shape,
                    memory: b.memory(),
                },
                global_shape: global.to_vec(),
                offset,
            });
            shards.push((i, start, n, b));
        }
        handle.declare_and_register(declared).unwrap();
        Trainer { handle, shards }
    }

    fn step(&self, version: u64) {
        for (i, start, n, b) in &self.shards {
            let (name, global, dtype) = TENSORS[*i];
            b.fill(&shard_bytes(name, global, *start, *n, version, dtype));
        }
    }
}

struct Engine {
    handle: EngineHandle,
    tensors: Vec<(usize, Buffer)>,
}

impl Engine {
    /// Every tensor whole in bf16, plus a buffer of its own it skips; `wrong`: the embedding
    /// declared one row longer.
    fn join(control: &str, rank: u32, wrong: bool) -> Engine {
        let handle = EngineHandle::connect(EngineOptions {
            job_token: Some(JOB_TOKEN.into()),
            ..EngineOptions::new(control, rank)
        })
        .unwrap();
        assert!(handle.is_declared());
        let mut tensors = Vec::new();
        let mut dst = Vec::new();
        for (i, (name, global, _)) in TENSORS.iter().enumerate() {
            let mut shape = global.to_vec();
            if wrong && i == 0 {
                shape[0] += 1;
            }
            let b = Buffer::zeroed(shape.iter().product::<u64>() as usize * 2);
            dst.push(DstTensor {
                name: name.to_string(),
                dtype: DType::BF16,
                shape,
                memory: b.memory(),
            });
            tensors.push((i, b));
        }
        let inv_freq = Buffer::zeroed(32);
        dst.push(DstTensor {
            name: "model.rotary_emb.inv_freq".into(),
            dtype: DType::F32,
            shape: vec![8],
            memory: inv_freq.memory(),
        });
        handle
            .declare_and_register(dst, vec!["model.rotary_emb.inv_freq".into()])
            .unwrap();
        Engine { handle, tensors }
    }

    fn check(&self, version: u64) {
        for (i, b) in &self.tensors {
            let (name, global, _) = TENSORS[*i];
            let n: u64 = global.iter().product();
            let want: Vec<u8> = (0..n)
                .flat_map(|f| value(name, f, version, DType::BF16))
                .collect();
            assert!(
                b.read() == want,
                "{}: {name} differs from the trainers' version {version}",
                self.handle.worker_id()
            );
        }
    }
}

/// A controller of a gemma3_text job (a family the planner does not know) on loopback.
fn controller(dir: &tempfile::TempDir) -> (tokio::runtime::Runtime, ServedController) {
    serve_job(
        dir,
        r#"{"model_type":"gemma3_text","hidden_size":16,"num_hidden_layers":2}"#,
        "fsdp=3",
        "dp=2,format=hf",
        DType::BF16,
    )
}

/// Pushes `version` from every trainer and waits for each.
fn push_all(trainers: &[Trainer], version: u64) -> Vec<Result<u64, EmbedError>> {
    for t in trainers {
        t.step(version);
    }
    let handles: Vec<_> = trainers
        .iter()
        .map(|t| t.handle.push(version).unwrap())
        .collect();
    handles
        .iter()
        .map(|h| h.wait(WAIT).map(|o| o.bytes))
        .collect()
}

#[test]
fn a_declared_model_syncs_byte_exact_into_two_engines() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir);
    let control = ctl.control.to_string();
    let engines: Vec<Engine> = (0..2).map(|r| Engine::join(&control, r, false)).collect();
    let trainers: Vec<Trainer> = (0..3).map(|r| Trainer::join(&control, r)).collect();
    for t in &trainers {
        t.handle.wait_plan(WAIT).unwrap();
    }
    for version in 1..=2 {
        let bytes: u64 = push_all(&trainers, version)
            .into_iter()
            .map(Result::unwrap)
            .sum();
        assert!(bytes > 0);
        for e in &engines {
            e.check(version);
        }
    }
}

#[test]
fn an_engine_that_disagrees_is_named_before_any_byte_moves() {
    let dir = tempfile::tempdir().unwrap();
    let (_rt, ctl) = controller(&dir);
    let control = ctl.control.to_string();
    let engines = [
        Engine::join(&control, 0, false),
        Engine::join(&control, 1, true),
    ];
    let trainers: Vec<Trainer> = (0..3).map(|r| Trainer::join(&control, r)).collect();
    let named = |s: &str| {
        s.contains("tensor model.embed_tokens.weight")
            && s.contains("inference rank 1 declares shape [102, 16]")
            && s.contains("trainer rank 0 holds a tensor of shape [101, 16]")
    };
    let e = engines[1].handle.wait_plan(WAIT).unwrap_err();
    assert!(
        matches!(e, EmbedError::PlanFailed { .. }) && named(&e.to_string()),
        "{e}"
    );
    let e = trainers[2].handle.wait_plan(WAIT).unwrap_err();
    assert!(named(&e.to_string()), "{e}");
    for r in push_all(&trainers, 1) {
        let e = r.unwrap_err().to_string();
        assert!(named(&e), "{e}");
    }
    let r = http_raw::send(ctl.http, "GET", "/v1/plan", None, b"").unwrap();
    assert!(named(&r.text()), "{}", r.text());
    for (_, b) in &engines[0].tensors {
        assert!(b.read().iter().all(|&x| x == 0), "nothing landed");
    }
}
