"""``minite demo``: a real NVFP4 RL loop, vLLM sampling and Megatron-Core learning, on a CPU.

1. A tiny Qwen3 (or a checkpoint you give) and its byte tokenizer; a short supervised warm start
   of the miniTE learner on single-digit addition (``"3+5="`` -> ``"8"``) so that RL has signal.
2. GRPO: vLLM (``quantization="minite"``) samples a group of completions per prompt with their
   log-probs; a rule-based reward scores them; the learner (Megatron-Core, miniTE spec) computes
   its log-probs of the same tokens and takes a clipped policy-gradient step with a truncated
   importance-sampling (TIS) correction ``min(exp(lp_learner - lp_sampler), cap)``, which is 1
   when the engines agree; the new weights stream into the running vLLM engine through miniTE's
   collective transport (:mod:`minite_vllm.sync`: the learner's own NVFP4 tensors, or BF16
   weights that vLLM quantizes for a BF16 learner), and the sync is checked bitwise.
3. Per step: reward, accuracy, mismatch figures, TIS weights, step time; at the end a terminal
   table, what the run shows (:func:`findings`), ``report.json`` and ``report.png``.
By default the miniTE run uses the recipe's strict mode, where the ops between the linears are
shared too and the sampler's and learner's log-probs agree bitwise (token multiplicative
probability error exactly 1; ``--no-strict``: only the NVFP4 linears agree bitwise), and the
usual quantized-rollout setup (miniTE sampler + BF16 learner) runs from the same warm start for
comparison (``--no-compare`` skips it).

The learner's loss, gradient clipping and Adam here use fixed-order sums and plain elementwise
arithmetic (:func:`grpo_loss`, :func:`clip_grad_norm`, :class:`FixedOrderAdam`), so with strict
mode every figure of the run and the final weights are the same on any CPU (instruction set,
thread count); the usual setup's figures are not (its BF16 GEMMs and torch's kernels follow the
CPU). The run is one seed of a toy task: it shows exact log-probs and TIS = 1 against the usual
setup's mismatch, not which setup learns faster.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
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
from minite_common import DEFAULT_RECIPE, NVFP4Recipe, ops
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


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``'s formula with fixed-order sums (:func:`ops.fixed_sum`)
    instead of torch's norm kernel, whose summation order follows the CPU's vector width."""
    grads = [p.grad for p in params if p.grad is not None]
    squares = torch.stack([ops.fixed_sum((g.float() * g.float()).reshape(-1)) for g in grads])
    total = ops.sqrt(ops.fixed_sum(squares))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef)
    return total


class FixedOrderAdam:
    """Adam as ``torch.optim.Adam`` computes it (no weight decay), in plain elementwise IEEE ops.

    torch's Adam runs fused kernels (``lerp``, ``addcmul``, ``addcdiv``) that use fused
    multiply-adds on AVX2/AVX-512 CPUs and separate ones elsewhere, so its bits depend on the
    CPU; here every step is one correctly rounded operation, the bias corrections are Python
    floats built by repeated multiplication, and an update gives the same bits on every CPU.
    """

    def __init__(
        self, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float = 1e-8
    ) -> None:
        self.params = list(params)
        self.param_groups = [{"lr": lr}]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.beta1_t, self.beta2_t = 1.0, 1.0

    @torch.no_grad()
    def step(self) -> None:
        self.beta1_t *= self.beta1
        self.beta2_t *= self.beta2
        step_size = self.param_groups[0]["lr"] / (1.0 - self.beta1_t)
        bias_sqrt = math.sqrt(1.0 - self.beta2_t)
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad
            m.mul_(self.beta1).add_(g * (1.0 - self.beta1))
            v.mul_(self.beta2).add_((g * g) * (1.0 - self.beta2))
            denom = (ops.sqrt(v) / bias_sqrt) + self.eps
            p.sub_((m / denom) * step_size)


