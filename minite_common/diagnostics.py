"""Execution diagnostics: sampler-vs-learner log-prob mismatch, first divergent layer, fingerprints.

Everything here is plain data in, plain data out: log-probs as tensors or JSONL files, per-layer
captures as ``{hf_name: tensor}`` dicts, fingerprints as ``{hf_name: {...}}`` dicts. The engine
adapters produce those; this module computes, explains and renders.

Metrics over the tokens of all sequences (``lp_s`` sampler, ``lp_l`` learner, ``r = lp_l - lp_s``,
``rho = exp(r)``, averages over tokens):
- ``token_mult_prob_error = mean(exp(|r|))`` (NeMo-RL's figure; 1.0 is perfect) and
  ``exp_mean_abs_diff = exp(mean|r|)``;
- ``k3_kl_sampler_learner = mean(rho - r - 1)`` (estimates KL(sampler||learner), NeMo-RL's
  ``gen_kl_error``) and ``k3_kl_learner_sampler = mean(rho*r - rho + 1)`` (KL(learner||sampler));
- ``js_divergence = mean(0.5*log(2/(1+rho)) + 0.5*rho*log(2*rho/(1+rho)))`` (JS divergence
  estimated from the sampler's tokens);
- ``mean_abs_diff``, ``max_abs_diff``, importance ratio ``rho`` mean/std/min/max, the share of
  ratios a truncated-IS correction at ``tis_cap`` would clip, ``frac_bitwise_equal`` (float32
  log-probs identical).
Tokens whose log-prob is NaN/Inf in either run are excluded and counted in ``nonfinite_tokens``
(and flagged), never averaged in.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .linear import gemm_path
from .recipe import NVFP4Recipe, RecipeMismatchError


class DiagnosticsInputError(ValueError):
    """Inputs to a diagnostic do not describe the same tokens (or cannot be compared)."""


def _as_f32(values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64).to(torch.float32).flatten()


def _token_metrics(lp_s: torch.Tensor, lp_l: torch.Tensor, tis_cap: float) -> dict[str, float]:
    s, lrn = lp_s.double(), lp_l.double()
    n = s.numel()
    if n == 0:
        return {"tokens": 0}
    r = lrn - s
    rho = torch.exp(r)
    return {
        "tokens": n,
        "token_mult_prob_error": float(torch.exp(r.abs()).mean()),
        "exp_mean_abs_diff": math.exp(float(r.abs().mean())),
        "k3_kl_sampler_learner": float((rho - r - 1).mean()),
        "k3_kl_learner_sampler": float((rho * r - rho + 1).mean()),
        "js_divergence": float(
            (0.5 * torch.log(2 / (1 + rho)) + 0.5 * rho * torch.log(2 * rho / (1 + rho))).mean()
        ),
        "mean_abs_diff": float(r.abs().mean()),
        "max_abs_diff": float(r.abs().max()),
        "ratio_mean": float(rho.mean()),
        "ratio_std": float(rho.std(unbiased=False)),
        "ratio_min": float(rho.min()),
        "ratio_max": float(rho.max()),
        "tis_clip_fraction": float((rho > tis_cap).double().mean()),
        "frac_bitwise_equal": float((lp_s == lp_l).double().mean()),
    }


@dataclass
class MismatchReport:
    """Log-prob mismatch between a sampler and a learner on the same tokens."""

    summary: dict[str, float]
    per_sequence: list[dict[str, float]]
    per_position: list[dict[str, float]]
    flags: list[str] = field(default_factory=list)
    fingerprints: dict[str, str | None] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "summary": self.summary,
            "flags": self.flags,
            "fingerprints": self.fingerprints,
            "per_sequence": self.per_sequence,
            "per_position": self.per_position,
        }

    def table(self) -> str:
        """A terminal table of the summary and any flags."""
        lines = [f"{'metric':28s} {'value':>14s}"]
        for key, value in self.summary.items():
            lines.append(f"{key:28s} {value:14.6g}")
        lines += [f"FLAG: {f}" for f in self.flags]
        return "\n".join(lines)


def logprob_mismatch(
    sampler: Sequence[Sequence[float] | torch.Tensor],
    learner: Sequence[Sequence[float] | torch.Tensor],
    *,
    sampler_tokens: Sequence[Sequence[int]] | None = None,
    learner_tokens: Sequence[Sequence[int]] | None = None,
    sampler_fingerprint: str | None = None,
    learner_fingerprint: str | None = None,
    allow_recipe_mismatch: bool = False,
    tis_cap: float = 2.0,
) -> MismatchReport:
    """Compare per-token log-probs of the same sequences from two runs (one list per sequence).

    Token ids, when given for both, must match exactly (else :class:`DiagnosticsInputError`
    naming the sequence and position). Different recipe fingerprints raise
    :class:`RecipeMismatchError` unless ``allow_recipe_mismatch`` (then the report is flagged).
    """
    flags: list[str] = []
    if sampler_fingerprint and learner_fingerprint and sampler_fingerprint != learner_fingerprint:
        message = (
            f"recipe fingerprints differ: sampler {sampler_fingerprint}, learner "
            f"{learner_fingerprint}"
        )
        if not allow_recipe_mismatch:
            raise RecipeMismatchError(
                message + "; the runs quantized differently, so their mismatch is expected. "
                "Pass allow_recipe_mismatch=True (CLI: --allow-recipe-mismatch) to compare anyway."
            )
        flags.append(message)
    if len(sampler) != len(learner):
        raise DiagnosticsInputError(
            f"sampler has {len(sampler)} sequences, learner has {len(learner)}"
        )
    if (sampler_tokens is None) != (learner_tokens is None):
        flags.append("token ids given for one run only: sequences not checked for identity")
    elif sampler_tokens is not None and learner_tokens is not None:
        _check_same_tokens(sampler_tokens, learner_tokens)

    all_s, all_l, per_seq = [], [], []
    by_position: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    nonfinite = 0
    for i, (s_seq, l_seq) in enumerate(zip(sampler, learner, strict=True)):
        s, lrn = _as_f32(s_seq), _as_f32(l_seq)
        if s.numel() != lrn.numel():
            raise DiagnosticsInputError(
                f"sequence {i}: sampler has {s.numel()} log-probs, learner {lrn.numel()}"
            )
        ok = torch.isfinite(s) & torch.isfinite(lrn)
        nonfinite += int((~ok).sum())
        positions = torch.arange(s.numel())[ok]
        s, lrn = s[ok], lrn[ok]
        per_seq.append({"sequence": i, **_token_metrics(s, lrn, tis_cap)})
        all_s.append(s)
        all_l.append(lrn)
        for p, a, b in zip(positions.tolist(), s, lrn, strict=True):
            slot = by_position.setdefault(p, ([], []))
            slot[0].append(a)
            slot[1].append(b)
    if nonfinite:
        flags.append(f"{nonfinite} tokens have NaN/Inf log-probs in a run; they are excluded")
    summary = _token_metrics(torch.cat(all_s or [torch.empty(0)]),
                             torch.cat(all_l or [torch.empty(0)]), tis_cap)  # fmt: skip
    summary["sequences"] = len(sampler)
    summary["nonfinite_tokens"] = nonfinite
    per_position = [
        {"position": p, **_token_metrics(torch.stack(a), torch.stack(b), tis_cap)}
        for p, (a, b) in sorted(by_position.items())
    ]
    return MismatchReport(
        summary=summary,
        per_sequence=per_seq,
        per_position=per_position,
        flags=flags,
        fingerprints={"sampler": sampler_fingerprint, "learner": learner_fingerprint},
    )


def _check_same_tokens(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> None:
    if len(a) != len(b):
        raise DiagnosticsInputError(f"token lists hold {len(a)} vs {len(b)} sequences")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        x, y = list(map(int, x)), list(map(int, y))
        if x == y:
            continue
        first = next((p for p, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
        where = f"position {first}" if first is not None else f"length {len(x)} vs {len(y)}"
        raise DiagnosticsInputError(
            f"sequence {i}: the two runs scored different tokens ({where}); mismatch figures "
            "are only meaningful on identical token sequences"
        )


def read_logprob_file(path: str | Path) -> dict[str, Any]:
    """Read a JSONL log-prob dump (format below); returns ids, tokens, logprobs, metadata.

    Line 1 may be a header ``{"minite_logprobs": 1, "fingerprint": ..., "vocab_size": ...,
    "engine": ...}``; every other line is one sequence ``{"id": ..., "tokens": [int, ...],
    "logprobs": [float, ...]}`` with one log-prob per token (the log-prob the run gave that token).
    """
    header: dict[str, Any] = {}
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DiagnosticsInputError(f"{path}:{lineno}: not JSON ({e.msg})") from e
            if "minite_logprobs" in obj:
                header = obj
                continue
            missing = {"tokens", "logprobs"} - set(obj)
            if missing:
                raise DiagnosticsInputError(f"{path}:{lineno}: record lacks {sorted(missing)}")
            if len(obj["tokens"]) != len(obj["logprobs"]):
                raise DiagnosticsInputError(
                    f"{path}:{lineno}: {len(obj['tokens'])} tokens but "
                    f"{len(obj['logprobs'])} log-probs"
                )
            records.append(obj)
    vocab = header.get("vocab_size")
    if vocab is not None:
        for r in records:
            bad = [t for t in r["tokens"] if not 0 <= int(t) < int(vocab)]
            if bad:
                raise DiagnosticsInputError(
                    f"{path}: sequence {r.get('id')} has token ids {bad[:5]} outside the "
                    f"declared vocab of {vocab}"
                )
    return {
        "ids": [r.get("id", i) for i, r in enumerate(records)],
        "tokens": [r["tokens"] for r in records],
        "logprobs": [[math.nan if v is None else v for v in r["logprobs"]] for r in records],
        "header": header,
    }


def write_logprob_file(
    path: str | Path,
    tokens: Iterable[Sequence[int]],
    logprobs: Iterable[Sequence[float] | torch.Tensor],
    *,
    fingerprint: str | None = None,
    vocab_size: int | None = None,
    engine: str | None = None,
) -> None:
    """Write the JSONL format :func:`read_logprob_file` reads (NaN written as null)."""
    with open(path, "w") as f:
        header = {"minite_logprobs": 1, "fingerprint": fingerprint, "vocab_size": vocab_size,
                  "engine": engine}  # fmt: skip
        f.write(json.dumps(header) + "\n")
        for i, (t, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            values = [None if not math.isfinite(v) else v for v in _as_f32(lp).tolist()]
            f.write(json.dumps({"id": i, "tokens": [int(x) for x in t], "logprobs": values}))
            f.write("\n")


def compare_logprob_files(
    sampler_path: str | Path, learner_path: str | Path, **kwargs: Any
) -> MismatchReport:
    """:func:`logprob_mismatch` on two JSONL dumps, sequences matched by ``id``."""
    a, b = read_logprob_file(sampler_path), read_logprob_file(learner_path)
    va, vb = a["header"].get("vocab_size"), b["header"].get("vocab_size")
    if va is not None and vb is not None and va != vb:
        raise DiagnosticsInputError(f"vocab sizes differ: sampler {va}, learner {vb}")
    index_b = {i: k for k, i in enumerate(b["ids"])}
    missing = [i for i in a["ids"] if i not in index_b]
    if missing or len(a["ids"]) != len(b["ids"]):
        raise DiagnosticsInputError(
            f"sequence ids differ between the files (first unmatched: {missing[:5]})"
        )
    order = [index_b[i] for i in a["ids"]]
    return logprob_mismatch(
        a["logprobs"],
        [b["logprobs"][k] for k in order],
        sampler_tokens=a["tokens"],
        learner_tokens=[b["tokens"][k] for k in order],
        sampler_fingerprint=a["header"].get("fingerprint"),
        learner_fingerprint=b["header"].get("fingerprint"),
        **kwargs,
    )


@dataclass
class LayerComparison:
    """Per-layer output differences between two engines' captures, in forward order."""

    rows: list[dict[str, Any]]
    first_divergent: str | None
    only_in_a: list[str]
    only_in_b: list[str]

    def table(self) -> str:
        """A terminal table: one line per layer."""
        lines = [f"{'layer':56s} {'bitwise':>8s} {'max|diff|':>12s} {'rel diff':>10s}"]
        for r in self.rows:
            lines.append(
                f"{r['name']:56s} {str(r['bitwise_equal']):>8s} {r['max_abs_diff']:12.4g} "
                f"{r['rel_diff']:10.3g}"
            )
        lines.append(f"first divergent layer: {self.first_divergent or 'none (all equal)'}")
        if self.only_in_a or self.only_in_b:
            lines.append(f"captured in one engine only: {self.only_in_a + self.only_in_b}")
        return "\n".join(lines)


