"""Staged landing into a tensor-parallel vLLM: each worker's arena holds only its rank's box of
each Hugging Face tensor, and vLLM's own loader reads exactly that box.

vLLM's ``load_weights`` takes checkpoint tensors whole and narrows each to the worker's
tensor-parallel rank itself: column-parallel rows (q/k/v heads, with kv heads replicated once
tp exceeds them; gate/up rows), row-parallel columns (o_proj, down_proj), vocabulary rows
(embed_tokens, lm_head); norms whole. The job's ``--infer tp=N,format=hf`` layout gives the
worker only its box of each tensor (``TensorInfo.global_shape`` / ``offset``). At load,
:func:`loader_items` hands vLLM each sharded tensor as a tensor of the whole shape into which
only the box was copied: the loader narrows to the same box, so nothing else is read. The rest
is never written (on CPU its pages are never touched: ``torch.empty`` of a large size maps
memory lazily), and the tensor goes as soon as vLLM's layerwise reload has loaded its layer
(it keeps a layer's loaded tensors until the layer is complete, so at most one layer's
whole-shaped tensors exist at a time). A tensor held whole (norms; the embedding, which
``format=hf`` keeps whole as transformers does unless the job says ``embed=vocab``) goes to
vLLM as the arena's own view, as at tp=1.

That is right only where vLLM's narrowing reads inside the arena's box. :func:`check_boxes`
works out at init, for every sharded tensor, the box vLLM's loader reads on this worker from
the layer that loads it (its tp rank and size, head counts, partition sizes, vocabulary shard
indices) and refuses, naming the tensor, a box the arena does not hold: e.g. lm_head when vLLM
pads the vocabulary to a multiple of 64 and splits the padded rows, while the planner splits the
real rows as ``torch.chunk`` does (the two agree when the vocabulary is a multiple of 64 x tp,
as Qwen3's 151936 is up to tp=8), or a layer class whose narrowing it does not know (it fails
closed, like vLLM's own M2N layout resolution).

Why not hand vLLM the shard itself: vLLM's linear loaders skip their narrowing for a parameter
flagged ``is_sharded_weight``, which would save the copy; but the vocabulary-parallel loaders
ignore that flag, the layerwise reload rebuilds each parameter from metadata captured at the
first load (a flag set on the live parameter afterwards does not reach the loader that runs),
and the loader would check only shapes, so a kv-head or vocabulary box in another place would
load silently wrong. The copy is one pass over the worker's own bytes per load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from .engine import TensorInfo
from .errors import RegistrationError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape) in the whole tensor

# The parts a vLLM layer fuses, in its order (vLLM's ``packed_modules_mapping``; QKV's shard
# ids are "q", "k", "v").
_QKV_SHARDS = ("q", "k", "v")


def _whole(global_shape: tuple[int, ...]) -> Box:
    return tuple(0 for _ in global_shape), global_shape


def _narrow(global_shape: tuple[int, ...], dim: int, start: int, size: int) -> Box:
    offset = [0] * len(global_shape)
    shape = list(global_shape)
    offset[dim], shape[dim] = start, size
    return tuple(offset), tuple(shape)


def _layer_of(model: Any, name: str) -> tuple[Any, str, int | None, str]:
    """The vLLM layer that loads HF tensor ``name``, the layer's path, the index of the part it
    is of a fused layer (None when unfused) and the parameter's own name (``weight``,
    ``bias``)."""
    path, _, pname = name.rpartition(".")
    parent, _, leaf = path.rpartition(".")
    shard: int | None = None
    for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
        if leaf in parts:
            leaf, shard = fused, list(parts).index(leaf)
            break
    path = f"{parent}.{leaf}" if parent else leaf
    return model.get_submodule(path), path, shard, pname


def vllm_box(model: Any, name: str, global_shape: tuple[int, ...]) -> Box:
    """The box of HF tensor ``name`` (whole shape ``global_shape``) that vLLM's loader reads on
    this worker. Raises ``LookupError`` for a layer whose narrowing is not known here."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    try:
        layer, path, shard, pname = _layer_of(model, name)
    except AttributeError as e:
        raise LookupError(f"no vLLM layer loads it ({e})") from None
    kind = type(layer)  # exact classes only: a subclass may narrow differently
    if kind is QKVParallelLinear and shard is not None:
        part = _QKV_SHARDS[shard]
        if part == "q":
            size = layer.num_heads * layer.head_size
            return _narrow(global_shape, 0, layer.tp_rank * size, size)
        head = layer.head_size if part == "k" else layer.v_head_size
        size = layer.num_kv_heads * head
        return _narrow(global_shape, 0, layer.tp_rank // layer.num_kv_head_replicas * size, size)
    if kind is MergedColumnParallelLinear and shard is not None:
        size = layer.output_sizes[shard] // layer.tp_size
        return _narrow(global_shape, 0, layer.tp_rank * size, size)
    if kind is ColumnParallelLinear and shard is None:
        size = layer.output_size_per_partition
        return _narrow(global_shape, 0, layer.tp_rank * size, size)
    if kind is RowParallelLinear and shard is None:
        if pname != "weight":  # the bias of a row-parallel layer is whole on every rank
            return _whole(global_shape)
        size = layer.input_size_per_partition
        return _narrow(global_shape, 1, layer.tp_rank * size, size)
    if kind in (VocabParallelEmbedding, ParallelLMHead) and shard is None:
        ix = layer.shard_indices
        start = ix.org_vocab_start_index
        return _narrow(global_shape, 0, start, ix.org_vocab_end_index - start)
    if kind is ReplicatedLinear:
        return _whole(global_shape)
    raise LookupError(f"vLLM loads it with {path} ({kind.__module__}.{kind.__name__}), "
                      "whose tensor-parallel narrowing is not known here")


def declared_layout(model: Any, tensors: list[Any], tp: int) -> list[TensorInfo]:
    """A declared model's arena on this worker at tensor parallelism ``tp``: each checkpoint
    tensor (``name``, ``dtype``, whole ``shape``: a :class:`weightsync._checkpoint.CheckpointTensor`)
    as the box vLLM's loader reads of it here (:func:`vllm_box`: q/k/v and gate/up rows, kv
    heads replicated past their count, o_proj and down_proj columns, vocabulary rows), or whole
    where the layer reads it whole or its narrowing is not known here (the loader then narrows
    the whole tensor itself: correct, at the cost of the bytes it does not read). Each entry
    places itself in its tensor (``global_shape``, ``offset``), which is what the engine
    declares to the controller (a sharded tensor as a source of one part, its box:
    :meth:`weightsync.Source.box_of`) and what :func:`loader_items` hands vLLM. With ``tp == 1``
    every tensor is whole."""
    out = []
    for t in tensors:
        whole = tuple(t.shape)
        offset, shape = _whole(whole)
        if tp > 1:
            try:
                offset, shape = vllm_box(model, t.name, whole)
            except LookupError:
                pass
        out.append(TensorInfo(t.name, t.dtype, tuple(shape), whole, tuple(offset)))
    return out


def declared_direct_sources(model: Any, params: dict[str, tuple[int, ...]],
                            checkpoint: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """What each of vLLM's parameters on this worker (``params``: name -> shape) is made of, in
    a declared model's direct mode: a fused parameter (``qkv_proj``, ``gate_up_proj``: a key of
    the model's ``packed_modules_mapping``) is the concatenation along dim 0 of the boxes
    vLLM's loader reads of each of its Hugging Face parts (``q_proj``, ``k_proj``, ``v_proj``;
    ``gate_proj``, ``up_proj``; whole shapes from ``checkpoint``: name -> shape); any other is
    its box of the checkpoint tensor of its name (None: whole). Returns
    :class:`weightsync.Source` (or None) by parameter name. A parameter whose parts vLLM's
    loader does not narrow in a way known here raises ``LookupError`` naming it."""
    from .engine import Source, SourceBox

    packed = getattr(model, "packed_modules_mapping", None) or {}
    out: dict[str, Any] = {}
    for name in params:
        path, _, pname = name.rpartition(".")
        parent, _, leaf = path.rpartition(".")
        if leaf in packed:
            parts = []
            for part in packed[leaf]:
                hf = f"{parent}.{part}.{pname}" if parent else f"{part}.{pname}"
                if hf not in checkpoint:
                    raise LookupError(f"{name}: its part {hf} is not in the checkpoint")
                offset, shape = vllm_box(model, hf, checkpoint[hf])
                parts.append(SourceBox(hf, tuple(offset), tuple(shape)))
            out[name] = Source(0, tuple(parts))
            continue
        whole = checkpoint.get(name)
        if whole is None:
            raise LookupError(f"{name}: no checkpoint tensor of its name")
        try:
            offset, shape = vllm_box(model, name, tuple(whole))
        except LookupError:
            offset, shape = _whole(tuple(whole))
        out[name] = Source.box_of(name, whole, offset, shape)
    return out


def _inside(inner: Box, outer: Box) -> bool:
    return all(o <= i and i + n <= o + m for i, n, o, m in zip(*inner, *outer, strict=True))


def check_boxes(model: Any, layout: list[TensorInfo], worker: str, tp: int) -> list[TensorInfo]:
    """Checks that vLLM's loader on this worker reads, of every tensor the arena holds only a
    box of, nothing outside that box; returns those sharded tensors. With ``tp == 1`` nothing is
    sharded and nothing is checked.

    Raises:
        RegistrationError: naming the tensor: it is not one box of one HF tensor (an fp8 scale,
            a packed expert tensor split by tp), vLLM reads outside its box, or vLLM's layer for
            it is not one whose narrowing is known.
    """
    if tp == 1:
        return []
    sharded = []
    for t in layout:
        if t.global_shape is None or t.offset is None:
            raise RegistrationError(
                f"{worker}: staged landing with tensor parallelism (tp={tp}) refused: tensor "
                f"{t.name} {list(t.shape)} of the job's layout is not one box of one Hugging Face "
                "tensor (an fp8 block-scale tensor or a packed expert tensor split by tp), so it "
                "cannot be handed to vLLM's loader as part of a whole tensor",
                worker=worker, tensor=t.name)
        if not t.sharded:
            continue
        try:
            offset, shape = vllm_box(model, t.name, t.global_shape)
        except LookupError as e:
            raise RegistrationError(
                f"{worker}: staged landing with tensor parallelism (tp={tp}) refused: tensor "
                f"{t.name}: {e}", worker=worker, tensor=t.name) from None
        if not _inside((offset, shape), (t.offset, t.shape)):
            raise RegistrationError(
                f"{worker}: staged landing with tensor parallelism (tp={tp}) refused: vLLM's "
                f"loader reads {t.name} at offset {list(offset)}, shape {list(shape)} of "
                f"{list(t.global_shape)}, but the job's layout gives this rank offset "
                f"{list(t.offset)}, shape {list(t.shape)} (the planner's tp split and vLLM's "
                "differ here, e.g. a vocabulary that is not a multiple of 64 x tp)",
                worker=worker, tensor=t.name)
        sharded.append(t)
    return sharded


def loader_items(arena: dict[str, torch.Tensor], sharded: dict[str, TensorInfo],
                 spent: list[float]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for vLLM's ``load_weights``: arena views, and for each tensor of
    ``sharded`` a whole-shaped tensor holding the arena's bytes in its box (see the module doc).
    Adds the seconds spent making those to ``spent[0]``."""
    for name, t in arena.items():
        info = sharded.get(name)
        if info is None:
            yield name, t
            continue
        assert info.global_shape is not None and info.offset is not None
        t0 = time.perf_counter()
        whole = torch.empty(info.global_shape, dtype=t.dtype, device=t.device)
        whole[tuple(slice(o, o + n) for o, n in zip(info.offset, info.shape, strict=True))].copy_(t)
        spent[0] += time.perf_counter() - t0
        yield name, whole
        del whole
