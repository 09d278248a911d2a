#!/usr/bin/env bash
# The GPU check of the `cuda` feature, in one go on a machine with one NVIDIA GPU (an H200 lent
# by the `device` tool: a bare machine with the driver, CUDA 13 and PyTorch, but no Rust toolchain
# and no network). The test binaries are built here, on a CPU machine, and carried there.
#
# 1. Here, in the checkout the device tool sends (needs cargo; a release build, several minutes):
#
#      bash worker/gpu-check.sh --build
#
#    It builds the test binaries with `--features weightsync-worker/cuda` and puts them, stripped,
#    in target/gpu-check/ (git-ignored, about 3 MB), with a MANIFEST naming the commit. Before
#    packaging it runs the checks that need no GPU: kernels.cu emulated on the CPU (needs c++)
#    and the NVRTC compiles (where an NVRTC is found here, e.g. WEIGHTSYNC_NVRTC=<wheel's
#    libnvrtc.so.13>).
#
# 2. The device tool, one call (the script itself stays well under 5 minutes of device time):
#
#      run(command="bash worker/gpu-check.sh", carry=["target/gpu-check"], timeout_s=420)
#
#    then give_back unless rerunning at once. It writes to $OUT (or target/gpu-check/out):
#      summary.json      one record: device, NVRTC used, each step's status, rc and seconds
#      gpu-check.jsonl   every `gpu-check-json:` record the checks printed
#      <step>.log        each step's full output;  env.txt  nvidia-smi, glibc, NVRTC candidates
#    and exits non-zero if any step that was built failed (or nothing could run).
#
# Steps (STEPS below). Each is a test binary and its arguments; a step whose binary was not
# built is reported as "not built", not as passed.
#   kernels  (a) phase 1: the fp8 kernel bit-exact with the CPU kernel on random data (normals,
#            subnormals, inf, NaN of both signs; every 16-bit pattern; awkward shapes and
#            alignments) and its throughput against a device-to-device copy of the same bytes
#            (ratio_vs_d2d, target >= 0.7 for bf16, 1 GiB, CUDA events); every cast; the e4m3
#            hardware-conversion self-test; pinned staging, source copies, IPC across processes.
#            (The NVRTC compile tests and the CPU emulation of kernels.cu need no GPU: --build
#            runs them here, before packaging.)
#   sync     (b) a full sync over TCP loopback from a device-memory source (an owned buffer,
#            then a borrowed cuMemAlloc range) through the one pipeline into a device-memory
#            destination: fp8 and casts prepared by the kernels on the device, copies and a
#            strided column band DMA'd into the pinned staging; the receiver's pinned bounce
#            buffers copied H2D before the sync counts as landed; every byte of the device
#            destination compared with the CPU kernels' result, checksums verified (on the
#            bounce buffers); ratio_vs_d2d, ratio_vs_fabric (the fabric alone moving the same
#            bytes between host buffers in the same run, over the sync's median wall: the
#            performance issue's 0.9 goal with the preparation on the GPU) and the stage
#            timeline in its record. Both ends run in one process (two fabrics over loopback).
#   overlap  (c) the same plan serialised and pipelined: overlap_speedup (target >= 2.2) with
#            real DMA, kernel and network stages.
# A step in another binary adds it to BUILD (name|cargo test target selection).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=target/gpu-check
out="${OUT:-$bundle/out}"

BUILD=(
  "worker-lib-tests|-p weightsync-worker --lib"
)
STEPS=(
  "kernels|worker-lib-tests|--include-ignored --test-threads=1 --nocapture --skip gpu::check::host --skip gpu::check::sync gpu::check gpu::tests gpu::device_source"
  "sync|worker-lib-tests|--include-ignored --test-threads=1 --nocapture gpu::check::sync::device_source_sync_lands_every_byte"
  "overlap|worker-lib-tests|--include-ignored --test-threads=1 --nocapture gpu::check::sync::device_source_pipeline_overlaps_its_stages"
)
STEP_TIMEOUT_S=240