def compare_layer_captures(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], order: Sequence[str] | None = None
) -> LayerComparison:
    """Compare two engines' captures of the same inputs, layer by layer (HF-style names).

    ``order`` is the forward order of the names (default: ``a``'s insertion order). The first
    layer whose outputs are not bitwise equal is the first divergent layer.
    """
    names = list(order) if order is not None else list(a)
    rows, first = [], None
    for name in names:
        if name not in a or name not in b:
            continue
        x, y = a[name], b[name]
        if tuple(x.shape) != tuple(y.shape):
            raise DiagnosticsInputError(
                f"layer {name}: captured shapes differ ({list(x.shape)} vs {list(y.shape)}); "
                "were both engines fed the same tokens?"
            )
        equal = torch.equal(x, y) and x.dtype == y.dtype
        diff = (x.double() - y.double()).abs()
        scale = float(y.double().abs().max()) or 1.0
        max_diff = float(diff.max()) if diff.numel() else 0.0
        rows.append({"name": name, "bitwise_equal": equal, "max_abs_diff": max_diff,
                     "rel_diff": max_diff / scale})  # fmt: skip
        if not equal and first is None:
            first = name
    return LayerComparison(
        rows=rows,
        first_divergent=first,
        only_in_a=sorted(set(a) - set(b)),
        only_in_b=sorted(set(b) - set(a)),
    )


