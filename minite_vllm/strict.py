"""Strict mode in vLLM: the ops around the NVFP4 linears run :mod:`minite_common.ops`.

With a recipe whose ``strict_ops`` is on (``MINITE_RECIPE`` or a strict miniTE checkpoint), the
``minite`` quantization config makes vLLM compute everything the learner computes the same way:

- RMSNorm (with its fused residual add), the rotary embedding and ``SiluAndMul``: out-of-tree
  replacements of vLLM's custom ops (:func:`register_strict_ops`, called by the plugin in every
  process). Each one checks, when the model is built, whether the engine runs a strict ``minite``
  recipe; otherwise it is vLLM's own op, unchanged.
- Attention: the CPU backend's implementation is swapped, per layer, for
  :class:`StrictCPUAttentionImpl`, which writes K/V into the paged cache and reads each
  sequence's keys back from it for :func:`minite_common.ops.causal_attention` (decode steps give
  the bits of a full-sequence pass).
- LM head and MoE router (BF16): :func:`minite_common.ops.linear`; routed experts: routing,
  SwiGLU and the combine from :mod:`minite_common.ops` around the NVFP4 expert GEMMs.

- The log-probs the sampler returns: vLLM's ``Sampler.compute_logprobs`` (torch's
  ``log_softmax``, whose bits depend on the CPU's instruction set) is replaced, in a process whose
  engine runs a strict model, by :func:`minite_common.ops.log_softmax` (fixed order, float64,
  the same bits on every CPU), the learner's ``token_logprobs`` in strict mode.

Strict mode needs eager execution (``enforce_eager=True``) and vLLM's CPU attention backend. It
runs at any tensor-parallel degree the model's shapes allow: its recipe turns on the TP-invariant
reduction of row-parallel linears (:mod:`minite_common.parallel`), attention heads and LM-head
vocabulary columns are independent of one another, and the sampler normalizes the gathered
(whole-vocabulary) logits, so every TP degree gives TP=1's bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from minite_common import grouped_w4a4_linear, ops

from .linear import MiniteBF16LinearMethod
from .moe import MiniteMoEMethod

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

logger = init_logger(__name__)

_PAD_SLOT = -1

#: ``[True]`` while the model this process built last runs a strict recipe (set when its
#: RMSNorm layers are built; vLLM's engine core normally runs in a process of its own).
_STRICT_LOGITS: list[bool] = []


def strict_enabled() -> bool:
    """Whether the vLLM config being built runs a ``minite`` recipe with ``strict_ops`` on;
    raises if it does but the engine would compile the model or use pipeline or expert
    parallelism (tensor parallelism is fine: its row-parallel reductions are TP-invariant)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.config.compilation import CompilationMode

    from .config import MiniteConfig

    config = get_current_vllm_config_or_none()
    quant = getattr(config, "quant_config", None)
    if not isinstance(quant, MiniteConfig) or not quant.recipe.strict_ops:
        return False
    if config.compilation_config.mode != CompilationMode.NONE:
        raise ValueError(
            "miniTE strict mode runs vLLM eagerly (torch.compile may fuse multiply-adds and change "
            "bits): start the engine with enforce_eager=True (--enforce-eager)"
        )
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.enable_expert_parallel:
        raise NotImplementedError(
            "miniTE strict mode covers tensor parallelism (row-parallel linears combine their "
            "partial sums deterministically), not pipeline or expert parallelism"
        )
    return True


# -- custom ops ----------------------------------------------------------------------------------


class StrictRMSNorm(RMSNorm):
    """vLLM's ``RMSNorm``; in strict mode :func:`ops.rms_norm` / :func:`ops.add_rms_norm`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()
        _STRICT_LOGITS[:] = [True] if self.minite_strict else []  # the model built last decides
        if self.minite_strict:
            if not self.has_weight or self.variance_size_override is not None:
                raise NotImplementedError(
                    "miniTE strict mode: RMSNorm without weight or with var_hidden_size"
                )
            self._forward_method = self.forward_strict

    def forward_strict(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        return ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)


class StrictRotaryEmbedding(RotaryEmbedding):
    """vLLM's ``RotaryEmbedding``; in strict mode :func:`ops.rope_cos_sin` + :func:`ops.apply_rope`
    (NeoX layout) on each token's position."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()
        if self.minite_strict:
            if not self.is_neox_style:
                raise NotImplementedError("miniTE strict mode: GPT-J (interleaved) rotary layout")
            self._forward_method = self.forward_strict

    def forward_strict(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cos, sin = ops.rope_cos_sin(positions.reshape(-1), self.rotary_dim, self.base)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, rotary_dim/2]: one row per token

        def rotate(x: torch.Tensor) -> torch.Tensor:
            heads = x.reshape(x.shape[0], -1, self.head_size)
            return ops.apply_rope(heads, cos, sin).reshape(x.shape)

        return rotate(query), None if key is None else rotate(key)


