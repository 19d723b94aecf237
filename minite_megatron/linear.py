"""Megatron-Core column/row-parallel linears whose matmuls are miniTE's NVFP4 W4A4.

They subclass Megatron's ``ColumnParallelLinear`` / ``RowParallelLinear`` and keep everything of
theirs (constructor keywords, ``.weight`` and its TP attributes, ``forward -> (output, bias)``,
``sharded_state_dict``, the empty extra state, so checkpoints load both ways between BF16 and
miniTE models); only ``_forward_impl`` changes: it calls
:func:`minite_common.w4a4_linear_train`, whose forward is the sampler's
:func:`minite_common.w4a4_linear` and whose backward is the recipe's NVFP4 dgrad/wgrad.

The weight is quantized the way the sampler quantizes the HF checkpoint: one amax per HF tensor
(q, k, v, gate, up, down, each expert's), MAX-reduced over the tensor-parallel group, 16x16
tiles inside each tensor, so the codes, block scales and per-row decode scales equal
``quantize_weight(hf_tensor)`` with rows permuted into Megatron's layout. The quantized copy is
made from the BF16 rounding of the master weight (the tensor the sampler receives) and cached;
it is re-made on the first forward after the master weight changes, detected by its storage
pointer, its autograd version counter (in-place updates, ``load_state_dict``) and a global count
of ``torch.optim`` optimizer steps (Megatron's optimizers write model weights through ``.data``,
which the version counter misses). Anything else that writes weights through ``.data`` must call
:func:`invalidate_quantized_weights`. Re-quantizing is collective over the TP group (one small
MAX all-reduce), so all TP ranks re-quantize in the same forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.utils import get_pg_rank, get_pg_size
from torch.optim.optimizer import register_optimizer_step_post_hook

from minite_common import (
    DEFAULT_RECIPE,
    NVFP4Recipe,
    NVFP4Tensor,
    cat_rows,
    w4a4_linear_train,
)
from minite_common.parallel import (
    check_tp_split,
    first_rank_only,
    quantize_weight_shards,
    tp_row_amax,
)

from .compat import accepted_kwargs
from .layout import RowSegment, gated_fc1_segments, qkv_segments, single_segment

#: Config options of Transformer Engine / APEX paths that miniTE's linears replace or cannot honor.
TE_ONLY_OPTIONS = {
    "fp8": "miniTE replaces TE's FP8 recipe; leave fp8 unset",
    "fp4": "miniTE replaces TE's NVFP4 recipe (Megatron's --fp4-format); leave fp4 unset",
    "tp_comm_overlap": "TE userbuffers overlap is TE-only; turn tp_comm_overlap off",
    "delay_wgrad_compute": "miniTE computes wgrad in backward; turn delay_wgrad_compute off",
    "gradient_accumulation_fusion": (
        "APEX's fused BF16 wgrad GEMM would bypass the NVFP4 wgrad; "
        "turn it off (--no-gradient-accumulation-fusion)"
    ),
}

#: HF-style part name of each non-fused Megatron linear (``tp_comm_buffer_name``).
_SINGLE_PART = {"proj": "o_proj", "fc2": "down_proj"}

_optimizer_steps = 0


def _count_optimizer_step(*_: Any) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


def check_config_supported(config: Any, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` if ``config`` turns on an option miniTE cannot run."""
    for option, hint in TE_ONLY_OPTIONS.items():
        value = getattr(config, option, None)
        if value not in (None, False):
            raise ValueError(f"{where}: config.{option}={value!r} is not supported: {hint}")


