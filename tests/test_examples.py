"""The adoption example runs as the README says."""

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parent.parent / "examples" / "adopt_minite.py"


def test_adoption_example_runs():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "token_mult_prob_error" in out.stdout and "weights pushed" in out.stdout
