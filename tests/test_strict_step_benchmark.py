"""The strict decode-step benchmark (``benchmarks/strict_step.py``) computes the same model in
both modes: its ``--cpu-smoke`` run (tiny Qwen3 layer and head, paged and contiguous KV caches
holding the same values) gives strict and default outputs within BF16 rounding where no NVFP4
activation quantization intervenes, and within the usual NVFP4 code-flip spread after it; and the
learner benchmark's ``minite_strict`` layer (its own rotary embedding, no SDPA swap) computes the
``minite`` layer's function."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_strict_step_cpu_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/strict_step.py", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "strict_step.json").read_text())
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["finite"] == 1.0
        # rotated q/k (the qkv linear's input is bitwise equal) and the attention over the cache:
        # BF16 rounding of the ops apart (default SDPA vs the strict fixed-order attention)
        assert r["q_rel"] < 1e-2 and r["k_rel"] < 1e-2, r
        assert r["attention_rel"] < 1e-2, r
        # the head on the same inputs: norm, LM head, log-softmax
        assert r["head_logprobs_max_abs"] < 5e-2, r
        # the whole model (layer, then head): an ulp may move an NVFP4 activation code
        assert r["residual_rel"] < 5e-2, r
        assert r["logprobs_rel"] < 5e-2, r
        assert r["logprobs_max_abs"] < 1.0, r


@pytest.mark.usefixtures("megatron_world")
def test_learner_strict_variant_matches_minite() -> None:
    """The layer's own contribution (output minus input, input gradient minus output gradient):
    strict and default miniTE apart by NVFP4 code flips (about 0.06 and 0.1 here); a strict layer
    that also got Megatron's rotary embedding lands about 0.5 away, a BF16 layer about 0.4."""
    import learner

    shape, cpu = learner.TINY["dense"], torch.device("cpu")
    outs = {}
    for variant in ("minite", "minite_strict"):
        layer, config = learner.build_layer(shape, variant, "sdpa", cpu)
        runner = learner.Runner(layer, config, shape, 32, 2, cpu)
        assert learner.is_strict(layer) == (variant == "minite_strict")
        assert (runner.rope is None) == (variant == "minite_strict")
        out = layer(
            hidden_states=runner.hidden, attention_mask=runner.mask, rotary_pos_emb=runner.rope
        )
        out = out[0] if isinstance(out, tuple) else out
        out.backward(runner.grad)
        outs[variant] = (
            out.detach().float() - runner.hidden.detach().float(),
            runner.hidden.grad.float() - runner.grad.float(),
        )
    (y0, dx0), (y1, dx1) = outs["minite"], outs["minite_strict"]
    assert float((y1 - y0).norm() / y0.norm()) < 0.2
    assert float((dx1 - dx0).norm() / dx0.norm()) < 0.3