class StrictSiluAndMul(SiluAndMul):
    """vLLM's ``SiluAndMul``; in strict mode :func:`ops.swiglu`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()
        if self.minite_strict:
            self._forward_method = ops.swiglu


#: vLLM class replaced -> miniTE's strict subclass (``CustomOp.register_oot`` keys on the name).
STRICT_OPS: dict[type[CustomOp], type[CustomOp]] = {
    RMSNorm: StrictRMSNorm,
    RotaryEmbedding: StrictRotaryEmbedding,
    SiluAndMul: StrictSiluAndMul,
}


def _strict_compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's ``Sampler.compute_logprobs``; :func:`ops.log_softmax` for a strict model."""
    if _STRICT_LOGITS:
        return ops.log_softmax(logits)
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def install_strict_logprobs() -> None:
    """Route vLLM's sampler log-probs through :func:`_strict_compute_logprobs` (idempotent)."""
    from vllm.v1.sample.sampler import Sampler

    if Sampler.__dict__.get("compute_logprobs") is not _STRICT_COMPUTE_LOGPROBS:
        Sampler.compute_logprobs = _STRICT_COMPUTE_LOGPROBS


_STRICT_COMPUTE_LOGPROBS = staticmethod(_strict_compute_logprobs)


def register_strict_ops() -> None:
    """Register the strict subclasses as vLLM's out-of-tree ops (idempotent). They behave exactly
    like vLLM's ops unless the engine runs a strict ``minite`` recipe."""
    install_strict_logprobs()
    for base, strict in STRICT_OPS.items():
        name = base.__name__
        if op_registry_oot.get(name) is strict:
            continue
        if name in op_registry_oot:
            logger.warning(
                "miniTE: another plugin replaces vLLM's %s (%s); miniTE strict mode will refuse "
                "to run",
                name,
                op_registry_oot[name].__name__,
            )
            continue
        registered_name = base.name  # register_oot renames the class; keep vLLM's op name
        CustomOp.register_oot(strict, name=name)
        strict.name = registered_name


def check_strict_ops_registered() -> None:
    """Raise unless every op of :data:`STRICT_OPS` resolves to miniTE's strict subclass."""
    oot = op_registry_oot
    missing = [b.__name__ for b, s in STRICT_OPS.items() if oot.get(b.__name__) is not s]
    if missing:
        raise RuntimeError(
            f"miniTE strict mode: vLLM's {missing} are not replaced by miniTE's strict ops "
            "(is the minite plugin loaded, and no other plugin replacing them?)"
        )


