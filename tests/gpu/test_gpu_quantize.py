"""GPU tests of the faster quantize kernels (issue 15), run on the H200: the BF16 word-pair
activation kernel bitwise equal to the generic kernel and to the CPU reference; the gradient
operands' stochastic rounding bitwise equal to the torch model of the shipped rule (fixed seed,
seed as int or device tensor); no recompilation when row counts change; stochastic-rounding
seeds reproducible from the CUDA generator's state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: e2m1_reference


def _bf16_inputs(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(rows, k // 16, 1, generator=g) * 8 - 4)
    x = torch.randn(rows, k // 16, 16, generator=g) * magnitude
    x = x.view(rows, k)
    x[torch.rand(rows, k, generator=g) < 0.02] = 0.0
    if rows > 4:
        x[1, 3], x[3, -1], x[4, 0] = float("nan"), float("inf"), -0.0
        x[2] = 0.0
    return x.to(torch.bfloat16)


def _same(got, ref) -> bool:
    codes, scales, decode = got
    return (
        torch.equal(codes.cpu(), ref.codes)
        and torch.equal(scales.view(torch.uint8).cpu(), ref.scales.view(torch.uint8))
        and torch.equal(decode.cpu().nan_to_num(), ref.decode_scale.nan_to_num())
        and torch.equal(decode.cpu().isnan(), ref.decode_scale.isnan())
    )


@pytest.mark.parametrize("rows,k", [(1, 4096), (17, 272), (300, 6144), (4096, 2048)])
def test_bf16_word_kernel_equals_generic_kernel_and_cpu(rows, k, monkeypatch):
    import minite_kernels.nvfp4_quantize as q

    from minite_common import quantize_nvfp4

    x = _bf16_inputs(rows, k, rows + k)
    ref = quantize_nvfp4(x, amax="row")
    words = q.quantize_nvfp4_triton(x.cuda(), amax="row", block_2d=False)
    assert _same(words, ref)
    given = x.float().nan_to_num(0.0, 0.0, 0.0).abs().amax(1) * 0.5
    ref_given = quantize_nvfp4(x, global_amax=given)
    assert _same(q.quantize_nvfp4_triton(x.cuda(), amax="row", block_2d=False,
                                         global_amax=given.cuda()), ref_given)  # fmt: skip
    monkeypatch.setattr(q, "_bf16_words", lambda _: False)
    generic = q.quantize_nvfp4_triton(x.cuda(), amax="row", block_2d=False)
    for a, b in zip(words, generic, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 12345, 2**31 + 7])
def test_stochastic_grad_operands_bitwise_the_shipped_rule(seed):
    from e2m1_reference import seeds, stochastic_row_values
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    x = _bf16_inputs(1000, 512, 9).float().nan_to_num(0.0, 0.0, 0.0)
    r, c = x.shape
    row, col, _ = quantize_grad_operands(
        x.cuda(), row=True, row_stochastic=True, col=True, col_stochastic=True, seed=seed
    )
    seed_row, seed_col = seeds(seed)
    index = torch.arange(r)[:, None] * c + torch.arange(c)[None, :]
    want = stochastic_row_values(x, seed_row, index)
    assert torch.equal(row.cpu().view(torch.int16), want.view(torch.int16))
    pad = torch.nn.functional.pad(x.t(), (0, -r % 16)).contiguous()
    index_t = torch.arange(pad.shape[1])[None, :] * c + torch.arange(c)[:, None]
    want = stochastic_row_values(pad, seed_col, index_t).t()
    assert torch.equal(col.cpu().view(torch.int16), want.view(torch.int16))
    as_tensor = quantize_grad_operands(
        x.cuda(), row=True, row_stochastic=True, col=True, col_stochastic=True,
        seed=torch.tensor([seed % 2**31], device="cuda"),
    )  # fmt: skip
    assert torch.equal(as_tensor[0], row) and torch.equal(as_tensor[1], col)


def _operand_model(v: torch.Tensor, seed: int | None, index: torch.Tensor) -> torch.Tensor:
    """BF16 values of float32 ``v`` [P, Q] (CPU) in 1x16 blocks with a per-tensor amax, non-finite
    elements as 0: nearest (``seed`` None) or the shipped stochastic rule; a zero keeps the sign
    of its input (BF16 operands, not codes: the kernels copy the sign bit)."""
    from e2m1_reference import stochastic_row_values

    from minite_common import quantize_nvfp4
    from minite_common.nvfp4 import E2M1_VALUES, unpack_codes

    v = torch.where(v.isfinite(), v, 0.0)
    if seed is None:
        t = quantize_nvfp4(v, amax="tensor")
        codes = torch.tensor(E2M1_VALUES)[unpack_codes(t.codes).long()].abs()
        values = codes * t.scales.float().repeat_interleave(16, dim=1)
        return torch.where(v.signbit(), -values, values).to(torch.bfloat16)
    return stochastic_row_values(v, seed, index)


def _heavy_tokens(rows: int, cols: int, seed: int) -> torch.Tensor:
    """BF16 [rows, cols] whose magnitudes change by up to 10^8 from token to token (the RHT's
    float32 sums round), with zeros and -0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 8 - 4)
    x[torch.rand(rows, cols, generator=g) < 0.05] = 0.0
    x[0, :4] = -0.0
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("stochastic", [False, True])
def test_grad_operands_bitwise_the_float32_models(stochastic):
    """Dense and grouped (empty, one-row and ragged groups) gradient operands on heavy-tailed
    input, C not a multiple of the column tile: the row operand is the per-tensor quantization
    of ``x * scale``, the col operand that of each group's zero-padded tokens after
    ``random_hadamard_transform`` summing in float32, bitwise; NaN/Inf count as 0 and make the
    operand's decode scale NaN."""
    from e2m1_reference import seeds
    from minite_kernels.nvfp4_grad import quantize_grad_operands
    from minite_kernels.nvfp4_grouped import group_layout, quantize_grouped_grad_operands

    from minite_common import random_hadamard_transform
    from minite_common.hadamard import RHT_SIGNS

    sizes = (100, 0, 1, 17, 300, 64, 3)
    c, seed = 272, 4242
    x = _heavy_tokens(sum(sizes), c, 1).float()
    x[150, 7], x[420, 0] = float("nan"), float("-inf")  # groups 4 and 5
    scale = torch.rand(len(sizes) * c) + 0.5
    seed_row, seed_col = seeds(seed) if stochastic else (None, None)
    kw = dict(row=True, row_stochastic=stochastic, col=True, rht_signs=RHT_SIGNS,
              col_stochastic=stochastic, seed=seed)  # fmt: skip
    _, starts, pstarts = group_layout(sizes, torch.device("cpu"))
    row, col, dec = quantize_grouped_grad_operands(
        x.cuda().bfloat16(), sizes, row_scale=scale.cuda(), **kw
    )
    row, col, dec = row.cpu(), col.cpu(), dec.cpu()
    for e, (size, start, pstart) in enumerate(zip(sizes, starts, pstarts, strict=True)):
        if not size:
            assert torch.equal(dec[e], torch.ones(2))
            continue
        xe, p = x[start : start + size], -(-size // 16) * 16
        ve = xe * scale[e * c : (e + 1) * c]
        index = (start + torch.arange(size))[:, None] * c + torch.arange(c)[None, :]
        assert torch.equal(row[start : start + size].view(torch.int16),
                           _operand_model(ve, seed_row, index).view(torch.int16)), e  # fmt: skip
        pad = torch.nn.functional.pad(xe.t(), (0, p - size))
        pad = random_hadamard_transform(pad, torch.float32).float()
        index_t = (start + torch.arange(p))[None, :] * c + torch.arange(c)[:, None]
        want = _operand_model(pad, seed_col, index_t).t()
        assert torch.equal(col[pstart : pstart + p].view(torch.int16), want.view(torch.int16)), e
        assert dec[e].isnan().tolist() == [e in (4, 5)] * 2
    dense = quantize_grad_operands(x.cuda().bfloat16(), row_scale=scale[:c].cuda(), **kw)
    r = x.shape[0]
    index = torch.arange(r)[:, None] * c + torch.arange(c)[None, :]
    want = _operand_model(x * scale[:c], seed_row, index)
    assert torch.equal(dense[0].cpu().view(torch.int16), want.view(torch.int16))
    pad = torch.nn.functional.pad(x.t(), (0, -r % 16))
    pad = random_hadamard_transform(pad, torch.float32).float()
    index_t = torch.arange(pad.shape[1])[None, :] * c + torch.arange(c)[:, None]
    want = _operand_model(pad, seed_col, index_t).t()
    assert torch.equal(dense[1].cpu().view(torch.int16), want.view(torch.int16))
    assert dense[2].isnan().all()


def _compiled(kernel) -> int:
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_no_recompilation_when_row_counts_change():
    import minite_kernels.nvfp4_grad as g
    import minite_kernels.nvfp4_quantize as q
    from minite_kernels.nvfp4_grad import quantize_grad_operands

    def run(rows: int) -> None:
        x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
        q.quantize_nvfp4_triton(x, amax="row", block_2d=False)
        q.quantize_nvfp4_triton(x, amax="tensor", block_2d=True)
        quantize_grad_operands(x, row=True, row_stochastic=True, col=True, col_stochastic=True)

    kernels = (
        q._quantize_bf16_rows_kernel,
        q._absmax_kernel,
        q._quantize_nvfp4_kernel,
        g._grad_amax_kernel,
        g._grad_qdq_kernel,
    )
    run(17)  # a few rows (<= 256: the BF16-rows kernel at 8 warps)
    run(300)  # more rows
    before = [_compiled(k) for k in kernels]
    for rows in (1, 16, 33, 256, 301, 512, 4097):
        run(rows)
    assert [_compiled(k) for k in kernels] == before


def test_stochastic_rounding_seed_follows_the_cuda_generator():
    from minite_common import NVFP4Recipe, quantize_weight, w4a4_linear_train

    torch.manual_seed(0)
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(384, 512, device="cuda") / 20).to(torch.bfloat16)
    dy = torch.randn(256, 384, device="cuda", dtype=torch.bfloat16)
    recipe = NVFP4Recipe()

    def grads() -> tuple[torch.Tensor, torch.Tensor]:
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        w4a4_linear_train(xi, wi, quantize_weight(w, recipe=recipe), recipe=recipe).backward(dy)
        return xi.grad, wi.grad

    state = torch.cuda.get_rng_state()
    first = grads()
    torch.manual_seed(123)  # host draws (data loaders, ...) do not move the seeds
    torch.cuda.set_rng_state(state)
    again = grads()
    other = grads()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_scale_rows_is_torch_mul_bitwise(out_dtype):
    """The backward GEMMs' epilogue kernel gives ``torch.mul``'s bits: one scale for every row,
    one per row, one per group of rows; NaN, Inf, magnitudes from 1e-30 to 1e33, columns past
    a block; bad arguments raise."""
    from minite_kernels import scale_rows

    def same(got, want):  # equal values, NaN where torch has NaN (payloads may differ)
        return torch.equal(got.isnan(), want.isnan()) and torch.equal(
            got.nan_to_num(), want.nan_to_num()
        )

    g = torch.Generator().manual_seed(7)
    for rows, cols in ((3, 5000), (64, 4096), (130, 48)):
        exponents = torch.randint(-30, 30, (rows, 1), generator=g)
        acc = (torch.randn(rows, cols, generator=g) * 10.0**exponents).cuda()
        acc[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0 + 2.0**-8])
        one = torch.tensor(0.7310585975646973).cuda()
        assert same(scale_rows(acc, one, out_dtype), torch.mul(acc, one).to(out_dtype))
        per_row = torch.rand(rows, generator=g).cuda() * 1e3
        got = scale_rows(acc, per_row, out_dtype, rows_per_scale=1)
        assert same(got, (acc * per_row[:, None]).to(out_dtype))
        per_group = per_row[: -(-rows // 2)]
        want = (acc * per_group.repeat_interleave(2)[:rows, None]).to(out_dtype)
        assert same(scale_rows(acc, per_group, out_dtype, rows_per_scale=2), want)
    with pytest.raises(ValueError, match="float32"):
        scale_rows(acc.bfloat16(), one, out_dtype)
    with pytest.raises(ValueError, match="scales for"):
        scale_rows(acc, per_row[:2], out_dtype, rows_per_scale=1)
