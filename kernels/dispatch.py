"""Which implementation serves a device: miniTE's Triton kernels on CUDA GPUs of compute
capability 9.x (Hopper) or >= 10 (Blackwell, unmeasured), the torch reference everywhere else.

``MINITE_BACKEND=torch`` forces the torch path on every device. This module imports no Triton,
so the CPU path never needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKEND_ENV = "MINITE_BACKEND"


def kernel_arch(device: torch.device | str) -> str | None:
    """``"sm90"`` or ``"sm100"`` when the Triton kernels serve tensors on ``device``, else None."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get(BACKEND_ENV, "").strip().lower() == "torch":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_arch(index)


@functools.cache
def _cuda_arch(index: int) -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    major, _ = torch.cuda.get_device_capability(index)
    if major >= 10:
        return "sm100"
    if major == 9:
        return "sm90"
    return None
