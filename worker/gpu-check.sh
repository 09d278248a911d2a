#!/usr/bin/env bash
# The GPU check of the `cuda` feature, in one device call on a machine with one NVIDIA GPU (lent
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
# 2. The device tool, one call (the script keeps to WEIGHTSYNC_GPU_CHECK_BUDGET_S, default 480 s,
#    so it ends, summary written, well inside the call's limit):
#
#      run(command="bash worker/gpu-check.sh", carry=["target/gpu-check"], timeout_s=560)
#
#    then give_back unless rerunning at once. It writes to $OUT (or target/gpu-check/out):
#      preflight.txt     what decides whether the rest can work (see `preflight` below)
#      summary.json      device, NVRTC used, each step's status, rc, seconds and time limit;
#                        rewritten after every step (and when the script is killed), so a step
#                        that hangs still leaves one naming it
#      gpu-check.jsonl   every `gpu-check-json:` record the checks printed
#      <step>.log        each step's full output;  env.txt  nvidia-smi, glibc, NVRTC candidates
#    and exits non-zero if any step that was built failed (or nothing could run).
#
# Steps, in order, cheapest and most decisive first (device review, section 3). Each runs under
# `timeout` with min(its cap, time left in the budget - 30 s); a step with under 45 s left is
# "skipped (no time left)", never started to be killed. A step whose binary was not built is
# "not built", not passed.
#   preflight  (cap 150 s, sub-probes capped at 60 s each) the binary's GLIBC floor against the
#            image's; nvidia-smi; the NVRTC a training process finds by itself (no
#            WEIGHTSYNC_NVRTC, no VIRTUAL_ENV: review N5); PyTorch's expandable segments against
#            cuMemGetAddressRange (review N4). It fails only when no GPU answers.
#   kernels  (cap 200 s) the fp8 kernel bit-exact with the CPU kernel on random data (normals,
#            subnormals, inf, NaN of both signs; every 16-bit pattern; awkward shapes and
#            alignments) and its throughput against a device-to-device copy of the same bytes
#            (ratio_vs_d2d, target >= 0.7 for bf16, 1 GiB, CUDA events); every cast; the e4m3
#            hardware-conversion self-test; pinned staging, source copies, IPC across processes
#            (the IPC child under its own 60 s limit).
#   sync     (cap 200 s) a full sync over TCP loopback from a device-memory source (an owned
#            buffer, then a borrowed cuMemAlloc range) through the one pipeline into a
#            device-memory destination: fp8 and casts prepared by the kernels on the device,
#            copies and a strided column band DMA'd into the pinned staging; the receiver's
#            pinned bounce buffers copied H2D before the sync counts as landed; every byte of
#            the device destination compared with the CPU kernels' result, checksums verified;
#            ratio_vs_d2d, ratio_vs_fabric (the fabric alone moving the same bytes between host
#            buffers in the same run, over the sync's median wall: the 0.9 goal with the
#            preparation on the GPU) and the stage timeline in its record.
#   overlap  (cap 150 s) the same plan serialised and pipelined: asserts the pipelined sync
#            within 1.25x of its slowest stage; overlap_speedup is reported as a figure (its 2.2
#            target is the verbs configuration's: on loopback TCP the write dominates, review N6).
# A step in another binary adds it to BUILD (name|cargo test target selection).
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=target/gpu-check
out="${OUT:-$bundle/out}"
budget_s=${WEIGHTSYNC_GPU_CHECK_BUDGET_S:-480}
# Time kept back at the end of the budget (summary, headline figures).
reserve_s=30
# A step is not started with less than this left.
min_step_s=45

