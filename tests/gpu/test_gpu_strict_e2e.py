"""GPU end-to-end test of strict mode (issue 16, part 3): sampled sequences score bitwise equal in
the strict Megatron-Core learner on the GPU.

vLLM's CUDA build cannot be installed on the GPU machine, so the sampler side is
:class:`minite.strict_sampler.StrictSampler`: it stands in for vLLM's scheduler, model runner,
Qwen3 model code and sampler, and runs the strict adapters' own op calls (``minite_vllm``'s
vLLM-free ``strict_forward`` bodies and the ``minite_common`` calls of the strict custom ops, LM
head and linear methods) on CUDA tensors, i.e. miniTE's Triton kernels.
(``tests/test_strict_alignment.py`` checks on the CPU that this driver gives the real vLLM
engine's bits; ``tests/test_strict_sampler.py`` runs this test small on the CPU.)

Per model (tiny dense Qwen3, tiny Qwen3-MoE): 256 requests with prompts of 1 to 96 tokens, each
sampling 256 tokens at temperature 1. The first request runs alone, the others join over about
100 steps (all 256 run at once at the peak), the last one runs alone at the end; prompts are
prefilled in chunks of at most 32 tokens next to other requests' decode steps, in a paged KV cache
of 4800 16-token blocks handed out in random order (filled with random values beforehand; the
requests need 5011 in all, so blocks of finished requests are handed out again). The
learner is ``build_gpt_model_from_hf(model_dir, recipe=strict)`` on the GPU, scoring with
``token_logprobs`` (through ``minite.alignment.learner_logprobs``, 64 right-padded sequences a
batch); every sampled token's log-prob must be bitwise the sampler's.
"""

from __future__ import annotations

import time

import pytest
import torch

pytest.importorskip("megatron.core", reason="needs Megatron-Core")

from minite.alignment import STRICT_RECIPE, learner_logprobs  # noqa: E402
from minite.strict_sampler import StrictSampler  # noqa: E402
from minite_common.diagnostics import logprob_mismatch  # noqa: E402

pytestmark = pytest.mark.gpu

SEQUENCES = 256
MAX_TOKENS = 256


def _workload(seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of 1 to 96 random bytes, and arrival steps: request 0 at step 0, the next 254 four
    a step from step 3, the last at step 100."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 97, (SEQUENCES,), generator=g).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    arrivals = [0] + [3 + i // 4 for i in range(SEQUENCES - 2)] + [100]
    return prompts, arrivals


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gpu_strict_sampler_and_learner_logprobs_are_bitwise_equal(
    kind, tiny_dense_dir, tiny_moe_dir, megatron_world
):
    from minite_megatron import build_gpt_model_from_hf

    model_dir = tiny_dense_dir if kind == "dense" else tiny_moe_dir
    prompts, arrivals = _workload(seed=1)
    start = time.perf_counter()
    sampler = StrictSampler(model_dir, STRICT_RECIPE, device="cuda", block_size=16,
                            num_blocks=4800, max_num_seqs=SEQUENCES, max_num_batched_tokens=512,
                            max_prefill_chunk=32)  # fmt: skip
    seqs, trace = sampler.generate(prompts, MAX_TOKENS, arrivals=arrivals, seed=2)
    torch.cuda.synchronize()
    sampled = time.perf_counter()
    assert [len(s.completion) for s in seqs] == [MAX_TOKENS] * SEQUENCES
    assert trace.running[0] == 1 and trace.running[-1] == 1
    assert max(trace.running) == SEQUENCES
    assert max(trace.prefill_chunks) >= 3 and trace.mixed_steps and trace.reused_blocks

    learner = build_gpt_model_from_hf(model_dir, recipe=STRICT_RECIPE)
    scores = learner_logprobs(learner, [s.prompt for s in seqs], [s.completion for s in seqs])
    torch.cuda.synchronize()
    report = logprob_mismatch([s.logprobs.tolist() for s in seqs], [t.tolist() for t in scores])
    print(
        f"\n{kind}: {SEQUENCES} sequences x {MAX_TOKENS} tokens, {len(trace.running)} steps, "
        f"sampler {sampled - start:.1f} s, learner {time.perf_counter() - sampled:.1f} s, "
        f"frac_bitwise_equal {report.summary['frac_bitwise_equal']}, "
        f"max_abs_diff {report.summary['max_abs_diff']:.3g}"
    )
    for i, (s, lp) in enumerate(zip(seqs, scores, strict=True)):
        assert torch.equal(s.logprobs, lp), (i, report.summary)
