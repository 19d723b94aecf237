"""Layer lists and a default signal for ``minite debug`` (see :mod:`minite.commands.debug`)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from minite_common import DEFAULT_RECIPE
from minite_common.debug import DebugConfig, activate, deactivate

#: Text the default signal scores (bytes of the tiny tokenizer; any tokenizer works).
SIGNAL_TEXT = "The quick brown fox jumps over the lazy dog. 12+34=46, 7+8=15."


def quantizable_layers(model_dir: str | Path) -> list[str]:
    """Bisection units of an HF Qwen3 / Qwen3-MoE model, in forward order, as module-name
    patterns (:func:`minite_common.recipe.check_module_pattern`): per decoder layer q/k/v
    together, o_proj, gate/up together, down_proj (dense) or all experts (MoE). vLLM fuses each
    unit into one layer, so a unit switches as a whole."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    experts = config.get("num_experts") or config.get("num_local_experts")
    sparse = set(range(config["num_hidden_layers"])) - set(config.get("mlp_only_layers", []))
    units = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        units += [f"{p}.self_attn.{{q,k,v}}_proj", f"{p}.self_attn.o_proj"]
        if experts and i in sparse:
            units.append(f"{p}.mlp.experts.*.{{gate,up,down}}_proj")
        else:
            units += [f"{p}.mlp.{{gate,up}}_proj", f"{p}.mlp.down_proj"]
    return [u for u in units if not DEFAULT_RECIPE.keeps_bf16(u)]


def sampler_layers(model_dir: str | Path) -> list[str]:
    """HF module names of the checkpoint's 2D weights (the linears vLLM loads and quantizes)."""
    from safetensors import safe_open

    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    files = (
        sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
        if index.exists()
        else [path / "model.safetensors"]
    )
    names = []
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if key.endswith(".weight") and len(f.get_slice(key).get_shape()) == 2:
                    names.append(key.removesuffix(".weight"))
    return [n for n in names if "norm" not in n]


@functools.cache
def _reference(model_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import AutoTokenizer

    from minite_megatron import build_gpt_model_from_hf, token_logprobs

    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir)(SIGNAL_TEXT)["input_ids"]])
    with torch.no_grad():
        return ids, token_logprobs(build_gpt_model_from_hf(model_dir, nvfp4=False), ids)


def nvfp4_logprob_error(model_dir: str | Path, bf16_layers: list[str]) -> float:
    """Mean |log-prob difference| between the miniTE learner with ``bf16_layers`` in BF16 and
    the all-BF16 learner, on :data:`SIGNAL_TEXT` (lower: those layers explain more error)."""
    from minite_megatron import build_gpt_model_from_hf, token_logprobs

    ids, reference = _reference(str(model_dir))
    activate(DebugConfig.disabling(bf16_layers), "megatron")
    try:
        model = build_gpt_model_from_hf(model_dir, nvfp4=True)
        with torch.no_grad():
            lp = token_logprobs(model, ids)
    finally:
        deactivate("megatron")
    return float((lp - reference).abs().mean())