# -- attention -----------------------------------------------------------------------------------


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[num_blocks, kv_heads, block_size, head_size]`` of a CPU_ATTN cache
    ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (each block holds its keys, then its
    values). Only :class:`StrictCPUAttentionImpl` writes and reads this cache in strict mode."""
    blocks, heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)


def _strict_impl_class() -> type:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    class StrictCPUAttentionImpl(CPUAttentionBackendImpl):
        """CPU_ATTN's implementation with :func:`ops.causal_attention` as the attention core."""

        def do_kv_cache_update(
            self,
            layer: torch.nn.Module,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
        ) -> None:
            """Copy each token's K/V (bits unchanged) into its cache slot."""
            key_cache, value_cache = _split_cache(kv_cache)
            n = min(slot_mapping.shape[0], key.shape[0])
            slots = slot_mapping[:n].long()
            keep = slots != _PAD_SLOT
            slots = slots[keep]
            block, offset = slots // key_cache.shape[2], slots % key_cache.shape[2]
            key_cache[block, :, offset] = key[:n][keep]
            value_cache[block, :, offset] = value[:n][keep]

        def forward(
            self,
            layer: torch.nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            attn_metadata: Any,
            output: torch.Tensor,
            output_scale: torch.Tensor | None = None,
            output_block_scale: torch.Tensor | None = None,
        ) -> torch.Tensor:
            """Each request's queries against its keys 0..seq_len-1, read from the cache."""
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("miniTE strict mode: fused output quantization")
            if attn_metadata is None:  # profiling run
                return output
            if not attn_metadata.causal or attn_metadata.dynamic_causal is not None:
                raise NotImplementedError("miniTE strict mode: non-causal attention")
            key_cache, value_cache = _split_cache(kv_cache)
            block_size = key_cache.shape[2]
            starts = attn_metadata.query_start_loc.tolist()
            seq_lens = attn_metadata.seq_lens.tolist()
            for i in range(len(starts) - 1):
                start, end, length = starts[i], starts[i + 1], seq_lens[i]
                if end == start:
                    continue
                pos = torch.arange(length, device=query.device)
                block = attn_metadata.block_table[i, pos // block_size].long()
                offset = pos % block_size
                output[start:end] = ops.causal_attention(
                    query[start:end],
                    key_cache[block, :, offset],
                    value_cache[block, :, offset],
                    pos[length - (end - start) :],
                    self.scale,
                )
            return output

    return StrictCPUAttentionImpl


def install_strict_attention(layer: torch.nn.Module) -> None:
    """Swap the attention implementation of vLLM ``Attention`` layer for the strict one
    (idempotent); raise for what the strict path does not cover."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    strict_cls = getattr(install_strict_attention, "impl_cls", None) or _strict_impl_class()
    install_strict_attention.impl_cls = strict_cls  # type: ignore[attr-defined]
    impl = layer.impl
    if isinstance(impl, strict_cls):
        return
    where = f"miniTE strict mode ({layer.layer_name})"
    if not isinstance(impl, CPUAttentionBackendImpl):
        raise NotImplementedError(
            f"{where}: runs on vLLM's CPU attention backend (CPU_ATTN), not {type(impl).__name__}"
        )
    unsupported = {
        "a non-decoder attention type": impl.attn_type != AttentionType.DECODER,
        "ALiBi": impl.alibi_slopes is not None,
        "a sliding window": impl.sliding_window not in (-1, None),
        "logit soft-capping": bool(impl.logits_soft_cap),
        "attention sinks": impl.sinks is not None,
        "a quantized KV cache": impl.kv_cache_dtype != "auto",
        "KV-cache sharing": impl.kv_sharing_target_layer_name is not None,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise NotImplementedError(f"{where}: does not support {', '.join(bad)}")
    strict = strict_cls.__new__(strict_cls)
    strict.__dict__.update(impl.__dict__)
    layer.impl = strict


# -- BF16 GEMMs and routed experts ---------------------------------------------------------------


class StrictLMHeadMethod(UnquantizedEmbeddingMethod):
    """The LM head's logits through :func:`ops.linear` (the embedding lookup is vLLM's)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to pack: the strict GEMM reads ``layer.weight``."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class StrictBF16LinearMethod(MiniteBF16LinearMethod):
    """Layers the recipe keeps in BF16 (e.g. the MoE router) through :func:`ops.linear`; a
    row-parallel one only at TP 1 (its all-reduce of rounded partial outputs depends on TP)."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            raise NotImplementedError(
                f"miniTE strict mode ({layer.prefix}): a BF16 row-parallel linear at TP="
                f"{layer.tp_size} would all-reduce rounded partial outputs; keep it in NVFP4 "
                "(drop it from bf16_modules) or run TP=1"
            )
        super().create_weights(layer, *args, **kwargs)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class StrictMoEMethod(MiniteMoEMethod):
    """NVFP4 routed experts whose routing, activation and combine are :mod:`minite_common.ops`.

    It takes the router logits itself (a "monolithic" method): :func:`ops.topk_routing`, each
    (token, expert) row through the expert's NVFP4 GEMMs, :func:`ops.silu_mul`,
    :func:`ops.moe_combine` in slot order.
    """

    @property
    def is_monolithic(self) -> bool:
        return True

    def apply_monolithic(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        unsupported = {
            "grouped top-k": layer.use_grouped_topk,
            "a custom routing function": layer.custom_routing_function is not None,
            f"scoring function {layer.scoring_func!r}": layer.scoring_func != "softmax",
            "a routed scaling factor": layer.routed_scaling_factor != 1.0,
            "an expert score bias": layer.e_score_correction_bias is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"miniTE strict mode ({layer.layer_name}): {bad}")
        tokens = x.shape[0]
        if tokens == 0:
            return x.new_zeros(0, self.hidden)
        weights, ids = ops.topk_routing(router_logits, layer.top_k, layer.renormalize)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        group_sizes = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // layer.top_k)
        gate_up = grouped_w4a4_linear(
            rows, self.gemm_weight(layer, "w13_"), group_sizes, recipe=self.recipe
        )
        act = ops.swiglu(gate_up)
        down = self.down_proj(layer, act, group_sizes)
        per_slot = torch.empty_like(down)
        per_slot[order] = down
        combined = ops.moe_combine(per_slot.view(tokens, layer.top_k, self.hidden), weights)
        return self.tp_output(combined)


def strict_layer_method(layer: torch.nn.Module) -> Any:
    """The strict handling of a layer that is neither linear nor routed experts: the attention
    implementation is swapped (None is returned: no weights), the LM head gets
    :class:`StrictLMHeadMethod`; anything else None."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    check_strict_ops_registered()
    if isinstance(layer, Attention):
        install_strict_attention(layer)
    elif isinstance(layer, ParallelLMHead):
        return StrictLMHeadMethod()
    return None
