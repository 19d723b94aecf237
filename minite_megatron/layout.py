"""Where each Hugging Face weight's rows sit inside Megatron's fused, tensor-parallel linears.

Megatron fuses q/k/v into ``linear_qkv`` (interleaved per query group: the group's query heads,
then its key head, then its value head) and gate/up into ``linear_fc1`` (each tensor-parallel
rank holds ``[gate shard; up shard]``). A :class:`RowSegment` list says, for one rank's shard,
which contiguous rows come from which HF tensor ("part") and where. The NVFP4 linears quantize
each part with its own amax through it, and the HF loader and exporter move rows through it.
"""

from __future__ import annotations

from dataclasses import dataclass

QKV_PARTS = ("q_proj", "k_proj", "v_proj")
GATED_FC1_PARTS = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class RowSegment:
    """Rows ``[local_start, local_start + rows)`` of a rank's weight shard are rows
    ``[hf_start, hf_start + rows)`` of the HF tensor ``part``."""

    part: str
    local_start: int
    hf_start: int
    rows: int


def qkv_segments(
    num_heads: int, num_query_groups: int, head_dim: int, tp_rank: int = 0, tp_size: int = 1
) -> list[RowSegment]:
    """Segments of ``linear_qkv`` on ``tp_rank``: per query group, its q heads, its k, its v."""
    if num_heads % num_query_groups or num_query_groups % tp_size:
        raise ValueError(
            f"{num_heads} attention heads in {num_query_groups} query groups cannot be split "
            f"over tensor-parallel size {tp_size}"
        )
    q_rows = num_heads // num_query_groups * head_dim
    groups_per_rank = num_query_groups // tp_size
    segments, local = [], 0
    for group in range(tp_rank * groups_per_rank, (tp_rank + 1) * groups_per_rank):
        for part, rows, hf_start in (
            ("q_proj", q_rows, group * q_rows),
            ("k_proj", head_dim, group * head_dim),
            ("v_proj", head_dim, group * head_dim),
        ):
            segments.append(RowSegment(part, local, hf_start, rows))
            local += rows
    return segments


def gated_fc1_segments(ffn_size: int, tp_rank: int = 0, tp_size: int = 1) -> list[RowSegment]:
    """Segments of a SwiGLU ``linear_fc1`` on ``tp_rank``: its gate shard, then its up shard."""
    if ffn_size % tp_size:
        raise ValueError(f"FFN size {ffn_size} does not split over tensor-parallel size {tp_size}")
    rows = ffn_size // tp_size
    return [
        RowSegment("gate_proj", 0, tp_rank * rows, rows),
        RowSegment("up_proj", rows, tp_rank * rows, rows),
    ]


def single_segment(part: str, rows: int, tp_rank: int = 0) -> list[RowSegment]:
    """The one segment of a non-fused linear whose shard holds ``rows`` rows on ``tp_rank``."""
    return [RowSegment(part, 0, tp_rank * rows, rows)]
