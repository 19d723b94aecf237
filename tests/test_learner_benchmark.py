"""The learner benchmark's grouped BF16 experts baseline (``benchmarks/learner.py``,
``BF16GroupedMLP``) against Megatron's ``SequentialMLP`` in a real one-layer Megatron-Core MoE
``TransformerLayer`` on CPU: the same initial weights, the same outputs and gradients (the
grouped GEMMs sum in another order, so within BF16 rounding), and a group with no tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

pytestmark = pytest.mark.usefixtures("megatron_world")


def _run(variant: str):
    import learner

    shape = learner.TINY["moe"]
    layer, config = learner.build_layer(shape, variant, "sdpa", torch.device("cpu"))
    runner = learner.Runner(layer, config, shape, 32, 2, torch.device("cpu"))
    out = layer(hidden_states=runner.hidden, attention_mask=runner.mask, rotary_pos_emb=runner.rope)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(runner.grad)
    return layer, out.detach(), runner.hidden.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_grouped_bf16_experts_match_sequential_mlp() -> None:
    seq_layer, seq_out, seq_dx = _run("bf16")
    grp_layer, grp_out, grp_dx = _run("bf16_grouped")
    experts = seq_layer.mlp.experts.local_experts
    grouped = grp_layer.mlp.experts
    for name in ("linear_fc1", "linear_fc2"):
        stacked = torch.stack([getattr(e, name).weight for e in experts])
        assert torch.equal(stacked, getattr(grouped, name).weight)
        grads = torch.stack([getattr(e, name).weight.grad for e in experts])
        assert _rel(getattr(grouped, name).weight.grad, grads) < 1e-2
    assert _rel(grp_out, seq_out) < 1e-2
    assert _rel(grp_dx, seq_dx) < 1e-2


def test_grouped_bf16_experts_empty_group() -> None:
    """An expert with no tokens: zero weight gradient, the others' rows as one expert each."""
    import learner

    _, config = learner.build_layer(
        learner.TINY["moe"], "bf16_grouped", "sdpa", torch.device("cpu")
    )
    mlp = learner.BF16GroupedMLP(3, config).to(torch.bfloat16)
    x = torch.randn(5, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(5)
    y, _ = mlp(x, torch.tensor([2, 0, 3]), probs)
    y.backward(torch.ones_like(y))
    assert torch.count_nonzero(mlp.linear_fc1.weight.grad[1]) == 0
    w1, w2 = mlp.linear_fc1.weight, mlp.linear_fc2.weight
    for e, rows in ((0, slice(0, 2)), (2, slice(2, 5))):
        gate, up = (x[rows] @ w1[e].t()).chunk(2, dim=-1)
        act = ((torch.nn.functional.silu(gate) * up) * probs[rows, None]).to(torch.bfloat16)
        assert _rel(y[rows].detach(), act @ w2[e].t()) < 1e-2
