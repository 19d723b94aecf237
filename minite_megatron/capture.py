"""Per-layer captures and execution fingerprints of a Megatron ``GPTModel``, under HF names.

The names and record formats are the vLLM plugin's (:mod:`minite_vllm.capture`,
``get_execution_fingerprints``), so :mod:`minite_common.diagnostics` compares the two directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from megatron.core.transformer.identity_op import IdentityOp

from minite_common import DEFAULT_RECIPE, NVFP4Recipe
from minite_common.debug import linear_hook
from minite_common.diagnostics import execution_record

from .experts import MiniTEGroupedMLP
from .hf import weight_bindings
from .linear import NVFP4LinearMixin
from .model import token_logprobs
from .spec import DEBUG_ENGINE
from .strict import StrictDotProductAttention


def hf_linears(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, dict[str, slice]]]:
    """Every linear of ``model`` (this TP rank) with the output columns of each HF module in it:
    ``{megatron module name: (module, {hf module name: column slice})}``. Grouped experts
    (:class:`~minite_megatron.experts.MiniTEGroupedMLP`, all experts in one module) are not
    listed: :func:`capture_layers` records them per expert, debug hooks do not cover them."""
    module_names = {m: n for n, m in model.named_modules()}
    linears = {}
    for b in weight_bindings(model):
        if (
            b.module is None
            or b.expert is not None
            or b.module is getattr(model, "output_layer", None)
        ):
            continue
        if b.kind == "row" or b.segments is None:
            columns = {b.hf_names["weight"].removesuffix(".weight"): slice(None)}
        else:
            rank = torch.distributed.get_rank(b.group) if b.group is not None else 0
            size = torch.distributed.get_world_size(b.group) if b.group is not None else 1
            columns = {}
            for s in b.segments(rank, size):
                name = b.hf_names[s.part].removesuffix(".weight")
                columns.setdefault(name, []).append(slice(s.local_start, s.local_start + s.rows))
            columns = {n: (v[0] if len(v) == 1 else v) for n, v in columns.items()}
        linears[module_names[b.module]] = (b.module, columns)
    return linears


def select_columns(out: torch.Tensor, where: slice | list[slice]) -> torch.Tensor:
    """The columns ``where`` (a slice or slices, from :func:`hf_linears`) of ``out``."""
    if isinstance(where, slice):
        return out[..., where]
    return torch.cat([out[..., s] for s in where], dim=-1)


def _attention_hooks(layer: torch.nn.Module, keep: Callable[[str, torch.Tensor], None]) -> list:
    """Hooks recording a layer's q/k norm outputs and attention-core inputs as [s*b, heads*d]."""
    prefix = f"model.layers.{layer.layer_number - 1}.self_attn"
    attn = layer.self_attention
    handles = []

    def tokens(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0] * t.shape[1], -1)

    for part, hf in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
        norm = getattr(attn, part, None)
        if norm is not None and not isinstance(norm, IdentityOp):
            handles.append(norm.register_forward_hook(
                lambda mod, args, out, name=f"{prefix}.{hf}": keep(f"{name}:output", tokens(out))
            ))  # fmt: skip

    def core_hook(mod: Any, args: tuple) -> None:
        for part, t in zip(("query", "key", "value"), args[:3], strict=False):
            keep(f"{prefix}.attn.{part}:input", tokens(t))

    core = attn.core_attention
    if isinstance(core, StrictDotProductAttention):  # its inputs are not rotated yet
        core = core.attention
    handles.append(core.register_forward_pre_hook(core_hook))
    return handles


def _grouped_expert_hooks(
    experts: MiniTEGroupedMLP, prefix: str, keep: Callable[[str, torch.Tensor], None]
) -> list:
    """Hooks recording each expert's gate/up/down inputs and outputs from the grouped linears,
    under the per-expert HF names ``SequentialMLP``'s experts are recorded with."""

    def hook(mod: Any, args: tuple, out: torch.Tensor) -> None:
        x, sizes = args
        start = 0
        for e, size in enumerate(sizes):
            rows = slice(start, start + size)
            for s in mod.row_segments:
                keep(f"{prefix}.{e}.{s.part}:input", x[rows])
                keep(
                    f"{prefix}.{e}.{s.part}:output",
                    out[rows, s.local_start : s.local_start + s.rows],
                )
            start += size

    return [
        experts.linear_fc1.register_forward_hook(hook),
        experts.linear_fc2.register_forward_hook(hook),
    ]


