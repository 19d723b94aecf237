"""The only places where miniTE's strict mode relies on Megatron-Core code that its ``ModuleSpec``
does not expose: each overrides a method of a Megatron class (or, for the output layer, of one
instance). They were checked against Megatron-Core 0.16 (0.16.1, the CPU build this project runs
and tests) and 0.19 (0.19.2, the release the lent GPU machine carries: sources read, the same
method names, signatures and keyword arguments); strict mode refuses other versions
(:func:`check_megatron_version`), naming the fix.

1. :class:`StrictMoELayer` overrides ``MoELayer.forward``: the spec can replace the router
   (``MoESubmodules.router``) and the experts, but the token dispatcher, which sums the experts'
   weighted outputs, is chosen by ``config.moe_token_dispatcher_type``, not by the spec, and its
   sum is not the fixed-order :func:`ops.moe_combine`. It reads ``self.router.weight`` and
   ``self.experts.local_experts`` (``SequentialMLP``) as built by ``MoELayer.__init__``.
2. :class:`StrictColumnParallelLinear` / :class:`StrictRowParallelLinear` (BF16 linears of the
   spec) override the private ``_forward_impl`` of Megatron's tensor-parallel linears, so that
   Megatron's own ``forward`` keeps its input/output communication and the GEMM is
   :func:`ops.linear`.
3. :func:`install_strict_output_layer` sets that ``_forward_impl`` on the ``GPTModel``'s output
   layer (LM head) instance: ``GPTModel`` builds it itself (``tensor_parallel.ColumnParallelLinear``
   in 0.16 and 0.19), with no spec or builder argument to choose its class.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.utils import get_pg_size

from minite_common import ops

#: Megatron-Core releases (major.minor) whose internals this module was checked against.
CHECKED_MEGATRON_VERSIONS = ("0.16", "0.19")


def megatron_version_supported(version: str) -> bool:
    """Whether ``version`` (e.g. ``"0.16.1"``) is a release in :data:`CHECKED_MEGATRON_VERSIONS`."""
    match = re.match(r"(\d+)\.(\d+)(?:\.|$|\+|rc|a|b)", version)
    return bool(match) and f"{match[1]}.{match[2]}" in CHECKED_MEGATRON_VERSIONS


def check_megatron_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed Megatron-Core) is one
    whose internals :mod:`minite_megatron.engine_patches` was checked against."""
    if version is None:
        from megatron.core import package_info

        version = package_info.__version__
    if not megatron_version_supported(version):
        raise RuntimeError(
            f"miniTE strict mode overrides Megatron-Core methods that its specs do not expose "
            f"(MoELayer.forward, the tensor-parallel linears' _forward_impl, the output layer's; "
            f"see minite_megatron/engine_patches.py), checked against Megatron-Core "
            f"{', '.join(CHECKED_MEGATRON_VERSIONS)}; this is Megatron-Core {version}. Install "
            f"megatron-core 0.16.x or 0.19.x, or check those places against {version} and add it "
            f"to minite_megatron.engine_patches.CHECKED_MEGATRON_VERSIONS."
        )


class StrictMoELayer(MoELayer):
    """Megatron's ``MoELayer`` (router weight, ``SequentialMLP`` experts) whose forward routes
    with :func:`ops.linear` + :func:`ops.topk_routing` (softmax over the top-k logits unless
    ``moe_router_pre_softmax``), runs each expert's MLP on its tokens and combines with
    :func:`ops.moe_combine`: routing weights apply to expert outputs, as in the sampler."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.experts, SequentialMLP):
            raise NotImplementedError(
                f"miniTE strict mode runs MoE experts as SequentialMLP, not "
                f"{type(self.experts).__name__} (turn grouped experts off)"
            )
        for expert in self.experts.local_experts:  # no token dispatcher sums their outputs
            expert.linear_fc2.output_is_final = True

    def forward(  # type: ignore[override]
        self,
        hidden_states: torch.Tensor,
        intermediate_tensors: Any = None,
        padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        if intermediate_tensors is not None:
            raise NotImplementedError("miniTE strict mode: partial MoE forward passes")
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = ops.linear(x, self.router.weight)
        weights, ids = ops.topk_routing(
            logits, self.config.moe_router_topk, renormalize=not self.config.moe_router_pre_softmax
        )
        per_slot = x.new_zeros(x.shape[0], ids.shape[1], shape[-1])
        for e, expert in enumerate(self.experts.local_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel():
                out, _ = expert(x[token])
                per_slot = per_slot.index_put((token, slot), out)
        return ops.moe_combine(per_slot, weights).reshape(shape), None


def strict_linear_impl(
    input: torch.Tensor,
    weight: torch.Tensor,
    *args: Any,
    bias: Any = None,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    tp_group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """A ``_forward_impl`` for Megatron's column-parallel BF16 linears (and the output layer):
    :func:`ops.linear` on this rank's output columns (each column's bits do not depend on the
    others), with Megatron's input communication for tensor parallelism."""
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(
            input, tensor_parallel_output_grad=True, group=tp_group
        )
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return ops.linear(input, weight, bias)


class StrictColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel linear the recipe keeps in BF16, through :func:`ops.linear`."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        return strict_linear_impl(input, weight, *args, **kwargs)


class StrictRowParallelLinear(RowParallelLinear):
    """A row-parallel linear the recipe keeps in BF16, through :func:`ops.linear` (TP 1 only:
    the all-reduce of BF16 partial outputs would depend on the TP degree)."""

    def _forward_impl(self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any):
        if get_pg_size(self.tp_group) > 1:
            raise NotImplementedError(
                f"miniTE strict mode: a BF16 row-parallel linear ({type(self).__name__}, input "
                f"size {self.input_size}) at TP={get_pg_size(self.tp_group)} would all-reduce "
                "rounded partial outputs; keep it in NVFP4 (drop it from bf16_modules) or run TP=1"
            )
        return strict_linear_impl(input, weight, *args, **kwargs)


def install_strict_output_layer(output: ColumnParallelLinear) -> None:
    """Route the ``GPTModel`` output layer ``output`` (LM head) through :func:`ops.linear`
    (idempotent; checks the Megatron-Core version first)."""
    check_megatron_version()
    if not isinstance(output, ColumnParallelLinear):
        raise NotImplementedError(
            f"miniTE strict mode: the output layer is a {type(output).__name__}, not Megatron's "
            "ColumnParallelLinear"
        )
    output._forward_impl = strict_linear_impl
