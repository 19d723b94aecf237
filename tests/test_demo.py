"""The main job as CI runs it: ``minite demo --steps 2 --tiny``, twice (reproducibility), once
more with the CPU kernels capped at AVX2 and one thread (strict mode's figures must not move),
and what the demo claims and plots."""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TIMING_KEYS = {"sample_s", "step_s", "sync_s"}


#: Caps torch's kernels, oneDNN and MKL at AVX2, and one thread: an AVX2-only machine's bits.
RESTRICTED_CPU_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}  # fmt: skip
OUTPUT: dict[str, str] = {}  # stdout per output folder


def _run_demo(out, *extra: str, env: dict[str, str] | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in RESTRICTED_CPU_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "minite.cli", "demo", "--steps", "2", "--tiny", "--out", str(out),
         *extra],
        capture_output=True, text=True, timeout=600, env=base | (env or {}),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report:" in proc.stdout
    OUTPUT[str(out)] = proc.stdout
    return json.loads((out / "report.json").read_text())


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("demo") / "a"
    return out, _run_demo(out)


def _strip(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


def _steps(report: dict, setup_prefix: str) -> list[dict]:
    return [r for r in report["records"] if "step" in r and r["setup"].startswith(setup_prefix)]


def test_demo_runs_end_to_end_and_is_reproducible(default_run, tmp_path):
    out, first = default_run
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
    # The strict learner streams its NVFP4 tensors, the BF16 learner BF16 weights.
    assert 0 < strict[0]["sync_bytes"] < usual[0]["sync_bytes"]
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    config = first["config"]  # JSON types, not strings
    assert config["steps"] == 2 and config["strict"] is True and config["compare"] is True
    assert config["model"] is None and config["lr"] == 2e-3 and config["tiny"] is True
    assert config["out"] == str(out)
    second = _run_demo(tmp_path / "b")
    assert _strip(first["records"]) == _strip(second["records"])


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_strict_demo_figures_do_not_depend_on_the_cpu(default_run, tmp_path):
    """The strict run with torch's, oneDNN's and MKL's kernels capped at AVX2 and one thread
    prints and stores the same figures, and ends with the same learner weights, bit for bit."""
    _, default = default_run
    restricted = _run_demo(tmp_path / "r", "--no-compare", env=RESTRICTED_CPU_ENV)
    strict = [r for r in default["records"] if r["setup"].startswith("miniTE strict")]
    assert any("weights_sha256" in r for r in strict)
    assert _strip(restricted["records"]) == _strip(strict)


def test_demo_claims_only_what_the_run_shows(default_run):
    out, report = default_run
    text = OUTPUT[str(out)]
    tokens = sum(r["tokens"] for r in _steps(report, "miniTE strict"))
    assert f"all {tokens} sampled tokens of 2 steps scored bitwise equal" in text
    assert "every TIS weight exactly 1" in text
    assert "not evidence that one learns faster than the other" in text
    assert "Machine-dependent: the figures of 'miniTE sampler + BF16 learner'" in text
    assert "Machine-independent: every figure of 'miniTE strict sampler + learner'" in text
    assert "(worst step)" in text and "TIS min..max" in text  # the usual setup's spikes


def test_mismatch_panel_is_on_a_log_scale(default_run):
    from minite.demo import figure

    fig = figure(default_run[1]["records"])
    assert fig.axes[1].get_yscale() in ("log", "symlog")
    labels = [line.get_label() for line in fig.axes[1].get_lines()]
    assert "miniTE strict sampler + learner (exactly 0: bitwise equal)" in labels


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
