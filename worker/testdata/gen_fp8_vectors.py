#!/usr/bin/env python3
"""Generate the fp8 e4m3fn test vectors the worker's Rust tests compare against, byte for byte.

Reference: ml_dtypes.float8_e4m3fn (the dtype JAX / numpy use; torch.float8_e4m3fn agrees on every
finite value in range). Requirements: `pip install numpy ml_dtypes`. Deterministic (fixed seed):
re-running it must reproduce the committed files exactly.

    python3 worker/testdata/gen_fp8_vectors.py   # writes fp8_vectors.json and fp8_blocks.bin here

Semantics pinned here (see worker/src/prepare/fp8.rs):
- element conversion is *saturating*: expected = ml_dtypes cast of clip(x, -448, 448) computed in
  f32 (ml_dtypes alone turns overflow and inf into NaN because e4m3fn has no infinity); NaN stays
  NaN with its sign;
- block quantisation (DeepGEMM / vLLM / SGLang `per_block_cast_to_fp8`, DeepSeek-V3 layout):
  amax = max(max |x| over the *finite* elements of the 128x128 block, 1e-4);
  weight_scale_inv = amax / 448; q = e4m3(clip(x * (448 / amax), -448, 448)), all in f32.

fp8_vectors.json:
  elements: [{dtype, input_hex, expected_hex, count}]  inputs little-endian, expected e4m3 bytes
  blocks:   [{name, dtype, rows, cols, input: [offset, len], values: [...], scales: [...]}]
            byte ranges into fp8_blocks.bin; scales are little-endian f32, [ceil(r/128), ceil(c/128)]
"""

import json
import os

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
DTYPES = {"bf16": ml_dtypes.bfloat16, "f16": np.float16, "f32": np.float32}
HERE = os.path.dirname(os.path.abspath(__file__))
F448 = np.float32(448.0)
FLOOR = np.float32(1e-4)


def e4m3_saturating(x_f32):
    """Saturating f32 -> e4m3fn bytes: clip (NaN passes through) then ml_dtypes' RNE cast."""
    x = np.asarray(x_f32, dtype=np.float32)
    return np.clip(x, -F448, F448).astype(E4M3).view(np.uint8)


def element_inputs():
    """f32 values covering every class of the conversion; returned as float32 bit patterns."""
    sub = 2.0**-9  # smallest e4m3 subnormal
    vals = [0.0, -0.0]
    vals += [k * sub for k in range(1, 8)]  # every subnormal
    vals += [(k + 0.5) * sub for k in range(0, 8)]  # ties between subnormals (and to 0, to min normal)
    vals += [(k + 0.5) * sub * (1 + 2**-12) for k in range(0, 8)]  # just above those ties
    vals += [(k + 0.5) * sub * (1 - 2**-12) for k in range(0, 8)]  # just below
    vals += [2.0**-6, 2.0**-6 * 1.0625, 2.0**-6 * 1.0625 * (1 + 2**-10), 2.0**-7 * 1.96875]
    vals += [2.0**-12, 2.0**-20, 1e-30, 1e-40, 1e-45]  # underflow to zero, f32 denormals
    vals += [1.0, 1.0625, 1.1875, 1.3125, 1.4375, 1.0625 * (1 + 2**-12), 3.75, 7.5, 15.0]  # ties
    vals += [240.0, 256.0, 272.0, 288.0, 416.0, 432.0, 440.0, 447.9, 448.0]
    vals += [449.0, 463.99, 464.0, 464.01, 479.0, 480.0, 481.0, 500.0, 1000.0, 65504.0, 1e6, 3e38]
    vals += [np.inf, np.nan]
    vals = np.array(vals, dtype=np.float32)
    vals = np.concatenate([vals, -vals])
    rng = np.random.default_rng(7)
    rand = (rng.standard_normal(512) * np.exp2(rng.integers(-12, 10, 512))).astype(np.float32)
    bits = np.concatenate([vals.view(np.uint32), rand.view(np.uint32)])
    # NaN payloads: signalling, quiet, both signs.
    extra = np.array([0x7F800001, 0xFF800001, 0x7FA00000, 0x7FFFFFFF, 0xFFC00001], dtype=np.uint32)
    return np.concatenate([bits, extra]).astype(np.uint32)


