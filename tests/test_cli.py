"""The ``minite`` console script as a user runs it."""

import re
import subprocess
import sys

import pytest


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


def _all_help(parser) -> dict[str, str]:
    """The help text of ``parser`` and of every subcommand under it, by command path."""
    import argparse

    texts = {parser.prog: parser.format_help()}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                texts.update(_all_help(sub))
    return texts


def test_help_texts_are_plain_text():
    from minite.cli import build_parser

    texts = _all_help(build_parser())
    assert "minite diagnose" in texts and "minite debug bisect" in texts
    for prog, text in texts.items():
        assert "``" not in text and not re.search(r":[a-z]+:`", text), (prog, text)
    assert "minite.diagnostics.read_logprob_file" not in texts["minite diagnose"]
    assert "(format: minite_common.diagnostics.read_logprob_file)" in texts["minite diagnose"]


def test_user_errors_print_one_line_and_exit_2(tiny_dense_dir, tmp_path):
    bad = {"list.json": "[1, 2]", "broken.json": "{not json", "field.json": '{"blocksize": 16}'}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
    cases = {
        ("--recipe", "list.json"): r"--recipe: .*list\.json holds a JSON list; a recipe file",
        ("--recipe", "broken.json"): r"--recipe: .*broken\.json is not valid JSON",
        ("--recipe", "field.json"): r"--recipe \(.*field\.json\): unknown NVFP4Recipe fields",
        ("--recipe", "missing.json"): r"--recipe: cannot read the recipe file .*missing\.json",
    }
    for (flag, name), pattern in cases.items():
        out = _minite("quantize-model", str(tiny_dense_dir), str(tmp_path / "q"), flag,
                      str(tmp_path / name))  # fmt: skip
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
        assert re.match(r"minite: error: " + pattern, out.stderr), out.stderr
    for name, text, pattern in (
        ("bad.yaml", "rules: [", r"bad\.yaml: not valid YAML"),
        ("no.yaml", "rules:\n  - {layers: '*', disable_quantization: 'no'}\n",
         r"no\.yaml: rule 0: disable_quantization must be true or false"),
    ):  # fmt: skip
        (tmp_path / name).write_text(text)
        out = _minite("debug", "check", str(tmp_path / name))
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert re.match(r"minite: error: .*" + pattern, out.stderr), out.stderr
    out = _minite("quantize-model", str(tmp_path / "nowhere"), str(tmp_path / "q"))
    assert out.returncode == 2 and out.stderr.startswith("minite: error: [Errno 2]"), out.stderr
    assert not (tmp_path / "q").exists()


def test_a_bug_keeps_its_traceback():
    from minite.cli import main

    # A "signal" that is not a function: a TypeError deep in the command, not a user error.
    with pytest.raises(TypeError, match="not callable"):
        main(["debug", "bisect", "--signal", "minite.debug_signals:SIGNAL_TEXT"])
