"""The main job as CI runs it: ``minite demo --steps 2 --tiny``, twice (reproducibility)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

TIMING_KEYS = {"sample_s", "step_s"}


def _run_demo(out) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "minite.cli", "demo", "--steps", "2", "--tiny", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report:" in proc.stdout and "miniTE sampler + miniTE learner" in proc.stdout
    return json.loads((out / "report.json").read_text())


def test_demo_runs_end_to_end_and_is_reproducible(tmp_path):
    first = _run_demo(tmp_path / "a")
    steps = [r for r in first["records"] if "step" in r]
    assert len(steps) == 2
    for r in steps:
        assert r["weights_bitwise_in_sync"] is True  # vLLM holds the learner's quantized bits
        for key in ("reward", "loss", "token_mult_prob_error", "k3_kl", "tis_weight_mean"):
            assert math.isfinite(r[key]), key
        assert r["token_mult_prob_error"] >= 1.0 and 0.0 <= r["reward"] <= 1.0
    assert (tmp_path / "a" / "report.png").read_bytes()[:4] == b"\x89PNG"
    second = _run_demo(tmp_path / "b")

    def strip(report):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in report["records"]]

    assert strip(first) == strip(second)
