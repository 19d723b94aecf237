"""The main job as CI runs it: ``minite demo --steps 2 --tiny``, twice (reproducibility)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TIMING_KEYS = {"sample_s", "step_s"}


def _run_demo(out, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "minite.cli", "demo", "--steps", "2", "--tiny", "--out", str(out),
         *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report:" in proc.stdout
    return json.loads((out / "report.json").read_text())


def _steps(report: dict, setup_prefix: str) -> list[dict]:
    return [r for r in report["records"] if "step" in r and r["setup"].startswith(setup_prefix)]


def test_demo_runs_end_to_end_and_is_reproducible(tmp_path):
    first = _run_demo(tmp_path / "a")
    strict = _steps(first, "miniTE strict")
    usual = _steps(first, "miniTE sampler + BF16")
    assert len(strict) == len(usual) == 2
    for r in strict + usual:
        for key in ("reward", "loss", "token_mult_prob_error", "k3_kl", "tis_weight_mean"):
            assert math.isfinite(r[key]), key
        assert 0.0 <= r["reward"] <= 1.0
    for r in strict:  # vLLM holds the learner's quantized bits, and every log-prob agrees
        assert r["weights_bitwise_in_sync"] is True
        assert r["token_mult_prob_error"] == 1.0 and r["frac_bitwise_equal"] == 1.0
        assert r["tis_weight_mean"] == 1.0
    for r in usual:
        assert r["token_mult_prob_error"] > 1.0 and r["weights_bitwise_in_sync"] is None
    assert (tmp_path / "a" / "report.png").read_bytes()[:4] == b"\x89PNG"
    config = first["config"]  # JSON types, not strings
    assert config["steps"] == 2 and config["strict"] is True and config["compare"] is True
    assert config["model"] is None and config["lr"] == 2e-3 and config["tiny"] is True
    assert config["out"] == str(tmp_path / "a")
    second = _run_demo(tmp_path / "b")

    def strip(report):
        return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in report["records"]]

    assert strip(first) == strip(second)


def test_demo_without_strict_mode_keeps_the_linears_in_sync(tmp_path):
    report = _run_demo(tmp_path / "c", "--no-strict", "--no-compare")
    steps = _steps(report, "miniTE sampler + learner")
    assert len(steps) == 2 and all(r["weights_bitwise_in_sync"] is True for r in steps)
    assert all(1.0 <= r["token_mult_prob_error"] < 1.5 for r in steps)


def test_demo_output_folder_is_ignored_by_git():
    root = Path(__file__).resolve().parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "check-ignore", "-q", "minite-demo/report.json"], cwd=root)
    assert proc.returncode == 0, "minite-demo/ (the demo's default output) is not in .gitignore"
