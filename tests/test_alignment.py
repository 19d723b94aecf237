"""Cross-engine alignment with the real engines: vLLM (``--quantization minite``) samples and
Megatron-Core (miniTE spec) scores the same tokens from the same BF16 checkpoint."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from minite.alignment import (
    SETUPS,
    build_learner,
    four_setup_table,
    four_setups,
    layer_alignment,
    learner_logprobs,
    sample,
    start_sampler,
    stop_sampler,
)
from minite_common import DEFAULT_RECIPE
from minite_common.diagnostics import logprob_mismatch, write_logprob_file
from minite_megatron import export_hf_weights
from minite_megatron.capture import hf_linears, select_columns
from minite_vllm import unpack_weights

PROMPT_IDS = list(b"The quick brown fox jumps over the lazy dog 12+34=")


@pytest.fixture(scope="module", params=["dense", "moe"])
def engines(request, tiny_dense_dir, tiny_moe_dir):
    model_dir = tiny_dense_dir if request.param == "dense" else tiny_moe_dir
    llm = start_sampler(model_dir)
    learner = build_learner(model_dir, nvfp4=True)
    yield request.param, llm, learner
    stop_sampler(llm)


def test_every_nvfp4_linear_agrees_bitwise_given_the_same_input(engines):
    kind, llm, learner = engines
    comparison, fingerprint_diff, sampler = layer_alignment(llm, learner, PROMPT_IDS)
    assert fingerprint_diff == []
    checked = 0
    for module, columns in hf_linears(learner).values():
        for name, where in columns.items():
            if DEFAULT_RECIPE.keeps_bf16(name) or ".experts." in name:
                continue  # experts: vLLM runs them fused; their weights are checked bitwise below
            x = sampler[f"{name}:input"]
            with torch.no_grad():
                out = module(x.unsqueeze(1))[0].squeeze(1)
            assert torch.equal(select_columns(out, where), sampler[f"{name}:output"]), name
            checked += 1
    assert checked >= 8  # q, k, v, o per layer (+ gate, up, down for the dense model)
    # The captures agree up to the first op that the engines compute differently.
    assert comparison.rows[0]["bitwise_equal"]
    assert comparison.first_divergent is None or comparison.first_divergent.endswith(":input")


def test_sampler_holds_the_learners_quantized_weights_bitwise(engines):
    kind, llm, learner = engines
    learner_q = dict(export_hf_weights(learner, quantized=True))
    sampler_q = unpack_weights(llm.collective_rpc("get_quantized_weights")[0])
    assert set(sampler_q) <= set(learner_q)
    experts = [n for n in sampler_q if ".experts." in n]
    assert (kind == "moe") == bool(experts)
    for name, tensor in sampler_q.items():
        other = learner_q[name]
        assert tensor.dtype == other.dtype and torch.equal(
            tensor.reshape(-1).view(torch.uint8), other.reshape(-1).view(torch.uint8)
        ), name


def test_sampled_logprobs_scored_by_the_learner(engines, tmp_path):
    kind, llm, learner = engines
    prompts = [PROMPT_IDS[:n] for n in (5, 12, 20, 33)]
    rollouts = sample(llm, prompts, n=2, max_tokens=8, seed=1)
    lp = learner_logprobs(learner, rollouts.prompts, rollouts.completions)
    report = logprob_mismatch(rollouts.logprobs, lp, sampler_fingerprint=rollouts.fingerprint,
                              learner_fingerprint=DEFAULT_RECIPE.fingerprint())  # fmt: skip
    s = report.summary
    assert s["tokens"] == sum(len(c) for c in rollouts.completions) > 0
    assert all(math.isfinite(v) for v in s.values())
    assert 1.0 <= s["token_mult_prob_error"] < 1.5
    # The same figures through the files a user dumps and the CLI.
    tokens = [p + c for p, c in zip(rollouts.prompts, rollouts.completions, strict=True)]
    write_logprob_file(tmp_path / "s.jsonl", rollouts.completions, rollouts.logprobs,
                       fingerprint=rollouts.fingerprint, vocab_size=272, engine="vllm")  # fmt: skip
    write_logprob_file(tmp_path / "l.jsonl", rollouts.completions, lp,
                       fingerprint=DEFAULT_RECIPE.fingerprint(), vocab_size=272)  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "minite.cli", "diagnose", "logprobs", str(tmp_path / "s.jsonl"),
         str(tmp_path / "l.jsonl"), "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"{s['token_mult_prob_error']:14.6g}" in out.stdout
    assert (tmp_path / "r.json").exists() and len(tokens) == len(lp)


def test_four_setups_rank_as_the_mission_says(tiny_dense_dir):
    prompts = [list(f"{a}+{b}=".encode()) for a, b in ((1, 2), (13, 4), (7, 8), (22, 19))]
    reports = four_setups(tiny_dense_dir, prompts, n=4, max_tokens=12)
    err = {k: r.summary["token_mult_prob_error"] for k, r in reports.items()}
    print(four_setup_table(reports))
    assert set(err) == set(SETUPS)
    assert all(math.isfinite(v) and v >= 1.0 for v in err.values())
    assert err["c"] < err["b"] and err["c"] < err["d"]  # aligned NVFP4 beats both usual setups
    assert err["a"] <= err["c"]
