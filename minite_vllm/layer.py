"""What the two quantized methods (dense linear, MoE experts) share: the tensors a quantized vLLM
layer holds, the HF weights ("parts") it is made of, and how parts are quantized, read and written.

A quantized layer keeps, for each stem (``""`` for a linear layer, ``"w13_"``/``"w2_"`` for
experts), the checkpoint-format tensors ``{stem}weight`` (uint8 packed codes),
``{stem}weight_scale`` (E4M3 block scales) and ``{stem}weight_scale_2`` (one FP32 decode scale
per HF weight), plus ``{stem}weight_decode_scale``, the per-output-channel decode scale the GEMM
applies (derived from the per-weight scales with :func:`minite_common.cat_rows`). Every HF weight
(q, k, v, gate, up, down, each expert's) occupies its own rows with its own global scale, exactly
as :func:`minite_common.quantize_weight` makes it from that HF tensor.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from minite_common import NVFP4Recipe, NVFP4Tensor, cat_rows, with_kernel_layout
from minite_common.checkpoint import check_nvfp4_state_tensor
from minite_common.nvfp4 import BLOCK
from minite_common.parallel import ProcessGroup, quantize_weight_shards

#: Checkpoint tensor suffixes of one quantized HF weight, in minite_common.checkpoint's order.
SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
DECODE_SCALE = "weight_decode_scale"
#: The layer attribute holding its weights' kernel layouts by stem (not a parameter or buffer: a
#: copy the GEMMs read, never saved or synced).
KERNEL_LAYOUTS = "minite_kernel_layouts"


@dataclass(frozen=True)
class Part:
    """One HF weight inside a quantized vLLM layer (this rank's shard of it).

    It holds rows ``row_start:row_start+rows`` of ``{stem}weight`` (of expert ``expert`` for MoE
    layers) and its global decode scale at ``{stem}weight_scale_2[scale_index]``; ``hf_shape`` is
    the whole HF tensor's [N, K] (all ranks together), the shape a checkpoint or update holds.
    """

    hf_name: str
    stem: str
    expert: int | None
    row_start: int
    rows: int
    scale_index: tuple[int, ...]
    hf_shape: tuple[int, int]


def _rows(t: torch.Tensor, part: Part) -> torch.Tensor:
    if part.expert is not None:
        t = t[part.expert]
    return t.narrow(0, part.row_start, part.rows)


def check_divisible(names: list[str], what: str, size: int, fix: str) -> None:
    """Raise naming ``names`` unless ``size`` (a per-rank dimension) is a multiple of 16."""
    if size % BLOCK:
        raise ValueError(
            f"{', '.join(names)}: {what} is {size}, not a multiple of {BLOCK}; NVFP4 needs whole "
            f"16-element blocks (and 16x16 weight tiles) per tensor-parallel shard. {fix}"
        )


def quantize_shards(
    shards: list[tuple[Part, torch.Tensor]],
    recipe: NVFP4Recipe,
    group: ProcessGroup | None,
) -> list[tuple[Part, NVFP4Tensor]]:
    """Quantize each part's rank-local BF16 shard (all a rank holds while loading) with the amax
    of the whole HF tensor over ``group`` (:func:`minite_common.parallel.quantize_weight_shards`).
    All ranks call this with the same parts in the same order (vLLM loads and processes layers
    in checkpoint order on every rank)."""
    named = [(f"{part.hf_name}.weight", shard) for part, shard in shards]
    quantized = quantize_weight_shards(named, recipe, group)
    return [(part, t) for (part, _), t in zip(shards, quantized, strict=True)]


class NVFP4LayerMixin:
    """State and tensor access shared by :class:`MiniteLinearMethod` and :class:`MiniteMoEMethod`.

    Subclasses set ``recipe``, ``prequantized``, ``parts`` (in row order per stem), ``stems``,
    ``out_dtype`` and ``loaded`` in ``create_weights`` and implement :meth:`parts_for_load`,
    :meth:`bf16_scratch` and :meth:`amax_group`.
    """

    recipe: NVFP4Recipe
    prequantized: bool
    parts: list[Part]
    stems: tuple[str, ...]
    out_dtype: torch.dtype
    loaded: set[tuple[Part, str]]
    #: The stems whose GEMMs read a kernel layout where one exists (dense GEMMs: the grouped
    #: experts' kernel reads none).
    kernel_layout_stems: tuple[str, ...] = ()

    def parts_for_load(self, param_name: str, arguments: Mapping[str, Any]) -> list[Part]:
        """The parts that one vLLM weight-loader call writes into (``arguments``: the call's
        arguments by name, from :func:`loader_arguments`)."""
        raise NotImplementedError

    def bf16_scratch(
        self, layer: torch.nn.Module, param_name: str, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        """An empty high-precision ``param_name`` in checkpoint format (this rank's shape) and
        the vLLM loader that narrows a full HF tensor into it."""
        raise NotImplementedError

    def amax_group(self) -> ProcessGroup | None:
        """The process group of the ranks that shard this layer's HF tensors (None: unsharded)."""
        raise NotImplementedError

    def bf16_standin(self, layer: torch.nn.Module, param_name: str) -> torch.nn.Parameter:
        """An empty high-precision ``param_name`` (this rank's shape) on the meta device, which
        vLLM's loader sees in place of the codes during a high-precision update."""
        scratch, _ = self.bf16_scratch(layer, param_name, self.out_dtype, torch.device("meta"))
        if isinstance(scratch, torch.nn.Parameter):
            return scratch
        return torch.nn.Parameter(scratch, requires_grad=False)

    def load_shards(
        self,
        layer: torch.nn.Module,
        param_name: str,
        scratch: torch.Tensor,
        loader: Callable[..., Any],
        args: tuple,
        kwargs: dict[str, Any],
    ) -> tuple[Any, list[tuple[Part, torch.Tensor]]]:
        """Run vLLM's ``loader`` (which narrows to this rank) into ``scratch`` from
        :meth:`bf16_scratch`; return the loader's result and the (part, shard) pairs it wrote."""
        args, kwargs = swap_param(args, kwargs, scratch)
        result = loader(*args, **kwargs)
        if result is False:  # an MoE expert that lives on another rank
            return result, []
        parts = self.parts_for_load(param_name, loader_arguments(loader, args, kwargs))
        return result, [(p, _rows(scratch.data, p).clone()) for p in parts]

    # -- reading and writing parts -------------------------------------------------------------

    def read_part(self, layer: torch.nn.Module, part: Part) -> NVFP4Tensor:
        """The NVFP4 tensor of one part (views of the layer's tensors)."""
        codes = _rows(getattr(layer, f"{part.stem}weight").data, part)
        scales = _rows(getattr(layer, f"{part.stem}weight_scale").data, part)
        decode = getattr(layer, f"{part.stem}weight_scale_2").data[part.scale_index]
        return NVFP4Tensor(
            codes=codes,
            scales=scales,
            decode_scale=decode,
            shape=torch.Size((part.rows, codes.shape[1] * 2)),
            dtype=self.out_dtype,
            block_2d=self.recipe.weight_block_2d,
            recipe_fingerprint=self.recipe.fingerprint(),
        )

    def write_part(self, layer: torch.nn.Module, part: Part, t: NVFP4Tensor) -> None:
        """Copy quantized ``t`` into the part's rows and scale (addresses unchanged)."""
        _rows(getattr(layer, f"{part.stem}weight").data, part).copy_(t.codes)
        _rows(getattr(layer, f"{part.stem}weight_scale").data, part).copy_(t.scales)
        getattr(layer, f"{part.stem}weight_scale_2").data[part.scale_index] = t.decode_scale

    def refresh_decode_scale(self, layer: torch.nn.Module) -> None:
        """Recompute each stem's per-output-channel decode scale from the per-part scales,
        registering it on first use."""
        for stem in self.stems:
            merged = cat_rows([self.read_part(layer, p) for p in self.parts if p.stem == stem])
            codes = getattr(layer, f"{stem}weight")
            name = f"{stem}{DECODE_SCALE}"
            if getattr(layer, name, None) is None:
                shape = codes.shape[:-1]
                layer.register_parameter(
                    name,
                    torch.nn.Parameter(
                        torch.empty(shape, dtype=torch.float32, device=codes.device),
                        requires_grad=False,
                    ),
                )
            getattr(layer, name).data.view(-1).copy_(merged.decode_scale)

    def refresh_kernel_layouts(self, layer: torch.nn.Module) -> None:
        """Make the kernel-friendly copies of the weights of ``kernel_layout_stems`` where a GPU
        kernel reads one (:func:`~minite_common.with_kernel_layout`), or rewrite them in place
        after a weight update, so that CUDA graphs captured on them replay with the new
        weights."""
        layouts = layer.__dict__.setdefault(KERNEL_LAYOUTS, {})
        for stem in self.kernel_layout_stems:
            w = self.gemm_weight(layer, stem)
            if stem in layouts:
                layouts[stem].refresh(w.codes, w.scales)
                continue
            layout = with_kernel_layout(w).kernel_layout
            if layout is not None:
                layouts[stem] = layout

    def gemm_weight(self, layer: torch.nn.Module, stem: str) -> NVFP4Tensor:
        """The stem's weight as one NVFP4 tensor ``[rows, K]`` (experts stacked along rows),
        with its kernel layout if it has one (:meth:`refresh_kernel_layouts`)."""
        codes = getattr(layer, f"{stem}weight").data
        scales = getattr(layer, f"{stem}weight_scale").data
        decode = getattr(layer, f"{stem}{DECODE_SCALE}").data
        rows = decode.numel()
        return NVFP4Tensor(
            codes=codes.reshape(rows, codes.shape[-1]),
            scales=scales.reshape(rows, scales.shape[-1]),
            decode_scale=decode.reshape(rows),
            shape=torch.Size((rows, codes.shape[-1] * 2)),
            dtype=self.out_dtype,
            block_2d=self.recipe.weight_block_2d,
            recipe_fingerprint=self.recipe.fingerprint(),
            kernel_layout=layer.__dict__.get(KERNEL_LAYOUTS, {}).get(stem),
        )

    # -- checkpoint and update tensors: checks while loading ---------------------------------

    def checked_loader(
        self, param_name: str, loader: Callable[..., Any], nvfp4: bool
    ) -> Callable[..., Any]:
        """Wrap vLLM's ``loader`` of parameter ``param_name``: before it runs, refuse a tensor
        that is not exactly the HF weight's (for ``nvfp4`` checkpoint tensors:
        :func:`~minite_common.checkpoint.check_nvfp4_state_tensor`; else a high-precision
        weight of the HF shape), naming it; record which parts arrived (see
        :meth:`check_complete`)."""
        suffix = next(s for s in reversed(SUFFIXES) if param_name.endswith(s))

        @functools.wraps(loader)  # keeps its signature: vLLM binds loader arguments by name
        def load(*args: Any, **kwargs: Any) -> Any:
            arguments = loader_arguments(loader, args, kwargs)
            loaded = arguments["loaded_weight"]
            parts = self.parts_for_load(param_name, arguments)
            for part in parts:
                if nvfp4:
                    check_nvfp4_state_tensor(part.hf_name, suffix, loaded, part.hf_shape)
                else:
                    check_hf_weight(part, loaded)
            result = loader(*args, **kwargs)
            if result is not False:
                self.loaded.update((p, suffix) for p in parts)
            return result

        return load

    def check_complete(self, where: str, suffixes: tuple[str, ...], touched_only: bool) -> None:
        """Raise naming every tensor ``{hf}.{suffix}`` of this layer's parts that did not arrive
        through :meth:`checked_loader` (with ``touched_only``, of the parts that received any);
        then forget what arrived."""
        parts = [
            p
            for p in self.parts
            if not touched_only or any((p, s) in self.loaded for s in SUFFIXES)
        ]
        missing = [f"{p.hf_name}.{s}" for p in parts for s in suffixes if (p, s) not in self.loaded]
        self.loaded = set()
        if not missing:
            return
        shown = ", ".join(missing[:6]) + (
            f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        )
        if suffixes == ("weight",):
            raise ValueError(
                f"{where}: the checkpoint lacks {shown}; every weight of the model must be in "
                "it (check the checkpoint's files and its model.safetensors.index.json)"
            )
        raise ValueError(
            f"{where}: lacks {shown}; every quantized weight needs its .weight, .weight_scale "
            "and .weight_scale_2 (`minite quantize-model SRC DST` writes all three, and so does "
            "nvfp4_to_state for an update)"
        )


def check_hf_weight(part: Part, tensor: torch.Tensor) -> None:
    """Raise naming ``{hf}.weight`` unless ``tensor`` is a floating-point weight of the whole HF
    tensor's shape (every rank receives it whole and keeps its own rows/columns)."""
    if not tensor.is_floating_point() or tuple(tensor.shape) != part.hf_shape:
        raise ValueError(
            f"{part.hf_name}.weight: expected a BF16/FP16/FP32 tensor {list(part.hf_shape)} (the "
            f"whole HF weight), found {tensor.dtype} {list(tensor.shape)}"
        )


def loader_arguments(
    loader: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> Mapping[str, Any]:
    """A vLLM weight-loader call's arguments by name (``param``, ``loaded_weight``, and
    ``loaded_shard_id`` or ``shard_id``/``expert_id`` where given)."""
    return inspect.signature(loader).bind(*args, **kwargs).arguments


def swap_param(args: tuple, kwargs: dict[str, Any], param: torch.Tensor) -> tuple[tuple, dict]:
    """A weight-loader call's arguments with its target parameter replaced by ``param``."""
    if "param" in kwargs:
        return args, {**kwargs, "param": param}
    return (param, *args[1:]), kwargs
