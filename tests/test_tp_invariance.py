"""TP-invariant row-parallel linears (``minite_common.parallel``): the deterministic reduction of
the ranks' partial accumulators gives the TP=1 output bitwise, on spawned gloo ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from minite_common import (
    DEFAULT_RECIPE,
    grouped_w4a4_linear,
    quantize_weight,
    w4a4_linear,
    w4a4_linear_train,
)
from minite_common import parallel as tp
from tests.tp_workers import run_ranks

R = dataclasses.replace(DEFAULT_RECIPE, tp_invariant=True)  # TP-invariant, not strict


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _inputs(m: int, k: int, seed: int) -> torch.Tensor:
    """Normal rows plus edge cases: an all-zero row, a heavy-tailed row, a NaN row, a tiny row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    if m >= 4:
        x[0] = 0
        x[1] = torch.randn(k, generator=g) ** 5 * 100
        x[2, 7] = float("nan")
        x[3] *= 1e-30
    return x.bfloat16()


def _primitive_worker(rank: int, world: int) -> None:
    group = dist.group.WORLD
    differs = 0
    for seed, (m, k, n) in enumerate(((1, 1024, 48), (3, 2048, 32), (17, 512 * world, 64),
                                      (64, 4096, 16))):  # fmt: skip
        g = torch.Generator().manual_seed(100 + seed)
        weight = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
        bias = torch.randn(n, generator=g).bfloat16()
        x = _inputs(m, k, seed)
        cols = slice(rank * k // world, (rank + 1) * k // world)
        full = quantize_weight(weight, recipe=R)
        (shard,) = tp.quantize_weight_shards([("w", weight[:, cols].contiguous())], R, group)
        assert torch.equal(shard.codes, full.codes[:, cols.start // 2 : cols.stop // 2])
        assert torch.equal(shard.decode_scale, full.decode_scale)
        for b in (None, bias):
            want = w4a4_linear(x, full, b, recipe=R)
            got = w4a4_linear(x[:, cols], shard, b, recipe=R, tp_group=group)
            assert torch.equal(_bits(got), _bits(want)), (world, m, k, n)
        # The plain reduction (BF16 partial outputs all-reduced) for comparison.
        plain = w4a4_linear(x[:, cols], shard, recipe=R, row_amax=tp.tp_row_amax(x[:, cols], group))
        dist.all_reduce(plain, group=group)
        differs += int((_bits(plain) != _bits(w4a4_linear(x, full, recipe=R))).sum())
        # Grouped experts: three experts, one of them without tokens.
        experts = torch.cat([weight, weight.flip(0), weight * 3])
        stacked = quantize_weight(experts, recipe=R)  # one amax for the stack is enough here
        shard3 = tp.quantize_weight_shards([("e", experts[:, cols].contiguous())],
                                           R, group)[0]  # fmt: skip
        sizes = [m, 0, min(m, 2)]
        xg = torch.cat([x, x[:2]])
        want = grouped_w4a4_linear(xg, stacked, sizes, recipe=R)
        got = grouped_w4a4_linear(xg[:, cols], shard3, sizes, recipe=R, tp_group=group)
        assert torch.equal(_bits(got), _bits(want))
        # Learner: same forward bits, gradient to this rank's slice as through an all-reduce.
        xs = x[:, cols].float().nan_to_num().bfloat16().requires_grad_()
        master = weight[:, cols].clone().requires_grad_()
        y = w4a4_linear_train(xs, master, shard, recipe=R, tp_group=group)
        whole = x.float().nan_to_num().bfloat16()
        assert torch.equal(_bits(y), _bits(w4a4_linear(whole, full, recipe=R)))
        y.float().square().sum().backward()
        assert xs.grad is not None and master.grad is not None
    if rank == 0:
        print(f"TP={world}: plain all-reduce differs from TP=1 in {differs} outputs")
    # -0.0 on the other ranks: a SUM all-reduce returns rank 0's tensor bitwise (NaN stays NaN;
    # gloo's BF16 sum canonicalizes a NaN's payload).
    for dtype in (torch.bfloat16, torch.float32):
        y = torch.tensor([1.5, -0.0, 0.0, float("nan"), -3e-38, float("inf"), -7e-45]).to(dtype)
        handed = tp.first_rank_only(y if rank == 0 else y * 7, group)
        dist.all_reduce(handed, group=group)
        assert torch.equal(handed.isnan(), y.isnan())
        assert torch.equal(_bits(handed)[~y.isnan()], _bits(y)[~y.isnan()])


@pytest.mark.parametrize("world", [2, 4])
def test_row_parallel_combine_equals_tp1(world, tmp_path):
    """At TP=2 and 4 (gloo), row-parallel W4A4 outputs (with and without bias, 1-64 rows,
    zero/heavy-tailed/NaN/tiny rows), grouped experts and the learner's forward equal TP=1
    bitwise; weight shards quantized with the MAX-reduced amax are the full tensor's tiles;
    ``first_rank_only`` survives an all-reduce bitwise."""
    run_ranks(_primitive_worker, world, tmp_path)


def test_supported_degrees_and_clear_errors(monkeypatch):
    """CPU: any K slice of whole 16-blocks; Hopper: slices of whole 512-element fold chunks;
    other GPUs: refused. Errors name the layer, K, TP and the supported degrees."""
    assert tp.tp_invariant_degrees(1024, "cpu") == [1, 2, 4, 8, 16, 32, 64]
    tp.check_tp_split(48, 2, "cpu", "layers.0.o_proj")
    monkeypatch.setattr(tp, "kernel_arch", lambda device: "sm90")
    assert tp.tp_invariant_degrees(2048, "cuda") == [1, 2, 4]
    if not hasattr(tp.minite_kernels, "fold_partials"):
        with pytest.raises(NotImplementedError, match="layers.0.o_proj.*fold_partials"):
            tp.check_tp_split(1024, 2, "cuda", "layers.0.o_proj")
        monkeypatch.setattr(tp.minite_kernels, "fold_partials", None, raising=False)
    tp.check_tp_split(1024, 2, "cuda", "layers.0.o_proj")
    with pytest.raises(ValueError, match=r"layers.0.o_proj.*K=1536 at TP=2.*\[1, 3\]"):
        tp.check_tp_split(768, 2, "cuda", "layers.0.o_proj")
    monkeypatch.setattr(tp, "kernel_arch", lambda device: "sm100")
    with pytest.raises(NotImplementedError, match="sm100"):
        tp.check_tp_split(1024, 2, "cuda", "x")


def test_one_rank_is_the_plain_linear():
    x = _inputs(5, 256, 0)
    w = quantize_weight(torch.randn(32, 256).bfloat16())
    assert tp.tp_row_amax(x, None) is None
    assert torch.equal(_bits(w4a4_linear(x, w, tp_group=None)), _bits(w4a4_linear(x, w)))
