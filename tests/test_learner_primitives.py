"""The learner-only parts of the recipe: RHT, stochastic rounding, NVFP4 backward."""

import pytest
import torch

from minite_common import (
    DEFAULT_RECIPE,
    NVFP4Recipe,
    dequantize_nvfp4,
    quantize_nvfp4,
    quantize_weight,
    random_hadamard_transform,
    rht_matrix,
    w4a4_linear,
    w4a4_linear_train,
)


def test_rht_matrix_is_orthogonal_and_signed():
    t = rht_matrix()
    assert torch.equal(t @ t.T, torch.eye(16))
    # Sylvester's H has an all-ones first column, so column 0 is TE's sign vector / 4.
    signs = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]
    assert torch.equal(t[:, 0], torch.tensor(signs, dtype=torch.float32) / 4)


def test_rht_preserves_inner_products_along_tokens():
    g = torch.randn(8, 64, dtype=torch.float64).bfloat16()
    x = torch.randn(12, 64, dtype=torch.float64).bfloat16()
    exact = g.double() @ x.double().T
    rotated = random_hadamard_transform(g).double() @ random_hadamard_transform(x).double().T
    assert float((rotated - exact).norm() / exact.norm()) < 1e-2  # BF16 rounding of the RHT only
    with pytest.raises(ValueError, match="multiple of 16"):
        random_hadamard_transform(torch.randn(3, 20))


def test_stochastic_rounding_is_unbiased_and_stays_on_neighbours():
    x = torch.full((4096, 16), 0.3)
    x[:, 0] = 6.0  # pins the block scale so 0.3 sits between the codes 0 (0.0) and 1 (0.5)
    gen = torch.Generator().manual_seed(0)
    q = quantize_nvfp4(x, stochastic=True, generator=gen)
    values = dequantize_nvfp4(q, torch.float64)[:, 1:]
    assert set(values.unique().tolist()) <= {0.0, 0.5}
    assert abs(float(values.mean()) - 0.3) < 0.01
    nearest = dequantize_nvfp4(quantize_nvfp4(x), torch.float64)[:, 1:]
    assert set(nearest.unique().tolist()) == {0.5}


def test_train_forward_is_the_inference_linear_bitwise():
    w = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(5, 7, 64, dtype=torch.bfloat16, requires_grad=True)
    w_q = quantize_weight(w.detach())
    assert torch.equal(w4a4_linear_train(x, w, w_q), w4a4_linear(x.detach(), w_q))


@pytest.mark.parametrize(
    "recipe", [DEFAULT_RECIPE, NVFP4Recipe(grad_stochastic_rounding=False, wgrad_rht=False)]
)
def test_nvfp4_gradients_are_close_to_the_bf16_reference(recipe):
    """Metric: relative Frobenius error of dX and dW against autograd through the unquantized
    linear. NVFP4 has ~2 bits of mantissa, so a single quantized operand gives ~10% relative
    error; the bound 0.35 allows the two quantized operands of each backward GEMM."""
    torch.manual_seed(0)
    w = (torch.randn(64, 128) / 11).requires_grad_()
    x = torch.randn(96, 128).requires_grad_()
    bias = torch.zeros(64, requires_grad=True)
    target = torch.randn(96, 64)
    w_q = quantize_weight(w.detach(), recipe=recipe)
    ((w4a4_linear_train(x, w, w_q, bias, recipe=recipe) - target) ** 2).sum().backward()
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, bias))
    ((torch.nn.functional.linear(xr, wr, br) - target) ** 2).sum().backward()
    for got, ref in ((x.grad, xr.grad), (w.grad, wr.grad), (bias.grad, br.grad)):
        assert torch.isfinite(got).all()
        assert float((got - ref).norm() / ref.norm()) < 0.35


def test_few_steps_of_nvfp4_training_reduce_the_loss():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(32, 64) * 0.1)
    teacher = torch.randn(32, 64) * 0.1
    opt = torch.optim.Adam([w], lr=1e-2)
    losses = []
    for _ in range(30):
        x = torch.randn(64, 64)
        y = w4a4_linear_train(x, w, quantize_weight(w.detach()))
        loss = ((y - x @ teacher.T) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.3 * losses[0]


def test_dgrad_weight_layout_is_the_transpose_of_the_fprop_weight():
    from minite_common import cat_rows
    from minite_common.autograd import transposed_weight_codes

    w = torch.randn(64, 48)
    fused = cat_rows([quantize_weight(w[:32]), quantize_weight(w[32:] * 100)])
    t = transposed_weight_codes(fused)
    folded = t.dequantize(torch.float32) * fused.channel_decode_scale()[None, :]
    assert torch.equal(folded, fused.dequantize(torch.float32).T)
    assert transposed_weight_codes(fused) is t  # cached until the weight changes
    fused.codes.add_(0)
    assert transposed_weight_codes(fused) is not t


def test_mm_f32_accumulates_in_float32_and_lets_errors_through():
    from minite_common.autograd import mm_f32, mm_out_dtype_supported

    g = torch.Generator().manual_seed(0)
    a = torch.randn(32, 256, generator=g).bfloat16()
    b = torch.randn(256, 24, generator=g).bfloat16()
    exact = a.double() @ b.double()
    # The capability check agrees with what torch.mm does on this device.
    if mm_out_dtype_supported("cpu"):
        assert torch.mm(a, b, out_dtype=torch.float32).dtype == torch.float32
    else:
        with pytest.raises(NotImplementedError, match=r"mm\.dtype"):
            torch.mm(a, b, out_dtype=torch.float32)
    # An error (here a shape mismatch; an OOM alike) propagates and changes nothing after it.
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        mm_f32(a, a)
    for out in (None, torch.empty(32, 24)):
        result = mm_f32(a, b, out)
        assert result.dtype == torch.float32
        assert torch.allclose(result.double(), exact, rtol=0, atol=1e-4)
        # Not a BF16-rounded product cast up (what the old fallback silently returned).
        assert not torch.equal(result, torch.mm(a, b).float())
