"""The strict sampler driver (``minite.strict_sampler``) on the CPU: what the GPU end-to-end test
(``tests/gpu/test_gpu_strict_e2e.py``) runs, small. Sequences sampled with chunked prefill, a
paged KV cache in shuffled and reused blocks, and requests joining and leaving the batch score
bitwise equal in the strict Megatron-Core learner. (``tests/test_strict_alignment.py`` checks the
driver against the real vLLM engine on the same tokens.)"""

from __future__ import annotations

import pytest
import torch

from minite.alignment import STRICT_RECIPE, learner_logprobs
from minite.strict_sampler import StrictSampler
from minite_common.diagnostics import logprob_mismatch

PROMPTS = [
    list(b"hi"),
    list(b"The quick brown fox jumps"),
    list(b"1+2="),
    list(b"abcdefghijklmnopq"),
]


def test_strict_sampler_logprobs_equal_the_megatron_learners(hf_dir, megatron_world):
    from minite_megatron import build_gpt_model_from_hf

    # 3 sequences at most, 8-token prompt chunks, 16 tokens per step, 30 blocks of 4 tokens
    # (the 4 sequences need 39 blocks in all: blocks of finished sequences are reused)
    sampler = StrictSampler(hf_dir, STRICT_RECIPE, block_size=4, num_blocks=30, max_num_seqs=3,
                            max_num_batched_tokens=16, max_prefill_chunk=8)  # fmt: skip
    seqs, trace = sampler.generate(PROMPTS, 24, arrivals=[0, 1, 3, 9], seed=1)
    assert [len(s.completion) for s in seqs] == [24] * 4
    assert trace.running[0] == 1 and max(trace.running) == 3 and trace.running[-1] == 1
    assert max(trace.prefill_chunks) >= 3 and trace.mixed_steps and trace.reused_blocks

    learner = build_gpt_model_from_hf(hf_dir, recipe=STRICT_RECIPE)
    scores = learner_logprobs(learner, [s.prompt for s in seqs], [s.completion for s in seqs])
    report = logprob_mismatch([s.logprobs.tolist() for s in seqs], [t.tolist() for t in scores])
    for s, lp in zip(seqs, scores, strict=True):
        assert torch.equal(s.logprobs, lp), report.summary


def test_strict_sampler_refuses_what_it_does_not_model(tiny_dense_dir):
    from minite_common import DEFAULT_RECIPE

    with pytest.raises(ValueError, match="strict_ops=True"):
        StrictSampler(tiny_dense_dir, DEFAULT_RECIPE)
    sampler = StrictSampler(tiny_dense_dir, STRICT_RECIPE, block_size=4, num_blocks=2)
    with pytest.raises(RuntimeError, match="num_blocks"):
        sampler.generate([list(b"a long prompt")], 2)