BUILD=(
  "worker-lib-tests|-p weightsync-worker --lib"
)
# name|binary|cap seconds|arguments
STEPS=(
  "kernels|worker-lib-tests|200|--include-ignored --test-threads=1 --nocapture --skip gpu::check::host --skip gpu::check::sync gpu::check gpu::tests gpu::device_source"
  "sync|worker-lib-tests|200|--include-ignored --test-threads=1 --nocapture gpu::check::sync::device_source_sync_lands_every_byte"
  "overlap|worker-lib-tests|150|--include-ignored --test-threads=1 --nocapture gpu::check::sync::device_source_pipeline_overlaps_its_stages"
)
PREFLIGHT_CAP_S=150

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
  # The plan of the device steps, walked with their budget: every step must fit the call.
  check_plan || exit 1
  {
    echo "commit $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "built $(date -u +%FT%TZ) on $(uname -m), $(ldd --version 2>/dev/null | head -n1)"
    echo "glibc floor of the binaries: $(glibc_floor "$bundle"/bin/*)"
    (cd "$bundle/bin" && sha256sum ./*)
  } > "$bundle/MANIFEST"
  cat "$bundle/MANIFEST"
  du -sh "$bundle"
  echo 'gpu-check: now run(command="bash worker/gpu-check.sh", carry=["target/gpu-check"], timeout_s=560)'
}

# The newest GLIBC_x.y symbol version the binaries need (the image's glibc must be at least it).
glibc_floor() {
  objdump -T "$@" 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -n1
}

# Every step's cap fits the budget with the reserve, and the budget fits the documented call
# (560 s) with time for the machine's start and the transfers.
check_plan() {
  local total=$PREFLIGHT_CAP_S cap
  for step in "${STEPS[@]}"; do
    IFS='|' read -r _ _ cap _ <<< "$step"
    [ "$cap" -le $((budget_s - reserve_s)) ] || { echo "gpu-check: a step's cap ${cap}s exceeds the budget"; return 1; }
    total=$((total + cap))
  done
  [ "$budget_s" -le 540 ] || { echo "gpu-check: budget ${budget_s}s does not fit a 560 s call"; return 1; }
  echo "gpu-check: plan: preflight + ${#STEPS[@]} steps, caps ${total}s in all, budget ${budget_s}s (each step gets min(cap, left - ${reserve_s}s))"
}

if [ "${1:-}" = "--build" ]; then build; exit 0; fi

start=$(date +%s)
left() { echo $((budget_s - ($(date +%s) - start))); }
mkdir -p "$out"
if [ ! -d "$bundle/bin" ]; then
  if command -v cargo >/dev/null; then build; else
    echo "gpu-check: no $bundle/bin and no cargo here: run 'bash worker/gpu-check.sh --build' on a"
    echo "gpu-check: CPU machine first and carry target/gpu-check (see this script's header)"
    exit 2
  fi
fi

# ---- the summary, rewritten after every step and when the script is killed ----------------
results=()
current=""
write_summary() {
  local device steps pending=""
  device=$(timeout 10 nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -n1)
  steps=$(IFS=,; echo "${results[*]}")
  [ -n "$current" ] && pending="{\"step\":\"$current\",\"status\":\"interrupted (the script was killed during it)\"}"
  [ -n "$steps" ] && [ -n "$pending" ] && pending=",$pending"
  printf '{"device":"%s","nvrtc":"%s","budget_s":%s,"elapsed_s":%s,"steps":[%s%s]}\n' \
    "$device" "${WEIGHTSYNC_NVRTC:-}" "$budget_s" $(($(date +%s) - start)) "$steps" "$pending" \
    > "$out/summary.json"
}
step_pid=
on_kill() {
  [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null
  write_summary; echo "gpu-check: killed during ${current:-no step}; summary written"; exit 143
}
trap on_kill TERM INT HUP

# NVRTC: the worker looks for libnvrtc.so.13/.12 itself (loader path, CUDA_HOME,
# /usr/local/cuda, $VIRTUAL_ENV/$CONDA_PREFIX wheels); the steps name one explicitly so the log
# says which, preferring the toolkit (it matches the driver) over PyTorch's wheel. The preflight
# first shows what the worker finds without the name.
nvrtc_candidates() {
  ls -1 /usr/local/cuda/lib64/libnvrtc.so.1[23] /usr/local/cuda/targets/*/lib/libnvrtc.so.1[23] 2>/dev/null
  timeout 20 python3 - <<'EOF' 2>/dev/null
import glob, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()] + sys.path
for d in dict.fromkeys(dirs):
    for g in sorted(glob.glob(d + "/nvidia/*/lib/libnvrtc.so.1[23]")):
        print(g)
EOF
}
{
  echo "== nvidia-smi"; timeout 20 nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
  timeout 20 nvidia-smi 2>&1 | grep -m1 "CUDA Version"
  echo "== system"; uname -a; ldd --version 2>&1 | head -n1
  echo "== bundle"; cat "$bundle/MANIFEST" 2>/dev/null
  echo "== NVRTC candidates"; nvrtc_candidates
} > "$out/env.txt" 2>&1
named_nvrtc=${WEIGHTSYNC_NVRTC:-$(nvrtc_candidates | head -n1)}

