"""The one shim that lets Megatron-Core's GPT forward/backward run on a machine without CUDA.

A few Megatron functions place tensors on ``torch.cuda.current_device()``, which raises without
CUDA: the rotary embedding (``RotaryEmbedding.get_emb``), the attention-score buffer
(``GlobalMemoryBuffer.get_tensor``), the MoE router (``Router.gating``) and, with tensor
parallelism, the gathers and reduce-scatters of ``tensor_parallel.mappings``. On a machine
without CUDA, :func:`apply_cpu_shim` wraps exactly these so that, while they run,
``torch.cuda.current_device()`` names the CPU. Megatron-Core 0.16.1 also reads the name
``te_general_gemm`` in the MoE router without defining it when Transformer Engine is absent;
the shim defines it as ``None``, as 0.19 does. With CUDA present nothing is changed.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_SHIMMED = "__minite_cpu_shim__"


@contextlib.contextmanager
def _current_device_is_cpu() -> Iterator[None]:
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _on_cpu(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _current_device_is_cpu():
            return method(*args, **kwargs)

    setattr(wrapper, _SHIMMED, True)
    return wrapper


def shim_targets() -> list[tuple[Any, str]]:
    """The (class or module, function name) pairs the shim wraps."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe.router import Router
    from megatron.core.utils import GlobalMemoryBuffer

    return [
        (RotaryEmbedding, "get_emb"),
        (GlobalMemoryBuffer, "get_tensor"),
        (Router, "gating"),
        (mappings, "_gather_along_last_dim"),
        (mappings, "_gather_along_first_dim"),
        (mappings, "_reduce_scatter_along_first_dim"),
    ]


def apply_cpu_shim() -> bool:
    """Apply the shim if CUDA is absent (idempotent); returns whether the shim is in place."""
    if torch.cuda.is_available():
        return False
    for owner, name in shim_targets():
        method = getattr(owner, name)
        if not getattr(method, _SHIMMED, False):
            setattr(owner, name, _on_cpu(method))
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return True
