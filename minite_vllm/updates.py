"""RL weight updates into a loaded vLLM model, quantized-tensor export and execution fingerprints.

An update is all-or-nothing. Every ``(hf_name, tensor)`` is first resolved through the model's
own ``load_weights`` (so vLLM's name mapping and tensor-parallel narrowing apply) with each
parameter's loader redirected to a staging copy; BF16 weights of quantized layers are narrowed to
this rank and quantized with the amax of the whole HF tensor, as ``quantize_weight`` does on the
learner. Only when every name, shape, dtype and value has passed are the staged
values copied into the live tensors, whose addresses never change. A failed update raises and
leaves the previous weights serving. :class:`StreamedUpdate` does the same for a sync streamed in
buckets through :mod:`minite_common.weight_sync`, staging each tensor as it arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, RoutedExperts
from vllm.model_executor.layers.linear import LinearBase
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from minite_common import NVFP4Recipe, NVFP4Tensor, check_fingerprints, quantize_weight, weight_sync
from minite_common.checkpoint import nvfp4_to_state
from minite_common.diagnostics import execution_record
from minite_common.parallel import weight_amax
from minite_common.weight_sync import Channel, Header, SyncStats

from .config import hf_expert_names, hf_module_names
from .layer import (
    SUFFIXES,
    NVFP4LayerMixin,
    Part,
    check_hf_weight,
    loader_arguments,
    swap_param,
)

Weights = Iterable[tuple[str, torch.Tensor]]


def quantized_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, NVFP4LayerMixin]]:
    """Every (module, method) pair of ``model`` that runs NVFP4."""
    return [
        (m, m.quant_method)
        for m in model.modules()
        if isinstance(getattr(m, "quant_method", None), NVFP4LayerMixin)
    ]


def _staged_copy(live: torch.Tensor) -> torch.Tensor:
    """A copy of parameter ``live`` with its class and attributes, for a loader to write into."""
    copy = live.data.clone()
    copy.__class__ = live.__class__
    copy.__dict__ = live.__dict__.copy()
    return copy


class _StagedUpdate:
    """The tensors of one update, resolved by the model's ``load_weights`` and held aside.

    ``nvfp4_input`` says whether quantized layers receive checkpoint-format NVFP4 tensors (True)
    or high-precision weights to quantize (False).
    """

    def __init__(self, model: torch.nn.Module, nvfp4_input: bool) -> None:
        self.model = model
        self.nvfp4_input = nvfp4_input
        self.name = ""
        self.target = ""  # the parameter the last loader call was for, and its shape
        self.resolved: set[str] = set()
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.parts: list[tuple[torch.nn.Module, NVFP4LayerMixin, Part, NVFP4Tensor]] = []
        self.layers: dict[int, tuple[torch.nn.Module, NVFP4LayerMixin]] = {}

    def resolve(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Stage every weight, one name at a time; raise naming the first that does not fit,
        then any NVFP4 weight that received only some of its checkpoint tensors."""
        restore = self._install_stagers()
        try:
            for name, tensor in weights:
                self.stage(name, tensor)
            self.check_complete()
        finally:
            restore()
            self.forget_loaded()

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Stage one weight (the stagers must be installed); raise naming it if it does not fit."""
        self.name = name
        try:
            self.model.load_weights([(name, tensor)])
        except Exception as e:
            given = f"{tensor.dtype} {list(tensor.shape)}"
            reason = str(e) or (
                f"vLLM's loader refused it ({type(e).__name__}) for this rank's "
                f"parameter {self.target}: the shape does not fit"
            )
            raise ValueError(f"weight update: {name} ({given}): {reason}") from e
        if name not in self.resolved:
            raise ValueError(f"weight update: {name} is not a weight of this model")

    def check_complete(self) -> None:
        """Raise naming any NVFP4 weight that received only some of its checkpoint tensors."""
        for _, method in self.layers.values():
            method.check_complete("weight update", SUFFIXES, touched_only=True)

    def forget_loaded(self) -> None:
        for _, method in self.layers.values():
            method.loaded.clear()

    def _install_stagers(self) -> Callable[[], None]:
        """Point every parameter's loader at a stager. For a high-precision update, an NVFP4
        layer's codes are stood in for by an empty BF16 parameter on the meta device, so that
        vLLM's loader sees the dtype of the weight it loads (not uint8 codes)."""
        installed: list[tuple[torch.Tensor, Callable[..., Any] | None]] = []
        standins: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
        seen: set[int] = set()
        for prefix, module in self.model.named_modules():
            method = getattr(module, "quant_method", None)
            for param_name, live in list(module._parameters.items()):
                if live is None or id(live) in seen:
                    continue
                seen.add(id(live))
                original = getattr(live, "weight_loader", None)
                stager = self._stager(
                    module, param_name, live, original or default_weight_loader, prefix
                )
                if (
                    not self.nvfp4_input
                    and isinstance(method, NVFP4LayerMixin)
                    and param_name in {f"{stem}weight" for stem in method.stems}
                ):
                    standin = method.bf16_standin(module, param_name)
                    standin.weight_loader = stager
                    module._parameters[param_name] = standin
                    standins.append((module, param_name, live))
                    continue
                installed.append((live, original))
                live.weight_loader = stager

        def restore() -> None:
            for module, param_name, live in standins:
                module._parameters[param_name] = live
            for live, original in installed:
                if original is None:
                    del live.weight_loader
                else:
                    live.weight_loader = original

        return restore

    def _stager(
        self,
        module: torch.nn.Module,
        param_name: str,
        live: torch.Tensor,
        original: Callable[..., Any],
        prefix: str,
    ) -> Callable[..., Any]:
        """The loader that stages what vLLM loads into ``{prefix}.{param_name}`` (``live``)."""
        method = getattr(module, "quant_method", None)

        def stage(*args: Any, **kwargs: Any) -> Any:
            self.resolved.add(self.name)
            self.target = f"{prefix}.{param_name} {list(live.shape)}"
            if isinstance(method, NVFP4LayerMixin) and param_name != "bias":
                self.layers[id(module)] = (module, method)
                if self.nvfp4_input:
                    if not any(param_name == f"{st}{s}" for st in method.stems for s in SUFFIXES):
                        raise ValueError(f"{param_name} is not a checkpoint tensor of NVFP4 layers")
                    return _load_into(self._copy_of(live), original, args, kwargs)
                arguments = loader_arguments(original, args, kwargs)
                return self._stage_to_quantize(
                    module, method, param_name, live, arguments, args, kwargs
                )
            if isinstance(method, FusedMoEMethodBase):
                raise ValueError(
                    "the recipe keeps these routed experts in BF16, and vLLM repacks BF16 experts "
                    "after loading; updating them in place is not supported"
                )
            return _load_into(self._copy_of(live), original, args, kwargs)

        return stage

    def _copy_of(self, live: torch.Tensor) -> torch.Tensor:
        if id(live) not in self.copies:
            self.copies[id(live)] = (live, _staged_copy(live))
        return self.copies[id(live)][1]

    def _stage_to_quantize(
        self,
        layer: torch.nn.Module,
        method: NVFP4LayerMixin,
        param_name: str,
        live: torch.Tensor,
        arguments: Mapping[str, Any],
        args: tuple,
        kwargs: dict[str, Any],
    ) -> Any:
        """Narrow one HF weight to this rank with vLLM's loader and quantize it with the amax of
        the whole tensor (every rank receives it whole, so no collective is needed); refuse any
        tensor but one whole HF weight."""
        if param_name not in {f"{stem}weight" for stem in method.stems}:
            raise ValueError(
                "update_weights_bf16 takes high-precision weights; NVFP4 tensors (codes and "
                "scales) go through update_weights_quantized"
            )
        loaded = arguments["loaded_weight"]
        parts = method.parts_for_load(param_name, arguments)
        if len(parts) > 1:
            raise ValueError(
                f"one tensor for {[p.hf_name for p in parts]}: send each HF weight under its "
                "own name, since each is quantized with its own scale"
            )
        for part in parts:
            check_hf_weight(part, loaded)
        scratch, loader = method.bf16_scratch(layer, param_name, loaded.dtype, live.device)
        result, shards = method.load_shards(layer, param_name, scratch, loader, args, kwargs)
        (amax,) = weight_amax([loaded])  # the whole HF tensor (every rank receives it whole)
        self.parts += [
            (layer, method, part, quantize_weight(shard, recipe=method.recipe,
                                                  name=f"{part.hf_name}.weight", global_amax=amax))
            for part, shard in shards
        ]  # fmt: skip
        return result

    def commit(self) -> None:
        """Copy everything staged into the live tensors, then refresh what derives from them."""
        for live, copy in self.copies.values():
            live.data.copy_(copy)
        for layer, method, part, t in self.parts:
            method.write_part(layer, part, t)
        for layer, method in self.layers.values():
            method.refresh_decode_scale(layer)
            method.refresh_kernel_layouts(layer)
        for module in self.model.modules():
            method = getattr(module, "quant_method", None)
            params = module._parameters.values()
            if method is None or isinstance(method, NVFP4LayerMixin):
                continue
            if any(p is not None and id(p) in self.copies for p in params):
                method.process_weights_after_loading(module)
                if hasattr(module, "update_param_tp_status"):
                    module.update_param_tp_status()


