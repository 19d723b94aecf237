"""Precision debugging applied identically in both engines (issue: per-layer BF16 switches,
tensor statistics, bisection), with the real vLLM and Megatron-Core."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from minite.alignment import build_learner, layer_alignment, start_sampler, stop_sampler
from minite_common import DEFAULT_RECIPE
from minite_common.debug import (
    ENV_VAR,
    DebugConfig,
    DebugConfigError,
    activate,
    bisect_layers,
    check_same_layers,
    deactivate,
)
from minite_megatron.capture import execution_fingerprints, hf_linears, select_columns

DISABLED = "model.layers.1.mlp.down_proj"
LOGGED = "model.layers.0.self_attn.o_proj"
PROMPT_IDS = list(b"Debugging precision, one layer at a time: 3+4=7")


def test_bad_configs_fail_clearly():
    with pytest.raises(DebugConfigError, match="unknown feature.*fake_quant"):
        DebugConfig.from_dict({"rules": [{"layers": "*", "fake_quant": True}]})
    with pytest.raises(DebugConfigError, match=r"rule 0: layers: pattern 'model\.\(' uses regular"):
        DebugConfig.from_dict({"rules": [{"layers": "model.(", "disable_quantization": True}]})
    with pytest.raises(DebugConfigError, match="freq \\(an integer >= 1\\)"):
        DebugConfig.from_dict({"rules": [{"layers": "*", "log_tensor_stats": {"freq": 0}}]})
    config = DebugConfig.from_dict(
        {"rules": [{"layers": "*.q_proj", "disable_quantization": True}]}
    )
    with pytest.raises(DebugConfigError, match="matches no layer of the learner"):
        config.check_layers(["model.layers.0.mlp.up_proj"], "learner")
    with pytest.raises(DebugConfigError, match="one engine only.*layers.3.self_attn.q_proj"):
        check_same_layers(["model.layers.3.self_attn.q_proj"], [], config)


def test_config_values_of_the_wrong_type_are_refused():
    rule = {"layers": DISABLED}
    for value in ("no", "false", 1, None):
        with pytest.raises(DebugConfigError, match="rule 0: disable_quantization must be true or"):
            DebugConfig.from_dict({"rules": [{**rule, "disable_quantization": value}]})
    with pytest.raises(DebugConfigError, match="tensorboard must be true or false.*'yes'"):
        DebugConfig.from_dict({"tensorboard": "yes"})
    with pytest.raises(DebugConfigError, match="rules: expected a list of rules.*int 5"):
        DebugConfig.from_dict({"rules": 5})
    with pytest.raises(DebugConfigError, match="rule 0: expected a mapping"):
        DebugConfig.from_dict({"rules": ["model.layers.0.mlp.up_proj"]})
    with pytest.raises(DebugConfigError, match="a debug config is a mapping"):
        DebugConfig.from_dict([rule])
    with pytest.raises(DebugConfigError, match="freq"):
        DebugConfig.from_dict({"rules": [{**rule, "log_tensor_stats": {"freq": "10"}}]})
    assert not DebugConfig.from_dict({"rules": [rule]}).rules[0].disable_quantization
    assert (
        DebugConfig.from_dict({"rules": [{**rule, "disable_quantization": True}]})
        .rules[0]
        .disable_quantization
    )


def test_disable_quantization_goes_into_the_recipe_fingerprint():
    config = DebugConfig.disabling([DISABLED])
    recipe = config.apply_to_recipe(DEFAULT_RECIPE)
    assert recipe.fingerprint() != DEFAULT_RECIPE.fingerprint()
    assert recipe.keeps_bf16("model.layers.1.mlp.down_proj")
    assert not recipe.keeps_bf16("model.layers.11.mlp.down_proj")
    assert DebugConfig().apply_to_recipe(DEFAULT_RECIPE) is DEFAULT_RECIPE


def test_bisect_finds_the_layer_in_log2_rounds():
    layers = [f"l{i}" for i in range(16)]
    calls = []

    def signal(bf16):
        calls.append(bf16)
        return 0.1 if "l11" in bf16 else 1.0

    layer, history = bisect_layers(layers, signal, log=lambda _: None)
    assert layer == "l11"
    assert len(calls) == 1 + 2 * 4  # baseline + two halves per round, log2(16) rounds


@pytest.fixture(scope="module")
def debug_engines(tiny_dense_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("debug")
    config = {
        "output_dir": str(out / "stats"),
        "rules": [
            {"layers": DISABLED, "disable_quantization": True},
            {"layers": LOGGED, "log_tensor_stats": {"freq": 1}},
        ],
    }
    path = out / "debug.yaml"
    path.write_text(yaml.safe_dump(config))
    os.environ[ENV_VAR] = str(path)  # read by the vLLM workers this engine spawns
    activate(DebugConfig.load(path), "megatron")
    try:
        llm = start_sampler(tiny_dense_dir)
        learner = build_learner(tiny_dense_dir, nvfp4=True)
    finally:
        del os.environ[ENV_VAR]
        deactivate("megatron")
    yield llm, learner, out / "stats"
    stop_sampler(llm)


def test_disabling_one_layer_changes_exactly_that_layer_in_both_engines(debug_engines):
    llm, learner, _ = debug_engines
    sampler_fp = llm.collective_rpc("get_execution_fingerprints")[0]
    learner_fp = execution_fingerprints(learner)
    down = "model.layers.1.mlp.down_proj"
    assert sampler_fp[down]["mode"] == learner_fp[down]["mode"] == "bf16"
    nvfp4 = {n for n, r in sampler_fp.items() if r["mode"] == "nvfp4"}
    assert "model.layers.0.mlp.down_proj" in nvfp4 and len(nvfp4) == 13
    assert {r["recipe"] for r in sampler_fp.values()} == {r["recipe"] for r in learner_fp.values()}
    comparison, fingerprint_diff, sampler = layer_alignment(llm, learner, PROMPT_IDS)
    assert fingerprint_diff == []
    linears = {n: (m, w) for m, cols in hf_linears(learner).values() for n, w in cols.items()}
    module, _ = linears[down]
    x = sampler[f"{down}:input"]
    with torch.no_grad():
        learner_out = module(x.unsqueeze(1))[0].squeeze(1)
        bf16_out = torch.nn.functional.linear(x, module.weight)
    assert torch.equal(learner_out, sampler[f"{down}:output"])  # the engines still agree
    assert torch.equal(learner_out, bf16_out)  # and that layer is plain BF16 now
    q_module, where = linears["model.layers.1.self_attn.q_proj"]
    xq = sampler["model.layers.1.self_attn.q_proj:input"]
    with torch.no_grad():
        q_out = select_columns(q_module(xq.unsqueeze(1))[0].squeeze(1), where)
        q_bf16 = select_columns(torch.nn.functional.linear(xq, q_module.weight), where)
    assert torch.equal(q_out, sampler["model.layers.1.self_attn.q_proj:output"])
    assert not torch.equal(q_out, q_bf16)  # its neighbours stay NVFP4


def test_stats_files_from_both_engines(debug_engines):
    _, _, stats_dir = debug_engines
    files = {f.name.split("-")[0]: f for f in stats_dir.glob("*.jsonl")}
    assert set(files) == {"vllm", "megatron"}
    for engine, f in files.items():
        records = [json.loads(line) for line in f.read_text().splitlines()]
        assert records and {r["layer"] for r in records} == {"model.layers.0.self_attn.o_proj"}
        kinds = {r["tensor"] for r in records}
        assert {"activation", "weight", "output"} <= kinds, engine
        for r in records:
            for key in ("min", "max", "amax", "dynamic_range", "block_dynamic_range",
                        "zero_scales", "saturated_scales", "subnormal_scales", "quant_mse",
                        "snr_db"):  # fmt: skip
                assert key in r, (engine, key)
            assert r["amax"] > 0 and r["min"] <= r["max"]
            assert 0 <= r["saturated_scales"] <= 1
            if r["tensor"] == "activation":
                assert 10 < r["snr_db"] < 40  # NVFP4 on activations: about 20 dB


def test_bisect_cli_on_the_embedded_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "minite.cli", "debug", "bisect", "--json", str(tmp_path / "b.json")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads((tmp_path / "b.json").read_text())
    assert len(result["rounds"]) == 1 + 2 * 3  # 8 layer groups -> 3 rounds
    baseline = result["rounds"][0]["signal"]
    assert min(r["signal"] for r in result["rounds"][1:]) < baseline
