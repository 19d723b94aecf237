"""The ``minite`` console script as a user runs it."""

import subprocess
import sys


def _minite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "minite.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_help_lists_the_commands():
    out = _minite("--help")
    assert out.returncode == 0
    assert "quantize-check" in out.stdout


def test_quantize_check_prints_figures_and_passes_batch_invariance():
    out = _minite("quantize-check", "--rows", "40", "--k", "128", "--n", "48")
    assert out.returncode == 0, out.stderr
    assert "bitwise equal" in out.stdout
    snr = [line for line in out.stdout.splitlines() if line.startswith("activation")][0].split()
    assert 15 < float(snr[-6]) < 30  # SNR column; NVFP4 on Gaussian-like data: about 20 dB