def _load_into(
    target: torch.Tensor, loader: Callable[..., Any], args: tuple, kwargs: dict[str, Any]
) -> Any:
    """Run a weight-loader call with ``target`` in place of the parameter it names."""
    args, kwargs = swap_param(args, kwargs, target)
    return loader(*args, **kwargs)


def _check_tensor(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight update: {name}: expected a torch.Tensor, got {type(tensor)}")
    values = tensor.float() if tensor.dtype.itemsize == 1 else tensor
    if tensor.is_floating_point() and not bool(torch.isfinite(values).all()):
        raise ValueError(f"weight update: {name}: holds NaN/Inf values")


def _checked_list(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    weights = list(weights)
    names = [name for name, _ in weights]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"weight update: names given more than once: {duplicates}")
    for name, tensor in weights:
        _check_tensor(name, tensor)
    return weights


@torch.no_grad()
def update_weights_bf16(model: torch.nn.Module, weights: Weights) -> None:
    """Load HF-named BF16 weights; quantized layers re-quantize them in place, bit for bit as
    ``quantize_weight`` does on the learner. All-or-nothing (see the module docstring)."""
    staged = _StagedUpdate(model, nvfp4_input=False)
    staged.resolve(_checked_list(weights))
    staged.commit()


@torch.no_grad()
def update_weights_quantized(
    model: torch.nn.Module, weights: Weights, recipe_fingerprint: str
) -> None:
    """Load weights in miniTE checkpoint format (``{hf}.weight`` uint8 codes, ``.weight_scale``
    E4M3, ``.weight_scale_2`` FP32 for quantized layers; BF16 for the rest) that were quantized
    under the recipe with ``recipe_fingerprint``. All-or-nothing (see the module docstring)."""
    layers = quantized_layers(model)
    if layers:
        check_fingerprints(layers[0][1].recipe.fingerprint(), recipe_fingerprint, "weight update")
    staged = _StagedUpdate(model, nvfp4_input=True)
    staged.resolve(_checked_list(weights))
    staged.commit()


class StreamedUpdate:
    """The vLLM side of a streamed sync (a :class:`minite_common.weight_sync.Receiver`): each
    tensor is checked and staged as it arrives, exactly as :func:`update_weights_bf16` /
    :func:`update_weights_quantized` stage a list, and committed only after every rank accepted.

    The commit needs the staged copies: for an NVFP4 payload, a copy of the codes and scales of
    every quantized layer it touches plus the high-precision tensors it carries; for a BF16
    payload, the quantized parts plus the high-precision tensors. Never the BF16 model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.staged: _StagedUpdate | None = None
        self.restore: Callable[[], None] | None = None
        self.seen: set[str] = set()

    def begin(self, header: Header) -> None:
        layers = quantized_layers(self.model)
        if layers and (header.payload == "nvfp4" or header.recipe_fingerprint is not None):
            check_fingerprints(
                layers[0][1].recipe.fingerprint(), header.recipe_fingerprint, "weight sync"
            )
        self.staged = _StagedUpdate(self.model, nvfp4_input=header.payload == "nvfp4")
        self.seen = set()
        self.restore = self.staged._install_stagers()

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.seen:
            raise ValueError(f"weight update: {name} was sent more than once")
        self.seen.add(name)
        _check_tensor(name, tensor)
        self.staged.stage(name, tensor)

    def finish(self) -> None:
        self.staged.check_complete()

    def commit(self) -> None:
        staged = self.staged
        self._release()
        staged.commit()

    def discard(self) -> None:
        self._release()

    def _release(self) -> None:
        if self.restore is not None:
            self.restore()
            self.staged.forget_loaded()
        self.staged, self.restore = None, None


@torch.no_grad()
def receive_weights(model: torch.nn.Module, channel: Channel) -> SyncStats:
    """Receive one streamed sync from ``channel`` into ``model``, all-or-nothing (see
    :mod:`minite_common.weight_sync`)."""
    return weight_sync.receive_weights(channel, StreamedUpdate(model))


def quantized_weights(
    model: torch.nn.Module, hf_names: Iterable[str] | None = None
) -> dict[str, torch.Tensor]:
    """This rank's NVFP4 tensors of the HF weights ``hf_names`` (all quantized ones if None), in
    checkpoint format (``{hf}.weight``, ``.weight_scale``, ``.weight_scale_2``), copied to CPU."""
    parts = {
        p.hf_name: (layer, method, p)
        for layer, method in quantized_layers(model)
        for p in method.parts
    }
    names = list(parts) if hf_names is None else list(hf_names)
    unknown = [n for n in names if n not in parts]
    if unknown:
        raise KeyError(f"not NVFP4 weights of this model: {unknown} (give HF module names)")
    out = {}
    for name in names:
        layer, method, part = parts[name]
        state = nvfp4_to_state(name, method.read_part(layer, part))
        out.update({k: v.detach().to("cpu", copy=True) for k, v in state.items()})
    return out


def execution_fingerprints(
    model: torch.nn.Module, recipe: NVFP4Recipe
) -> dict[str, dict[str, Any]]:
    """How each HF weight's GEMM runs: ``{hf_name: {"mode", "recipe", "kernel", "config"}}``
    (the record :func:`minite_common.diagnostics.diff_fingerprints` compares)."""
    packed = getattr(model, "packed_modules_mapping", {})
    records: dict[str, dict[str, Any]] = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, NVFP4LayerMixin):
            device = getattr(module, f"{method.stems[0]}weight").device
            record = execution_record(recipe, device)
            records.update({p.hf_name: dict(record) for p in method.parts})
        elif isinstance(module, RoutedExperts):
            names = [n for expert in hf_expert_names(module.layer_name, module) for n in expert]
            records.update({n: execution_record(recipe, nvfp4=False) for n in names})
        elif isinstance(module, LinearBase | VocabParallelEmbedding):
            names = hf_module_names(prefix, packed)
            records.update({n: execution_record(recipe, nvfp4=False) for n in names})
    return records