def execution_record(
    recipe: NVFP4Recipe, device: torch.device | str | None = None, *, nvfp4: bool = True
) -> dict[str, Any]:
    """The execution record of one layer, as both engines report it for :func:`diff_fingerprints`.

    NVFP4 layers: ``{"mode": "nvfp4", "recipe", "kernel" (the GEMM path on ``device``),
    "config"}``; layers kept in high precision: ``{"mode": "bf16", "recipe"}``.
    """
    if not nvfp4:
        return {"mode": "bf16", "recipe": recipe.fingerprint()}
    config = (
        f"weight={'16x16' if recipe.weight_block_2d else '1x16'} blocks/tensor amax, "
        f"activation=1x16 blocks/{recipe.activation_amax} amax"
    )
    return {"mode": "nvfp4", "recipe": recipe.fingerprint(), "kernel": gemm_path(device or "cpu"),
            "config": config}  # fmt: skip


def diff_fingerprints(
    a: Mapping[str, Mapping[str, Any]],
    b: Mapping[str, Mapping[str, Any]],
    names: tuple[str, str] = ("sampler", "learner"),
) -> list[str]:
    """Name every layer whose execution record differs between two engines.

    Each record is ``{"mode": "nvfp4"|"bf16", "recipe": fingerprint, "kernel": path, ...}``.
    Returns one human-readable line per difference (empty when both engines ran the same way).
    """
    lines = []
    for layer in sorted(set(a) | set(b)):
        if layer not in b:
            lines.append(f"{layer}: only in the {names[0]} ({dict(a[layer])})")
            continue
        if layer not in a:
            lines.append(f"{layer}: only in the {names[1]} ({dict(b[layer])})")
            continue
        for key in sorted(set(a[layer]) | set(b[layer])):
            va, vb = a[layer].get(key), b[layer].get(key)
            if va != vb:
                lines.append(f"{layer}: {key} differs: {names[0]}={va!r}, {names[1]}={vb!r}")
    return lines