class NVFP4LinearMixin:
    """NVFP4 weight cache and W4A4 ``_forward_impl`` shared by the column and row linears."""

    recipe: NVFP4Recipe
    minite_role: str
    row_segments: list[RowSegment]

    def _init_nvfp4(self, recipe: NVFP4Recipe, role: str, row_segments: list[RowSegment]) -> None:
        self.recipe = recipe
        self.minite_role = role
        self.row_segments = row_segments
        self._quantized: NVFP4Tensor | None = None
        self._quantized_key = (0, 0, 0)
        k = self.weight.shape[1] if self.weight is not None else None
        if k is not None and k % 16:
            raise ValueError(
                f"{type(self).__name__} ({role}): NVFP4 needs the input size per tensor-parallel "
                f"rank to be a multiple of 16, got {k} (hidden size, FFN size or head layout / "
                "TP); pad the model or keep this layer in BF16 through the recipe"
            )
        bad = sorted({s.rows for s in row_segments if s.rows % 16})
        if bad:
            raise ValueError(
                f"{type(self).__name__} ({role}): NVFP4's 16x16 weight tiles need every fused "
                f"part (head_dim, per-rank FFN size) to have a multiple of 16 rows, got {bad}"
            )

    def quantized_weight(self) -> NVFP4Tensor:
        """The NVFP4 copy of ``self.weight`` (cached; re-made after the master weight changed)."""
        weight = self.weight
        key = (weight.data_ptr(), weight._version, _optimizer_steps)
        if self._quantized is None or self._quantized_key != key:
            self._quantized = self.quantize(weight)
            self._quantized_key = key
        return self._quantized

    def invalidate_quantized_weight(self) -> None:
        """Drop the cached NVFP4 weight; the next forward re-quantizes (collective over TP)."""
        self._quantized = None

    def quantize(self, weight: torch.Tensor) -> NVFP4Tensor:
        """Quantize this rank's shard ``weight`` with one amax per HF tensor over all TP ranks."""
        w = weight.detach().to(torch.bfloat16)
        by_part: dict[str, list[RowSegment]] = {}
        for s in self.row_segments:
            by_part.setdefault(s.part, []).append(s)
        rows = {
            part: torch.cat([w[s.local_start : s.local_start + s.rows] for s in segments])
            for part, segments in by_part.items()
        }
        shards = [(f"{self.minite_role}.{part}", r) for part, r in rows.items()]
        quantized = dict(
            zip(rows, quantize_weight_shards(shards, self.recipe, self.tp_group), strict=True)
        )
        taken = dict.fromkeys(by_part, 0)
        pieces = []
        for s in self.row_segments:
            pieces.append(quantized[s.part].narrow_rows(taken[s.part], s.rows))
            taken[s.part] += s.rows
        return pieces[0] if len(pieces) == 1 else cat_rows(pieces)

    def _forward_impl(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        gtp_remat_size: int = 1,
        **_: Any,
    ) -> torch.Tensor:
        """Megatron's matmul hook: ``input`` [..., K] -> W4A4 output, with Megatron's TP comms.

        Megatron's other keywords (gradient-accumulation fusion, which the constructor refuses,
        deferral limits) do not apply.
        """
        if grad_output_buffer is not None or gtp_remat_size > 1:
            raise NotImplementedError(
                f"{type(self).__name__}: deferred wgrad and GTP weight sharding are not "
                "supported by miniTE's NVFP4 linears"
            )
        if sequence_parallel:
            input = gather_from_sequence_parallel_region(
                input, tensor_parallel_output_grad=True, group=tp_group
            )
        elif allreduce_dgrad:
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        w_q = self.quantized_weight() if weight is self.weight else self.quantize(weight)
        if not isinstance(self, RowParallelLinear) or get_pg_size(self.tp_group) == 1:
            return w4a4_linear_train(input, weight, w_q, bias, recipe=self.recipe)
        if self.recipe.deterministic_tp:  # the whole output on every rank (see forward)
            return w4a4_linear_train(
                input, weight, w_q, bias, recipe=self.recipe, tp_group=self.tp_group,
                where=self.minite_where,
            )  # fmt: skip
        # Each rank holds a K slice of every row: quantize it with the whole row's amax.
        amax = tp_row_amax(input, self.tp_group)
        return w4a4_linear_train(input, weight, w_q, bias, recipe=self.recipe, row_amax=amax)

    @property
    def minite_where(self) -> str:
        """The layer's name in error messages."""
        return f"{type(self).__name__} ({self.minite_role})"

    def __repr__(self) -> str:
        megatron_repr = super().__repr__()  # "Class(in_features=..., TP=n)"
        return f"{megatron_repr[:-1]}, NVFP4 W4A4 {self.minite_role}, {self.recipe.fingerprint()})"


