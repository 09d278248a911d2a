#!/usr/bin/env bash
# GPU check for the `cuda` feature of weightsync-worker, for a machine with an NVIDIA GPU,
# the CUDA driver and NVRTC (libnvrtc) installed. Run from the repository root:
#
#   bash worker/gpu-check.sh
#
# It builds the worker with `--features cuda` and runs the #[ignore]d device tests in
# worker/src/gpu/check.rs:
#   - cuda_kernels_are_bit_exact_with_cpu: fp8 block quantisation (values and weight_scale_inv)
#     and every cast, bf16/f16/f32 random inputs incl. inf/NaN/subnormal patterns, compared byte
#     for byte with the CPU kernels (which are themselves pinned to ml_dtypes by committed vectors);
#   - cuda_fp8_throughput_vs_device_copy: 256 MiB of bf16, CUDA-event timed, prints
#     ratio_vs_d2d for the fp8 kernel (target >= 0.7) and the cast.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
# NVRTC is loaded at run time; make a toolkit's lib dir visible if there is one.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
cargo test -p weightsync-worker --features cuda --release --lib -- --include-ignored --nocapture --test-threads=1 gpu:: 2>&1 \
  | grep -E "gpu-check:|^test |test result|panicked|error" || true
# Exit status: rerun quietly so a failure is reported as one.
cargo test -p weightsync-worker --features cuda --release --lib -- --include-ignored --test-threads=1 gpu:: >/dev/null 2>&1 \
  && echo "gpu-check: PASS" || { echo "gpu-check: FAIL"; exit 1; }
