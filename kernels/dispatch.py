"""Which implementation serves a device: miniTE's Triton kernels on CUDA GPUs of compute
capability 9.x (Hopper) or >= 10 (Blackwell, unmeasured), the torch reference everywhere else.

``MINITE_BACKEND=torch`` forces the torch path on every device; ``MINITE_KERNEL_LAYOUT=0`` makes
no kernel-friendly weight copies (:func:`kernel_layout_enabled`). This module imports no Triton,
so the CPU path never needs it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKEND_ENV = "MINITE_BACKEND"
KERNEL_LAYOUT_ENV = "MINITE_KERNEL_LAYOUT"


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


def kernel_layout_enabled() -> bool:
    """Whether weights get kernel-friendly copies beside their canonical codes (the default;
    ``MINITE_KERNEL_LAYOUT=0`` saves their memory, same numbers, slower small-batch GEMMs)."""
    return os.environ.get(KERNEL_LAYOUT_ENV, "").strip().lower() not in ("0", "false", "no", "off")
