"""The E2M1 rounding formulas the quantize kernels used before the magic-number rounding, kept
as the reference that ``tests/test_kernels_interpreter.py`` (check ``e2m1_rounding``) compares
the new helpers with, bitwise. Imported only inside the interpreter subprocess."""

from __future__ import annotations

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
    lo = tl.floor(a * per_step) * step
    old_sr = tl.minimum(tl.where(u * step < a - lo, lo + step, lo), 6.0)
    out = out_ptr + offs * 6
    tl.store(out, old_code, mask=ok)
    tl.store(out + 1, e2m1_code_rne(a), mask=ok)
    tl.store(out + 2, old_near.to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 3, e2m1_round_nearest(a).to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 4, old_sr.to(tl.int32, bitcast=True), mask=ok)
    tl.store(out + 5, e2m1_round_stochastic(a, u).to(tl.int32, bitcast=True), mask=ok)
