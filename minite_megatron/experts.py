"""MoE experts as one grouped NVFP4 module for the miniTE Megatron spec (opt-in).

:class:`MiniTEGroupedMLP` takes ``SequentialMLP``'s place in a MoE layer (same constructor,
``forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs) -> (output, None)``)
and runs all local experts at once: ``linear_fc1`` and ``linear_fc2`` are
:class:`GroupedExpertLinear` modules holding every expert's weight stacked
(``[experts, 2 * ffn, hidden]`` with each expert's ``[gate; up]`` rows as Megatron's ``linear_fc1``
holds them, and ``[experts, hidden, ffn]``), each a :func:`minite_common.grouped_w4a4_linear_train`
(the sampler's :func:`minite_common.grouped_w4a4_linear` forward, the recipe's per-expert NVFP4
backward). Between them the sampler's MoE activation :func:`minite_common.expert_swiglu`
(``bf16(silu(f32 gate) * f32 up)``, one rounding) and then the router probabilities as
Megatron's expert MLP applies them (``bf16(act * prob)``): one fused kernel each way on the GPU.

Against ``SequentialMLP`` with miniTE linears, every expert linear's output is bitwise the same
(same weights, same per-HF-tensor quantization); the MoE output differs only through the
activation: Megatron's local MLP computes ``bf16(bf16(silu(gate)) * up)`` (two roundings), which
is why this module is opt-in (``grouped_experts=True`` of the miniTE spec functions and
:func:`~minite_megatron.build_gpt_model_from_hf`). With that activation made the same, forward
and (nearest-rounding) gradients are bitwise ``SequentialMLP``'s (on a GPU the router
probabilities' gradient, a row sum, runs in the fused kernel's order: equal up to float32
rounding; on Hopper the experts' weight and input gradients are bitwise the per-expert cuBLAS
backward's). Its HF names, capture records,
quantized exports and distributed-checkpoint weight layout are ``SequentialMLP``'s per-expert
ones (the plain ``state_dict`` holds the two stacked tensors).

Limits: expert tensor parallelism 1, SwiGLU experts without bias, no strict mode (strict mode's
MoE layer runs ``SequentialMLP``'s experts one by one).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_expert_parallel_rng_tracker_name,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank, get_pg_size

from minite_common import (
    DEFAULT_RECIPE,
    NVFP4Recipe,
    NVFP4Tensor,
    expert_swiglu,
    grouped_w4a4_linear_train,
    quantize_stacked_weight,
)

from .layout import GATED_FC1_PARTS, RowSegment
from .linear import MiniTEColumnParallelLinear, NVFP4LinearMixin, check_config_supported
from .spec_tree import DESCEND, map_spec


class GroupedExpertLinear(NVFP4LinearMixin, torch.nn.Module):
    """One linear of every local expert: ``weight`` [experts, N, K] (expert e's rows are its HF
    tensors ``parts`` stacked, ``row_segments`` says where), ``forward(x, group_sizes)`` on rows
    grouped by expert. The NVFP4 copy (one amax per HF tensor of every expert, 16x16 tiles) is
    cached like :class:`~minite_megatron.linear.NVFP4LinearMixin`'s, re-made after an optimizer
    step, and quantized for all experts at once (:func:`minite_common.quantize_stacked_weight`).
    """

    def __init__(
        self,
        num_experts: int,
        output_size: int,
        input_size: int,
        *,
        config: TransformerConfig,
        parts: tuple[str, ...],
        role: str,
        recipe: NVFP4Recipe,
        partition_dim: int,
        stride: int,
        expert_parallel: bool,
    ) -> None:
        super().__init__()
        rows = output_size // len(parts)
        if input_size % 16 or rows % 16 or rows * len(parts) != output_size:
            raise ValueError(
                f"{type(self).__name__} ({role}): NVFP4 needs K={input_size} and the rows of each "
                f"HF tensor ({output_size} over {list(parts)}) to be multiples of 16"
            )
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(
                num_experts, output_size, input_size, dtype=config.params_dtype, device=device
            )
        )
        set_tensor_model_parallel_attributes(
            self.weight, is_parallel=True, dim=partition_dim, stride=stride
        )
        self.weight.allreduce = not expert_parallel
        self.recipe = recipe
        self.minite_role = role
        self.row_segments = [RowSegment(p, i * rows, 0, rows) for i, p in enumerate(parts)]
        self._quantized: NVFP4Tensor | None = None
        self._quantized_key = (0, 0, 0)

    def quantize(self, weight: torch.Tensor) -> NVFP4Tensor:
        """The stacked NVFP4 copy [experts * N, K] of ``weight``'s BF16 values."""
        experts, n, k = weight.shape
        names = [
            f"{self.minite_role}.{e}.{s.part}" for e in range(experts) for s in self.row_segments
        ]
        return quantize_stacked_weight(
            weight.detach().to(torch.bfloat16).reshape(experts * n, k),
            self.row_segments[0].rows,
            recipe=self.recipe,
            names=names,
        )

    def forward(self, x: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        """``x`` [T, K], rows grouped by expert (``group_sizes[e]`` rows of expert e) -> [T, N]."""
        experts, n, k = self.weight.shape
        return grouped_w4a4_linear_train(
            x,
            self.weight.view(experts * n, k),
            self.quantized_weight(),
            group_sizes,
            recipe=self.recipe,
        )

    def extra_repr(self) -> str:
        experts, n, k = self.weight.shape
        return f"experts={experts}, in_features={k}, out_features={n}"


@torch.no_grad()
def init_stacked_experts(
    config: TransformerConfig, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor
) -> None:
    """Initialize stacked expert weights ([experts, out, in]) as ``SequentialMLP``'s expert MLPs
    are: each expert's fc1 then fc2, in its order (CPU: a float32 master per tensor; GPU: under
    the expert-parallel RNG tracker), so both start from the same numbers."""
    inits = ((fc1_weight, config.init_method), (fc2_weight, config.output_layer_init_method))
    for e in range(fc1_weight.shape[0]):
        for weight, init in inits:
            if config.use_cpu_initialization:
                master = torch.empty(weight.shape[1:], dtype=torch.float32)
                init(master)
                weight[e].copy_(master)
            else:
                with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                    init(weight[e])


class MiniTEGroupedMLP(MegatronModule):
    """Megatron's ``SequentialMLP`` contract with all local experts in two grouped NVFP4 linears
    (see the module docstring). ``submodules`` and ``name`` are accepted for the spec's sake
    and not used."""

    def __init__(
        self,
        num_local_experts: int,
        config: TransformerConfig,
        submodules: Any = None,
        pg_collection: Any = None,
        name: str | None = None,
        *,
        recipe: NVFP4Recipe = DEFAULT_RECIPE,
    ) -> None:
        super().__init__(config=config)
        where = type(self).__name__
        check_config_supported(config, where)
        unsupported = {
            "gated_linear_unit must be True with activation_func F.silu (SwiGLU experts)": not (
                config.gated_linear_unit and config.activation_func is F.silu
            ),
            "add_bias_linear must be False": config.add_bias_linear,
            "moe_latent_size must be unset": getattr(config, "moe_latent_size", None) is not None,
            "activation_func_clamp_value must be unset and glu_linear_offset 0": (
                getattr(config, "activation_func_clamp_value", None) is not None
                or getattr(config, "glu_linear_offset", 0.0) != 0.0
            ),
            "expert_tensor_parallel_size must be 1": get_pg_size(pg_collection.expt_tp) > 1,
        }
        bad = [message for message, failed in unsupported.items() if failed]
        if bad:
            raise ValueError(f"{where}: " + "; ".join(bad))
        self.num_local_experts = num_local_experts
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp
        self.dp_group = pg_collection.expt_dp
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        common = dict(config=config, recipe=recipe, expert_parallel=get_pg_size(self.ep_group) > 1)
        self.linear_fc1 = GroupedExpertLinear(
            num_local_experts, 2 * ffn, hidden, parts=GATED_FC1_PARTS, role="fc1",
            partition_dim=1, stride=2, **common,
        )  # fmt: skip
        self.linear_fc2 = GroupedExpertLinear(
            num_local_experts, hidden, ffn, parts=("down_proj",), role="fc2",
            partition_dim=2, stride=1, **common,
        )  # fmt: skip
        if config.perform_initialization:
            self._initialize()

    def _initialize(self) -> None:
        init_stacked_experts(self.config, self.linear_fc1.weight, self.linear_fc2.weight)

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Rows grouped by local expert (``tokens_per_expert``) -> expert outputs, rows alike."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        sizes = [int(s) for s in tokens_per_expert.tolist()]
        act = expert_swiglu(self.linear_fc1(hidden, sizes), probs)
        return self.linear_fc2(act, sizes), None

    def backward_dw(self) -> None:
        """Nothing to defer: wgrad runs in backward (``delay_wgrad_compute`` is refused)."""

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict[str, ShardedTensor]:
        """The expert weights under ``SequentialMLP``'s distributed-checkpoint keys and global
        layout: ``{prefix}experts.linear_fc1.weight`` [global experts, 2 * ffn, hidden] (each
        expert's gate rows, then its up rows: with expert tensor parallelism 1 the two halves of
        ``SequentialMLP``'s GLU split are one row range) and ``...linear_fc2.weight`` [global
        experts, hidden, ffn], this rank's experts at their global offset, one tensor per linear
        instead of one per expert. ``SequentialMLP``'s per-expert ``_extra_state`` objects (empty
        for Megatron's linears) are not written."""
        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError(f"{type(self).__name__}: singleton_local_shards checkpoints")
        axis = len(sharded_offsets)
        experts = (axis, get_pg_rank(self.ep_group), get_pg_size(self.ep_group))
        replica_id = (0, 0, get_pg_rank(self.dp_group))
        return {
            f"{prefix}{name}.weight": ShardedTensor.from_rank_offsets(
                f"{prefix}experts.{name}.weight",
                linear.weight,
                *sharded_offsets,
                experts,
                replica_id=replica_id,
                prepend_axis_num=axis,
            )
            for name, linear in (("linear_fc1", self.linear_fc1), ("linear_fc2", self.linear_fc2))
        }


def _is_nvfp4_expert_mlp(submodules: Any) -> bool:
    fc1 = getattr(submodules, "linear_fc1", None)
    return isinstance(fc1, ModuleSpec) and fc1.module is MiniTEColumnParallelLinear


def _grouped(submodules: Any) -> dict[str, Any]:
    recipe = submodules.linear_fc1.params["recipe"]
    if recipe.strict_ops:
        raise ValueError(
            "miniTE spec: grouped_experts is not available in strict mode (recipe.strict_ops), "
            "whose MoE layer runs SequentialMLP's experts one by one; drop one of the two"
        )
    return {"recipe": recipe}


def use_grouped_experts(obj: Any) -> Any:
    """A copy of a miniTE spec tree (layer spec or block submodules) with every ``SequentialMLP``
    whose expert linears are miniTE's replaced by :class:`MiniTEGroupedMLP` (experts the recipe
    keeps in BF16 stay in ``SequentialMLP``)."""

    def visit(node: Any, path: tuple[str, ...]) -> Any:
        if (
            isinstance(node, ModuleSpec)
            and node.module is SequentialMLP
            and _is_nvfp4_expert_mlp(node.submodules)
        ):
            return ModuleSpec(
                module=MiniTEGroupedMLP,
                params={**node.params, **_grouped(node.submodules)},
                submodules=node.submodules,
                metainfo=dict(node.metainfo),
            )
        if isinstance(node, functools.partial) and node.func is SequentialMLP:
            submodules = node.keywords.get("submodules")
            if _is_nvfp4_expert_mlp(submodules):
                return functools.partial(
                    MiniTEGroupedMLP, *node.args, **node.keywords, **_grouped(submodules)
                )
        return DESCEND

    return map_spec(obj, visit)
