"""Per-layer captures inside a vLLM model, under HF-style names, for the diagnostics.

:func:`start_capture` hooks every linear layer (inputs and outputs; fused q/k/v and gate/up
outputs split into their HF parts), the q/k norms (``...self_attn.q_norm:output``), the
attention core's inputs after the rotary embedding (``...self_attn.attn.query:input``, ``key``,
``value``), every MoE block output and the final norm, all as ``[tokens, features]``; the next
forward pass (one prefill) is recorded, and :func:`finish_capture` removes the hooks and returns
``{"<hf module>:input" | "<hf module>:output": tensor}`` in forward order. With tensor
parallelism each rank records its own shards.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase

from .config import hf_module_names

_ATTR = "_minite_capture"


def start_capture(model: torch.nn.Module) -> None:
    """Hook ``model`` so that its next forward pass is recorded (only the first call of each)."""
    if getattr(model, _ATTR, None) is not None:
        raise RuntimeError("a capture is already running on this model; call finish_capture")
    records: dict[str, torch.Tensor] = {}
    packed = getattr(model, "packed_modules_mapping", {})
    handles = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        records.setdefault(name, tensor.detach().to("cpu", copy=True))

    for prefix, module in model.named_modules():
        if isinstance(module, LinearBase):
            names = hf_module_names(prefix, packed)
            sizes = list(getattr(module, "output_partition_sizes", [])) or None

            def hook(mod: Any, args: tuple, output: Any, names=names, sizes=sizes) -> None:
                out = output[0] if isinstance(output, tuple) else output
                for name in names:
                    keep(f"{name}:input", args[0])
                pieces = out.split(sizes, dim=-1) if len(names) > 1 and sizes else [out]
                for name, piece in zip(names, pieces, strict=True):
                    keep(f"{name}:output", piece)

            handles.append(module.register_forward_hook(hook))
        elif prefix.endswith((".self_attn.q_norm", ".self_attn.k_norm")):

            def norm_hook(mod: Any, args: tuple, output: Any, name: str = prefix) -> None:
                out = output[0] if isinstance(output, tuple) else output
                keep(f"{name}:output", out.reshape(out.shape[0], -1))

            handles.append(module.register_forward_hook(norm_hook))
        elif prefix.endswith(".self_attn.attn"):

            def attn_hook(mod: Any, args: tuple, name: str = prefix) -> None:
                for part, t in zip(("query", "key", "value"), args[:3], strict=False):
                    keep(f"{name}.{part}:input", t.reshape(t.shape[0], -1))

            handles.append(module.register_forward_pre_hook(attn_hook))
        elif (prefix.endswith(".mlp") and hasattr(module, "experts")) or prefix == "model.norm":

            def block_hook(mod: Any, args: tuple, output: Any, name: str = prefix) -> None:
                keep(f"{name}:output", output[0] if isinstance(output, tuple) else output)

            handles.append(module.register_forward_hook(block_hook))
    setattr(model, _ATTR, (records, handles))


def finish_capture(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Remove the hooks of :func:`start_capture` and return what the forward pass recorded."""
    state = getattr(model, _ATTR, None)
    if state is None:
        raise RuntimeError("no capture is running on this model; call start_capture first")
    records, handles = state
    for h in handles:
        h.remove()
    setattr(model, _ATTR, None)
    return records
