"""References for the quantize kernels' rounding, kept to compare the kernels with bitwise:

- :func:`rounding_kernel`: the E2M1 formulas the kernels used before the magic-number rounding
  (``tests/test_kernels_interpreter.py``, check ``e2m1_rounding``);
- :func:`stochastic_row_values`: a torch model of the gradient operands' stochastic rounding as
  it shipped (seed derivation, lowbias32 uniforms, the rule), for the interpreter and GPU tests;
- the kernels' random Hadamard transform is ``random_hadamard_transform(x, torch.float32)``
  (the CPU path's butterfly order, summed in float32).

Imported only where Triton is (the interpreter subprocesses, tests/gpu)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from minite_kernels.nvfp4_grad import e2m1_round_nearest, e2m1_round_stochastic
from minite_kernels.nvfp4_quantize import e2m1_code_rne


@triton.jit
def rounding_kernel(a_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Row i of ``out`` int32 [n, 6]: old code, new code, old nearest, new nearest, old
    stochastic, new stochastic (float bits) of ``a[i]`` in [0, 6] with uniform ``u[i]``."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    a = tl.load(a_ptr + offs, mask=ok, other=0.0)
    u = tl.load(u_ptr + offs, mask=ok, other=0.0)
    old_code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    per_step = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))
    old_near = ((a * per_step + 8388608.0) - 8388608.0) * step
    old_sr = tl.minimum(tl.floor(a * per_step + u) * step, 6.0)
    out = out_ptr + offs * 6
    tl.store(out, old_code, mask=ok)
    tl.store(out + 1, e2m1_code_rne(a), mask=ok)
    tl.store(out + 2, old_near.to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 3, e2m1_round_nearest(a).to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 4, old_sr.to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 5, e2m1_round_stochastic(a, u).to(tl.int32, bitcast=True), mask=ok)


def seeds(seed: int) -> tuple[int, int]:
    """The row and col operands' seeds the kernels derive from ``seed``."""
    return seed % 2**31, (seed * 2654435761 + 1013904223) % 2**31


def lowbias32_pair(seed: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' two uniforms per hash in torch int64 arithmetic: lowbias32 of
    ``index * golden + seed``, its high and low 16 bits k as ``(k + 1/2) * 2^-16``."""
    m = 0xFFFFFFFF
    x = (index * 0x9E3779B9 + seed) & m
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return ((x >> 16).float() + 0.5) * 2.0**-16, ((x & 0xFFFF).float() + 0.5) * 2.0**-16


def stochastic_row_values(v: torch.Tensor, seed: int, index: torch.Tensor) -> torch.Tensor:
    """BF16 ``code * scale`` of float32 ``v`` [P, Q] (CPU, finite) quantized in 1x16 blocks with
    the per-tensor amax and stochastic rounding as shipped: ``floor(a / step + u) * step`` with
    ``a = |v * encode|`` (the sum rounded once in float32) and ``u`` from ``seed`` and the int64
    element indices ``index`` [P, Q]: element q of a block draws the high half of the hash of
    its own index when q % 16 < 8, else the low half of the hash of element q - 8's index."""
    from minite_common import quantize_nvfp4

    ref = quantize_nvfp4(v, amax="tensor")  # the scales do not depend on the rounding
    scale = ref.scales.float().repeat_interleave(16, dim=1)
    encode = torch.clamp(1.0 / (scale * ref.decode_scale), max=torch.finfo(torch.float32).max)
    scaled = v * encode
    a = scaled.abs().clamp(max=6.0)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    p, q = index.shape
    blocks = index.view(p, q // 16, 2, 8)
    first, second = lowbias32_pair(seed, blocks[:, :, 0])
    u = torch.stack([first, second], dim=2).view(p, q)
    magnitude = torch.floor(a / step + u) * step
    return (torch.where(scaled.signbit(), -magnitude, magnitude) * scale).to(torch.bfloat16)
