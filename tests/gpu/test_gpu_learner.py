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


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN payloads aside (NaN at the same places)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def _swiglu_operands(t: int, f: int, dtype: torch.dtype, seed: int):
    """``[gate | up]`` with zeros, -0, exp overflow/underflow, subnormals, NaN and Inf planted,
    router probabilities and an output gradient (also with specials)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, 2 * f, generator=g) * 6
    specials = [0.0, -0.0, 88.5, -88.5, 104.0, -104.0, 1e-39, -1e-41, 3e4, -3e4, 0.5]
    specials += [float("nan"), float("inf"), float("-inf")] if t > 2 else []
    flat = x.view(-1)
    flat[torch.randperm(flat.numel(), generator=g)[: len(specials)]] = torch.tensor(specials)
    grad = torch.randn(t, f, generator=g) * 3
    grad.view(-1)[torch.randperm(grad.numel(), generator=g)[:2]] = torch.tensor([0.0, -0.0])
    probs = torch.rand(t, generator=g)
    return x.to(dtype).cuda(), probs.cuda(), grad.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_probs", [False, True])
def test_fused_expert_swiglu_is_the_torch_composition(dtype, with_probs):
    """The fused kernels (forward and the input gradient) give bitwise the torch composition's
    bits on CUDA; the probabilities' gradient (a row sum in another order) within float32
    summation error."""
    from minite_common import expert_swiglu
    from minite_common.grouped import _ExpertSwiGLU

    for t, f, seed in ((1, 8, 0), (5, 40, 1), (333, 768, 2), (64, 1000, 3), (4099, 24, 4)):
        x, p, grad = _swiglu_operands(t, f, dtype, seed)
        xa, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
        pa, pr = p.clone().requires_grad_(), p.clone().requires_grad_()
        y = expert_swiglu(xa, pa if with_probs else None)
        act = _ExpertSwiGLU.apply(xr)
        ref = (act * pr.unsqueeze(-1)).to(act.dtype) if with_probs else act
        assert _bits_equal(y, ref), (t, f)
        y.backward(grad)
        ref.backward(grad)
        assert _bits_equal(xa.grad, xr.grad), (t, f)
        if with_probs:
            terms = (grad.double() * act.detach().double()).abs().sum(-1)
            err = (pa.grad.double() - pr.grad.double()).abs()
            ok = (err <= 1e-5 * terms) | (pa.grad == pr.grad) | (pa.grad.isnan() & pr.grad.isnan())
            assert bool(ok.all()), (t, f)
