"""Diagnostics on plain data: mismatch metrics, file format, layer captures, fingerprint diff."""

import json
import math

import pytest
import torch

from minite_common import RecipeMismatchError
from minite_common.diagnostics import (
    DiagnosticsInputError,
    compare_layer_captures,
    compare_logprob_files,
    diff_fingerprints,
    logprob_mismatch,
    plot_report,
    write_logprob_file,
)


def test_identical_runs_are_perfect():
    lp = [torch.tensor([-0.5, -1.25, -3.0]), torch.tensor([-0.1])]
    s = logprob_mismatch(lp, [t.clone() for t in lp]).summary
    assert s["token_mult_prob_error"] == 1.0
    assert s["frac_bitwise_equal"] == 1.0
    assert s["k3_kl_sampler_learner"] == 0.0 == s["k3_kl_learner_sampler"] == s["js_divergence"]
    assert s["tokens"] == 4 and s["sequences"] == 2


def test_metrics_match_their_formulas():
    lp_s = torch.tensor([-1.0, -2.0, -0.5])
    lp_l = torch.tensor([-1.1, -1.9, -0.5])
    r = (lp_l - lp_s).double()
    s = logprob_mismatch([lp_s], [lp_l], tis_cap=1.05).summary
    assert s["token_mult_prob_error"] == pytest.approx(float(torch.exp(r.abs()).mean()))
    assert s["exp_mean_abs_diff"] == pytest.approx(math.exp(float(r.abs().mean())))
    assert s["k3_kl_sampler_learner"] == pytest.approx(float((r.exp() - r - 1).mean()))
    assert s["k3_kl_learner_sampler"] == pytest.approx(float((r.exp() * r - r.exp() + 1).mean()))
    assert s["max_abs_diff"] == pytest.approx(0.1, rel=1e-5)
    assert s["tis_clip_fraction"] == pytest.approx(1 / 3)
    assert s["frac_bitwise_equal"] == pytest.approx(1 / 3)
    assert s["js_divergence"] > 0


def test_per_position_and_per_sequence():
    lp_s = [torch.zeros(3), torch.zeros(2)]
    lp_l = [torch.tensor([0.0, -0.2, 0.0]), torch.tensor([0.0, -0.4])]
    report = logprob_mismatch(lp_s, lp_l)
    assert [p["max_abs_diff"] for p in report.per_position] == pytest.approx([0, 0.4, 0])
    assert [q["tokens"] for q in report.per_sequence] == [3, 2]


def test_nan_tokens_are_flagged_and_excluded():
    report = logprob_mismatch([[-1.0, float("nan")]], [[-1.0, -2.0]])
    assert report.summary["nonfinite_tokens"] == 1
    assert report.summary["tokens"] == 1 and report.summary["token_mult_prob_error"] == 1.0
    assert any("NaN" in f for f in report.flags)
    assert "FLAG" in report.table()


def test_bad_inputs_raise():
    with pytest.raises(DiagnosticsInputError, match="sequence 0.*position 1"):
        logprob_mismatch([[0.0, 0.0]], [[0.0, 0.0]], sampler_tokens=[[1, 2]],
                         learner_tokens=[[1, 3]])  # fmt: skip
    with pytest.raises(DiagnosticsInputError, match="2 sequences"):
        logprob_mismatch([[0.0], [0.0]], [[0.0]])
    with pytest.raises(RecipeMismatchError, match="allow_recipe_mismatch"):
        logprob_mismatch([[0.0]], [[0.0]], sampler_fingerprint="a", learner_fingerprint="b")
    flagged = logprob_mismatch([[0.0]], [[0.0]], sampler_fingerprint="a",
                               learner_fingerprint="b", allow_recipe_mismatch=True)  # fmt: skip
    assert any("fingerprints differ" in f for f in flagged.flags)


def test_jsonl_files_round_trip_and_check_vocab(tmp_path):
    tokens = [[1, 2, 3], [4, 5]]
    write_logprob_file(tmp_path / "s.jsonl", tokens, [[-1.0, -2.0, -3.0], [-0.5, -0.25]],
                       fingerprint="fp", vocab_size=10, engine="vllm")  # fmt: skip
    write_logprob_file(tmp_path / "l.jsonl", tokens, [[-1.0, -2.5, -3.0], [-0.5, -0.25]],
                       fingerprint="fp", vocab_size=10, engine="megatron")  # fmt: skip
    report = compare_logprob_files(tmp_path / "s.jsonl", tmp_path / "l.jsonl")
    assert report.summary["max_abs_diff"] == pytest.approx(0.5)
    assert report.summary["frac_bitwise_equal"] == pytest.approx(4 / 5)
    write_logprob_file(tmp_path / "v.jsonl", tokens, [[-1.0] * 3, [-1.0] * 2], vocab_size=12)
    with pytest.raises(DiagnosticsInputError, match="vocab sizes differ"):
        compare_logprob_files(tmp_path / "s.jsonl", tmp_path / "v.jsonl")
    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    lines[1] = json.dumps({"id": 0, "tokens": [1, 2, 30], "logprobs": [0, 0, 0]})
    (tmp_path / "bad.jsonl").write_text("\n".join(lines))
    with pytest.raises(DiagnosticsInputError, match="outside the declared vocab"):
        compare_logprob_files(tmp_path / "bad.jsonl", tmp_path / "l.jsonl")


def test_layer_captures_find_the_first_divergent_layer(tmp_path):
    a = {"l0": torch.ones(2, 4), "l1": torch.ones(2, 4), "l2": torch.ones(2, 4)}
    b = {"l0": torch.ones(2, 4), "l1": torch.ones(2, 4) * 1.5, "l2": torch.ones(2, 4) * 2}
    cmp = compare_layer_captures(a, b)
    assert cmp.first_divergent == "l1"
    assert [r["bitwise_equal"] for r in cmp.rows] == [True, False, False]
    assert "first divergent layer: l1" in cmp.table()
    png = plot_report(tmp_path / "r.png", logprob_mismatch([[-1.0]], [[-1.1]]), cmp)
    assert png.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(DiagnosticsInputError, match="shapes differ"):
        compare_layer_captures({"x": torch.ones(2)}, {"x": torch.ones(3)})


def test_fingerprint_diff_names_each_layer():
    a = {"q": {"mode": "nvfp4", "recipe": "r1", "kernel": "k"}, "o": {"mode": "nvfp4"}}
    b = {"q": {"mode": "bf16", "recipe": "r1", "kernel": "k"}, "v": {"mode": "nvfp4"}}
    lines = diff_fingerprints(a, b)
    assert any(line.startswith("q: mode differs") for line in lines)
    assert any(line.startswith("o: only in the sampler") for line in lines)
    assert any(line.startswith("v: only in the learner") for line in lines)
    assert diff_fingerprints(a, a) == []
