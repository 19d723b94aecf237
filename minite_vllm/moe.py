"""NVFP4 W4A4 for vLLM 0.32's routed experts (``RoutedExperts``, e.g. Qwen3-MoE).

Routing (top-k selection and weights) is vLLM's own. Each (token, expert) pair runs the expert's
gate/up GEMM and down GEMM through :func:`minite_common.grouped_w4a4_linear`, so every row gives
bitwise what ``w4a4_linear`` gives for that token and expert alone. The activation
``bf16(silu(f32(gate)) * f32(up))`` is elementwise, and the top-k outputs are combined per token
in FP32 in slot order 0..k-1, then rounded once: no step depends on the other tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_ep_group, get_tp_group
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig
from vllm.model_executor.layers.fused_moe.routed_experts import FusedMoeWeightScaleSupported
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.utils import set_weight_attrs

from minite_common import expert_counts, grouped_w4a4_linear
from minite_common.grouped import expert_swiglu
from minite_common.ops import moe_combine
from minite_common.parallel import ProcessGroup, check_tp_split, first_rank_only, tp_row_amax

from .layer import SUFFIXES, NVFP4LayerMixin, Part, check_divisible, quantize_shards

if TYPE_CHECKING:
    from .config import MiniteConfig

_FIX = "Keep these experts in BF16 by listing them in NVFP4Recipe.bf16_modules."
_SHARD_OF = {"w1": 0, "w3": 1}


class MiniteMoEMethod(NVFP4LayerMixin, FusedMoEMethodBase):
    """NVFP4 W4A4 routed experts; ``hf_experts`` lists each expert's (gate, up, down) HF names.

    ``w13`` holds each expert's gate rows then up rows, ``w2`` its down rows; every one of those
    HF weights has its own global scale (``w13_weight_scale_2 [E, 2]``, ``w2_weight_scale_2 [E]``).
    """

    def __init__(
        self, config: MiniteConfig, moe: FusedMoEConfig, hf_experts: list[tuple[str, str, str]]
    ) -> None:
        super().__init__(moe)
        self.recipe = config.recipe
        self.prequantized = config.prequantized
        self.uses_meta_device = not config.prequantized
        self.hf_experts = hf_experts
        self.stems = ("w13_", "w2_")
        self.loaded = set()

    def _check_supported(self, layer: RoutedExperts) -> None:
        moe, where = self.moe, layer.layer_name
        if moe.moe_parallel_config.use_ep:
            raise NotImplementedError(f"{where}: minite does not support expert parallelism yet")
        if moe.has_bias or not moe.is_act_and_mul or moe.activation != MoEActivation.SILU:
            raise NotImplementedError(
                f"{where}: minite supports bias-free SiLU-gated experts only (got activation "
                f"{moe.activation.value}, bias={moe.has_bias}). {_FIX}"
            )
        if layer.apply_router_weight_on_input:
            raise NotImplementedError(f"{where}: apply_router_weight_on_input is not supported")

    def maybe_roundup_sizes(
        self,
        hidden_size: int,
        intermediate_size_per_partition: int,
        act_dtype: torch.dtype,
        moe_parallel_config: FusedMoEParallelConfig,
    ) -> tuple[int, int]:
        """No padding: every expert weight keeps its checkpoint shape."""
        return hidden_size, intermediate_size_per_partition

    def create_weights(
        self,
        layer: RoutedExperts,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        self._check_supported(layer)
        hidden, inter = hidden_size, intermediate_size_per_partition
        names = [layer.layer_name]
        check_divisible(names, "the hidden size", hidden, _FIX)
        check_divisible(names, "the expert intermediate size per rank", inter, _FIX)
        self.num_experts, self.hidden, self.inter = num_experts, hidden, inter
        tp_size = self.moe.moe_parallel_config.tp_size
        if tp_size > 1 and self.recipe.deterministic_tp:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            check_tp_split(inter, tp_size, device, f"{layer.layer_name} (down_proj)")
        self.out_dtype = params_dtype
        self.weight_attrs = extra_weight_attrs
        full_inter = inter * self.moe.moe_parallel_config.tp_size
        gate_up = [
            Part(name, "w13_", e, start, inter, (e, i), (full_inter, hidden))
            for e, experts in enumerate(self.hf_experts[:num_experts])
            for i, (name, start) in enumerate(zip(experts[:2], (0, inter), strict=True))
        ]
        down = [
            Part(experts[2], "w2_", e, 0, hidden, (e,), (hidden, full_inter))
            for e, experts in enumerate(self.hf_experts[:num_experts])
        ]
        self.parts = gate_up + down
        if self.prequantized:
            self._register_quantized(layer, device=None)
            return
        for name, shape in (("w13_weight", (2 * inter, hidden)), ("w2_weight", (hidden, inter))):
            param = torch.nn.Parameter(
                torch.empty(num_experts, *shape, dtype=params_dtype, device="meta"),
                requires_grad=False,
            )
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
            param.weight_loader = self.checked_loader(name, layer.weight_loader, nvfp4=False)
        initialize_online_processing(layer)

    def _register_quantized(self, layer: RoutedExperts, device: torch.device | None) -> None:
        """Register the checkpoint-format NVFP4 tensors (with checking loaders)."""
        e, hidden, inter = self.num_experts, self.hidden, self.inter
        group = FusedMoeWeightScaleSupported.GROUP.value
        tensor = FusedMoeWeightScaleSupported.TENSOR.value
        specs = {
            "w13_weight": ((e, 2 * inter, hidden // 2), torch.uint8, None),
            "w13_weight_scale": ((e, 2 * inter, hidden // 16), torch.float8_e4m3fn, group),
            "w13_weight_scale_2": ((e, 2), torch.float32, tensor),
            "w2_weight": ((e, hidden, inter // 2), torch.uint8, None),
            "w2_weight_scale": ((e, hidden, inter // 16), torch.float8_e4m3fn, group),
            "w2_weight_scale_2": ((e,), torch.float32, tensor),
        }
        for name, (shape, dtype, scale_kind) in specs.items():
            param = torch.nn.Parameter(
                torch.empty(shape, dtype=dtype, device=device), requires_grad=False
            )
            layer.register_parameter(name, param)
            set_weight_attrs(param, self.weight_attrs)
            if scale_kind is not None:
                param.quant_method = scale_kind
            param.weight_loader = self.checked_loader(name, layer.weight_loader, nvfp4=True)

    def parts_for_load(self, param_name: str, arguments: Mapping[str, Any]) -> list[Part]:
        stem = "w2_" if param_name.startswith("w2_") else "w13_"
        expert, shard = arguments["expert_id"], arguments["shard_id"]
        index = 2 * expert + _SHARD_OF[shard] if stem == "w13_" else 2 * self.num_experts + expert
        return [self.parts[index]]

    def bf16_scratch(
        self, layer: RoutedExperts, param_name: str, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, Any]:
        shape = (
            (2 * self.inter, self.hidden)
            if param_name == "w13_weight"
            else (self.hidden, self.inter)
        )
        return torch.empty(
            self.num_experts, *shape, dtype=dtype, device=device
        ), layer.weight_loader

    def amax_group(self) -> ProcessGroup | None:
        """The ranks that tensor-shard the experts (vLLM flattens that sharding over its EP group's
        span); None without expert tensor parallelism."""
        return get_ep_group().device_group if self.moe.moe_parallel_config.tp_size > 1 else None

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        if self.prequantized:
            self.check_complete(layer.layer_name, SUFFIXES, touched_only=False)
        else:
            self.check_complete(layer.layer_name, ("weight",), touched_only=False)
            weights = {stem: getattr(layer, f"{stem}weight").data for stem in self.stems}
            shards = [
                (p, weights[p.stem][p.expert].narrow(0, p.row_start, p.rows)) for p in self.parts
            ]
            quantized = quantize_shards(shards, self.recipe, self.amax_group())
            self._register_quantized(layer, weights["w13_"].device)
            for part, t in quantized:
                self.write_part(layer, part, t)
        self.refresh_decode_scale(layer)
        layer._already_called_process_weights_after_loading = True

    def get_fused_moe_quant_config(self, layer: torch.nn.Module) -> None:
        return None

    def apply(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        """Routed expert output (before any tensor-parallel reduction, which vLLM does)."""
        tokens, top_k = topk_ids.shape
        if tokens == 0:
            return x.new_zeros(0, self.hidden)
        flat = topk_ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        # Stays on the device: the grouped kernel reads it there (no sync, graph-capturable).
        group_sizes = expert_counts(flat, self.num_experts)
        rows = x.index_select(0, order // top_k)
        gate_up = grouped_w4a4_linear(
            rows, self.gemm_weight(layer, "w13_"), group_sizes, recipe=self.recipe
        )
        act = expert_swiglu(gate_up)
        down = self.down_proj(layer, act, group_sizes)
        per_slot = torch.empty_like(down)
        per_slot[order] = down
        return self.tp_output(moe_combine(per_slot.view(tokens, top_k, self.hidden), topk_weights))

    def down_proj(
        self, layer: RoutedExperts, act: torch.Tensor, group_sizes: torch.Tensor | list[int]
    ) -> torch.Tensor:
        """The experts' down GEMM of ``act`` (rows grouped by expert): with expert TP, this
        rank's K slice quantized with the whole row's amax, and, under the recipe's TP-invariant
        reduction, the whole output (``grouped_w4a4_linear(..., tp_group=)``)."""
        w2 = self.gemm_weight(layer, "w2_")
        if self.moe.moe_parallel_config.tp_size == 1:
            return grouped_w4a4_linear(act, w2, group_sizes, recipe=self.recipe)
        group = get_tp_group().device_group
        if self.recipe.deterministic_tp:
            return grouped_w4a4_linear(
                act, w2, group_sizes, recipe=self.recipe, tp_group=group, where=layer.layer_name
            )
        # Each rank holds a K slice of every row: quantize it with the whole row's amax.
        amax = tp_row_amax(act, group)
        return grouped_w4a4_linear(act, w2, group_sizes, recipe=self.recipe, row_amax=amax)

    def tp_output(self, y: torch.Tensor) -> torch.Tensor:
        """The experts' output as vLLM will all-reduce it over TP: under the TP-invariant
        reduction ``y`` is whole on every rank, so rank 0 keeps it and the others give -0.0."""
        if self.moe.moe_parallel_config.tp_size > 1 and self.recipe.deterministic_tp:
            return first_rank_only(y, get_tp_group().device_group)
        return y