build() {
  command -v cargo >/dev/null || { echo "gpu-check: --build needs cargo"; exit 2; }
  rm -rf "$bundle" && mkdir -p "$bundle/bin"
  for entry in "${BUILD[@]}"; do
    name=${entry%%|*}; sel=${entry#*|}
    echo "gpu-check: building $name: cargo test --release --features weightsync-worker/cuda $sel --no-run"
    # shellcheck disable=SC2086
    exe=$(cargo test --release --features weightsync-worker/cuda $sel --no-run \
            --message-format=json-render-diagnostics \
          | python3 -c '
import json, sys
exes = [m["executable"] for m in map(json.loads, sys.stdin)
        if m.get("reason") == "compiler-artifact" and m.get("executable")
        and m.get("profile", {}).get("test")]
print(exes[-1] if exes else "")') || { echo "gpu-check: build of $name failed"; exit 1; }
    [ -n "$exe" ] || { echo "gpu-check: no test executable for $name"; exit 1; }
    cp "$exe" "$bundle/bin/$name" && strip "$bundle/bin/$name"
  done
  # Before any device time: the kernels compile (where an NVRTC is found here) and, run on the
  # CPU under an emulation of the CUDA built-ins, match the CPU kernels bit for bit.
  echo "gpu-check: checking the kernels without a GPU (NVRTC compile, host emulation)"
  "$bundle/bin/worker-lib-tests" --include-ignored gpu::kernels gpu::nvrtc gpu::check::host \
    || { echo "gpu-check: the kernels fail without a GPU already; not packaging"; rm -rf "$bundle/bin"; exit 1; }
  {
    echo "commit $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%FT%TZ) on $(uname -m), $(ldd --version 2>/dev/null | head -n1)"
    (cd "$bundle/bin" && sha256sum ./*)
  } > "$bundle/MANIFEST"
  cat "$bundle/MANIFEST"
  du -sh "$bundle"
  echo 'gpu-check: now run(command="bash worker/gpu-check.sh", carry=["target/gpu-check"], timeout_s=420)'
}

if [ "${1:-}" = "--build" ]; then build; exit 0; fi

mkdir -p "$out"
if [ ! -d "$bundle/bin" ]; then
  if command -v cargo >/dev/null; then build; else
    echo "gpu-check: no $bundle/bin and no cargo here: run 'bash worker/gpu-check.sh --build' on a"
    echo "gpu-check: CPU machine first and carry target/gpu-check (see this script's header)"
    exit 2
  fi
fi

# NVRTC: the worker looks for libnvrtc.so.13/.12 itself (loader path, CUDA_HOME,
# /usr/local/cuda, $VIRTUAL_ENV/$CONDA_PREFIX wheels); name one explicitly here so the log says
# which, preferring the toolkit (it matches the driver) over PyTorch's wheel.
nvrtc_candidates() {
  ls -1 /usr/local/cuda/lib64/libnvrtc.so.1[23] /usr/local/cuda/targets/*/lib/libnvrtc.so.1[23] 2>/dev/null
  python3 - <<'EOF' 2>/dev/null
import glob, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for d in dict.fromkeys(dirs):
    for g in sorted(glob.glob(d + "/nvidia/*/lib/libnvrtc.so.1[23]")):
        print(g)
EOF
}
{
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  nvidia-smi 2>&1 | grep -m1 "CUDA Version"
  echo "== system"; uname -a; ldd --version 2>&1 | head -n1
  echo "== bundle"; cat "$bundle/MANIFEST" 2>/dev/null
  echo "== NVRTC candidates"; nvrtc_candidates
} > "$out/env.txt" 2>&1
if [ -z "${WEIGHTSYNC_NVRTC:-}" ]; then
  first=$(nvrtc_candidates | head -n1)
  [ -n "$first" ] && export WEIGHTSYNC_NVRTC="$first"
fi
export WEIGHTSYNC_REQUIRE_NVRTC=1
echo "gpu-check: NVRTC ${WEIGHTSYNC_NVRTC:-(none named; the worker searches)}"
head -n3 "$out/env.txt" | tail -n2

: > "$out/gpu-check.jsonl"
results=()
failed=0; ran=0
for step in "${STEPS[@]}"; do
  IFS='|' read -r name bin args <<< "$step"
  if [ -z "$bin" ] || [ ! -x "$bundle/bin/$bin" ]; then
    echo "gpu-check: step $name: not built"
    results+=("{\"step\":\"$name\",\"status\":\"not built\"}")
    continue
  fi
  echo "gpu-check: step $name: $bin $args"
  t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  timeout -k 10 "$STEP_TIMEOUT_S" "$bundle/bin/$bin" $args 2>&1 | tee "$out/$name.log"
  rc=${PIPESTATUS[0]}
  secs=$(python3 -c "import time; print(round(time.time() - $t0, 1))" 2>/dev/null || echo null)
  sed -n 's/^gpu-check-json: //p' "$out/$name.log" >> "$out/gpu-check.jsonl"
  ran=$((ran + 1))
  if [ "$rc" = 0 ]; then status=pass; else status=fail; failed=$((failed + 1)); fi
  [ "$rc" = 124 ] && status="fail (timed out after ${STEP_TIMEOUT_S}s)"
  results+=("{\"step\":\"$name\",\"status\":\"$status\",\"rc\":$rc,\"seconds\":$secs}")
done

device=$(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n1)
steps=$(IFS=,; echo "${results[*]}")
printf '{"device":"%s","nvrtc":"%s","steps":[%s]}\n' "$device" "${WEIGHTSYNC_NVRTC:-}" "$steps" \
  > "$out/summary.json"
echo "gpu-check: summary $(cat "$out/summary.json")"
# The headline figures, last in the output (the device tool returns its tail).
python3 - "$out/gpu-check.jsonl" <<'EOF' 2>/dev/null || true
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("check") == "fp8_throughput":
        ops = {o["op"]: round(o["ratio_vs_d2d"], 3) for o in r["ops"]}
        print(f'gpu-check: fp8 {r["dtype"]}: exact {r["bit_exact_with_cpu"]}, ratio_vs_d2d '
              f'{r["ratio_vs_d2d"]:.3f} (target {r["target_ratio_vs_d2d"]}), all ops {ops}')
    elif r.get("check") == "device_sync":
        print(f'gpu-check: sync from {r["source"]} device memory: every byte equal '
              f'{r["every_byte_equal"]}, checksums {r["checksums_verified"]}, '
              f'{r["sync_gb_per_s"]:.2f} GB/s, ratio_vs_d2d {r["ratio_vs_d2d"]:.4f}')
    elif r.get("check") == "device_overlap":
        print(f'gpu-check: overlap_speedup {r["overlap_speedup"]:.2f} '
              f'(target {r["target_overlap_speedup"]}), serialised {r["serialised_s"]:.3f} s, '
              f'pipelined {r["pipelined_s"]:.3f} s')
    elif r.get("check") == "device":
        print(f'gpu-check: {r["device"]["name"]} sm_{r["device"]["arch"]}, {r["target"]}, '
              f'NVRTC {r["nvrtc"]["version"]}, fp8 conversion {r["fp8_conversion"]}, '
              f'self-test {r["e4m3_selftest"]}')
EOF
if [ "$ran" = 0 ]; then echo "gpu-check: FAIL (no step was built)"; exit 2; fi
if [ "$failed" = 0 ]; then echo "gpu-check: PASS ($ran step(s) run)"; exit 0; fi
echo "gpu-check: FAIL ($failed of $ran step(s))"; exit 1