: > "$out/gpu-check.jsonl"
failed=0; ran=0

# run_step NAME CAP CMD...: runs CMD under min(CAP, left - reserve), logs to $out/NAME.log,
# records its result and rewrites the summary.
run_step() {
  local name=$1 cap=$2; shift 2
  local avail=$(($(left) - reserve_s)) limit rc status t0 secs
  limit=$(( cap < avail ? cap : avail ))
  if [ "$limit" -lt "$min_step_s" ]; then
    echo "gpu-check: step $name: skipped, ${avail}s left in the budget"
    results+=("{\"step\":\"$name\",\"status\":\"skipped (no time left)\",\"left_s\":$avail}")
    write_summary; return
  fi
  echo "gpu-check: step $name (limit ${limit}s): $*"
  current=$name; write_summary
  t0=$(date +%s)
  # In the background and waited for, so a TERM to this script runs its trap at once.
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  rc=$?
  step_pid=
  secs=$(($(date +%s) - t0))
  tail -n 25 "$out/$name.log"
  sed -n 's/^gpu-check-json: //p' "$out/$name.log" >> "$out/gpu-check.jsonl"
  ran=$((ran + 1))
  if [ "$rc" = 0 ]; then status=pass; else status=fail; failed=$((failed + 1)); fi
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status="fail (timed out after ${limit}s)"
  results+=("{\"step\":\"$name\",\"status\":\"$status\",\"rc\":$rc,\"seconds\":$secs,\"limit_s\":$limit}")
  current=""; write_summary
}

# ---- preflight: can the rest work at all? ---------------------------------------------------
preflight() {
  local bin=$bundle/bin/worker-lib-tests
  echo "== kernel, glibc (image) and the binary's floor"
  uname -r; ldd --version 2>&1 | head -n1
  echo "binary needs $(glibc_floor "$bin")"
  echo "== GPU"
  timeout 20 nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader || { echo "no GPU answers"; return 1; }
  echo "== NVRTC"
  ls -l /usr/local/cuda/lib64/libnvrtc.so* 2>&1 | head -n3
  echo "VIRTUAL_ENV=${VIRTUAL_ENV:-unset} CONDA_PREFIX=${CONDA_PREFIX:-unset}"
  echo "== NVRTC as a training process finds it (no WEIGHTSYNC_NVRTC, no VIRTUAL_ENV; review N5):"
  env -u WEIGHTSYNC_NVRTC -u VIRTUAL_ENV -u WEIGHTSYNC_REQUIRE_NVRTC timeout 60 "$bin" \
    --include-ignored --exact --nocapture gpu::check::exact::device_and_kernel_report 2>&1 \
    | grep -E 'gpu-check-json|panicked|NVRTC|nvrtc|test result' | cut -c1-600
  echo "== PyTorch expandable segments against cuMemGetAddressRange (review N4):"
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 60 python3 -c "
import torch, ctypes as c
t = torch.empty(96 << 20, dtype=torch.uint8, device='cuda'); cu = c.CDLL('libcuda.so.1')
b, s = c.c_uint64(), c.c_size_t()
rc = cu.cuMemGetAddressRange_v2(c.byref(b), c.byref(s), c.c_uint64(t.data_ptr()))
have = b.value + s.value - t.data_ptr()
print('rc', rc, 'have', have, 'need', t.numel(), 'covered' if have >= t.numel() else 'NOT covered (N4)')" 2>&1 | tail -n3
  return 0
}
export -f preflight glibc_floor 2>/dev/null
export bundle
if [ -x "$bundle/bin/worker-lib-tests" ]; then
  run_step preflight "$PREFLIGHT_CAP_S" bash -c preflight
  cp "$out/preflight.log" "$out/preflight.txt" 2>/dev/null
