"""(Copied from the fact-finding of issue 13, /work/wt/pyproto/fp8_reference.py; it shares no code
with weightsync: the fp8 engine test compares against it.)

Independent torch reference for fp8 e4m3fn 128x128 block quantisation, recipe "a"
(shared/engines/fp8-recipes.md): amax = max(|x| over the finite elements of the block, 1e-4),
q = e4m3(clamp(x * (448 / amax), -448, 448)) with a TRUE f32 division 448 / amax,
weight_scale_inv = amax / 448 (f32). Saturating: |x| > 448 after scaling clamps, NaN stays NaN.

Pitfalls (each checked by fp8_check.py):
  * `448.0 / amax` in torch is Tensor.__rtruediv__ = `amax.reciprocal() * 448` -> recipe b.
    Write `torch.full_like(amax, 448.0) / amax` (tensor / tensor = IEEE division) instead.
  * `.to(torch.float8_e4m3fn)` does not saturate: out-of-range and inf become NaN; clamp first.
  * torch's f16 -> f32 conversion of small (non-vectorised) tensors returns a canonical +NaN
    (0x7fffffff) for a negative f16 NaN, so the e4m3 NaN loses its sign; vectorised (large)
    tensors keep it. _keep_nan_sign() restores it from the original tensor's sign bit.
"""

import torch

BLOCK = 128
F8 = torch.float8_e4m3fn


def _keep_nan_sign(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    nan = torch.isnan(x)
    if not bool(nan.any()):
        return q
    u = q.view(torch.uint8).clone()
    u[nan] = torch.where(torch.signbit(x[nan]), 0xFF, 0x7F).to(torch.uint8)
    return u.view(F8)


def quantize_blocks(w: torch.Tensor, recipe: str = "a") -> tuple[torch.Tensor, torch.Tensor]:
    """2-D bf16/f16/f32 tensor -> (e4m3fn tensor of the same shape, f32 [ceil(r/128), ceil(c/128)])."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    x = w.detach().to(torch.float32)
    rows, cols = x.shape
    rb, cb = -(-rows // BLOCK), -(-cols // BLOCK)
    xp = torch.zeros(rb * BLOCK, cb * BLOCK, dtype=torch.float32)
    xp[:rows, :cols] = x
    xb = xp.view(rb, BLOCK, cb, BLOCK)
    finite_abs = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros((), dtype=torch.float32))
    amax = finite_abs.amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    f448 = torch.full_like(amax, 448.0)
    if recipe == "a":        # x * (448 / amax), true division
        scaled = xb * (f448 / amax)
    elif recipe == "b":      # the common torch helper: scalar / tensor == reciprocal(amax) * 448
        scaled = xb * (448.0 / amax)
    elif recipe == "c":      # x * (1 / sf), sf = amax / 448
        scaled = xb * (torch.ones_like(amax) / (amax / f448))
    elif recipe == "d":      # x / sf
        scaled = xb / (amax / f448)
    elif recipe == "transformers":
        # transformers' Fp8Quantize (integrations/finegrained_fp8.py, 5.19), written out: no
        # amax floor, scales = 448.0 / max_abs (torch: reciprocal times 448), 1 where a block
        # is all zero, weight_scale_inv = 1.0 / scales.
        raw = finite_abs.amax(dim=(1, 3), keepdim=True)
        safe = torch.where(raw > 0, raw, torch.ones_like(raw))
        scales = torch.where(raw > 0, 448.0 / safe, torch.ones_like(safe))
        q = (xb * scales).clamp(-448.0, 448.0).to(F8)
        q = _keep_nan_sign(q.view(rb * BLOCK, cb * BLOCK)[:rows, :cols].contiguous(), w.detach())
        return q, (1.0 / scales).to(torch.float32).view(rb, cb).contiguous()
    else:
        raise ValueError(recipe)
    q = scaled.clamp(-448.0, 448.0).to(F8)           # clamp keeps NaN; .to() is RNE
    q = _keep_nan_sign(q.view(rb * BLOCK, cb * BLOCK)[:rows, :cols].contiguous(), w.detach())
    scale_inv = (amax / f448).view(rb, cb).contiguous()
    return q, scale_inv


def e4m3_saturating(x: torch.Tensor) -> torch.Tensor:
    return _keep_nan_sign(x.to(torch.float32).clamp(-448.0, 448.0).to(F8), x)
