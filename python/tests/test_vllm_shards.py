"""The tensor-parallel staged landing's checks (``weightsync._vllm_shards``) against vLLM's own
layer classes, without an engine: the box vLLM's loader reads on a worker is worked out from
the layer that loads each HF tensor, compared with the box the job's layout gives that rank, and
a sharded tensor reaches the loader whole-shaped with only its box written.

The layers are vLLM's classes with only the attributes their loaders read set (building them for
real needs vLLM's distributed state); the vocabulary shard comes from vLLM's own
``VocabParallelEmbedding._get_indices`` and ``pad_vocab_size``. The end-to-end run against a
real tp=2 vLLM is ``test_vllm.py::test_vllm_staged_tensor_parallel``.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm.model_executor.layers.linear import (  # noqa: E402
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
    pad_vocab_size,
)

from weightsync import RegistrationError, TensorInfo  # noqa: E402
from weightsync._vllm_shards import check_boxes, loader_items, vllm_box  # noqa: E402

H, HEADS, KV, D, INTER = 128, 4, 2, 32, 256


def layer(cls: type, **attrs: Any) -> Any:
    """An instance of vLLM's ``cls`` with only ``attrs`` set (no weights, no process group)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    for k, v in attrs.items():
        object.__setattr__(obj, k, v)
    return obj


