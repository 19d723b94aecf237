"""GPU tests of the learner's NVFP4 linear (forward bits, Hopper backward), run on the H200."""

from __future__ import annotations

import pytest
import torch

from minite_common import NVFP4Recipe, quantize_weight, w4a4_linear, w4a4_linear_train
from minite_common import autograd as learner

pytestmark = pytest.mark.gpu


def _operands(m: int = 512, n: int = 768, k: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16).cuda()
    return x, w


def test_train_forward_is_the_inference_linear_and_close_to_the_cpu_exact_result():
    x, w = _operands()
    w_q = quantize_weight(w)
    y = w4a4_linear_train(x.requires_grad_(), w.requires_grad_(), w_q)
    assert torch.equal(y, w4a4_linear(x.detach(), w_q))
    y_cpu = w4a4_linear(x.detach().cpu(), w_q.to("cpu")).float()
    assert float((y.detach().float().cpu() - y_cpu).norm() / y_cpu.norm()) < 1e-2  # BF16 rounding


@pytest.mark.parametrize("stochastic", [False, True])
def test_hopper_backward_matches_the_nvfp4_gemm_backward_and_bf16(stochastic):
    recipe = NVFP4Recipe(grad_stochastic_rounding=stochastic)
    x, w = _operands(seed=1)
    target = torch.randn(x.shape[0], w.shape[0], device="cuda")
    grads = {}
    for path in (True, False):
        learner.HOPPER_CUBLAS_BACKWARD = path
        try:
            xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = w4a4_linear_train(xi, wi, quantize_weight(wi.detach(), recipe=recipe),
                                  recipe=recipe)  # fmt: skip
            ((y.float() - target) ** 2).sum().backward()
            grads[path] = (xi.grad.float(), wi.grad.float())
        finally:
            learner.HOPPER_CUBLAS_BACKWARD = True
    xr, wr = x.float().requires_grad_(), w.float().requires_grad_()
    ((xr @ wr.T - target) ** 2).sum().backward()
    for got, ref in zip(grads[True], (xr.grad, wr.grad), strict=True):
        assert torch.isfinite(got).all()
        assert float((got - ref).norm() / ref.norm()) < 0.35  # as on the CPU
    if not stochastic:  # same quantized operands, another accumulation order
        for hopper, nvfp4 in zip(grads[True], grads[False], strict=True):
            assert float((hopper - nvfp4).norm() / nvfp4.norm()) < 1e-4