def capture_layers(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward of a single sequence ``input_ids`` [S] recording, in forward order,
    ``"<hf module>:input"`` / ``":output"`` of every linear (fused q/k/v and gate/up split and
    de-interleaved into HF order), the q/k norms' outputs (``...self_attn.q_norm:output``), the
    attention core's inputs after the rotary embedding (``...self_attn.attn.query:input``, ``key``,
    ``value``), each MoE block's output and the final norm's output, as ``[S, features]`` CPU
    tensors."""
    records: dict[str, torch.Tensor] = {}
    handles = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        records.setdefault(name, tensor.detach().reshape(-1, tensor.shape[-1]).to("cpu"))

    for module, columns in hf_linears(model).values():

        def hook(mod: Any, args: tuple, output: Any, columns=columns) -> None:
            out = output[0] if isinstance(output, tuple) else output
            for name, where in columns.items():
                keep(f"{name}:input", args[0])
                keep(f"{name}:output", select_columns(out, where))

        handles.append(module.register_forward_hook(hook))
    for layer in model.decoder.layers:
        handles += _attention_hooks(layer, keep)
        if hasattr(layer.mlp, "router"):
            name = f"model.layers.{layer.layer_number - 1}.mlp"
            if isinstance(layer.mlp.experts, MiniTEGroupedMLP):
                handles += _grouped_expert_hooks(layer.mlp.experts, f"{name}.experts", keep)
            handles.append(layer.mlp.register_forward_hook(
                lambda mod, args, out, name=name: keep(f"{name}:output", out[0])
            ))  # fmt: skip
    handles.append(model.decoder.final_layernorm.register_forward_hook(
        lambda mod, args, out: keep("model.norm:output", out)
    ))  # fmt: skip
    try:
        with torch.no_grad():
            token_logprobs(model, input_ids.reshape(1, -1))
    finally:
        for h in handles:
            h.remove()
    return records


def execution_fingerprints(
    model: torch.nn.Module, recipe: NVFP4Recipe | None = None
) -> dict[str, dict[str, Any]]:
    """``{hf module name: record}`` for every linear weight, expert, embedding and LM head, in
    :func:`minite_common.diagnostics.execution_record`'s format. ``recipe`` (default: the one
    the NVFP4 linears run, else the default) is what BF16 layers report."""
    recipes = {m.recipe for m in model.modules() if isinstance(m, NVFP4LinearMixin)}
    recipe = recipe or (recipes.pop() if len(recipes) == 1 else DEFAULT_RECIPE)
    records = {}
    for b in weight_bindings(model):
        if b.kind == "replicated" and b.module is None and "norm" in b.hf_names["weight"]:
            continue
        if isinstance(b.module, NVFP4LinearMixin):
            record = execution_record(b.module.recipe, b.module.weight.device)
        else:
            record = execution_record(recipe, nvfp4=False)
        for name in b.hf_names.values():
            records[name.removesuffix(".weight")] = dict(record)
    return records


def attach_debug_hooks(model: torch.nn.Module) -> int:
    """Hook the linears that the active debug configuration logs (``MINITE_DEBUG_CONFIG`` or
    :func:`minite_common.debug.activate` with engine ``"megatron"``); returns how many.

    Weight statistics use the master weight rows of each HF module. A no-op without a config.
    """
    hooked = 0
    for module, columns in hf_linears(model).values():

        def weight(name: str, module=module, columns=columns) -> torch.Tensor:
            return select_columns(module.weight.detach().t(), columns[name]).t()

        hook = linear_hook(DEBUG_ENGINE, list(columns), weight)
        if hook is not None:
            module.register_forward_hook(hook)
            hooked += 1
    return hooked
