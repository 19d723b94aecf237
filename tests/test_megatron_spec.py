"""The miniTE layer specs, the ``--spec`` objects, config refusals, the CPU shim, Bridge hook."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.spec_utils import ModuleSpec, import_module

from minite.tiny_model import TinyModelSpec, tiny_config
from minite_common import NVFP4Recipe
from minite_megatron import (
    MiniTEColumnParallelLinear,
    MiniTERowParallelLinear,
    get_gpt_decoder_block_minite_spec,
    gpt_model_kwargs_from_hf,
    register_with_megatron_bridge,
    token_logprobs,
    transformer_config_from_hf,
)
from minite_megatron.cpu_shim import shim_targets

pytestmark = pytest.mark.usefixtures("megatron_world")


def _build(spec_factory, tiny: TinyModelSpec | None = None, **overrides) -> GPTModel:
    hf = tiny_config(tiny or TinyModelSpec())
    config = transformer_config_from_hf(hf, **overrides)
    spec = spec_factory if isinstance(spec_factory, ModuleSpec) else spec_factory(config)
    return GPTModel(config, spec, **gpt_model_kwargs_from_hf(hf))


@pytest.mark.parametrize(
    "name, moe",
    [("minite_qk_norm_layer_spec", False), ("minite_moe_qk_norm_layer_spec", True)],
)
def test_spec_argument_objects_build_nvfp4_models(name, moe):
    """``--spec minite_megatron.spec NAME`` resolves (Megatron's import_module) to a ModuleSpec
    that builds a GPTModel whose decoder linears are miniTE's and whose LM head is not."""
    spec = import_module(("minite_megatron.spec", name))
    model = _build(spec, TinyModelSpec(moe=moe))
    linears = [m for m in model.modules() if isinstance(m, MiniTEColumnParallelLinear)]
    rows = [m for m in model.modules() if isinstance(m, MiniTERowParallelLinear)]
    experts = 8 if moe else 1
    assert len(linears) == len(rows) == 2 * (1 + experts)
    assert type(model.output_layer).__name__ == "ColumnParallelLinear"
    assert torch.isfinite(token_logprobs(model, torch.randint(0, 256, (1, 16)))).all()


def test_callable_spec_object_builds_the_block_with_the_recipe_file(tmp_path, monkeypatch):
    """slime calls the ``--spec`` object as ``spec(args, config, vp_stage)``: ``minite_block_spec``
    returns this config's block spec, with the recipe of the file named by ``MINITE_RECIPE``."""
    provider = import_module(("minite_megatron.spec", "minite_block_spec"))
    hf = tiny_config(TinyModelSpec(num_layers=3))
    config = transformer_config_from_hf(hf)

    def nvfp4_layers() -> list[bool]:
        model = GPTModel(config, provider(None, config, None), **gpt_model_kwargs_from_hf(hf))
        return [
            isinstance(layer.self_attention.linear_qkv, MiniTEColumnParallelLinear)
            and isinstance(layer.mlp.linear_fc2, MiniTERowParallelLinear)
            for layer in model.decoder.layers
        ]

    monkeypatch.delenv("MINITE_RECIPE", raising=False)
    assert nvfp4_layers() == [True, True, True]
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(NVFP4Recipe(bf16_last_layers=1).to_dict()))
    monkeypatch.setenv("MINITE_RECIPE", str(path))
    assert nvfp4_layers() == [True, True, False]
    with pytest.raises(ValueError, match="gradient_accumulation_fusion"):
        provider(None, transformer_config_from_hf(hf, gradient_accumulation_fusion=True), None)


def test_hidden_size_not_a_multiple_of_16_fails_clearly():
    with pytest.raises(ValueError, match="multiple of 16"):
        _build(get_gpt_decoder_block_minite_spec, TinyModelSpec(hidden_size=40))


def test_head_dim_not_a_multiple_of_16_fails_clearly():
    with pytest.raises(ValueError, match="16x16 weight tiles"):
        _build(get_gpt_decoder_block_minite_spec, TinyModelSpec(head_dim=24))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(fp8="e4m3"), "fp8"),
        (dict(fp4="e2m1"), "fp4"),
        (dict(tp_comm_overlap=True), "tp_comm_overlap"),
        (dict(gradient_accumulation_fusion=True), "gradient_accumulation_fusion"),
        (dict(first_last_layers_bf16=True), "bf16_first_layers"),
    ],
)
def test_transformer_engine_options_fail_clearly(overrides, message):
    with pytest.raises(ValueError, match=message):
        _build(get_gpt_decoder_block_minite_spec, **overrides)
    spec = import_module(("minite_megatron.spec", "minite_qk_norm_layer_spec"))
    if "first_last_layers_bf16" not in overrides:  # the linears refuse the others themselves
        with pytest.raises(ValueError, match=message):
            _build(spec, **overrides)


def test_grouped_experts_and_quantized_router_fail_clearly():
    with pytest.raises(ValueError, match="moe_grouped_gemm"):
        _build(get_gpt_decoder_block_minite_spec, TinyModelSpec(moe=True), moe_grouped_gemm=True)
    recipe = NVFP4Recipe(bf16_modules=("{,*.}embed_tokens", "{,*.}lm_head"))
    with pytest.raises(ValueError, match="mlp.gate"):
        _build(lambda c: get_gpt_decoder_block_minite_spec(c, recipe), TinyModelSpec(moe=True))


def test_linear_takes_keywords_of_newer_megatron_releases():
    """Megatron-Core 0.19 passes ``name=``; on releases without it the keyword is dropped."""
    config = transformer_config_from_hf(tiny_config(TinyModelSpec()))
    linear = MiniTEColumnParallelLinear(
        128,
        512,
        config=config,
        init_method=config.init_method,
        bias=False,
        gather_output=False,
        skip_bias_add=True,
        is_expert=False,
        tp_comm_buffer_name="fc1",
        name="decoder.layers.0.mlp.linear_fc1",
    )
    assert [s.part for s in linear.row_segments] == ["gate_proj", "up_proj"]


def test_cpu_shim_is_scoped_to_megatron_calls():
    model = _build(get_gpt_decoder_block_minite_spec)
    token_logprobs(model, torch.randint(0, 256, (1, 8)))
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()


def test_cpu_shim_changes_nothing_when_cuda_is_present():
    code = (
        "import torch\n"
        "torch.cuda.is_available = lambda: True\n"
        "from megatron.core.transformer.moe import moe_utils\n"
        "from minite_megatron.cpu_shim import apply_cpu_shim, shim_targets\n"
        "before = [getattr(owner, name) for owner, name in shim_targets()]\n"
        "had = hasattr(moe_utils, 'te_general_gemm')\n"
        "assert apply_cpu_shim() is False\n"
        "assert [getattr(owner, name) for owner, name in shim_targets()] == before\n"
        "assert hasattr(moe_utils, 'te_general_gemm') == had\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(getattr(getattr(o, n), "__minite_cpu_shim__", False) for o, n in shim_targets())


def test_megatron_bridge_registration_is_guarded():
    installed = importlib.util.find_spec("megatron.bridge") is not None
    assert register_with_megatron_bridge() is installed
