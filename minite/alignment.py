"""Sampler-vs-learner alignment on one model: vLLM samples, Megatron scores the same tokens.

Used by ``minite diagnose align`` / ``minite diagnose layers``, the alignment tests and the demo.
The four setups of the alignment table:
- (a) BF16 sampler + BF16 learner;
- (b) miniTE sampler + BF16 learner (the usual "quantized rollouts");
- (c) miniTE sampler + miniTE learner;
- (d) miniTE sampler + a learner whose NVFP4 uses a per-tensor activation amax (Transformer
  Engine's choice for activations), everything else equal;
- (e) (c) in strict mode (``NVFP4Recipe(strict_ops=True)``): both engines also run the ops between
  the linears through :mod:`minite_common.ops`, so on CPU every log-prob is bitwise equal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from minite_common import DEFAULT_RECIPE, NVFP4Recipe
from minite_common.diagnostics import (
    LayerComparison,
    MismatchReport,
    compare_layer_captures,
    diff_fingerprints,
    logprob_mismatch,
)
from minite_common.weight_sync import SyncStats

#: vLLM settings for the CPU build (docs/contract.md section 10); callers may override.
VLLM_CPU_KWARGS = {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 512}

#: Environment the vLLM CPU build needs: a bounded KV cache, no thread pinning, no hub.
CPU_ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

SETUPS = {
    "a": "BF16 sampler + BF16 learner",
    "b": "miniTE sampler + BF16 learner",
    "c": "miniTE sampler + miniTE learner",
    "d": "miniTE sampler + per-tensor-activation NVFP4 learner",
    "e": "strict miniTE sampler + strict miniTE learner",
}

#: The recipe of setup (e): the default one with strict mode on.
STRICT_RECIPE = dataclasses.replace(DEFAULT_RECIPE, strict_ops=True)


@dataclasses.dataclass
class Rollouts:
    """Sampled sequences: prompt and completion token ids and the sampler's log-probs."""

    prompts: list[list[int]]
    completions: list[list[int]]
    logprobs: list[list[float]]
    fingerprint: str | None


def configure_cpu_engines() -> None:
    """Set the variables vLLM's CPU build needs (docs/contract.md section 10), unless the user
    set them."""
    import os

    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def recipe_env(recipe: NVFP4Recipe | None) -> Iterator[None]:
    """Within the block, ``MINITE_RECIPE`` names a file holding ``recipe`` (nothing when None),
    so the vLLM engines started there (and their processes) quantize with it."""
    if recipe is None:
        yield
        return
    from minite_vllm.config import RECIPE_ENV

    previous = os.environ.get(RECIPE_ENV)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.json"
        path.write_text(json.dumps(recipe.to_dict()))
        os.environ[RECIPE_ENV] = str(path)
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(RECIPE_ENV, None)
            else:
                os.environ[RECIPE_ENV] = previous


def start_sampler(
    model_dir: str | Path,
    *,
    nvfp4: bool = True,
    seed: int = 0,
    recipe: NVFP4Recipe | None = None,
    **kwargs: Any,
):
    """A vLLM ``LLM`` on ``model_dir`` (``quantization="minite"`` when ``nvfp4``, with ``recipe``
    when given; a strict one also selects miniTE's strict attention backend,
    ``attention_backend="CUSTOM"``) with miniTE's worker extension, so weight updates, captures
    and fingerprints are available."""
    configure_cpu_engines()
    from vllm import LLM

    from minite_vllm import WORKER_EXTENSION

    if recipe is not None and not nvfp4:
        raise ValueError("start_sampler: a recipe needs the miniTE sampler (nvfp4=True)")
    args = dict(VLLM_CPU_KWARGS, seed=seed, worker_extension_cls=WORKER_EXTENSION, **kwargs)
    if nvfp4:
        args["quantization"] = "minite"
    if recipe is not None and recipe.strict_ops:
        args.setdefault("attention_backend", "CUSTOM")
    with recipe_env(recipe):
        return LLM(str(model_dir), **args)


