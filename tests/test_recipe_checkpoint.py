"""Recipe fingerprints and BF16 selection, and the on-disk checkpoint format."""

import dataclasses
import time

import pytest
import torch

from minite_common import DEFAULT_RECIPE, NVFP4Recipe, RecipeMismatchError, quantize_weight
from minite_common.checkpoint import (
    nvfp4_from_state,
    nvfp4_to_state,
    quantization_config,
    recipe_from_quantization_config,
)


def test_recipe_round_trips_through_dict_and_keeps_fingerprint():
    recipe = NVFP4Recipe(bf16_first_layers=1, bf16_modules=("*.o_proj",))
    again = NVFP4Recipe.from_dict(recipe.to_dict())
    assert again == recipe
    assert again.fingerprint() == recipe.fingerprint() != DEFAULT_RECIPE.fingerprint()


def test_recipe_rejects_bad_fields():
    with pytest.raises(ValueError, match="blocks of 16"):
        NVFP4Recipe(block_size=32)
    with pytest.raises(ValueError, match="activation_amax"):
        NVFP4Recipe(activation_amax="column")
    with pytest.raises(ValueError, match="unknown NVFP4Recipe fields"):
        NVFP4Recipe.from_dict({"blocksize": 16})
    with pytest.raises(RecipeMismatchError, match="contract v99"):
        NVFP4Recipe.from_dict({"contract_version": 99})


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("lm_head", True),
        ("model.embed_tokens", True),
        ("model.layers.0.mlp.gate", True),
        ("model.layers.0.mlp.gate_proj", False),
        ("model.layers.0.mlp.experts.3.down_proj", False),
        ("model.layers.1.self_attn.q_proj", False),
    ],
)
def test_default_recipe_keeps_embeddings_head_and_router_in_bf16(name, expected):
    assert DEFAULT_RECIPE.keeps_bf16(name) is expected


def test_module_patterns_are_whole_name_globs():
    recipe = NVFP4Recipe(bf16_modules=("model.layers.1.self_attn.{q,k,v}_proj", "*.experts.?"))
    assert recipe.keeps_bf16("model.layers.1.self_attn.k_proj")
    assert not recipe.keeps_bf16("model.layers.1.self_attn.o_proj")
    assert not recipe.keeps_bf16("model.layers.11.self_attn.k_proj")  # the whole name, no search
    assert recipe.keeps_bf16("model.layers.0.mlp.experts.3")
    assert not recipe.keeps_bf16("model.layers.0.mlp.experts.31")
    assert not DEFAULT_RECIPE.keeps_bf16("model.my_lm_head")


def test_module_patterns_cannot_stall_and_regexes_are_refused():
    with pytest.raises(ValueError, match=r"bf16_modules: pattern .* regular-expression syntax"):
        NVFP4Recipe(bf16_modules=("^(.*.*)*X$",))
    with pytest.raises(ValueError, match="regular-expression syntax"):  # an old recipe's default
        NVFP4Recipe.from_dict({"bf16_modules": [r"(^|\.)lm_head$"]})
    with pytest.raises(ValueError, match="more than 64 alternatives"):
        NVFP4Recipe(bf16_modules=("{a,b}" * 7,))
    with pytest.raises(ValueError, match="more than 256"):
        NVFP4Recipe(bf16_modules=("a" * 300,))
    with pytest.raises(ValueError, match="unbalanced braces"):
        NVFP4Recipe(bf16_modules=("model.{a,b",))
    with pytest.raises(ValueError, match="a list of module-name patterns"):
        NVFP4Recipe(bf16_modules="*.o_proj")
    start = time.perf_counter()
    worst = NVFP4Recipe(bf16_modules=("*a" * 100 + "*X", "{*a*,*?*}" * 6 + "X"))
    for n in (16, 1000, 4000):
        assert not worst.keeps_bf16("a" * n)
    assert time.perf_counter() - start < 1.0


def test_first_and_last_layers_in_bf16():
    recipe = NVFP4Recipe(bf16_first_layers=1, bf16_last_layers=1)
    keeps = [recipe.keeps_bf16(f"model.layers.{i}.mlp.down_proj", num_layers=4) for i in range(4)]
    assert keeps == [True, False, False, True]
    with pytest.raises(ValueError, match="layer count"):
        recipe.keeps_bf16("model.layers.2.mlp.down_proj")


def test_checkpoint_tensors_round_trip_bitwise():
    w = torch.randn(48, 64, dtype=torch.bfloat16)
    q = quantize_weight(w)
    state = nvfp4_to_state("model.layers.0.mlp.up_proj", q)
    back = nvfp4_from_state("model.layers.0.mlp.up_proj", state, (48, 64), DEFAULT_RECIPE)
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.scales.view(torch.uint8), q.scales.view(torch.uint8))
    assert torch.equal(back.decode_scale.view(torch.int32), q.decode_scale.view(torch.int32))
    assert torch.equal(back.dequantize(), q.dequantize())


def test_checkpoint_errors_name_the_layer():
    q = quantize_weight(torch.randn(32, 64))
    state = nvfp4_to_state("layer.x", q)
    missing = {k: v for k, v in state.items() if not k.endswith("weight_scale")}
    with pytest.raises(ValueError, match=r"layer\.x.*lacks.*weight_scale"):
        nvfp4_from_state("layer.x", missing, (32, 64), DEFAULT_RECIPE)
    wrong = dict(state, **{"layer.x.weight_scale": state["layer.x.weight_scale"].float()})
    with pytest.raises(ValueError, match=r"layer\.x\.weight_scale: expected torch.float8_e4m3fn"):
        nvfp4_from_state("layer.x", wrong, (32, 64), DEFAULT_RECIPE)
    with pytest.raises(ValueError, match=r"layer\.x\.weight: expected torch.uint8 \[32, 16\]"):
        nvfp4_from_state("layer.x", state, (32, 32), DEFAULT_RECIPE)


def test_quantization_config_detects_edited_recipe():
    cfg = quantization_config(DEFAULT_RECIPE)
    assert recipe_from_quantization_config(cfg) == DEFAULT_RECIPE
    edited = dict(cfg, recipe=dict(cfg["recipe"], weight_block_2d=False))
    with pytest.raises(RecipeMismatchError, match="does not match"):
        recipe_from_quantization_config(edited)
    other = dataclasses.replace(DEFAULT_RECIPE, weight_block_2d=False)
    assert recipe_from_quantization_config(quantization_config(other)) == other