def plot_report(
    path: str | Path,
    mismatch: MismatchReport | None = None,
    layers: LayerComparison | None = None,
    title: str = "miniTE diagnostics",
) -> Path:
    """Save a PNG: mismatch per token position and/or max |diff| per layer (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (mismatch, layers) if p is not None]
    if not panels:
        raise ValueError("plot_report needs a mismatch report, a layer comparison, or both")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 3.2 * len(panels)), squeeze=False)
    row = 0
    if mismatch is not None:
        ax = axes[row][0]
        pos = [p["position"] for p in mismatch.per_position]
        ax.plot(pos, [p["mean_abs_diff"] for p in mismatch.per_position], label="mean |lp_s-lp_l|")
        ax.plot(pos, [p["max_abs_diff"] for p in mismatch.per_position], label="max |lp_s-lp_l|")
        ax.set_xlabel("token position")
        ax.set_ylabel("log-prob difference")
        ax.set_title(
            f"token_mult_prob_error = {mismatch.summary.get('token_mult_prob_error', 1):.6f}"
        )
        ax.legend()
        row += 1
    if layers is not None:
        ax = axes[row][0]
        diffs = [max(r["max_abs_diff"], 1e-12) for r in layers.rows]
        colors = ["tab:green" if r["bitwise_equal"] else "tab:red" for r in layers.rows]
        ax.bar(range(len(diffs)), diffs, color=colors)
        ax.set_yscale("log")
        ax.set_xticks(range(len(diffs)), [r["name"] for r in layers.rows], rotation=90, fontsize=6)
        ax.set_ylabel("max |diff| (green: bitwise equal)")
        ax.set_title(f"first divergent layer: {layers.first_divergent or 'none'}")
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def layer_health(
    activations: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    recipe: NVFP4Recipe,
) -> list[dict[str, Any]]:
    """Quantizer health of each layer's activation (quantized per row, 1x16) and weight (the
    recipe's weight quantization), ``{"name", "tensor", **quantizer_health}`` per row."""
    from .health import quantizer_health
    from .linear import quantize_weight
    from .nvfp4 import quantize_nvfp4

    rows = []
    for name, x in activations.items():
        x2 = x.reshape(-1, x.shape[-1])
        q = quantize_nvfp4(x2, amax=recipe.activation_amax, recipe=recipe)
        rows.append({"name": name, "tensor": "activation", **quantizer_health(x2, q)})
    for name, w in weights.items():
        health = quantizer_health(w, quantize_weight(w, recipe=recipe, name=name))
        rows.append({"name": name, "tensor": "weight", **health})
    return rows


def health_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A terminal table of :func:`layer_health` rows."""
    keys = ("amax", "snr_db", "zero_scales", "subnormal_scales", "saturated_scales",
            "flushed_to_zero")  # fmt: skip
    lines = [f"{'layer':48s} {'tensor':10s}" + "".join(f"{k:>17s}" for k in keys)]
    for r in rows:
        lines.append(f"{r['name']:48s} {r['tensor']:10s}" + "".join(f"{r[k]:17.4g}" for k in keys))
    return "\n".join(lines)