def element_cases():
    bits = element_inputs()
    x32 = bits.view(np.float32)
    cases = []
    for name, dt in DTYPES.items():
        with np.errstate(over="ignore", invalid="ignore"):
            x = x32.astype(dt)  # the input as the trainer would hold it (RNE narrowing)
        expected = e4m3_saturating(x.astype(np.float32))
        cases.append(
            {
                "dtype": name,
                "count": int(x.size),
                "input_hex": x.tobytes().hex(),
                "expected_hex": expected.tobytes().hex(),
            }
        )
    return cases


def quantise_blocks(x):
    """Reference block quantisation of a 2-D array of bf16/f16/f32 -> (e4m3 bytes, f32 scales)."""
    x = x.astype(np.float32)
    rows, cols = x.shape
    rb, cb = -(-rows // 128), -(-cols // 128)
    values = np.zeros((rows, cols), dtype=np.uint8)
    scales = np.zeros((rb, cb), dtype=np.float32)
    for i in range(rb):
        for j in range(cb):
            blk = x[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            finite = np.abs(blk[np.isfinite(blk)])
            amax = finite.max() if finite.size else np.float32(0.0)
            amax = np.maximum(np.float32(amax), FLOOR)
            inv = F448 / amax  # f32 / f32, IEEE
            scales[i, j] = amax / F448
            with np.errstate(over="ignore", invalid="ignore"):
                values[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = e4m3_saturating(blk * inv)
    return values, scales


def block_cases(rng):
    cases = []

    # A: one whole f32 block, normal weights.
    a = (rng.standard_normal((128, 128)) * 0.02).astype(np.float32)
    cases.append(("f32_single_block", "f32", a))

    # B: bf16 200x300 (2x3 grid with partial blocks), per-block magnitudes from 1e-6 to 1e3,
    # an all-zero block (1, 2) and a block whose amax is below the 1e-4 floor (0, 2).
    b = rng.standard_normal((200, 300)).astype(np.float32)
    mags = np.array([[1e-2, 3.0, 5e-6], [1e3, 0.5, 0.0]], dtype=np.float32)
    for i in range(2):
        for j in range(3):
            b[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= mags[i, j]
    cases.append(("bf16_partial_blocks_zero_and_floor", "bf16", b.astype(ml_dtypes.bfloat16)))

    # C: f16 130x256 with inf, -inf and NaN in block (0, 0), f16 subnormals in block (0, 1),
    # and exact ties after scaling (amax 448 -> inv 1, so values are converted unscaled).
    c = (rng.standard_normal((130, 256)) * 4).astype(np.float32)
    c[0, 0], c[5, 7], c[9, 9] = np.inf, -np.inf, np.nan
    c[0:128, 128:256] = rng.standard_normal((128, 128)) * 2.0**-20
    c[128:130, 0:128] = np.array([448.0, 1.0625, 1.1875, -3.75, 2.0**-10, 3 * 2.0**-10] * 42 + [0.0] * 4).reshape(2, 128)
    cases.append(("f16_nonfinite_subnormal_ties", "f16", c.astype(np.float16)))

    # D: bf16 256x128, used for the block-row sub-range test as well.
    d = (rng.standard_normal((256, 128)) * 0.1).astype(np.float32)
    cases.append(("bf16_two_block_rows", "bf16", d.astype(ml_dtypes.bfloat16)))
    return cases


def main():
    rng = np.random.default_rng(20251129)
    blob = bytearray()

    def put(arr):
        off = len(blob)
        data = np.ascontiguousarray(arr).tobytes()
        blob.extend(data)
        return [off, len(data)]

    blocks = []
    for name, dt, x in block_cases(rng):
        values, scales = quantise_blocks(x)
        rows, cols = x.shape
        blocks.append(
            {
                "name": name,
                "dtype": dt,
                "rows": rows,
                "cols": cols,
                "input": put(x),
                "values": put(values),
                "scales": put(scales.astype("<f4")),
            }
        )
    doc = {
        "generator": "worker/testdata/gen_fp8_vectors.py",
        "ml_dtypes": ml_dtypes.__version__,
        "elements": element_cases(),
        "blocks": blocks,
    }
    with open(os.path.join(HERE, "fp8_vectors.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(os.path.join(HERE, "fp8_blocks.bin"), "wb") as f:
        f.write(bytes(blob))


if __name__ == "__main__":
    main()
