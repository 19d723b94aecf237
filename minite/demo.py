"""``minite demo``: a real NVFP4 RL loop, vLLM sampling and Megatron-Core learning, on a CPU.

1. A tiny Qwen3 (or a checkpoint you give) and its byte tokenizer; a short supervised warm start
   of the miniTE learner on single-digit addition (``"3+5="`` -> ``"8"``) so that RL has signal.
2. GRPO: vLLM (``quantization="minite"``) samples a group of completions per prompt with their
   log-probs; a rule-based reward scores them; the learner (Megatron-Core, miniTE spec) computes
   its log-probs of the same tokens and takes a clipped policy-gradient step with a truncated
   importance-sampling (TIS) correction ``min(exp(lp_learner - lp_sampler), cap)``, which is 1
   when the engines agree; the new weights go into the running vLLM engine (re-quantized there
   to the learner's bits), and the sync is checked bitwise.
3. Per step: reward, accuracy, mismatch figures, TIS weights, step time; at the end a terminal
   table, ``report.json`` and ``report.png``.
By default the miniTE run uses the recipe's strict mode, where the ops between the linears are
shared too and the sampler's and learner's log-probs agree bitwise (token multiplicative
probability error exactly 1; ``--no-strict``: only the NVFP4 linears agree bitwise), and the
usual quantized-rollout setup (miniTE sampler + BF16 learner) runs from the same warm start for
comparison (``--no-compare`` skips it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from minite.alignment import (
    STRICT_RECIPE,
    build_learner,
    learner_logprobs,
    sample,
    start_sampler,
    stop_sampler,
    sync_weights,
    weights_in_sync,
)
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import DEFAULT_RECIPE, NVFP4Recipe
from minite_common.diagnostics import logprob_mismatch


@dataclasses.dataclass
class DemoConfig:
    """Everything the demo does, with the embedded defaults (``minite demo`` with no arguments)."""

    out: Path = Path("minite-demo")
    model: Path | None = None  # an HF Qwen3 / Qwen3-MoE checkpoint dir instead of the tiny model
    moe: bool = False
    tiny: bool = False  # smaller and shorter (the CI variant)
    hidden_size: int = 128
    num_layers: int = 2
    steps: int = 40
    warmup_steps: int = 60
    prompts_per_step: int = 32
    group_size: int = 8
    max_tokens: int = 4
    lr: float = 2e-3
    warmup_lr: float = 3e-3
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    seed: int = 0
    compare: bool = True  # also the usual setup: miniTE sampler + BF16 learner
    strict: bool = True  # strict mode: the ops between the linears aligned too (CPU)

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.recipe = STRICT_RECIPE if self.strict else DEFAULT_RECIPE
        if self.tiny:
            self.hidden_size, self.warmup_steps = 64, 20
            self.prompts_per_step, self.group_size = 8, 4


@dataclasses.dataclass
class Problem:
    """One addition problem: its prompt and the answer a correct completion spells."""

    a: int
    b: int

    @property
    def prompt(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


PROBLEMS = [Problem(a, b) for a in range(10) for b in range(10)]


def reward(problem: Problem, completion: Sequence[int], tokenizer: Any) -> float:
    """1 for exactly the right digits followed by end-of-sequence, else 0."""
    ended = bool(completion) and completion[-1] == tokenizer.eos_token_id
    text = tokenizer.decode(list(completion[:-1] if ended else completion))
    return float(ended and text == problem.answer)


class Learner:
    """A Megatron ``GPTModel`` (miniTE spec or BF16) with FP32 master weights and Adam."""

    def __init__(
        self, model_dir: Path, *, nvfp4: bool, lr: float, recipe: NVFP4Recipe = DEFAULT_RECIPE
    ) -> None:
        self.model = build_learner(model_dir, nvfp4=nvfp4, recipe=recipe)
        self.nvfp4 = nvfp4
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = torch.optim.Adam(self.master, lr=lr, betas=(0.9, 0.99))

    def logprobs(
        self, prompts: list[list[int]], completions: list[list[int]]
    ) -> list[torch.Tensor]:
        """Per-token log-probs of the completions (no gradient)."""
        self.model.eval()
        return learner_logprobs(self.model, prompts, completions)

    def step(self, loss_fn) -> float:
        """One optimizer step on ``loss_fn(model)``; returns the loss."""
        from minite_megatron import invalidate_quantized_weights

        self.model.train()
        for p in self.params:
            p.grad = None
        loss = loss_fn(self.model)
        loss.backward()
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        torch.nn.utils.clip_grad_norm_(self.master, 1.0)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)
        invalidate_quantized_weights(self.model)
        return float(loss.detach())

    def save_hf(self, src_dir: Path, dst_dir: Path) -> Path:
        """Write the current weights as an HF checkpoint (config and tokenizer from ``src_dir``)."""
        from safetensors.torch import save_file

        from minite_megatron import export_hf_weights

        dst_dir.mkdir(parents=True, exist_ok=True)
        for f in src_dir.iterdir():
            if f.is_file() and not f.name.startswith("model.safetensors"):
                shutil.copy(f, dst_dir / f.name)
        tensors = {n: t.contiguous() for n, t in export_hf_weights(self.model)}
        save_file(tensors, str(dst_dir / "model.safetensors"), metadata={"format": "pt"})
        return dst_dir


def _sequences_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    """Per-token log-probs of ``completions`` with gradient (one padded batch)."""
    from minite_megatron import token_logprobs

    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    lp = token_logprobs(model, ids)
    return [lp[i, len(p) - 1 : len(p) - 1 + len(c)]
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]  # fmt: skip


def warm_start(learner: Learner, tokenizer: Any, cfg: DemoConfig, log) -> float:
    """Supervised warm start on the addition task; returns the final loss."""
    from tqdm import tqdm

    rng = random.Random(cfg.seed)
    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.warmup_lr
    loss = math.nan
    for _ in tqdm(range(cfg.warmup_steps), desc="warm start (SFT)", leave=False):
        batch = rng.choices(PROBLEMS, k=32)
        prompts = [tokenizer(p.prompt)["input_ids"] for p in batch]
        answers = [tokenizer(p.answer)["input_ids"] + [tokenizer.eos_token_id] for p in batch]

        def nll(model, prompts=prompts, answers=answers):
            lps = _sequences_logprobs(model, prompts, answers)
            return -torch.cat(lps).mean()

        loss = learner.step(nll)
    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.lr
    log(f"warm start: {cfg.warmup_steps} steps, final NLL {loss:.3f}")
    return loss


def grpo_loss(
    model, prompts, completions, rewards, sampler_lp, old_lp, group_size, clip_eps, tis_cap
):  # fmt: skip
    """GRPO's clipped surrogate with group-normalized advantages and a TIS correction."""
    r = torch.tensor(rewards).view(-1, group_size)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten()
    new_lp = _sequences_logprobs(model, prompts, completions)
    total, tokens = torch.zeros((), device=new_lp[0].device), 0
    for i, lp in enumerate(new_lp):
        old = old_lp[i].to(lp.device)
        ratio = torch.exp(lp - old)
        sampler = torch.as_tensor(sampler_lp[i], dtype=torch.float32, device=lp.device)
        tis = torch.clamp(torch.exp(old - sampler), max=tis_cap)
        a = adv[i].to(lp.device)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
        total = total - (tis * surrogate).sum()
        tokens += lp.numel()
    return total / max(tokens, 1)


