"""Registering a module as it is (issue 36): the path components wrappers put into parameter
names (``_orig_mod`` from ``torch.compile``, ``_checkpoint_wrapped_module`` from activation
checkpointing, ``module`` from DDP-style wrappers) are dropped wherever they appear, and a
``name_map`` (mapping or function) turns a framework's own names into the job's.

First the naming itself on real wrapped torch modules (``torch.compile`` with the eager backend,
``checkpoint_wrapper``, a ``self.module`` wrapper), then both registrations against a real
controller: wrapped trainer tensors and renamed engine tensors, one sync, every engine byte equal
to the trainer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import weightsync
from weightsync._tensors import job_name, named_tensors

from conftest import Procs
from test_embedded import controller, full_value, in_threads

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(8, 16, bias=False)
        self.down_proj = torch.nn.Linear(16, 8, bias=True)

    def forward(self, x: Any) -> Any:
        return self.down_proj(torch.relu(self.up_proj(x)))


class Net(torch.nn.Module):
    def __init__(self, wrap_layer: Any = None) -> None:
        super().__init__()
        layers = [Block(), Block()]
        if wrap_layer is not None:
            layers = [wrap_layer(b) for b in layers]
        self.layers = torch.nn.ModuleList(layers)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class Wrapper(torch.nn.Module):
    """What DDP and many frameworks' wrappers do: the model as ``self.module``."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any) -> Any:
        return self.module(x)


PLAIN = [n for n, _ in Net().named_parameters()]


def test_plain_names_unchanged() -> None:
    assert PLAIN == ["layers.0.up_proj.weight", "layers.0.down_proj.weight", "layers.0.down_proj.bias",
                     "layers.1.up_proj.weight", "layers.1.down_proj.weight", "layers.1.down_proj.bias",
                     "norm.weight", "norm.bias"]
    assert [n for n, _ in named_tensors(Net())] == PLAIN


def test_torch_compile_prefix_dropped() -> None:
    net = Net()
    compiled = torch.compile(net, backend="eager")
    raw = [n for n, _ in compiled.named_parameters()]
    assert all(n.startswith("_orig_mod.") for n in raw), raw
    got = named_tensors(compiled)
    assert [n for n, _ in got] == PLAIN
    # The very tensors of the module, not copies.
    assert all(t is p for (_, t), (_, p) in zip(got, net.named_parameters()))
    # It still runs (compiled with the eager backend).
    assert compiled(torch.ones(2, 8)).shape == (2, 8)


def test_checkpoint_wrapper_dropped_inside_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    net = Net(wrap_layer=checkpoint_wrapper)
    raw = [n for n, _ in net.named_parameters()]
    assert "layers.0._checkpoint_wrapped_module.up_proj.weight" in raw, raw
    assert [n for n, _ in named_tensors(net)] == PLAIN


def test_all_wrappers_at_once() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    wrapped = torch.compile(Wrapper(Net(wrap_layer=checkpoint_wrapper)), backend="eager")
    raw = [n for n, _ in wrapped.named_parameters()]
    assert raw[0] == "_orig_mod.module.layers.0._checkpoint_wrapped_module.up_proj.weight", raw
    assert [n for n, _ in named_tensors(wrapped)] == PLAIN


def test_name_map_mapping_and_function() -> None:
    net = Wrapper(Net())
    mapped = named_tensors(net, name_map={"norm.weight": "model.norm.weight", "norm.bias": "model.norm.bias"})
    assert [n for n, _ in mapped][-2:] == ["model.norm.weight", "model.norm.bias"]
    assert [n for n, _ in mapped][:-2] == PLAIN[:-2]  # names the mapping lacks pass unchanged
    # A function sees the name with the wrappers already dropped; None leaves a tensor out.
    seen: list[str] = []

    def rename(name: str) -> str | None:
        seen.append(name)
        return None if name.endswith(".bias") else "model." + name

    got = [n for n, _ in named_tensors(net, name_map=rename)]
    assert seen == PLAIN
    assert got == ["model." + n for n in PLAIN if not n.endswith(".bias")]


def test_bad_names_refused_by_name() -> None:
    net = Net()
    # Two tensors that end up with one name: both originals are named.
    with pytest.raises(ValueError, match=r"layers\.0\.up_proj\.weight and layers\.1\.up_proj\.weight"):
        named_tensors(net, name_map=lambda n: n.replace("layers.1.", "layers.0."))
    with pytest.raises(ValueError, match=r"module\.layers\.0\.up_proj\.weight and layers\.0\.up_proj\.weight"):
        named_tensors([("module.layers.0.up_proj.weight", 1), ("layers.0.up_proj.weight", 2)])
    with pytest.raises(TypeError, match="name_map gave int 3 for norm.bias"):
        named_tensors(net, name_map=lambda n: 3 if n == "norm.bias" else n)  # type: ignore[arg-type,return-value]
    with pytest.raises(TypeError, match="name_map must be a mapping or a callable"):
        named_tensors(net, name_map=42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="only wrapper components"):
        job_name("module._orig_mod")


def test_registered_under_the_jobs_names(tmp_path: Path, procs: Procs) -> None:
    """Trainers register tensors under wrapped names (``_orig_mod.module.`` in front,
    ``_checkpoint_wrapped_module`` inside each layer), engines under a framework's own names
    undone by a ``name_map``; the sync lands every byte where the job's names say."""
    c = controller(tmp_path, procs)
    tok = c.job_token
    engines = [weightsync.Engine(c.control, r, job_token=tok) for r in range(2)]
    trainers = [weightsync.Trainer(c.control, r, job_token=tok) for r in range(2)]
    try:
        dst = [{t.name: np.zeros(t.shape, np.uint16) for t in e.layout()} for e in engines]
        shards = [{s.name: s for s in t.layout()} for t in trainers]
        src = [{n: np.zeros(s.shape, np.uint16) for n, s in sh.items()} for sh in shards]

        def wrapped(name: str) -> str:
            return "_orig_mod.module." + name.replace(".layers.0.", ".layers.0._checkpoint_wrapped_module.")

        def framework(name: str) -> str:
            return "engine/" + name.replace(".", "/")

        from_framework = {framework(n): n for d in dst for n in d}
        regs = in_threads(
            [lambda e=e, d=d: e.register({framework(n): (a, "bf16") for n, a in d.items()}, format="hf",
                                         name_map=from_framework)
             for e, d in zip(engines, dst)]
            + [lambda t=t, s=s: t.register({wrapped(n): (a, "bf16") for n, a in s.items()})
               for t, s in zip(trainers, src)]
        )
        # Addresses come back by the job's names.
        assert sorted(regs[0]) == sorted(dst[0]) and sorted(regs[2]) == sorted(src[0])
        assert any("layers.0." in n for n in regs[2])

        full: dict[str, Any] = {}
        for sh, s in zip(shards, src):
            for name, info in sh.items():
                full.setdefault(name, full_value(name, info.global_shape, 1))
                box = tuple(slice(o, o + k) for o, k in zip(info.offset, info.shape))
                s[name][...] = full[name][box]
        in_threads([lambda t=t: t.push(1).wait(timeout=60) for t in trainers])
        for e, d in zip(engines, dst):
            assert e.wait_for_version(1, timeout=30).version == 1
            for name, a in d.items():
                assert np.array_equal(a, full[name]), f"{e.worker_id}: {name} differs"
    finally:
        for w in [*trainers, *engines]:
            w.close()
