"""How an existing RL loop adopts miniTE: four touch points, shown on one GRPO-style step.

1. Learner: build the Megatron model with miniTE's spec (one call in the model provider).
2. Sampler: start vLLM with ``quantization="minite"`` and miniTE's worker extension.
3. Weight sync: after each optimizer step, stream the learner's NVFP4 tensors into vLLM over a
   collective group (set up once), all-or-nothing.
4. Diagnostics: compare the sampler's and the learner's log-probs of the rollout tokens.

Run it (CPU, about a minute): ``python examples/adopt_minite.py``. Your own trainer replaces the
toy reward and loss below; everything miniTE needs is marked ``# miniTE``.
"""

from __future__ import annotations

import os
import tempfile

for key, value in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                   "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}.items():  # fmt: skip
    os.environ.setdefault(key, value)  # vLLM's CPU build (see the README)


def main() -> None:
    import torch
    from megatron.core.models.gpt.gpt_model import GPTModel
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    import minite_megatron as mm
    from minite.tiny_model import write_tiny_model
    from minite_common.diagnostics import logprob_mismatch
    from minite_vllm import WORKER_EXTENSION
    from minite_vllm.sync import connect_weight_sync, sync_weights

    model_dir = write_tiny_model(tempfile.mkdtemp(prefix="adopt-minite-"))  # your checkpoint

    # 1. Learner: your model provider, with miniTE's spec instead of Megatron's.     # miniTE
    mm.init_megatron()  # (your launcher already set up torch.distributed and model parallelism)
    hf_config = AutoConfig.from_pretrained(model_dir)
    config = mm.transformer_config_from_hf(hf_config)
    spec = mm.get_gpt_decoder_block_minite_spec(config)  # <- the one-line switch     # miniTE
    model = GPTModel(config, spec, **mm.gpt_model_kwargs_from_hf(hf_config)).to(torch.bfloat16)
    mm.load_hf_weights(model, model_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)

    # 2. Sampler: vLLM with miniTE's quantization (CLI: vllm serve DIR --quantization minite).
    llm = LLM(
        str(model_dir),
        quantization="minite",  # miniTE
        worker_extension_cls=WORKER_EXTENSION,  # miniTE
        enforce_eager=True, dtype="bfloat16", max_model_len=256, seed=0,
    )  # fmt: skip

    prompt = list(b"2+2=")
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=4, max_tokens=6, logprobs=0, seed=0))[0]  # fmt: skip
    completions = [list(c.token_ids) for c in out.outputs]
    sampler_lp = [[lp[t].logprob for t, lp in zip(c, o.logprobs, strict=True)]
                  for c, o in zip(completions, out.outputs, strict=True)]  # fmt: skip

    # Learner log-probs of the same tokens, and a toy policy-gradient step.
    rewards = torch.tensor([float(b"4" in bytes(c)) for c in completions])
    learner_lp = []
    loss = torch.zeros(())
    for c, r in zip(completions, rewards, strict=True):
        ids = torch.tensor([prompt + c])
        lp = mm.token_logprobs(model, ids)[0, len(prompt) - 1 :]
        learner_lp.append(lp.detach())
        loss = loss - (r - rewards.mean()) * lp.sum()
    loss.backward()
    optimizer.step()

    # 4. Diagnostics: how far is the learner from the sampler on these tokens?       # miniTE
    report = logprob_mismatch(sampler_lp, learner_lp)
    print(report.table())

    # 3. Weight sync: stream the learner's own NVFP4 tensors into vLLM over a collective group,
    #    in fixed-size buckets, all-or-nothing (set the group up once; gloo here, NCCL on GPUs).
    #    sync_weights also resets vLLM's prefix cache (its K/V came from the old weights).
    connect_weight_sync(llm)  # miniTE
    fingerprint = mm.hf_quantization_config(model)["fingerprint"]
    stats = sync_weights(llm, mm.export_hf_weights(model, quantized=True),  # miniTE
                         recipe_fingerprint=fingerprint)  # fmt: skip
    print(f"weights pushed ({stats.payload_bytes} bytes in {stats.buckets} buckets); "
          "the next rollout samples from the updated policy")  # fmt: skip


if __name__ == "__main__":
    main()
