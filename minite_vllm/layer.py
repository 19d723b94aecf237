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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from minite_common import NVFP4Recipe, NVFP4Tensor, cat_rows, quantize_weight
from minite_common.nvfp4 import BLOCK

#: Checkpoint tensor suffixes of one quantized HF weight, in minite_common.checkpoint's order.
SUFFIXES = ("weight", "weight_scale", "weight_scale_2")
DECODE_SCALE = "weight_decode_scale"


@dataclass(frozen=True)
class Part:
    """One HF weight inside a quantized vLLM layer (this rank's shard of it).

    It holds rows ``row_start:row_start+rows`` of ``{stem}weight`` (of expert ``expert`` for MoE
    layers) and its global decode scale at ``{stem}weight_scale_2[scale_index]``.
    """

    hf_name: str
    stem: str
    expert: int | None
    row_start: int
    rows: int
    scale_index: tuple[int, ...]


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
    reduce_amax: Callable[[torch.Tensor], torch.Tensor],
) -> list[tuple[Part, NVFP4Tensor]]:
    """Quantize each part's rank-local BF16 shard (all a rank holds while loading) with the amax
    of the whole HF tensor.

    ``reduce_amax`` MAX-reduces the vector of per-shard amaxes over the ranks that shard these
    tensors, in one collective, so every rank holds the tiles ``quantize_weight`` gives for the
    full tensor. All ranks call this with the same parts in the same order (vLLM loads and
    processes layers in checkpoint order on every rank).
    """
    for part, shard in shards:  # before the collective, which a failing rank would not join
        if not bool(torch.isfinite(shard).all()):
            raise ValueError(
                f"{part.hf_name}.weight: holds NaN/Inf values; refusing to quantize it"
            )
    amax = torch.stack([shard.abs().amax().float() for _, shard in shards])
    amax = reduce_amax(amax)
    return [
        (part, quantize_weight(shard, recipe=recipe, name=f"{part.hf_name}.weight", global_amax=a))
        for (part, shard), a in zip(shards, amax, strict=True)
    ]


class NVFP4LayerMixin:
    """State and tensor access shared by :class:`MiniteLinearMethod` and :class:`MiniteMoEMethod`.

    Subclasses set ``recipe``, ``prequantized``, ``parts`` (in row order per stem), ``stems``,
    ``out_dtype`` and ``loaded`` in ``create_weights`` and implement :meth:`parts_for_load`,
    :meth:`bf16_scratch` and :meth:`reduce_amax`.
    """

    recipe: NVFP4Recipe
    prequantized: bool
    parts: list[Part]
    stems: tuple[str, ...]
    out_dtype: torch.dtype
    loaded: set[tuple[Part, str]]

    def parts_for_load(self, param_name: str, args: tuple, kwargs: dict[str, Any]) -> list[Part]:
        """The parts that one vLLM weight-loader call (``args``/``kwargs``) writes into."""
        raise NotImplementedError

    def bf16_scratch(
        self, layer: torch.nn.Module, param_name: str, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, Callable[..., Any]]:
        """An empty high-precision ``param_name`` in checkpoint format (this rank's shape) and
        the vLLM loader that narrows a full HF tensor into it."""
        raise NotImplementedError

    def reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """MAX-reduce a vector of per-shard amaxes over the ranks that shard this layer."""
        raise NotImplementedError

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
        shards = [
            (p, _rows(scratch.data, p).clone())
            for p in self.parts_for_load(param_name, args, kwargs)
        ]
        return result, shards

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

    def gemm_weight(self, layer: torch.nn.Module, stem: str) -> NVFP4Tensor:
        """The stem's weight as one NVFP4 tensor ``[rows, K]`` (experts stacked along rows)."""
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
        )

    def check_values(self, layer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Raise naming the HF tensor if a block scale is NaN or a global scale is not positive.

        ``tensors`` maps checkpoint-format parameter names to the values to check (the layer's
        own tensors, or staged copies of them).
        """
        for part in self.parts:
            scales = _rows(tensors[f"{part.stem}weight_scale"], part)
            if bool(torch.isnan(scales.float()).any()):
                raise ValueError(
                    f"{part.hf_name}.weight_scale: holds NaN block scales; re-create the "
                    "checkpoint with `minite quantize-model SRC DST`"
                )
            decode = float(tensors[f"{part.stem}weight_scale_2"][part.scale_index])
            if not decode > 0 or decode == float("inf"):
                raise ValueError(
                    f"{part.hf_name}.weight_scale_2: global decode scale {decode} is not a "
                    "positive finite number; re-create the checkpoint with `minite quantize-model`"
                )

    # -- pre-quantized checkpoints: dtype and completeness checks while loading ----------------

    def checked_loader(
        self, layer: torch.nn.Module, param_name: str, loader: Callable[..., Any]
    ) -> Callable[..., Any]:
        """Wrap vLLM's ``loader`` of checkpoint tensor ``param_name``: refuse a tensor of the
        wrong dtype, naming it, and record which parts arrived (see :meth:`check_complete`)."""
        expected = getattr(layer, param_name).dtype
        suffix = next(s for s in reversed(SUFFIXES) if param_name.endswith(s))

        def load(*args: Any, **kwargs: Any) -> Any:
            loaded = kwargs["loaded_weight"] if "loaded_weight" in kwargs else args[1]
            parts = self.parts_for_load(param_name, args, kwargs)
            if loaded.dtype != expected:
                names = ", ".join(f"{p.hf_name}.{suffix}" for p in parts)
                raise ValueError(
                    f"{names}: a miniTE checkpoint stores this tensor as {expected}, found "
                    f"{loaded.dtype}; write the checkpoint with `minite quantize-model SRC DST` "
                    "(a BF16 checkpoint without quantization_config is quantized online)"
                )
            result = loader(*args, **kwargs)
            if result is not False:
                self.loaded.update((p, suffix) for p in parts)
            return result

        return load

    def check_complete(self, prefix: str) -> None:
        """Raise naming every checkpoint tensor of this layer that was not loaded; then reset."""
        missing = [
            f"{p.hf_name}.{s}" for p in self.parts for s in SUFFIXES if (p, s) not in self.loaded
        ]
        self.loaded = set()
        if missing:
            shown = ", ".join(missing[:6]) + (
                f" and {len(missing) - 6} more" if len(missing) > 6 else ""
            )
            raise ValueError(
                f"{prefix}: the miniTE checkpoint lacks {shown}; every quantized weight needs "
                "its .weight, .weight_scale and .weight_scale_2. Re-create the checkpoint with "
                "`minite quantize-model SRC DST`"
            )


def swap_param(args: tuple, kwargs: dict[str, Any], param: torch.Tensor) -> tuple[tuple, dict]:
    """A weight-loader call's arguments with its target parameter replaced by ``param``."""
    if "param" in kwargs:
        return args, {**kwargs, "param": param}
    return (param, *args[1:]), kwargs