def evaluate(llm, tokenizer) -> float:
    """Greedy accuracy over all 100 problems."""
    prompts = [tokenizer(p.prompt)["input_ids"] for p in PROBLEMS]
    r = sample(llm, prompts, n=1, max_tokens=4, temperature=0.0)
    return sum(reward(p, c, tokenizer) for p, c in zip(PROBLEMS, r.completions, strict=True)) / len(
        PROBLEMS
    )


def rl_run(
    name: str, model_dir: Path, llm, tokenizer, cfg: DemoConfig, *, nvfp4_learner: bool, log
) -> list[dict[str, Any]]:
    """GRPO from the checkpoint in ``model_dir``; returns one record per step."""
    from tqdm import tqdm

    torch.manual_seed(cfg.seed)
    recipe = cfg.recipe if nvfp4_learner else DEFAULT_RECIPE  # a BF16 learner has no recipe
    learner = Learner(model_dir, nvfp4=nvfp4_learner, lr=cfg.lr, recipe=recipe)
    sync_weights(llm, learner.model)  # the sampler starts from exactly the learner's weights
    rng = random.Random(cfg.seed + 1)
    records = [{"setup": name, "initial_accuracy": evaluate(llm, tokenizer)}]
    fingerprint = cfg.recipe.fingerprint() if nvfp4_learner else None
    for step in tqdm(range(cfg.steps), desc=f"GRPO ({name})", leave=False):
        start = time.perf_counter()
        batch = rng.sample(PROBLEMS, cfg.prompts_per_step)
        prompts = [tokenizer(p.prompt)["input_ids"] for p in batch]
        rollouts = sample(llm, prompts, n=cfg.group_size, max_tokens=cfg.max_tokens,
                          seed=cfg.seed * 1000 + step)  # fmt: skip
        problems = [p for p in batch for _ in range(cfg.group_size)]
        rewards = [reward(p, c, tokenizer)
                   for p, c in zip(problems, rollouts.completions, strict=True)]  # fmt: skip
        t_sample = time.perf_counter() - start
        old_lp = learner.logprobs(rollouts.prompts, rollouts.completions)
        mismatch = logprob_mismatch(
            rollouts.logprobs, old_lp, sampler_fingerprint=rollouts.fingerprint,
            learner_fingerprint=fingerprint, allow_recipe_mismatch=True, tis_cap=cfg.tis_cap,
        ).summary  # fmt: skip
        loss = learner.step(functools.partial(
            grpo_loss, prompts=rollouts.prompts, completions=rollouts.completions,
            rewards=rewards, sampler_lp=rollouts.logprobs, old_lp=old_lp,
            group_size=cfg.group_size, clip_eps=cfg.clip_eps, tis_cap=cfg.tis_cap,
        ))  # fmt: skip
        sync_weights(llm, learner.model)
        in_sync = weights_in_sync(llm, learner.model) if nvfp4_learner else None
        records.append({
            "step": step, "setup": name, "reward": sum(rewards) / len(rewards), "loss": loss,
            "token_mult_prob_error": mismatch["token_mult_prob_error"],
            "k3_kl": mismatch["k3_kl_sampler_learner"],
            "max_abs_diff": mismatch["max_abs_diff"],
            "frac_bitwise_equal": mismatch["frac_bitwise_equal"],
            "tis_weight_mean": mismatch["ratio_mean"],
            "tis_clip_fraction": mismatch["tis_clip_fraction"],
            "weights_bitwise_in_sync": in_sync,
            "sample_s": t_sample, "step_s": time.perf_counter() - start,
        })  # fmt: skip
        r = records[-1]
        log(f"[{name}] step {step:3d}  reward {r['reward']:.3f}  "
            f"mult_prob_err {r['token_mult_prob_error']:.5f}  k3 {r['k3_kl']:.2e}  "
            f"tis {r['tis_weight_mean']:.4f}  sync {in_sync}  {r['step_s']:.1f}s")  # fmt: skip
    records.append({"setup": name, "final_accuracy": evaluate(llm, tokenizer)})
    del learner
    return records


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    """PNG: reward and token multiplicative probability error per step, per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for setup in dict.fromkeys(r["setup"] for r in records):
        rows = [r for r in records if r["setup"] == setup and "step" in r]
        steps = [r["step"] for r in rows]
        ax1.plot(steps, [r["reward"] for r in rows], marker="o", label=setup)
        ax2.plot(steps, [r["token_mult_prob_error"] for r in rows], marker="o", label=setup)
    ax1.set(xlabel="GRPO step", ylabel="mean reward", title="reward")
    ax2.set(xlabel="GRPO step", ylabel="token_mult_prob_error", title="sampler/learner mismatch")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.legend()
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary_table(records: list[dict[str, Any]]) -> str:
    """Per setup: mean reward first/last steps, mismatch, TIS weights, sync, accuracy, time."""
    lines = [f"{'setup':40s} {'reward first->last':>20s} {'mult_prob_err':>14s} "
             f"{'frac_bitwise':>13s} {'TIS mean':>9s} {'in sync':>8s} {'accuracy':>9s} "
             f"{'s/step':>7s}"]  # fmt: skip
    for setup in dict.fromkeys(r["setup"] for r in records):
        rows = [r for r in records if r["setup"] == setup and "step" in r]
        final = next(r["final_accuracy"] for r in records
                     if r["setup"] == setup and "final_accuracy" in r)  # fmt: skip
        half = max(len(rows) // 2, 1)
        first = sum(r["reward"] for r in rows[:half]) / half
        last = sum(r["reward"] for r in rows[-half:]) / half
        mean = {k: sum(r[k] for r in rows) / len(rows)
                for k in ("token_mult_prob_error", "frac_bitwise_equal", "tis_weight_mean",
                          "step_s")}  # fmt: skip
        sync = {r["weights_bitwise_in_sync"] for r in rows}
        lines.append(f"{setup:40s} {first:9.3f} -> {last:7.3f} "
                     f"{mean['token_mult_prob_error']:14.6f} {mean['frac_bitwise_equal']:13.4f} "
                     f"{mean['tis_weight_mean']:9.5f} "
                     f"{str(sync.pop() if len(sync) == 1 else sync):>8s} {final:9.2f} "
                     f"{mean['step_s']:7.2f}")  # fmt: skip
    return "\n".join(lines)


def config_json(cfg: DemoConfig) -> dict[str, Any]:
    """The configuration as JSON types: numbers and booleans as such, paths as strings, no
    model as ``null``."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()}