def stop_sampler(llm: Any) -> None:
    """Shut a vLLM engine down (and its weight-sync group) and free its processes."""
    from minite_vllm.sync import close_weight_sync

    close_weight_sync(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def sample(
    llm: Any,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 1,
    max_tokens: int = 16,
    temperature: float = 1.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
) -> Rollouts:
    """Sample ``n`` completions per prompt with the log-prob of every sampled token."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=n, max_tokens=max_tokens, temperature=temperature, logprobs=0, seed=seed,
        stop_token_ids=list(stop_token_ids or []),
    )  # fmt: skip
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                           use_tqdm=False)  # fmt: skip
    rollouts = Rollouts([], [], [], None)
    for prompt, out in zip(prompts, outputs, strict=True):
        for completion in out.outputs:
            ids = list(completion.token_ids)
            rollouts.prompts.append(list(prompt))
            rollouts.completions.append(ids)
            rollouts.logprobs.append([lp[t].logprob for t, lp in zip(ids, completion.logprobs,
                                                                      strict=True)])  # fmt: skip
    rollouts.fingerprint = sampler_fingerprint(llm)
    return rollouts


def sampler_fingerprint(llm: Any) -> str | None:
    """The recipe fingerprint a vLLM engine runs (None for an engine without miniTE)."""
    if llm.llm_engine.vllm_config.model_config.quantization != "minite":
        return None
    return llm.collective_rpc("get_recipe_fingerprint")[0]


def learner_logprobs(
    model: torch.nn.Module, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
    *, pad_id: int = 0, batch_size: int = 64,
) -> list[torch.Tensor]:  # fmt: skip
    """The learner's float32 log-prob of each completion token given its prefix."""
    from minite_megatron import token_logprobs

    result: list[torch.Tensor] = []
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = torch.tensor(s)
        with torch.no_grad():
            lp = token_logprobs(model, ids).float().cpu()
        for i in range(len(chunk)):
            p, c = len(prompts[start + i]), len(completions[start + i])
            result.append(lp[i, p - 1 : p - 1 + c])
    return result


def _learner_rank(
    rank: int, tp: int, init_file: str, model_dir: str, nvfp4: bool, recipe: dict[str, Any],
    prompts: list[list[int]], completions: list[list[int]], out: str,
) -> None:  # fmt: skip
    """One tensor-parallel rank of :func:`learner_logprobs_tp` (a spawned process)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from minite_megatron import build_gpt_model_from_hf

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    try:
        model = build_gpt_model_from_hf(
            model_dir, nvfp4=nvfp4, recipe=NVFP4Recipe.from_dict(recipe), tensor_parallel_size=tp
        )
        lp = learner_logprobs(model, prompts, completions)
        if rank == 0:
            torch.save(lp, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def learner_logprobs_tp(
    model_dir: str | Path, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
    *, tp: int, nvfp4: bool = True, recipe: NVFP4Recipe = DEFAULT_RECIPE,
) -> list[torch.Tensor]:  # fmt: skip
    """:func:`learner_logprobs` of a Megatron learner of ``model_dir`` at tensor parallelism
    ``tp``: ``tp`` spawned processes on one gloo group (CPU) build it and score the tokens;
    rank 0's log-probs are returned."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logprobs.pt"
        args = (tp, str(Path(tmp) / "rendezvous"), str(model_dir), nvfp4, recipe.to_dict(),
                [list(p) for p in prompts], [list(c) for c in completions], str(out))  # fmt: skip
        mp.start_processes(_learner_rank, args=args, nprocs=tp, start_method="spawn")
        return torch.load(out)


def build_learner(model_dir: str | Path, *, nvfp4: bool, recipe: NVFP4Recipe = DEFAULT_RECIPE):
    """A Megatron ``GPTModel`` of ``model_dir`` with the miniTE spec (or the BF16 local spec)."""
    from minite_megatron import build_gpt_model_from_hf

    return build_gpt_model_from_hf(model_dir, nvfp4=nvfp4, recipe=recipe)


def four_setups(
    model_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    n: int = 4,
    max_tokens: int = 16,
    seed: int = 0,
    strict: bool = True,
    setups: str = "abcde",
    sampler_tp: int = 1,
    learner_tp: int = 1,
) -> dict[str, MismatchReport]:
    """Mismatch reports of ``setups`` (default (a)-(d), and (e) when ``strict``) on
    ``model_dir`` (see the module docstring), with the vLLM sampler at tensor parallelism
    ``sampler_tp`` and the Megatron learner at ``learner_tp`` (spawned gloo ranks when > 1)."""
    per_tensor = dataclasses.replace(DEFAULT_RECIPE, activation_amax="tensor")
    learners = {
        "a": ("bf16", False, DEFAULT_RECIPE),
        "b": ("minite", False, DEFAULT_RECIPE),
        "c": ("minite", True, DEFAULT_RECIPE),
        "d": ("minite", True, per_tensor),
        "e": ("strict", True, STRICT_RECIPE),
    }
    unknown = sorted(set(setups) - set(learners))
    if unknown:
        raise ValueError(f"four_setups: unknown setups {unknown}; choose from 'abcde'")
    learners = {k: v for k, v in learners.items() if k in setups and (strict or k != "e")}
    samplers = {"bf16": (False, None), "minite": (True, None), "strict": (True, STRICT_RECIPE)}
    rollouts = {}
    for name in dict.fromkeys(sampler for sampler, _, _ in learners.values()):
        nvfp4, sampler_recipe = samplers[name]
        llm = start_sampler(model_dir, nvfp4=nvfp4, seed=seed, recipe=sampler_recipe,
                            tensor_parallel_size=sampler_tp)  # fmt: skip
        rollouts[name] = sample(llm, prompts, n=n, max_tokens=max_tokens, seed=seed)
        stop_sampler(llm)
    reports = {}
    for key, (sampler, learner_nvfp4, recipe) in learners.items():
        r = rollouts[sampler]
        if learner_tp > 1:
            lp = learner_logprobs_tp(model_dir, r.prompts, r.completions, tp=learner_tp,
                                     nvfp4=learner_nvfp4, recipe=recipe)  # fmt: skip
        else:
            model = build_learner(model_dir, nvfp4=learner_nvfp4, recipe=recipe)
            lp = learner_logprobs(model, r.prompts, r.completions)
            del model
        reports[key] = logprob_mismatch(
            r.logprobs, lp, sampler_fingerprint=r.fingerprint,
            learner_fingerprint=recipe.fingerprint() if learner_nvfp4 else None,
            allow_recipe_mismatch=True,
        )  # fmt: skip
        gc.collect()
    return reports


def four_setup_table(reports: dict[str, MismatchReport]) -> str:
    """A Markdown table of the headline figures of :func:`four_setups`."""
    keys = ("token_mult_prob_error", "k3_kl_sampler_learner", "mean_abs_diff", "max_abs_diff",
            "frac_bitwise_equal")  # fmt: skip
    lines = ["| setup | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for key, report in reports.items():
        values = " | ".join(f"{report.summary[k]:.6g}" for k in keys)
        lines.append(f"| ({key}) {SETUPS[key]} | {values} |")
    return "\n".join(lines)


def layer_alignment(
    llm: Any, model: torch.nn.Module, input_ids: Sequence[int]
) -> tuple[LayerComparison, list[str], dict[str, torch.Tensor]]:
    """Capture both engines on one sequence and compare them layer by layer.

    Returns the comparison (forward order of the learner), the execution-fingerprint diff and the
    sampler's captures (whose ``:input`` tensors can be fed to the learner's layers).
    """
    from vllm import SamplingParams

    from minite_megatron.capture import capture_layers, execution_fingerprints
    from minite_vllm import unpack_weights

    llm.collective_rpc("start_capture")
    llm.generate({"prompt_token_ids": list(input_ids)}, SamplingParams(max_tokens=1),
                 use_tqdm=False)  # fmt: skip
    sampler = unpack_weights(llm.collective_rpc("finish_capture")[0])
    learner = capture_layers(model, torch.tensor(list(input_ids)))
    comparison = compare_layer_captures(sampler, learner, order=list(learner))
    fingerprints = diff_fingerprints(
        llm.collective_rpc("get_execution_fingerprints")[0], execution_fingerprints(model)
    )
    return comparison, fingerprints, sampler


def sync_weights(llm: Any, model: torch.nn.Module, *, bucket_bytes: int | None = None) -> SyncStats:
    """The RL weight sync, one call: stream the learner's weights into the running sampler through
    miniTE's collective transport (:mod:`minite_vllm.sync`; the group is set up on first use),
    all-or-nothing, and reset its prefix cache. A miniTE learner sends the NVFP4 tensors it
    computes with (codes, scales, decode scales; BF16 for the layers the recipe keeps in high
    precision), checked against the sampler's recipe; a BF16 learner sends BF16 weights, which
    the sampler quantizes."""
    from minite_megatron import export_hf_weights, hf_quantization_config
    from minite_megatron.linear import NVFP4LinearMixin
    from minite_vllm.sync import sync_weights as stream

    nvfp4 = any(isinstance(m, NVFP4LinearMixin) for m in model.modules())
    fingerprint = hf_quantization_config(model)["fingerprint"] if nvfp4 else None
    extra = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    return stream(
        llm, export_hf_weights(model, quantized=nvfp4), payload="nvfp4" if nvfp4 else "bf16",
        recipe_fingerprint=fingerprint, **extra,
    )  # fmt: skip


def weights_in_sync(llm: Any, model: torch.nn.Module) -> bool:
    """Whether every NVFP4 weight in the sampler equals the learner's quantized weight bitwise."""
    from minite_megatron import export_hf_weights
    from minite_vllm import unpack_weights

    sampler = unpack_weights(llm.collective_rpc("get_quantized_weights")[0])
    learner = dict(export_hf_weights(model, quantized=True))
    return bool(sampler) and all(
        name in learner
        and t.dtype == learner[name].dtype
        and torch.equal(
            t.reshape(-1).view(torch.uint8), learner[name].reshape(-1).view(torch.uint8)
        )
        for name, t in sampler.items()
    )
