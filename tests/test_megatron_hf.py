"""HF Qwen3 / Qwen3-MoE <-> Megatron GPTModel: config, loader, BF16 and NVFP4 export (CPU)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from minite_common import DEFAULT_RECIPE, quantize_weight
from minite_common.checkpoint import nvfp4_from_state, quantization_config
from minite_megatron import (
    build_gpt_model_from_hf,
    export_hf_weights,
    hf_quantization_config,
    load_hf_weights,
    token_logprobs,
    transformer_config_from_hf,
)
from minite_megatron.hf import HFCheckpoint, weight_bindings
from minite_megatron.layout import qkv_segments

pytestmark = pytest.mark.usefixtures("megatron_world")


def _tokens(seed: int, batch: int = 2, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(tokens).logits
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]


def _checkpoint_tensors(hf_dir) -> dict[str, torch.Tensor]:
    ckpt = HFCheckpoint(hf_dir)
    return {name: ckpt.read(name) for name in ckpt.names()}


def _save_export(model, hf_dir, out_dir) -> None:
    out_dir.mkdir()
    for file in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(hf_dir / file, out_dir / file)
    save_file(dict(export_hf_weights(model)), str(out_dir / "model.safetensors"))


def test_transformer_config_from_hf_moe(tiny_moe_dir):
    hf = AutoConfig.from_pretrained(tiny_moe_dir)
    hf.mlp_only_layers = [1]
    config = transformer_config_from_hf(hf)
    assert (config.num_layers, config.hidden_size, config.kv_channels) == (2, 128, 32)
    assert (config.num_attention_heads, config.num_query_groups) == (4, 2)
    assert config.qk_layernorm and config.gated_linear_unit and config.normalization == "RMSNorm"
    assert not config.add_bias_linear and config.params_dtype == torch.bfloat16
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (
        8,
        2,
        64,
    )
    assert config.moe_layer_freq == [1, 0] and not config.moe_router_pre_softmax
    hf.model_type = "llama"
    with pytest.raises(ValueError, match="not supported"):
        transformer_config_from_hf(hf)


def test_bf16_megatron_model_matches_transformers(hf_dir):
    """The loader maps every tensor right: Megatron with its own BF16 linears gives the HF
    model's log-probs up to BF16 kernel differences (measured max |diff| ~0.006 nats)."""
    tokens = _tokens(0)
    megatron_lp = token_logprobs(build_gpt_model_from_hf(hf_dir, nvfp4=False), tokens).detach()
    hf_lp = _hf_logprobs(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16), tokens)
    diff = (megatron_lp - hf_lp).abs()
    assert diff.max().item() < 0.05 and diff.mean().item() < 0.01


def test_bf16_export_is_the_checkpoint_and_loads_into_transformers(hf_dir, tmp_path):
    model = build_gpt_model_from_hf(hf_dir)
    original = _checkpoint_tensors(hf_dir)
    exported = dict(export_hf_weights(model))
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert tensor.dtype == exported[name].dtype and torch.equal(tensor, exported[name]), name
    _save_export(model, hf_dir, tmp_path / "export")
    tokens = _tokens(1)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.bfloat16)
    source = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    assert torch.equal(_hf_logprobs(reloaded, tokens), _hf_logprobs(source, tokens))


def test_export_after_training_round_trips_through_the_loader(tiny_moe_dir, tmp_path):
    model = build_gpt_model_from_hf(tiny_moe_dir)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    (-token_logprobs(model, _tokens(2)).mean()).backward()
    optimizer.step()
    _save_export(model, tiny_moe_dir, tmp_path / "trained")
    reloaded = build_gpt_model_from_hf(tmp_path / "trained")
    untrained = build_gpt_model_from_hf(tiny_moe_dir)
    for (name, p), (_, q) in zip(
        model.named_parameters(), reloaded.named_parameters(), strict=True
    ):
        assert torch.equal(p, q), name
    assert not torch.equal(model.output_layer.weight, untrained.output_layer.weight)
    assert torch.equal(
        token_logprobs(model, _tokens(3)).detach(), token_logprobs(reloaded, _tokens(3)).detach()
    )


def test_quantized_export_is_what_both_engines_compute_with(hf_dir):
    model = build_gpt_model_from_hf(hf_dir)
    exported = dict(export_hf_weights(model, quantized=True))
    original = _checkpoint_tensors(hf_dir)
    nvfp4_prefixes = {n.removesuffix(".weight_scale_2") for n in exported if "weight_scale_2" in n}
    for name, tensor in original.items():
        prefix = name.removesuffix(".weight")
        if prefix not in nvfp4_prefixes:
            assert torch.equal(exported[name], tensor), name
            continue
        w_q = nvfp4_from_state(prefix, exported, tuple(tensor.shape), DEFAULT_RECIPE)
        expected = quantize_weight(tensor)
        assert torch.equal(w_q.codes, expected.codes), name
        assert torch.equal(w_q.scales.view(torch.uint8), expected.scales.view(torch.uint8))
        assert torch.equal(w_q.decode_scale, expected.decode_scale)
    experts = model.config.num_moe_experts or 1
    assert len(nvfp4_prefixes) == model.config.num_layers * (4 + 3 * experts)
    assert hf_quantization_config(model) == quantization_config(DEFAULT_RECIPE)
    # The learner's own quantized q/k/v rows are the exported tensors' rows.
    qkv = model.decoder.layers[0].self_attention.linear_qkv
    learner = qkv.quantized_weight()
    for s in qkv_segments(4, 2, 32):
        prefix = f"model.layers.0.self_attn.{s.part}"
        rows = exported[f"{prefix}.weight"][s.hf_start : s.hf_start + s.rows]
        assert torch.equal(learner.codes[s.local_start : s.local_start + s.rows], rows)


def test_loader_refuses_missing_and_misshapen_tensors(tiny_dense_dir, tmp_path):
    model = build_gpt_model_from_hf(tiny_dense_dir, load_weights=False)
    tensors = _checkpoint_tensors(tiny_dense_dir)
    broken = tmp_path / "broken"
    broken.mkdir()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(KeyError, match="k_proj"):
        load_hf_weights(model, broken)
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(48, 128, dtype=torch.bfloat16)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj"):
        load_hf_weights(model, broken)
    assert len(list(weight_bindings(model))) == 1 + 2 * 8 + 2
