"""Tiny Qwen3-architecture models and a byte-level tokenizer, written locally (no hub access).

The demo and the tests use these: a real Hugging Face model directory (``config.json``,
``model.safetensors``, tokenizer files) that vLLM, Transformers and miniTE's Megatron loader read
like any downloaded checkpoint. Every linear dimension is a multiple of 16, as NVFP4 needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")
VOCAB_SIZE = 272  # 256 bytes + special tokens, rounded up to a multiple of 16


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Qwen3 (dense) or Qwen3-MoE model."""

    moe: bool = False
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    num_experts: int = 8
    experts_per_token: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 512


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def write_byte_tokenizer(path: str | Path) -> None:
    """Write a byte-level tokenizer (one token per byte, ids 0-255, then special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in byte_to_unicode().items()}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[1]
    )
    fast.save_pretrained(str(path))


def tiny_config(spec: TinyModelSpec):
    """The Transformers config of ``spec`` (``Qwen3Config`` or ``Qwen3MoeConfig``)."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=256,
        pad_token_id=257,
        bos_token_id=None,
        dtype="bfloat16",
    )
    if not spec.moe:
        config = Qwen3Config(intermediate_size=spec.intermediate_size, **common)
        config.architectures = ["Qwen3ForCausalLM"]
        return config
    config = Qwen3MoeConfig(
        intermediate_size=spec.intermediate_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.experts_per_token,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        mlp_only_layers=[],
        **common,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def write_tiny_model(
    path: str | Path,
    spec: TinyModelSpec = TinyModelSpec(),
    *,
    seed: int = 0,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write a tiny Qwen3 model directory with random BF16 weights (or ``state_dict``)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(spec), dtype=torch.bfloat16)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    model.save_pretrained(str(path), safe_serialization=True)
    write_byte_tokenizer(path)
    (path / "minite_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=1))
    return path
