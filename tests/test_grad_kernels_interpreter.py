"""The learner's Hopper backward operands (``kernels/nvfp4_grad.py``) against the torch path,
through Triton's interpreter on CPU (each check in a subprocess with ``TRITON_INTERPRET=1``).

Nearest rounding gives the same values as ``dequantize(quantize_nvfp4(...))`` without the global
decode scale, bit for bit (with the RHT, on inputs whose transform is exact in float32);
stochastic rounding is unbiased, stays on the two neighbouring codes and picks the upper one as
often as the torch path does; dX/dW of the Hopper backward equal the torch path's within float32
accumulation error.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minite_common.hadamard import RHT_SIGNS

CHECKS = [
    "row_nearest",
    "col_rht_exact",
    "col_rht_random",
    "stochastic",
    "stochastic_bits",
    "nonfinite",
    "backward",
    "scale_rows",
]


@pytest.mark.parametrize("check", CHECKS)
def test_grad_kernels_in_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


# ---- worker side (runs under TRITON_INTERPRET=1) ----


def _values(t) -> torch.Tensor:
    """float32 ``code * f32(scale)`` of an NVFP4Tensor (no global decode scale)."""
    from minite_common.nvfp4 import E2M1_VALUES, unpack_codes

    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    codes = lut[unpack_codes(t.codes).long()]
    return codes * t.scales.float().repeat_interleave(16, dim=1)


def _heavy(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(rows, 1, generator=g) * 4 - 2)
    return (torch.randn(rows, cols, generator=g) * magnitude).to(torch.bfloat16)


def check_row_nearest() -> None:
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    from minite_common import quantize_nvfp4

    x = _heavy(50, 96, 0)
    for scale in (torch.rand(96) * 3 + 0.1, torch.tensor(0.37)):
        row, col, dec = quantize_grad_operands(x, row=True, row_scale=scale)
        assert col is None and row.dtype == torch.bfloat16 and row.shape == (50, 96)
        ref = quantize_nvfp4(x.float() * scale, amax="tensor")
        assert torch.equal(row.float(), _values(ref)), "row values differ from the torch path"
        assert torch.equal(dec[0], ref.decode_scale)


def _col_reference(x: torch.Tensor, rht: bool):
    from minite_common import quantize_nvfp4, random_hadamard_transform

    pad = -x.shape[0] % 16
    t = torch.nn.functional.pad(x.t(), (0, pad))
    if rht:
        t = random_hadamard_transform(t)
    return quantize_nvfp4(t.contiguous(), amax="tensor")


def check_col_rht_exact() -> None:
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    g = torch.Generator().manual_seed(1)
    # Small integers times powers of two: every RHT sum is exact in float32, in any order.
    x = torch.randint(-8, 9, (50, 48), generator=g) * 2.0 ** torch.randint(
        -3, 4, (50, 1), generator=g
    )
    x = x.to(torch.bfloat16)
    for rht in (True, False):
        signs = RHT_SIGNS if rht else None
        row, col, dec = quantize_grad_operands(x, row=False, col=True, rht_signs=signs)
        assert row is None and col.shape == (64, 48)
        ref = _col_reference(x, rht)
        assert torch.equal(col.float().t(), _values(ref)), f"col values differ (rht={rht})"
        assert torch.equal(dec[1], ref.decode_scale)


def check_col_rht_random() -> None:
    """Heavy-tailed input (float32 RHT sums round): bitwise the kernels' float32 butterfly model
    (``random_hadamard_transform`` summing in float32), and nearly always the float64 torch path."""
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    from minite_common import quantize_nvfp4, random_hadamard_transform

    x = _heavy(200, 64, 2)
    row, col, dec = quantize_grad_operands(x, row=True, col=True, rht_signs=RHT_SIGNS)
    pad = torch.nn.functional.pad(x.float().t(), (0, -x.shape[0] % 16))
    f32_butterfly = random_hadamard_transform(pad, torch.float32).float()
    model = quantize_nvfp4(f32_butterfly, amax="tensor")
    assert torch.equal(col.float().t(), _values(model)), "col values differ from the f32 model"
    assert torch.equal(dec[1], model.decode_scale)
    ref = _col_reference(x, True)
    same = (col.float().t() == _values(ref)).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the RHT'd values agree with the torch path"
    assert torch.equal(row.float(), _values(quantize_nvfp4(x.float(), amax="tensor")))


def check_stochastic() -> None:
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    from minite_common import quantize_nvfp4

    x = torch.full((256, 64), 0.3)
    x[:, 0] = 6.0  # pins the block scales: 0.3 lies between the codes 0 and 0.5 (scale 1)
    for seed in range(3):
        row, col, dec = quantize_grad_operands(
            x, row=True, row_stochastic=True, col=True, col_stochastic=True, seed=seed
        )
        values = row.float() * dec[0]
        first_block = values[:, 1:16]  # its scale is pinned by the 6.0
        assert set(first_block.mul(2**10).round().unique().tolist()) <= {0.0, 512.0}
        assert abs(first_block.mean().item() - 0.3) < 0.01
        # Along tokens a block of column c >= 1 holds 0.3 only: its scale is E4M3(0.3 * 448 / 6)
        # and every element is the largest code, the same in every block.
        col_values = col.float()[:, 1:] * dec[1]
        assert col_values.unique().numel() == 1
        assert abs(col_values[0, 0].item() - 0.3) < 0.02
    # Unbiased, with the same spread as the torch path's rounding, on varied magnitudes.
    g = torch.Generator().manual_seed(3)
    y = torch.rand(512, 32, generator=g) * 6
    draws = 8
    ours = [quantize_grad_operands(y, row=True, row_stochastic=True, seed=s) for s in range(draws)]
    ours_mean = torch.stack([r.float() * d[0] for r, _, d in ours]).mean(0)
    refs = [quantize_nvfp4(y, amax="tensor", stochastic=True, generator=g) for _ in range(draws)]
    torch_mean = torch.stack([_values(t) * t.decode_scale for t in refs]).mean(0)
    assert abs((ours_mean - y).mean().item()) < 0.01, "stochastic rounding is biased"
    spread_ours = (ours_mean - y).abs().mean().item()
    spread_torch = (torch_mean - y).abs().mean().item()
    assert abs(spread_ours / spread_torch - 1) < 0.1, (spread_ours, spread_torch)


def check_stochastic_bits() -> None:
    """Row and col operands with stochastic rounding and a fixed seed, bitwise against a torch
    model of the rule the kernels shipped with (``e2m1_reference.stochastic_row_values``); the
    seed as a Python int and as a tensor give the same bytes."""
    from e2m1_reference import seeds, stochastic_row_values
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    x = _heavy(40, 48, 5).float()
    x[0, :3] = torch.tensor([-0.0, 1e-30, -1e-30])
    r, c = x.shape
    for seed in (0, 7, 2**31 + 12345):
        row, col, dec = quantize_grad_operands(
            x, row=True, row_stochastic=True, col=True, col_stochastic=True, seed=seed
        )
        seed_row, seed_col = seeds(seed)
        index = torch.arange(r)[:, None] * c + torch.arange(c)[None, :]
        want = stochastic_row_values(x, seed_row, index)
        assert torch.equal(row.view(torch.int16), want.view(torch.int16))
        pad = torch.nn.functional.pad(x.t(), (0, -r % 16)).contiguous()  # [C, R16]
        index_t = torch.arange(pad.shape[1])[None, :] * c + torch.arange(c)[:, None]
        want = stochastic_row_values(pad, seed_col, index_t).t()
        assert torch.equal(col.view(torch.int16), want.view(torch.int16))
        as_tensor = quantize_grad_operands(
            x, row=True, row_stochastic=True, col=True, col_stochastic=True,
            seed=torch.tensor([seed % 2**31]),
        )  # fmt: skip
        assert torch.equal(as_tensor[0], row) and torch.equal(as_tensor[1], col)


def check_nonfinite() -> None:
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    x = _heavy(40, 32, 4)
    x[3, 5] = float("nan")
    row, col, dec = quantize_grad_operands(x, row=True, col=True, rht_signs=RHT_SIGNS)
    assert torch.isnan(dec).all()
    y = _heavy(40, 32, 5)
    y[7, 1] = float("inf")
    _, _, dec = quantize_grad_operands(y, row=False, col=True)
    assert torch.isnan(dec[1])
    empty = torch.zeros(0, 32, dtype=torch.bfloat16)
    row, col, dec = quantize_grad_operands(empty, row=True, col=True)
    assert row.shape == (0, 32) and col.shape == (0, 32) and torch.equal(dec, torch.ones(2))


def check_backward() -> None:
    from minite_kernels.nvfp4_grad import decoded_weight

    import minite_common.autograd as ag
    from minite_common import NVFP4Recipe, cat_rows, quantize_weight

    w = torch.randn(64, 256) / 10
    w_q = cat_rows([quantize_weight(w[:32]), quantize_weight(w[32:] * 50)])
    dec = decoded_weight(w_q)
    assert torch.equal(dec.float() * 128, _values(w_q)) and decoded_weight(w_q) is dec
    fresh = decoded_weight(
        w_q, cache=False
    )  # MINITE_CACHE_DECODED_WEIGHT=0: the same bits, kept nowhere
    assert fresh is not dec and torch.equal(fresh, dec)
    assert decoded_weight(w_q) is not dec  # the cached copy was dropped

    def exact_mm(a, b, out=None):  # exact stand-in for cuBLAS
        result = a.double().mm(b.double()).float()
        return result if out is None else out.copy_(result)

    ag.mm_f32 = exact_mm
    recipe = NVFP4Recipe(grad_stochastic_rounding=False)
    x = _heavy(40, 256, 6).float()
    g = _heavy(40, 64, 7).float()
    dx, dw = ag._hopper_backward(g, x, w_q, recipe, True, True, torch.float32, torch.float32)
    ref_dx = ag.nvfp4_dgrad(g, w_q, recipe)
    assert float((dx - ref_dx).norm() / ref_dx.norm()) < 1e-6
    ref_dw = ag.nvfp4_wgrad(g, x, recipe)
    # fp32 inputs: the kernel's RHT sums in another order than torch's (rare 1-ulp BF16 flips).
    assert float((dw - ref_dw).norm() / ref_dw.norm()) < 1e-2
    x_b, g_b = x.bfloat16(), g.bfloat16()
    dx, dw = ag._hopper_backward(g_b, x_b, w_q, recipe, True, True, torch.float32, torch.float32)
    assert float((dx - ag.nvfp4_dgrad(g_b, w_q, recipe)).norm() / ref_dx.norm()) < 1e-6
    ref_dw = ag.nvfp4_wgrad(g_b, x_b, recipe)
    assert float((dw - ref_dw).norm() / ref_dw.norm()) < 1e-2
    # Stochastic rounding: the seed comes from the device's generator (state that Megatron
    # checkpoints), so restoring that state repeats the backward bit for bit.
    sr = NVFP4Recipe()
    state = torch.get_rng_state()
    first = ag._hopper_backward(g_b, x_b, w_q, sr, True, True, torch.float32, torch.float32)
    second = ag._hopper_backward(g_b, x_b, w_q, sr, True, True, torch.float32, torch.float32)
    assert not torch.equal(first[0], second[0])
    torch.set_rng_state(state)
    again = ag._hopper_backward(g_b, x_b, w_q, sr, True, True, torch.float32, torch.float32)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def check_scale_rows() -> None:
    """The backward epilogue gives torch.mul's bits (float32 and BF16 out), per-tensor, per-row
    and per-group scales, NaN (also the GPU's NaN, bits 0x7FFFFFFF), Inf, BF16 ties and
    overflow."""
    from minite_kernels.nvfp4_grad import scale_rows

    g = torch.Generator().manual_seed(3)
    acc = torch.randn(6, 40, generator=g) * 10.0 ** torch.randint(-20, 20, (6, 1), generator=g)
    acc[0, :6] = torch.tensor([float("inf"), -float("inf"), 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                               3.0e38, -3.0e38])  # fmt: skip
    acc.view(torch.int32)[1, :2] = torch.tensor([0x7FFFFFFF, 0x7FC00000], dtype=torch.int32)

    def same(got: torch.Tensor, want: torch.Tensor) -> bool:
        return torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got.nan_to_num(), want.nan_to_num()
        )

    for out in (torch.float32, torch.bfloat16):
        one = torch.tensor(1.0)
        assert same(scale_rows(acc, one, out), acc.to(out)), out
        per_row = torch.rand(6, generator=g) * 4
        assert same(scale_rows(acc, per_row, out, 1), (acc * per_row[:, None]).to(out)), out
        per_pair = per_row[:3]
        want = (acc * per_pair.repeat_interleave(2)[:, None]).to(out)
        assert same(scale_rows(acc, per_pair, out, 2), want), out


if __name__ == "__main__":
    globals()[f"check_{sys.argv[1]}"]()
    print("ok")