def run_demo(cfg: DemoConfig, log=print) -> dict[str, Any]:
    """The whole demo; returns the report it writes to ``cfg.out / "report.json"``."""
    from transformers import AutoTokenizer

    from minite.alignment import configure_cpu_engines

    configure_cpu_engines()
    started = time.perf_counter()
    cfg.out.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.model is not None:
        base = Path(cfg.model)
    else:
        spec = TinyModelSpec(moe=cfg.moe, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                             intermediate_size=2 * cfg.hidden_size)  # fmt: skip
        base = write_tiny_model(cfg.out / "base-model", spec, seed=cfg.seed)
        log(f"model: tiny Qwen3{'-MoE' if cfg.moe else ''} (hidden {cfg.hidden_size}, "
            f"{cfg.num_layers} layers) in {base}")  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    warm = Learner(base, nvfp4=True, lr=cfg.lr, recipe=cfg.recipe)
    warm_start(warm, tokenizer, cfg, log)
    start_dir = warm.save_hf(base, cfg.out / "warm-start")
    del warm

    llm = start_sampler(start_dir, seed=cfg.seed, recipe=cfg.recipe)
    records = []
    setups = [(f"miniTE{' strict' if cfg.strict else ''} sampler + learner", True)]
    if cfg.compare:
        setups.append(("miniTE sampler + BF16 learner", False))
    for name, nvfp4_learner in setups:
        records += rl_run(name, start_dir, llm, tokenizer, cfg, nvfp4_learner=nvfp4_learner,
                          log=log)  # fmt: skip
    stop_sampler(llm)

    report = {"config": config_json(cfg),
              "recipe": cfg.recipe.fingerprint(), "records": records,
              "wall_s": time.perf_counter() - started}  # fmt: skip
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1))
    png = plot(records, cfg.out / "report.png")
    log(summary_table(records))
    log(f"report: {cfg.out / 'report.json'}, plot: {png}, wall time {report['wall_s']:.0f} s")
    return report
