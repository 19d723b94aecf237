"""GPU tests of the TP-invariant row-parallel reduction (``minite_common.parallel``, issue 14).

One GPU: the fold-chunk partials of K shards that start on 512-element boundaries, concatenated in
shard order and folded, equal the unsharded ``nvfp4_gemm`` bitwise (every M, TP degree, bias,
output dtype). Two GPUs (NCCL, skipped with fewer): ``w4a4_linear(..., tp_group=)`` and the
grouped experts' GEMM on each rank's K slice equal the TP=1 result bitwise on every rank.

Needs the kernels' ``minite_kernels.nvfp4_gemm_partials`` / ``fold_partials`` entry points.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import minite_kernels
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minite_common import (
    DEFAULT_RECIPE,
    grouped_w4a4_linear,
    nvfp4_gemm,
    quantize_nvfp4,
    quantize_weight,
    w4a4_linear,
)
from minite_common import parallel as tp
from minite_common.nvfp4 import NVFP4Tensor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not hasattr(minite_kernels, "nvfp4_gemm_partials"),
        reason="minite_kernels has no nvfp4_gemm_partials / fold_partials yet",
    ),
]

RECIPE = dataclasses.replace(DEFAULT_RECIPE, tp_invariant=True)


def _k_slice(t: NVFP4Tensor, start: int, length: int) -> NVFP4Tensor:
    """Columns ``start:start+length`` of ``t`` (whole 16-blocks): what a rank holds."""
    return dataclasses.replace(
        t,
        codes=t.codes[:, start // 2 : (start + length) // 2].contiguous(),
        scales=t.scales[:, start // 16 : (start + length) // 16].contiguous(),
        shape=torch.Size((t.rows, length)),
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("m", [1, 7, 64, 300, 1024])
def test_partials_of_512_aligned_shards_fold_to_the_unsharded_gemm(m):
    k, n = 4096, 384
    g = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=g) / torch.rand(m, k, generator=g).pow(2)).cuda()
    a = quantize_nvfp4(x)
    w = quantize_weight((torch.randn(n, k, generator=g) * 0.02).bfloat16().cuda(), recipe=RECIPE)
    bias = torch.randn(n, generator=g).bfloat16().cuda()
    whole = tp.gemm_partials(a, w)
    assert whole.dtype == torch.float32 and tuple(whole.shape) == (k // 512, m, n)
    assert tp.tp_invariant_degrees(k, "cuda") == [1, 2, 4, 8]
    for degree in (1, 2, 4, 8):
        size = k // degree
        parts = torch.cat(
            [tp.gemm_partials(_k_slice(a, r * size, size), _k_slice(w, r * size, size))
             for r in range(degree)]
        )  # fmt: skip
        assert torch.equal(parts, whole), degree
        for b in (None, bias):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                want = nvfp4_gemm(a, w, b, out_dtype=dtype)
                got = tp.finish_partials(parts, a.decode_scale, w.decode_scale, b, dtype)
                assert torch.equal(_bits(got), _bits(want)), (degree, b is None, dtype)


def _two_gpu_worker(rank: int, world: int, init_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        for m, k, n in ((1, 2048, 256), (33, 4096, 512), (600, 8192, 128)):
            g = torch.Generator().manual_seed(m)
            x = torch.randn(m, k, generator=g).bfloat16().cuda()
            weight = (torch.randn(n, k, generator=g) * 0.02).bfloat16().cuda()
            bias = torch.randn(n, generator=g).bfloat16().cuda()
            cols = slice(rank * k // world, (rank + 1) * k // world)
            full = quantize_weight(weight, recipe=RECIPE)
            (shard,) = tp.quantize_weight_shards([("w", weight[:, cols].contiguous())], RECIPE,
                                                 group)  # fmt: skip
            for b in (None, bias):
                want = w4a4_linear(x, full, b, recipe=RECIPE)
                got = w4a4_linear(x[:, cols], shard, b, recipe=RECIPE, tp_group=group)
                assert torch.equal(_bits(got), _bits(want)), (rank, m, k, n)
            experts = torch.cat([weight, weight.flip(0)])
            sizes = [m // 3, m - m // 3]
            want = grouped_w4a4_linear(x, quantize_weight(experts, recipe=RECIPE), sizes,
                                       recipe=RECIPE)  # fmt: skip
            (stack,) = tp.quantize_weight_shards([("e", experts[:, cols].contiguous())], RECIPE,
                                                 group)  # fmt: skip
            got = grouped_w4a4_linear(x[:, cols], stack, sizes, recipe=RECIPE, tp_group=group)
            assert torch.equal(_bits(got), _bits(want)), (rank, "grouped", m)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_row_parallel_linear_equals_tp1():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_two_gpu_worker, args=(2, f"{tmp}/rdv"), nprocs=2,
                           start_method="spawn")  # fmt: skip
