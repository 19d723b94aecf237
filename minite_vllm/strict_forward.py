"""The forward bodies of miniTE's strict vLLM adapters, free of vLLM imports.

:class:`~minite_vllm.strict.StrictRotaryEmbedding`, :class:`~minite_vllm.strict.StrictMoEMethod`
and :class:`~minite_vllm.strict_attention.StrictAttentionImpl` call these functions with the
tensors vLLM hands them; :mod:`minite.strict_sampler` calls the same functions where vLLM cannot
run (the GPU machine), so both run the same sequence of :mod:`minite_common` calls. Only layout
lives here (views, index arithmetic, token grouping); every formula is in :mod:`minite_common`.

The KV-cache convention of the strict backend: a layer's cache is ``[blocks, kv_heads,
block_size, head_size + head_size_v]``; each cell holds a token's key, then its value, bits
unchanged. Slot ``s`` is offset ``s % block_size`` of block ``s // block_size``; slot -1 is padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from minite_common import NVFP4Recipe, NVFP4Tensor, grouped_w4a4_linear, ops

PAD_SLOT = -1


def rotate(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    rotary_dim: int,
    base: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's rotary embedding (NeoX layout) of ``query`` / ``key`` [T, heads * head_size] at
    ``positions`` [T]: :func:`ops.rope_cos_sin` + :func:`ops.apply_rope`, one row per token."""
    cos, sin = ops.rope_cos_sin(positions.reshape(-1), rotary_dim, base)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [T, 1, rotary_dim/2]

    def apply(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(x.shape[0], -1, head_size)
        return ops.apply_rope(heads, cos, sin).reshape(x.shape)

    return apply(query), None if key is None else apply(key)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key and value views ``[blocks, kv_heads, block_size, d]`` of a layer's cache."""
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    head_size: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Copy each token's ``key`` [T, Hk, D] and ``value`` [T, Hk, Dv] (bits unchanged) into its
    cache slot; rows past ``slot_mapping`` and slots -1 are skipped."""
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)
    n = min(slot_mapping.shape[0], key.shape[0])
    slots = slot_mapping[:n].long()
    keep = slots != PAD_SLOT
    slots = slots[keep]
    block_size = kv_cache.shape[2]
    block, offset = slots // block_size, slots % block_size
    key_cache[block, :, offset] = key[:n][keep].to(kv_cache.dtype)
    value_cache[block, :, offset] = value[:n][keep].to(kv_cache.dtype)


def cached_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    head_size: int,
    block_table: torch.Tensor,
    query_starts: Sequence[int],
    seq_lens: Sequence[int],
    scale: float,
    output: torch.Tensor,
) -> torch.Tensor:
    """Request ``i``'s queries (rows ``query_starts[i]:query_starts[i+1]`` of ``query`` [T, H, D])
    against its keys ``0..seq_lens[i]-1`` read from the cache through ``block_table[i]``, with
    :func:`ops.paged_attention` (chunked prefill and decode alike), written into ``output``
    [T, H, Dv]; rows past ``query_starts[-1]`` (padding) are left alone."""
    key_cache, value_cache = split_kv_cache(kv_cache, head_size)
    rows = int(query_starts[-1])
    if rows:
        output[:rows] = ops.paged_attention(
            query[:rows],
            key_cache.transpose(1, 2),  # [blocks, block_size, Hk, D] views
            value_cache.transpose(1, 2),
            block_table,
            query_starts,
            seq_lens,
            scale,
        )
    return output


def routed_experts(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    w13: NVFP4Tensor,
    down: Callable[[torch.Tensor, list[int]], torch.Tensor],
    num_experts: int,
    recipe: NVFP4Recipe,
) -> torch.Tensor:
    """Strict routed experts of ``x`` [T, H]: :func:`ops.topk_routing` of ``router_logits``, each
    (token, expert) row through the experts' stacked gate/up weight ``w13``
    (:func:`grouped_w4a4_linear`), :func:`ops.swiglu`, ``down(act, group_sizes)`` (the experts'
    down GEMM), then :func:`ops.moe_combine` in slot order."""
    tokens, hidden = x.shape
    if tokens == 0:
        return x.new_zeros(0, hidden)
    weights, ids = ops.topk_routing(router_logits, top_k, renormalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    group_sizes = torch.bincount(flat, minlength=num_experts).tolist()
    rows = x.index_select(0, order // top_k)
    gate_up = grouped_w4a4_linear(rows, w13, group_sizes, recipe=recipe)
    act = ops.swiglu(gate_up)
    out = down(act, group_sizes)
    per_slot = torch.empty_like(out)
    per_slot[order] = out
    return ops.moe_combine(per_slot.view(tokens, top_k, out.shape[-1]), weights)