def model(tp: int, rank: int, vocab: int) -> Any:
    """A one-layer Qwen3-shaped vLLM model on tp rank ``rank`` of ``tp`` (fused qkv / gate_up,
    as vLLM's Qwen3 is)."""
    m = torch.nn.Module()
    m.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    replicas = max(1, tp // KV)
    attn = torch.nn.Module()
    attn.add_module("qkv_proj", layer(QKVParallelLinear, tp_rank=rank, tp_size=tp, num_heads=HEADS // tp,
                                      head_size=D, v_head_size=D, num_kv_heads=max(1, KV // tp),
                                      num_kv_head_replicas=replicas))
    attn.add_module("o_proj", layer(RowParallelLinear, tp_rank=rank, tp_size=tp,
                                    input_size_per_partition=HEADS * D // tp))
    mlp = torch.nn.Module()
    mlp.add_module("gate_up_proj", layer(MergedColumnParallelLinear, tp_rank=rank, tp_size=tp,
                                         output_sizes=[INTER, INTER]))
    mlp.add_module("down_proj", layer(RowParallelLinear, tp_rank=rank, tp_size=tp,
                                      input_size_per_partition=INTER // tp))
    dec = torch.nn.Module()
    dec.add_module("self_attn", attn)
    dec.add_module("mlp", mlp)
    dec.add_module("input_layernorm", torch.nn.Module())
    padded = pad_vocab_size(vocab)
    ix = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
    inner = torch.nn.Module()
    inner.add_module("embed_tokens", layer(VocabParallelEmbedding, tp_size=tp, shard_indices=ix))
    inner.add_module("layers", torch.nn.ModuleList([dec]))
    m.add_module("model", inner)
    m.add_module("lm_head", layer(ParallelLMHead, tp_size=tp, shard_indices=ix))
    return m


def planned(name: str, global_shape: tuple[int, ...], dim: int | None, tp: int, rank: int,
            kv_heads: int | None = None) -> TensorInfo:
    """The job's layout (hf) for tp rank ``rank``: torch.chunk rows or columns, kv heads
    replicated past their count, as the planner lays them out."""
    if dim is None:
        return TensorInfo(name, "bf16", global_shape, global_shape, tuple(0 for _ in global_shape))
    whole = global_shape[dim]
    if kv_heads is not None and tp > kv_heads:
        size, start = D, rank // (tp // kv_heads) * D
    else:
        size = -(-whole // tp)
        start = min(rank * size, whole)
        size = min(whole, start + size) - start
    shape = list(global_shape)
    offset = [0] * len(global_shape)
    shape[dim], offset[dim] = size, start
    return TensorInfo(name, "bf16", tuple(shape), global_shape, tuple(offset))


def layout(tp: int, rank: int, vocab: int, embed_split: bool = False) -> list[TensorInfo]:
    """``embed_split``: the job says ``embed=vocab`` (else format=hf keeps the embedding whole)."""
    pre = "model.layers.0."
    return [
        planned("model.embed_tokens.weight", (vocab, H), 0 if embed_split else None, tp, rank),
        planned(pre + "input_layernorm.weight", (H,), None, tp, rank),
        planned(pre + "self_attn.q_proj.weight", (HEADS * D, H), 0, tp, rank),
        planned(pre + "self_attn.k_proj.weight", (KV * D, H), 0, tp, rank, kv_heads=KV),
        planned(pre + "self_attn.v_proj.weight", (KV * D, H), 0, tp, rank, kv_heads=KV),
        planned(pre + "self_attn.o_proj.weight", (H, HEADS * D), 1, tp, rank),
        planned(pre + "mlp.gate_proj.weight", (INTER, H), 0, tp, rank),
        planned(pre + "mlp.up_proj.weight", (INTER, H), 0, tp, rank),
        planned(pre + "mlp.down_proj.weight", (H, INTER), 1, tp, rank),
        planned("lm_head.weight", (vocab, H), 0, tp, rank),
    ]


def test_vllm_narrowing_matches_the_planners_boxes() -> None:
    for tp in (2, 4):  # tp=4 > 2 kv heads: kv heads replicated
        for rank in range(tp):
            infos = layout(tp, rank, vocab=1024)
            sharded = check_boxes(model(tp, rank, 1024), infos, f"rollout-{rank}", tp)
            # Everything but the embedding (whole in format=hf) and the norm is this rank's part.
            assert [t.name for t in sharded] == [t.name for t in infos[2:]]
            for t in sharded:
                assert vllm_box(model(tp, rank, 1024), t.name, t.global_shape or ()) == (t.offset, t.shape), t
    # Spelled out for tp=4, rank 3: q heads 3, kv head 1 (shared with rank 2), o_proj columns.
    m = model(4, 3, 1024)
    assert vllm_box(m, "model.layers.0.self_attn.q_proj.weight", (128, 128)) == ((96, 0), (32, 128))
    assert vllm_box(m, "model.layers.0.self_attn.k_proj.weight", (64, 128)) == ((32, 0), (32, 128))
    assert vllm_box(m, "model.layers.0.self_attn.o_proj.weight", (128, 128)) == ((0, 96), (128, 32))
    assert vllm_box(m, "model.layers.0.mlp.up_proj.weight", (256, 128)) == ((192, 0), (64, 128))
    assert vllm_box(m, "lm_head.weight", (1024, 128)) == ((768, 0), (256, 128))
    assert check_boxes(m, [TensorInfo("x", "bf16", (3,))], "rollout-0", 1) == []  # tp=1: nothing to check


def test_a_vocab_split_embedding_is_checked_like_lm_head() -> None:
    # The job's `embed=vocab`: each rank's arena holds only its vocabulary rows of the
    # embedding, which vLLM's VocabParallelEmbedding loader narrows to the same rows.
    for tp in (2, 4):
        for rank in range(tp):
            infos = layout(tp, rank, vocab=1024, embed_split=True)
            sharded = check_boxes(model(tp, rank, 1024), infos, f"rollout-{rank}", tp)
            assert sharded[0].name == "model.embed_tokens.weight"
            assert [t.name for t in sharded] == [infos[0].name, *(t.name for t in infos[2:])]
            emb = sharded[0]
            assert vllm_box(model(tp, rank, 1024), emb.name, emb.global_shape or ()) == (emb.offset, emb.shape)
    # Vocabulary 1000 at tp=2: vLLM's padded split reads rows the arena does not hold; refused
    # naming the embedding (the first tensor), as lm_head would be.
    with pytest.raises(RegistrationError, match=r"embed_tokens\.weight.*shape \[512, 128\]") as e:
        check_boxes(model(2, 0, 1000), layout(2, 0, 1000, embed_split=True), "rollout-0", 2)
    assert e.value.tensor == "model.embed_tokens.weight"


def test_a_whole_embedding_at_tp_is_hinted(caplog: pytest.LogCaptureFixture) -> None:
    from weightsync.vllm import _hint_whole_embedding

    with caplog.at_level("INFO", logger="weightsync.vllm"):
        _hint_whole_embedding(layout(2, 0, 1024), "rollout-0", 2)
        assert "embed=vocab" in caplog.text and "rollout-0" in caplog.text
        caplog.clear()
        _hint_whole_embedding(layout(2, 0, 1024, embed_split=True), "rollout-0", 2)
        _hint_whole_embedding(layout(1, 0, 1024), "rollout-0", 1)
        assert caplog.text == ""


def test_refusals_name_the_tensor() -> None:
    # Vocabulary 1000, tp=2: vLLM pads it to 1024 and gives rank 0 rows [0, 512); the planner's
    # torch.chunk split gives it [0, 500): vLLM would read 12 rows the arena does not hold.
    with pytest.raises(RegistrationError, match=r"lm_head\.weight.*offset \[0, 0\], shape \[512, 128\]") as e:
        check_boxes(model(2, 0, 1000), layout(2, 0, 1000), "rollout-0", 2)
    assert e.value.tensor == "lm_head.weight"
    # Rank 1 reads [512, 1000), inside its [500, 1000): accepted (it receives 12 rows it never reads).
    check_boxes(model(2, 1, 1000), layout(2, 1, 1000), "rollout-1", 2)
    # Not one box of one tensor (an fp8 scale, packed experts split by tp).
    scale = TensorInfo("model.layers.0.self_attn.q_proj.weight_scale_inv", "f32", (1, 1))
    with pytest.raises(RegistrationError, match="not one box of one Hugging Face tensor") as e:
        check_boxes(model(2, 0, 1024), [*layout(2, 0, 1024), scale], "rollout-0", 2)
    assert e.value.tensor == scale.name
    # A layer whose narrowing is not known: refused, not guessed.
    m = model(2, 0, 1024)
    m.model.layers[0].mlp.down_proj = torch.nn.Linear(2, 2)
    with pytest.raises(RegistrationError, match=r"down_proj.*torch\.nn\.modules\.linear\.Linear"):
        check_boxes(m, layout(2, 0, 1024), "rollout-0", 2)
    m = model(2, 0, 1024)
    del m.model.layers[0].mlp.down_proj
    with pytest.raises(RegistrationError, match="no vLLM layer loads it"):
        check_boxes(m, layout(2, 0, 1024), "rollout-0", 2)


def test_loader_items_write_only_the_box() -> None:
    infos = layout(2, 1, 1024)
    arena = {t.name: torch.randn(t.shape).to(torch.bfloat16) for t in infos}
    sharded = {t.name: t for t in check_boxes(model(2, 1, 1024), infos, "rollout-1", 2)}
    spent = [0.0]
    seen = []
    for name, t in loader_items(arena, sharded, spent):
        info = next(i for i in infos if i.name == name)
        assert tuple(t.shape) == info.global_shape, name
        box = t[tuple(slice(o, o + n) for o, n in zip(info.offset or (), info.shape))]
        assert torch.equal(box, arena[name]), name
        if name not in sharded:
            assert t.data_ptr() == arena[name].data_ptr(), f"{name}: a whole tensor goes as the arena's own view"
        seen.append(name)
    assert seen == list(arena) and spent[0] > 0


def qwen3_config(tmp_path: Any) -> Any:
    """A config file of this module's Qwen3 shapes (one layer, vocab 1024) for a controller."""
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": H,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": D,
        "intermediate_size": INTER, "num_hidden_layers": 1, "vocab_size": 1024,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return cfg


def test_a_declared_tp_2_worker_declares_the_family_paths_boxes(tmp_path: Any) -> None:
    # The layout a vLLM worker of a *declared* model declares at tp=2 (each checkpoint tensor as
    # the box vLLM's loader reads of it on this worker, as its source), against what the planner
    # lays out from the config for the same Qwen3 shapes (`tp=2,format=hf,embed=vocab`, fetched
    # from a real controller): the same boxes, so the declared job plans each rank's part
    # without knowing the family (the tables' equality is the agent crate's
    # `tensor_parallel_boxes_declared_plan_the_config_paths_table`).
    import weightsync
    from weightsync._checkpoint import CheckpointTensor
    from weightsync._vllm_shards import declared_layout

    cfg = qwen3_config(tmp_path)
    with weightsync.Controller(cfg, "fsdp=1", "tp=2,format=hf,embed=vocab") as c:
        for rank in range(2):
            with weightsync.Engine(c.control_address, rank, job_token=c.engine_token) as e:
                planned = e.layout()
            checkpoint = [CheckpointTensor(t.name, t.dtype, t.global_shape or t.shape) for t in planned]
            declared = declared_layout(model(2, rank, 1024), checkpoint, 2)
            assert declared == planned, rank
            sharded = [t.name for t in declared if t.sharded]
            assert "lm_head.weight" in sharded and "model.layers.0.mlp.down_proj.weight" in sharded
            sources = {t.name: weightsync.Source.box_of(t.name, t.global_shape or (), t.offset or (), t.shape)
                       for t in declared}
            assert {n for n, s in sources.items() if s is not None} == set(sharded)
    # At tp=1 every tensor is whole, whatever the layers.
    assert all(not t.sharded for t in declared_layout(model(2, 0, 1024), checkpoint, 1))


def test_a_declared_direct_worker_declares_fused_parameters_as_their_parts(tmp_path: Any) -> None:
    # Direct mode of a declared model: vLLM's own parameters (the family path's `format=fused`
    # layout at tp=2, fetched from a real controller, for the same Qwen3 shapes) each declared
    # as what it is made of: qkv_proj of this rank's q, k and v rows, gate_up_proj of its gate
    # and up rows, o_proj / down_proj their columns; each source fills its parameter exactly.
    import weightsync
    from weightsync import Source, SourceBox
    from weightsync._vllm_shards import declared_direct_sources

    cfg = qwen3_config(tmp_path)
    checkpoint = {t.name: t.global_shape for t in layout(1, 0, 1024)}
    pre = "model.layers.0."
    with weightsync.Controller(cfg, "fsdp=1", "tp=2,format=fused") as c:
        for rank in range(2):
            with weightsync.Engine(c.control_address, rank, job_token=c.engine_token) as e:
                params = {t.name: t.shape for t in e.layout() if t.name in checkpoint or "_proj" in t.name}
            sources = declared_direct_sources(model(2, rank, 1024), params, checkpoint)
            for name, shape in params.items():
                src = sources[name]
                if src is None:
                    assert shape == checkpoint[name], name
                    continue
                rows = sum(p.shape[0] for p in src.parts) if src.dim == 0 else shape[0]
                assert rows == shape[0] and all(p.shape[1:] == shape[1:] for p in src.parts), (name, src)
            q, kv = HEADS * D // 2, KV * D // 2
            assert sources[pre + "self_attn.qkv_proj.weight"] == Source(0, (
                SourceBox(pre + "self_attn.q_proj.weight", (rank * q, 0), (q, H)),
                SourceBox(pre + "self_attn.k_proj.weight", (rank * kv, 0), (kv, H)),
                SourceBox(pre + "self_attn.v_proj.weight", (rank * kv, 0), (kv, H))))
            assert sources[pre + "mlp.gate_up_proj.weight"] == Source(0, (
                SourceBox(pre + "mlp.gate_proj.weight", (rank * INTER // 2, 0), (INTER // 2, H)),
                SourceBox(pre + "mlp.up_proj.weight", (rank * INTER // 2, 0), (INTER // 2, H))))
            assert sources[pre + "self_attn.o_proj.weight"] == Source(0, (
                SourceBox(pre + "self_attn.o_proj.weight", (0, rank * q), (H, q)),))
    with pytest.raises(LookupError, match="no checkpoint tensor"):
        declared_direct_sources(model(2, 0, 1024), {"x.weight": (1,)}, checkpoint)