class MiniTEColumnParallelLinear(NVFP4LinearMixin, ColumnParallelLinear):
    """Megatron's ``ColumnParallelLinear`` with NVFP4 W4A4 matmuls (see the module docstring).

    Takes Megatron's constructor keywords (unknown ones for this Megatron release are dropped)
    plus ``recipe``. ``tp_comm_buffer_name`` "qkv" / "fc1" (Megatron's attention and MLP pass
    them) select the fused q/k/v and gate/up layouts; other names are one HF tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        recipe: NVFP4Recipe = DEFAULT_RECIPE,
        **kwargs: Any,
    ) -> None:
        check_config_supported(kwargs.get("config"), type(self).__name__)
        super().__init__(
            input_size, output_size, **accepted_kwargs(ColumnParallelLinear.__init__, kwargs)
        )
        role = kwargs.get("tp_comm_buffer_name") or "linear"
        rank, size = get_pg_rank(self.tp_group), get_pg_size(self.tp_group)
        config = self.config
        if role == "qkv":
            heads, groups = (
                config.num_attention_heads,
                config.num_query_groups or (config.num_attention_heads),
            )
            head_dim = config.kv_channels
            if (heads + 2 * groups) * head_dim != output_size:
                raise ValueError(
                    f"{type(self).__name__} (qkv): output size {output_size} is not "
                    f"(heads {heads} + 2 x groups {groups}) x head_dim {head_dim}"
                )
            segments = qkv_segments(heads, groups, head_dim, rank, size)
        elif role == "fc1" and config.gated_linear_unit:
            segments = gated_fc1_segments(output_size // 2, rank, size)
        else:
            segments = single_segment(
                _SINGLE_PART.get(role, role), self.output_size_per_partition, rank
            )
        self._init_nvfp4(recipe, role, segments)


class MiniTERowParallelLinear(NVFP4LinearMixin, RowParallelLinear):
    """Megatron's ``RowParallelLinear`` with NVFP4 W4A4 matmuls (see the module docstring).

    With TP > 1 each rank quantizes its K slice of the activation with the whole row's amax
    (one MAX all-reduce of a float per token), so every block gets the codes and scales it gets
    at TP = 1. Then, by default, Megatron's all-reduce sums the BF16 partial outputs, so the
    result differs from TP = 1 in the accumulation order only; with a recipe whose
    ``deterministic_tp`` holds (``tp_invariant`` or ``strict_ops``) the ranks' partial
    accumulators are combined by :mod:`minite_common.parallel` instead, so the output is TP = 1's
    bitwise (see ``docs/megatron.md``). Expert linears (``explicit_expert_comm``), whose sum the
    token dispatcher does, then hand the whole output to tensor-parallel rank 0 and ``-0.0`` to
    the others (the dispatcher's sum then gives it bitwise) unless ``output_is_final`` (set by
    :class:`~minite_megatron.engine_patches.StrictMoELayer`, which reduces nothing).
    """

    output_is_final = False

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        recipe: NVFP4Recipe = DEFAULT_RECIPE,
        **kwargs: Any,
    ) -> None:
        check_config_supported(kwargs.get("config"), type(self).__name__)
        super().__init__(
            input_size, output_size, **accepted_kwargs(RowParallelLinear.__init__, kwargs)
        )
        role = kwargs.get("tp_comm_buffer_name") or "linear"
        segments = single_segment(_SINGLE_PART.get(role, role), output_size)
        self._init_nvfp4(recipe, role, segments)
        tp = get_pg_size(self.tp_group)
        if recipe.deterministic_tp and tp > 1:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            check_tp_split(self.input_size_per_partition, tp, device, self.minite_where)

    def forward(
        self, input_: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Megatron's forward; with the TP-invariant reduction its all-reduce (or reduce-scatter)
        is replaced by :func:`minite_common.w4a4_linear`'s deterministic combine (same
        gradients: each rank's partial receives the output gradient)."""
        if not self.recipe.deterministic_tp or get_pg_size(self.tp_group) == 1:
            return super().forward(input_, *args, **kwargs)
        extra = [a for a in args if a is not None] + [k for k, v in kwargs.items() if v is not None]
        if extra:
            raise NotImplementedError(
                f"{self.minite_where}: the TP-invariant forward takes the input only, got {extra}"
            )
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        output = self._forward_impl(input=input_, weight=self.weight)
        if self.explicit_expert_comm:
            if not self.output_is_final:
                output = first_rank_only(output, self.tp_group)
        elif self.sequence_parallel:
            output = scatter_to_sequence_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias if self.skip_bias_add else None
        return output + self.bias, None


def invalidate_quantized_weights(model: torch.nn.Module) -> int:
    """Drop every cached NVFP4 weight in ``model`` (call on all TP ranks); returns how many."""
    linears = [m for m in model.modules() if isinstance(m, NVFP4LinearMixin)]
    for m in linears:
        m.invalidate_quantized_weight()
    return len(linears)
