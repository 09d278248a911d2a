"""The README's "Use it from Python" examples stay true: every line of them is a line of the
end-to-end test's scripts (which run them), and mypy type-checks them against the package's
stubs. Every other ``python`` block of the README and of ``docs/`` (the vLLM and server examples
in ``docs/engines.md``) must be lines of those scripts too. mypy also checks the package itself
(strict)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import JOBS, REPO

PREAMBLE = '''from typing import Any
import weightsync

args: Any
model: Any
optimizer: Any
torch: Any
vocab: int
g: Any
tensors: Any


def before_landing(version: int) -> None: ...
def after_commit(version: int) -> None: ...

'''


def readme_examples() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "the README's Python section lost its examples"
    return blocks


def _assert_lines_of_the_tests(blocks: list[str], where: str) -> None:
    scripts = {p.name: {line.strip() for line in p.read_text().splitlines()} for p in JOBS.glob("*.py")}
    for block in blocks:
        for line in block.splitlines():
            code = line.split("  #")[0].strip()
            if not code:
                continue
            homes = [name for name, lines in scripts.items() if any(code in l for l in lines)]
            assert homes, f"{where} line not in the tests' scripts: {code!r}"


def test_readme_examples_are_lines_of_the_tests() -> None:
    _assert_lines_of_the_tests(readme_examples(), "README")


def test_every_python_example_in_the_docs_is_lines_of_the_tests() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    checked = 0
    for page in pages:
        blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        _assert_lines_of_the_tests(blocks, str(page.relative_to(REPO)))
        checked += len(blocks)
    # The README's two, its vLLM example, and docs/engines.md's vLLM and server examples.
    assert checked >= 5, f"only {checked} python examples found in the README and docs/"


def _mypy(argv: list[str]) -> None:
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", *argv], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_readme_examples_type_check(tmp_path: Path) -> None:
    for i, block in enumerate(readme_examples()):
        (tmp_path / f"example{i}.py").write_text(PREAMBLE + block)
    _mypy(["--strict", "--follow-imports=silent", *map(str, sorted(tmp_path.glob("example*.py")))])


def test_package_type_checks() -> None:
    import importlib.util

    import weightsync

    pkg = Path(weightsync.__file__).parent
    # The framework adapters import their framework: each is checked where it is installed.
    adapters = {"trl": ("trl",)}
    missing_adapters = {m for m, needs in adapters.items() if any(importlib.util.find_spec(n) is None for n in needs)}
    if importlib.util.find_spec("vllm") is not None and not missing_adapters:
        _mypy(["--strict", "-p", "weightsync"])
        return
    # Without vLLM, the modules that import it (weightsync.vllm subclasses vLLM's types,
    # weightsync._vllm_shards reads vLLM's layers) cannot be checked: every other module is, and
    # these two are checked wherever vLLM is installed.
    needs_vllm = ("__init__", "vllm", "_vllm_shards") if importlib.util.find_spec("vllm") is None else ()
    skipped = {*needs_vllm, *missing_adapters}
    modules = sorted(f"weightsync.{p.stem}" for p in pkg.glob("*.py") if p.stem not in skipped)
    assert modules, f"no modules found in {pkg}"
    _mypy(["--strict", "-m", "weightsync", *[a for m in modules for a in ("-m", m)]])