class Learner:
    """A Megatron ``GPTModel`` (miniTE spec or BF16) with FP32 master weights and Adam."""

    def __init__(
        self, model_dir: Path, *, nvfp4: bool, lr: float, recipe: NVFP4Recipe = DEFAULT_RECIPE
    ) -> None:
        self.model = build_learner(model_dir, nvfp4=nvfp4, recipe=recipe)
        self.nvfp4 = nvfp4
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.optimizer = FixedOrderAdam(self.master, lr=lr, betas=(0.9, 0.99))

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
        clip_grad_norm(self.master, 1.0)
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)
        invalidate_quantized_weights(self.model)
        return float(loss.detach())

    def weights_sha256(self) -> str:
        """SHA-256 of the FP32 master weights' bytes: the learner's whole state in one figure."""
        digest = hashlib.sha256()
        for m in self.master:
            digest.update(m.detach().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

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
            lps = torch.cat(_sequences_logprobs(model, prompts, answers))
            return -(ops.fixed_sum(lps) / lps.numel())  # fixed order: the same bits on any CPU

        loss = learner.step(nll)
    for group in learner.optimizer.param_groups:
        group["lr"] = cfg.lr
    log(f"warm start: {cfg.warmup_steps} steps, final NLL {loss:.3f}")
    return loss


def grpo_loss(
    model, prompts, completions, rewards, sampler_lp, old_lp, group_size, clip_eps, tis_cap
):  # fmt: skip
    """GRPO's clipped surrogate with group-normalized advantages and a TIS correction.

    Every reduction is :func:`ops.fixed_sum` and every exp :func:`ops.exp` (not torch's
    ``mean``/``std``/``sum``/``exp``, whose bits follow the CPU's instruction set), so a strict
    learner's loss and gradients are the same on every CPU."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    centered = r - (ops.fixed_sum(r) / group_size).unsqueeze(1)
    std = ops.sqrt(ops.fixed_sum(centered * centered) / (group_size - 1))  # unbiased, as .std()
    adv = (centered / (std.unsqueeze(1) + 1e-4)).flatten()
    new_lp = _sequences_logprobs(model, prompts, completions)
    total, tokens = torch.zeros((), device=new_lp[0].device), 0
    for i, lp in enumerate(new_lp):
        old = old_lp[i].to(lp.device)
        ratio = ops.exp(lp - old)
        sampler = torch.as_tensor(sampler_lp[i], dtype=torch.float32, device=lp.device)
        tis = torch.clamp(ops.exp(old - sampler), max=tis_cap)
        a = adv[i].to(lp.device)
        surrogate = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a)
        total = total - ops.fixed_sum(tis * surrogate)
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
        sync = sync_weights(llm, learner.model)
        in_sync = weights_in_sync(llm, learner.model) if nvfp4_learner else None
        records.append({
            "step": step, "setup": name, "reward": sum(rewards) / len(rewards), "loss": loss,
            "token_mult_prob_error": mismatch["token_mult_prob_error"],
            "k3_kl": mismatch["k3_kl_sampler_learner"],
            "max_abs_diff": mismatch["max_abs_diff"],
            "frac_bitwise_equal": mismatch["frac_bitwise_equal"],
            "tis_weight_mean": mismatch["ratio_mean"],
            "tis_weight_min": mismatch["ratio_min"], "tis_weight_max": mismatch["ratio_max"],
            "tis_clip_fraction": mismatch["tis_clip_fraction"], "tokens": mismatch["tokens"],
            "weights_bitwise_in_sync": in_sync, "sync_bytes": sync.payload_bytes,
            "sync_s": sync.seconds,
            "sample_s": t_sample, "step_s": time.perf_counter() - start,
        })  # fmt: skip
        r = records[-1]
        log(f"[{name}] step {step:3d}  reward {r['reward']:.3f}  "
            f"mult_prob_err {r['token_mult_prob_error']:.5f}  k3 {r['k3_kl']:.2e}  "
            f"tis {r['tis_weight_mean']:.4f}  sync {in_sync}  {r['step_s']:.1f}s")  # fmt: skip
    records.append({"setup": name, "final_accuracy": evaluate(llm, tokenizer),
                    "weights_sha256": learner.weights_sha256()})  # fmt: skip
    del learner
    return records


def figure(records: list[dict[str, Any]]):
    """Reward per step, and the sampler/learner mismatch per step on a log scale
    (``token_mult_prob_error - 1``: 0, drawn at the bottom, means every log-prob bitwise equal)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for setup in dict.fromkeys(r["setup"] for r in records):
        rows = [r for r in records if r["setup"] == setup and "step" in r]
        steps = [r["step"] for r in rows]
        excess = [r["token_mult_prob_error"] - 1.0 for r in rows]
        if all(e == 0.0 for e in excess):
            setup += " (exactly 0: bitwise equal)"
        ax1.plot(steps, [r["reward"] for r in rows], marker="o", label=setup)
        ax2.plot(steps, excess, marker="o", label=setup)
    ax1.set(xlabel="GRPO step", ylabel="mean reward",
            title="reward (one seed: not a learning-speed comparison)")  # fmt: skip
    ax2.set_yscale("symlog", linthresh=1e-6)  # logarithmic above 1e-6, so that 0 can be drawn
    ax2.set_ylim(bottom=0.0)
    ax2.set(xlabel="GRPO step", ylabel="token_mult_prob_error - 1 (log)",
            title="sampler/learner mismatch")  # fmt: skip
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(records: list[dict[str, Any]], path: Path) -> Path:
    """:func:`figure` as a PNG at ``path``."""
    import matplotlib.pyplot as plt

    fig = figure(records)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _setup_rows(records: list[dict[str, Any]], setup: str) -> list[dict[str, Any]]:
    return [r for r in records if r["setup"] == setup and "step" in r]


def _setup_final(records: list[dict[str, Any]], setup: str) -> dict[str, Any]:
    return next(r for r in records if r["setup"] == setup and "final_accuracy" in r)


def summary_table(records: list[dict[str, Any]]) -> str:
    """Per setup: mean reward first/last half, mismatch (mean and worst step), TIS weights
    (mean, range), weight sync, final greedy accuracy, time per step."""
    lines = [f"{'setup':34s} {'reward 1st->2nd half':>20s} {'mult_prob_err':>13s} "
             f"{'(worst step)':>12s} {'frac_bitwise':>12s} {'TIS mean':>9s} "
             f"{'TIS min..max':>15s} {'in sync':>7s} {'accuracy':>8s} {'s/step':>6s}"]  # fmt: skip
    for setup in dict.fromkeys(r["setup"] for r in records):
        rows = _setup_rows(records, setup)
        final = _setup_final(records, setup)["final_accuracy"]
        half = max(len(rows) // 2, 1)
        first = sum(r["reward"] for r in rows[:half]) / half
        last = sum(r["reward"] for r in rows[-half:]) / half
        mean = {k: sum(r[k] for r in rows) / len(rows)
                for k in ("token_mult_prob_error", "frac_bitwise_equal", "tis_weight_mean",
                          "step_s")}  # fmt: skip
        worst = max(r["token_mult_prob_error"] for r in rows)
        tis_min = min(r["tis_weight_min"] for r in rows)
        tis = f"{tis_min:.3f}..{max(r['tis_weight_max'] for r in rows):.3f}"
        sync = {r["weights_bitwise_in_sync"] for r in rows}
        lines.append(f"{setup:34s} {first:9.3f} -> {last:7.3f} "
                     f"{mean['token_mult_prob_error']:13.6f} {worst:12.6f} "
                     f"{mean['frac_bitwise_equal']:12.4f} {mean['tis_weight_mean']:9.5f} "
                     f"{tis:>15s} {str(sync.pop() if len(sync) == 1 else sync):>7s} "
                     f"{final:8.2f} {mean['step_s']:6.2f}")  # fmt: skip
    return "\n".join(lines)


def findings(records: list[dict[str, Any]]) -> str:
    """What the run shows, and no more: exact log-probs and TIS = 1 where every token was bitwise
    equal, the usual setup's mismatch and its worst steps, and what depends on the machine."""
    out = ["What this run shows:"]
    for setup in dict.fromkeys(r["setup"] for r in records):
        rows = _setup_rows(records, setup)
        tokens = sum(r["tokens"] for r in rows)
        exact = all(r["frac_bitwise_equal"] == 1.0 for r in rows)
        if exact and all(r["tis_weight_min"] == r["tis_weight_max"] == 1.0 for r in rows):
            synced = all(r["weights_bitwise_in_sync"] for r in rows)
            out.append(f"- {setup}: all {tokens} sampled tokens of {len(rows)} steps scored "
                       f"bitwise equal by sampler and learner; every TIS weight exactly 1"
                       f"{'; vLLM held the learner bits after every weight sync' if synced else ''}"
                       ".")  # fmt: skip
        else:
            by_err = sorted(rows, key=lambda r: r["token_mult_prob_error"], reverse=True)
            worst = ", ".join(f"step {r['step']}: {r['token_mult_prob_error']:.4f}"
                              for r in by_err[:3])  # fmt: skip
            median = sorted(r["token_mult_prob_error"] for r in rows)[len(rows) // 2]
            equal = sum(r["frac_bitwise_equal"] * r["tokens"] for r in rows) / tokens
            out.append(f"- {setup}: sampler and learner disagree on {1 - equal:.1%}"
                       f" of {tokens} tokens; token_mult_prob_error median {median:.4f}, worst "
                       f"{worst}; TIS weights {min(r['tis_weight_min'] for r in rows):.3f}.."
                       f"{max(r['tis_weight_max'] for r in rows):.3f}.")  # fmt: skip
    out.append("- Reward: one seed, a few dozen steps of a toy task. The curves of the setups are "
               "not evidence that one learns faster than the other.")  # fmt: skip
    strict = [s for s in dict.fromkeys(r["setup"] for r in records) if "strict" in s]
    for setup in strict:
        digest = _setup_final(records, setup)["weights_sha256"]
        out.append(f"- Machine-independent: every figure of '{setup}' and its final learner "
                   f"weights (sha256 {digest[:16]}) come from fixed-order ops only, so they do not "
                   "depend on the CPU's instruction set or thread count (tested: AVX2 vs AVX-512/"
                   "AMX kernels, 1 vs 2 threads).")  # fmt: skip
    others = [s for s in dict.fromkeys(r["setup"] for r in records) if s not in strict]
    if others:
        out.append(f"- Machine-dependent: the figures of {', '.join(repr(s) for s in others)} "
                   "(BF16 GEMMs through oneDNN/BLAS and torch's reductions, whose bits follow the "
                   "CPU's instruction set and the thread count), and all times.")  # fmt: skip
    return "\n".join(out)


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
    log(findings(records))
    log(f"report: {cfg.out / 'report.json'}, plot: {png}, wall time {report['wall_s']:.0f} s")
    return report
