"""miniTE's strict attention backend for vLLM, registered in the attention-backend registry.

:func:`register_strict_attention_backend` (called by the plugin in every process) puts
:class:`StrictAttentionBackend` in vLLM's ``CUSTOM`` slot
(``vllm.v1.attention.backends.registry.register_backend``); an engine selects it with the public
attention-backend setting, ``LLM(..., attention_backend="CUSTOM")`` / ``--attention-backend
CUSTOM``, which strict mode requires. The backend owns its KV-cache convention (each cell of a
layer's ``[blocks, kv_heads, block_size, head_size + head_size_v]`` view holds a token's key, then
its value, bits unchanged) and its metadata (built from vLLM's ``CommonAttentionMetadata``), so it
depends on no other backend's private layout. Each request's queries attend its keys
``0..seq_len-1`` read back from the cache through :func:`minite_common.ops.paged_attention`
(:mod:`minite_vllm.strict_forward` holds the cache write and read, free of vLLM imports): a decode
step gives the bits of the full-sequence pass at that position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from .strict_forward import cached_attention, write_kv_cache

#: The qualified name vLLM's registry resolves ``AttentionBackendEnum.CUSTOM`` to.
STRICT_BACKEND_PATH = "minite_vllm.strict_attention.StrictAttentionBackend"


@dataclass
class StrictAttentionMetadata:
    """Per-batch metadata: request ``i``'s queries are rows ``query_starts[i]:query_starts[i+1]``
    and see keys ``0..seq_lens[i]-1``, stored in the blocks of ``block_table[i]``."""

    query_starts: list[int]
    seq_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor


class StrictAttentionMetadataBuilder(AttentionMetadataBuilder[StrictAttentionMetadata]):
    """Builds :class:`StrictAttentionMetadata` from vLLM's common metadata (causal batches only)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: Any):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> StrictAttentionMetadata:
        m = common_attn_metadata
        if m.causal is not True:
            raise NotImplementedError("miniTE strict attention: non-causal attention")
        return StrictAttentionMetadata(
            query_starts=m.query_start_loc_cpu[: m.num_reqs + 1].tolist(),
            seq_lens=m.seq_lens[: m.num_reqs].tolist(),
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
        )


class StrictAttentionImpl(AttentionImpl[StrictAttentionMetadata]):
    """Causal decoder self-attention through ``ops.paged_attention`` over the paged cache;
    refuses (at construction) ALiBi, sliding windows, soft-capping, sinks, a quantized KV cache,
    KV sharing and non-decoder attention."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        unsupported = {
            f"attention type {attn_type!r}": attn_type != AttentionType.DECODER,
            "ALiBi": alibi_slopes is not None,
            "a sliding window": sliding_window not in (-1, None),
            "logit soft-capping": bool(logits_soft_cap),
            "a quantized KV cache": kv_cache_dtype != "auto",
            "KV-cache sharing": kv_sharing_target_layer_name is not None,
        }
        unsupported.update({f"extra argument {k!r}": v is not None for k, v in extra.items()})
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"miniTE strict attention does not support {', '.join(bad)}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Copy each token's key and value (bits unchanged) into its cache slot."""
        write_kv_cache(key, value, kv_cache, self.head_size, slot_mapping)

    def forward(
        self,
        layer: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: StrictAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Each request's queries against its keys ``0..seq_len-1``, read from the cache."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("miniTE strict attention: fused output quantization")
        if attn_metadata is None:  # profiling run
            return output
        return cached_attention(
            query,
            kv_cache,
            self.head_size,
            attn_metadata.block_table,
            attn_metadata.query_starts,
            attn_metadata.seq_lens,
            self.scale,
            output,
        )


class StrictAttentionBackend(AttentionBackend):
    """vLLM attention backend of miniTE's strict mode (registered as ``CUSTOM``)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[StrictAttentionImpl]:
        return StrictAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[StrictAttentionMetadataBuilder]:
        return StrictAttentionMetadataBuilder

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True


def register_strict_attention_backend() -> None:
    """Point vLLM's ``CUSTOM`` attention backend at :class:`StrictAttentionBackend` (idempotent).
    Another plugin's ``CUSTOM`` registration is kept (strict mode then refuses to start)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    custom = AttentionBackendEnum.CUSTOM
    if custom.is_overridden() and custom.get_path() != STRICT_BACKEND_PATH:
        return
    register_backend(custom, STRICT_BACKEND_PATH)


def strict_attention_selected(vllm_config: Any) -> bool:
    """Whether ``vllm_config`` selects the ``CUSTOM`` backend and it is miniTE's."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    custom = AttentionBackendEnum.CUSTOM
    return (
        vllm_config.attention_config.backend == custom
        and custom.is_overridden()
        and custom.get_path() == STRICT_BACKEND_PATH
    )
