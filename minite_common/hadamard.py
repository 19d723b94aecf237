"""The random Hadamard transform (RHT) that the learner applies to wgrad operands.

Transformer Engine's NVFP4 recipe: a 16-point Sylvester Hadamard matrix with a fixed sign
vector, scaled by 1/4 (so ``T @ T.T == I``), applied to blocks of 16 along the reduction (token)
dimension of both wgrad operands, the result rounded to BF16 before it is quantized. Because the
same orthogonal ``T`` multiplies both operands, ``(G T)(X T)^T == G X^T`` up to quantization.
"""

from __future__ import annotations

import functools

import torch

RHT_SIZE = 16
#: Transformer Engine's fixed wgrad sign vector.
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def rht_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16x16 float32 matrix ``diag(signs) @ H16 / 4`` (orthogonal); one cached copy per
    device (do not modify it)."""
    return _rht_matrix(torch.device(device))


@functools.cache
def _rht_matrix(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32, device=device)
    while h.shape[0] < RHT_SIZE:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)])
    signs = torch.tensor(RHT_SIGNS, dtype=torch.float32, device=device)
    return (signs.unsqueeze(1) * h) * 0.25


def random_hadamard_transform(
    x: torch.Tensor, sum_dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Apply the RHT to blocks of 16 along the last dimension of ``x``; returns BF16.

    The last dimension must be a multiple of 16 (pad tokens with zeros, which the transform keeps
    zero and which add nothing to a wgrad product). The sums run in ``sum_dtype`` in a fixed
    butterfly order, rounded to float32 and then to BF16: the same bits on every CPU. float64
    (the default) is the learner's CPU path; ``torch.float32`` gives the bits of the Hopper
    kernels (``kernels/nvfp4_grad.py``), which run the same order in float32.
    """
    if x.shape[-1] % RHT_SIZE:
        raise ValueError(
            f"random_hadamard_transform: last dimension {x.shape[-1]} is not a multiple of 16; "
            "zero-pad the token dimension first"
        )
    signs = torch.tensor(RHT_SIGNS, dtype=sum_dtype, device=x.device)
    y = x.to(sum_dtype).reshape(-1, RHT_SIZE) * signs  # exact
    # ``blocks @ rht_matrix()`` as a fast Walsh-Hadamard transform, in one fixed order (not a
    # BLAS GEMM, whose summation order and hence bits depend on the CPU): Sylvester's H16 is
    # symmetric, so stage by stage ``[a, b] -> [a + b, a - b]`` over pairs at distance 1, 2, 4, 8.
    h = 1
    while h < RHT_SIZE:
        y = y.view(-1, RHT_SIZE // (2 * h), 2, h)
        y = torch.cat([y[:, :, :1] + y[:, :, 1:], y[:, :, :1] - y[:, :, 1:]], dim=2)
        h *= 2
    return (y.reshape(x.shape) * 0.25).to(torch.float32).to(torch.bfloat16)