fi

[ -n "$named_nvrtc" ] && export WEIGHTSYNC_NVRTC="$named_nvrtc"
export WEIGHTSYNC_REQUIRE_NVRTC=1
echo "gpu-check: NVRTC ${WEIGHTSYNC_NVRTC:-(none named; the worker searches)}"

for step in "${STEPS[@]}"; do
  IFS='|' read -r name bin cap args <<< "$step"
  if [ -z "$bin" ] || [ ! -x "$bundle/bin/$bin" ]; then
    echo "gpu-check: step $name: not built"
    results+=("{\"step\":\"$name\",\"status\":\"not built\"}")
    write_summary
    continue
  fi
  # shellcheck disable=SC2086
  run_step "$name" "$cap" "$bundle/bin/$bin" $args
done
write_summary
echo "gpu-check: summary $(cat "$out/summary.json")"
# The headline figures, last in the output (the device tool returns its tail).
timeout 20 python3 - "$out/gpu-check.jsonl" <<'EOF' 2>/dev/null || true
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("check") == "fp8_throughput":
        ops = {o["op"]: round(o["ratio_vs_d2d"], 3) for o in r["ops"]}
        print(f'gpu-check: fp8 {r["dtype"]}: exact {r["bit_exact_with_cpu"]}, ratio_vs_d2d '
              f'{r["ratio_vs_d2d"]:.3f} (target {r["target_ratio_vs_d2d"]}), all ops {ops}')
    elif r.get("check") == "device_sync":
        print(f'gpu-check: sync from {r["source"]} device memory: every byte equal '
              f'{r["every_byte_equal"]}, checksums {r["checksums_verified"]}, '
              f'{r["sync_gb_per_s"]:.2f} GB/s, ratio_vs_d2d {r["ratio_vs_d2d"]:.4f}, '
              f'ratio_vs_fabric {r["ratio_vs_fabric"]:.3f}')
    elif r.get("check") == "device_overlap":
        print(f'gpu-check: overlap: pipelined {r["pipelined_s"]:.3f} s = '
              f'{r["pipelined_over_slowest_stage"]:.2f}x its slowest stage (max '
              f'{r["max_pipelined_over_slowest_stage"]}); overlap_speedup {r["overlap_speedup"]:.2f} '
              f'(a figure; 2.2 is the verbs target)')
    elif r.get("check") == "device":
        print(f'gpu-check: {r["device"]["name"]} sm_{r["device"]["arch"]}, {r["target"]}, '
              f'NVRTC {r["nvrtc"]["version"]}, fp8 conversion {r["fp8_conversion"]}, '
              f'self-test {r["e4m3_selftest"]}')
EOF
if [ "$ran" = 0 ]; then echo "gpu-check: FAIL (no step was built)"; exit 2; fi
if [ "$failed" = 0 ]; then echo "gpu-check: PASS ($ran step(s) run)"; exit 0; fi
echo "gpu-check: FAIL ($failed of $ran step(s))"; exit 1
