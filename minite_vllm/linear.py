"""NVFP4 W4A4 for vLLM's ``LinearBase`` layers (column, row, merged QKV and gate/up, replicated)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.model_loader.reload.layerwise import initialize_online_processing
from vllm.model_executor.parameter import ModelWeightParameter, PerTensorScaleParameter
from vllm.model_executor.utils import set_weight_attrs

from minite_common import w4a4_linear
from minite_common.parallel import ProcessGroup, check_tp_split, first_rank_only, tp_row_amax

from .layer import SUFFIXES, NVFP4LayerMixin, Part, check_divisible, quantize_shards

if TYPE_CHECKING:
    from .config import MiniteConfig

_FIX = "Pad the layer, or keep it in BF16 by listing its name in NVFP4Recipe.bf16_modules."
_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


@register_weight_loader_v2_supported_method
class MiniteLinearMethod(NVFP4LayerMixin, LinearMethodBase):
    """NVFP4 W4A4 linear: ``w4a4_linear(x, W)`` with W's HF weights (q/k/v, gate/up or one)
    quantized each on its own, stacked along the output dimension.

    Online mode creates the BF16 weight on the meta device and quantizes it once loaded (vLLM's
    layerwise processing, about one BF16 layer of extra memory); pre-quantized mode loads the
    packed tensors. Either way the layer ends with the same tensors (see :mod:`.layer`).
    """

    def __init__(self, config: MiniteConfig, hf_names: list[str]) -> None:
        self.recipe = config.recipe
        self.prequantized = config.prequantized
        self.uses_meta_device = not config.prequantized
        self.hf_names = hf_names
        self.stems = ("",)
        self.kernel_layout_stems = ("",)
        self.loaded = set()

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        if len(output_partition_sizes) != len(self.hf_names):
            raise ValueError(
                f"{layer.prefix}: vLLM splits this layer into {len(output_partition_sizes)} "
                f"weights but its name maps to the HF weights {self.hf_names}; the model's "
                "packed_modules_mapping does not describe it"
            )
        check_divisible(self.hf_names, "the input size per rank", input_size_per_partition, _FIX)
        self.tp_output_is_final = False
        if (
            isinstance(layer, RowParallelLinear)
            and layer.tp_size > 1
            and self.recipe.deterministic_tp
        ):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            check_tp_split(input_size_per_partition, layer.tp_size, device, layer.prefix)
            # The combine leaves the whole output on every rank: vLLM must not all-reduce it.
            # A layer whose model reduces it later (reduce_results=False) gets it on rank 0 only.
            self.tp_output_is_final = layer.reduce_results
            layer.reduce_results = False
        for name, rows in zip(self.hf_names, output_partition_sizes, strict=True):
            check_divisible([name], "the output size per rank", rows, _FIX)
        starts = [0, *itertools.accumulate(output_partition_sizes)]
        hf_rows = _hf_rows(layer, output_size)
        self.parts = [
            Part(name, "", None, start, rows, (i,), (n, input_size))
            for i, (name, start, rows, n) in enumerate(
                zip(self.hf_names, starts[:-1], output_partition_sizes, hf_rows, strict=True)
            )
        ]
        self.rows, self.cols = starts[-1], input_size_per_partition
        self.out_dtype = params_dtype
        self.loader = extra_weight_attrs.pop("weight_loader")
        self.weight_attrs = extra_weight_attrs
        if self.prequantized:
            self._register_quantized(layer, device=None)
            return
        weight = ModelWeightParameter(
            data=torch.empty(self.rows, self.cols, dtype=params_dtype, device="meta"),
            input_dim=1,
            output_dim=0,
            weight_loader=self.loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        weight.weight_loader = self.checked_loader("weight", self.loader, nvfp4=False)
        initialize_online_processing(layer)

    def _register_quantized(self, layer: torch.nn.Module, device: torch.device | None) -> None:
        """Register the checkpoint-format NVFP4 tensors (with checking loaders)."""
        shapes = {
            "weight": ((self.rows, self.cols // 2), torch.uint8),
            "weight_scale": ((self.rows, self.cols // 16), torch.float8_e4m3fn),
        }
        for name, (shape, dtype) in shapes.items():
            param = ModelWeightParameter(
                data=torch.empty(shape, dtype=dtype, device=device),
                input_dim=1,
                output_dim=0,
                weight_loader=self.loader,
            )
            layer.register_parameter(name, param)
        layer.register_parameter(
            "weight_scale_2",
            PerTensorScaleParameter(
                data=torch.empty(len(self.parts), dtype=torch.float32, device=device),
                weight_loader=self.loader,
            ),
        )
        for name in SUFFIXES:
            set_weight_attrs(getattr(layer, name), self.weight_attrs)
            getattr(layer, name).weight_loader = self.checked_loader(name, self.loader, nvfp4=True)

    def parts_for_load(self, param_name: str, arguments: Mapping[str, Any]) -> list[Part]:
        shard = arguments.get("loaded_shard_id")
        if shard is None:
            return list(self.parts)
        indices = shard if isinstance(shard, tuple) else (shard,)
        return [self.parts[_QKV_SHARDS.get(i, i)] for i in indices]

    def bf16_scratch(
        self, layer: torch.nn.Module, param_name: str, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, Any]:
        scratch = ModelWeightParameter(
            data=torch.empty(self.rows, self.cols, dtype=dtype, device=device),
            input_dim=1,
            output_dim=0,
            weight_loader=self.loader,
        )
        scratch.tp_rank, scratch.tp_size = layer.tp_rank, layer.tp_size
        return scratch, self.loader

    def amax_group(self) -> ProcessGroup | None:
        """The TP group (every linear but a replicated one splits its HF tensors over it)."""
        return get_tp_group().device_group if get_tensor_model_parallel_world_size() > 1 else None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, "_already_called_process_weights_after_loading", False):
            return
        if self.prequantized:
            self.check_complete(layer.prefix, SUFFIXES, touched_only=False)
        else:
            self.check_complete(layer.prefix, ("weight",), touched_only=False)
            weight = layer.weight.data
            shards = [(p, weight.narrow(0, p.row_start, p.rows)) for p in self.parts]
            quantized = quantize_shards(shards, self.recipe, self.amax_group())
            self._register_quantized(layer, weight.device)
            for part, t in quantized:
                self.write_part(layer, part, t)
        self.refresh_decode_scale(layer)
        self.refresh_kernel_layouts(layer)
        layer._already_called_process_weights_after_loading = True

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = self.gemm_weight(layer, "")
        if not isinstance(layer, RowParallelLinear) or layer.tp_size == 1:
            return w4a4_linear(x, w, bias, recipe=self.recipe)
        group = get_tp_group().device_group
        if self.recipe.deterministic_tp:  # the whole output on every rank, bias (whole) once
            bias = None if layer.skip_bias_add else layer.bias
            y = w4a4_linear(x, w, bias, recipe=self.recipe, tp_group=group, where=layer.prefix)
            return y if self.tp_output_is_final else first_rank_only(y, group)
        # Each rank holds a K slice of every row: quantize it with the whole row's amax.
        amax = tp_row_amax(x, group)
        return w4a4_linear(x, w, bias, recipe=self.recipe, row_amax=amax)


def _hf_rows(layer: torch.nn.Module, output_size: int) -> list[int]:
    """The row counts of the whole HF weights that make up ``layer`` (all ranks together)."""
    if isinstance(layer, QKVParallelLinear):
        kv = layer.total_num_kv_heads
        return [
            layer.total_num_heads * layer.head_size,
            kv * layer.head_size,
            kv * layer.v_head_size,
        ]
    return list(getattr(layer, "output_sizes", [output_size]))


class MiniteBF16LinearMethod(UnquantizedLinearMethod):
    """vLLM's BF16 linear, for the layers the recipe keeps in high precision (e.g. MoE routers).

    Unlike its base class it keeps the BF16 ``weight`` registered after processing (vLLM's CPU
    GEMM packs it and drops it), so that weight updates can write into it and re-run processing.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        super().process_weights_after_loading(layer)
        if layer.weight is not weight:
            layer.register_parameter("weight", weight)
