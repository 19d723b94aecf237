"""TP-invariance in the real engines: vLLM samplers at TP=1 and 2 and Megatron learners at TP=1, 2
and 4 (gloo) agree bitwise in strict mode; with the ``tp_invariant`` recipe (not strict) every
row-parallel NVFP4 linear of the learner gives the TP=1 output bitwise."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from minite.alignment import (
    STRICT_RECIPE,
    learner_logprobs_tp,
    sample,
    start_sampler,
    stop_sampler,
)
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import DEFAULT_RECIPE, quantize_weight, w4a4_linear
from minite_common.diagnostics import logprob_mismatch
from tests.tp_workers import run_ranks

PROMPTS = [list(f"{a}+{b}=".encode()) for a, b in ((1, 2), (13, 4), (7, 8), (22, 19))]
TP_INVARIANT = dataclasses.replace(DEFAULT_RECIPE, tp_invariant=True)


@pytest.fixture(scope="module")
def tp4_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE whose 4 KV heads allow TP=4 in Megatron: its row-parallel layers are
    o_proj and the routed experts' down_proj (expert TP)."""
    path = tmp_path_factory.mktemp("tiny_tp4")
    return write_tiny_model(path, TinyModelSpec(moe=True, num_kv_heads=4), seed=3)


def _f32_bits(values: list[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float32).view(torch.int32)


def test_strict_logprobs_do_not_depend_on_either_engines_tp_degree(tp4_moe_dir):
    """Strict mode, MoE model: the vLLM sampler at TP=2 samples the same tokens with the same
    log-probs as at TP=1, and Megatron learners at TP=1, 2 and 4 (expert TP alike) score them
    with bitwise those log-probs (token multiplicative probability error exactly 1)."""
    rollouts = {}
    for tp in (1, 2):
        llm = start_sampler(tp4_moe_dir, recipe=STRICT_RECIPE, tensor_parallel_size=tp)
        try:
            rollouts[tp] = sample(llm, PROMPTS, n=2, max_tokens=8, seed=1)
        finally:
            stop_sampler(llm)
    one, two = rollouts[1], rollouts[2]
    assert one.completions == two.completions
    assert all(torch.equal(_f32_bits(a), _f32_bits(b))
               for a, b in zip(one.logprobs, two.logprobs, strict=True))  # fmt: skip
    for tp in (1, 2, 4):
        learner = learner_logprobs_tp(
            tp4_moe_dir, two.prompts, two.completions, tp=tp, recipe=STRICT_RECIPE
        )
        for s, lp in zip(two.logprobs, learner, strict=True):
            assert torch.equal(_f32_bits(s), _f32_bits(lp)), tp
        report = logprob_mismatch(two.logprobs, learner, sampler_fingerprint=two.fingerprint,
                                  learner_fingerprint=STRICT_RECIPE.fingerprint())  # fmt: skip
        assert report.summary["token_mult_prob_error"] == 1.0
        assert report.summary["frac_bitwise_equal"] == 1.0


def _row_parallel_worker(rank: int, world: int, hf_dirs: list[str]) -> None:
    from minite_megatron import build_gpt_model_from_hf
    from minite_megatron.hf import HFCheckpoint, weight_bindings
    from minite_megatron.linear import MiniTERowParallelLinear

    try:
        for hf_dir in hf_dirs:
            model = build_gpt_model_from_hf(hf_dir, recipe=TP_INVARIANT, tensor_parallel_size=world)
            ckpt = HFCheckpoint(Path(hf_dir))
            x = torch.randn(3, 2, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
            x[0, 1, 5] = float("inf")  # a non-finite row: NaN on every rank, as at TP=1
            checked = 0
            for b in weight_bindings(model):
                module = b.module
                if not isinstance(module, MiniTERowParallelLinear):
                    continue
                k = module.input_size_per_partition
                with torch.no_grad():
                    y = module(x[..., rank * k : (rank + 1) * k])[0]
                if module.explicit_expert_comm:  # experts leave the sum to the token dispatcher
                    dist.all_reduce(y, group=module.tp_group)
                full = quantize_weight(ckpt.read(b.hf_names["weight"]), recipe=TP_INVARIANT)
                want = w4a4_linear(x[..., : module.input_size], full, recipe=TP_INVARIANT)
                assert torch.equal(y.isnan(), want.isnan()), b.hf_names
                assert torch.equal(y.nan_to_num().view(torch.int16),
                                   want.nan_to_num().view(torch.int16)), b.hf_names  # fmt: skip
                checked += 1
            assert checked >= 2 * model.config.num_layers, checked
    finally:
        parallel_state.destroy_model_parallel()


def test_tp_invariant_recipe_row_parallel_linears_equal_tp1(tiny_dense_dir, tiny_moe_dir, tmp_path):
    """With ``NVFP4Recipe(tp_invariant=True)`` (default ops), every row-parallel NVFP4 linear of
    a TP=2 Megatron learner (o_proj, down_proj, the experts' down_proj under expert TP) gives on
    every rank bitwise ``w4a4_linear`` of the whole input and HF weight."""
    run_ranks(_row_parallel_worker, 2, tmp_path, [str(tiny_dense_dir), str(tiny_moe_dir)])
