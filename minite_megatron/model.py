"""Building a ready-to-run Megatron ``GPTModel`` from a HF directory, and per-token log-probs."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.tensor_parallel.random import (
    initialize_rng_tracker,
    model_parallel_cuda_manual_seed,
)

from minite_common import DEFAULT_RECIPE, NVFP4Recipe, ops

from .cpu_shim import apply_cpu_shim
from .hf import gpt_model_kwargs_from_hf, load_hf_weights, transformer_config_from_hf
from .spec import get_gpt_decoder_block_minite_spec
from .strict import finalize_strict_model


def init_megatron(tensor_parallel_size: int | None = None, *, seed: int = 0) -> None:
    """Make Megatron-Core usable in this process; a no-op for what is already set up.

    Starts a one-process ``torch.distributed`` group (gloo without CUDA) unless one exists (for
    more processes, start it yourself, e.g. with torchrun), initializes model parallelism with
    ``tensor_parallel_size`` (default: the existing size, else 1), and sets up the RNG tracker:
    without CUDA the no-op inference tracker (dropout must be 0) plus :func:`apply_cpu_shim`;
    with CUDA ``model_parallel_cuda_manual_seed(seed)`` when this call initialized the groups.
    """
    if not dist.is_initialized():
        if tensor_parallel_size not in (None, 1):
            raise ValueError(
                f"init_megatron: tensor_parallel_size={tensor_parallel_size} needs a process "
                "group of that many ranks; initialize torch.distributed first (e.g. torchrun)"
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    initialized_here = not parallel_state.model_parallel_is_initialized()
    if initialized_here:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel_size or 1
        )
    elif tensor_parallel_size not in (
        None,
        parallel_state.get_tensor_model_parallel_world_size(),
    ):
        raise ValueError(
            f"init_megatron: model parallelism is already initialized with TP="
            f"{parallel_state.get_tensor_model_parallel_world_size()}, not {tensor_parallel_size}"
        )
    if torch.cuda.is_available():
        if initialized_here:
            model_parallel_cuda_manual_seed(seed)
    else:
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        apply_cpu_shim()


def build_gpt_model_from_hf(
    hf_dir: str | Path,
    *,
    nvfp4: bool = True,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    load_weights: bool = True,
    tensor_parallel_size: int | None = None,
    grouped_experts: bool = False,
    **config_overrides: object,
) -> GPTModel:
    """A Megatron ``GPTModel`` for the HF Qwen3 / Qwen3-MoE checkpoint in ``hf_dir``.

    Calls :func:`init_megatron`, derives the ``TransformerConfig`` with
    :func:`transformer_config_from_hf` (``config_overrides`` set other fields), builds the
    miniTE spec (``nvfp4=False``: Megatron's local BF16 spec, same structure), casts parameters
    to the config's dtype as Megatron's mixed-precision wrapper does, moves the model to the
    current CUDA device if there is one, loads the BF16 weights (this rank's shards) and attaches
    the statistics hooks of an active debug configuration. A recipe with ``strict_ops`` builds
    the strict modules of :mod:`minite_megatron.strict` (setting ``use_te_activation_func=True``,
    which they need) and finalizes the model for them. ``grouped_experts`` runs NVFP4 MoE
    experts through :class:`~minite_megatron.experts.MiniTEGroupedMLP` (miniTE spec only).
    """
    from transformers import AutoConfig

    init_megatron(tensor_parallel_size)
    hf_config = AutoConfig.from_pretrained(str(hf_dir))
    config_overrides.setdefault("perform_initialization", not load_weights)
    if recipe.strict_ops:
        if not nvfp4:
            raise ValueError("strict mode (recipe.strict_ops) builds the miniTE spec: nvfp4=True")
        config_overrides.setdefault("use_te_activation_func", True)
    config = transformer_config_from_hf(hf_config, **config_overrides)
    kwargs = gpt_model_kwargs_from_hf(hf_config, strict=nvfp4 and recipe.strict_ops)
    if nvfp4:
        spec = get_gpt_decoder_block_minite_spec(
            config,
            recipe,
            grouped_experts=grouped_experts,
            rotary_base=kwargs["rotary_base"],
            rotary_percent=kwargs["rotary_percent"],
        )
    else:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=config.normalization
        )
    model = GPTModel(config, spec, **kwargs)
    model.to(dtype=config.params_dtype)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if load_weights:
        load_hf_weights(model, hf_dir)
    if nvfp4 and recipe.strict_ops:
        finalize_strict_model(model)
    from .capture import attach_debug_hooks  # capture builds on this module

    attach_debug_hooks(model)
    return model


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean causal mask ``[1, 1, S, S]`` (True = masked out)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def token_logprobs(
    model: GPTModel, input_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """``lp[b, t] = log p(input_ids[b, t+1] | input_ids[b, :t+1])``, float32 ``[B, S-1]``.

    One causal forward of ``model`` (positions ``0..S-1``; with right padding, the values at
    padded positions are meaningless), logits gathered over tensor parallelism, divided by
    ``temperature`` and normalized in float32 as vLLM's sampler does: torch's ``log_softmax``, or
    in strict mode (a model finished by ``finalize_strict_model``) the fixed-order
    :func:`minite_common.ops.log_softmax` that the strict sampler uses too. Call on every TP rank
    of the last pipeline stage.
    """
    batch, seq_len = input_ids.shape
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    position_ids = torch.arange(seq_len, device=device).expand(batch, seq_len)
    logits = model(
        input_ids,
        position_ids,
        causal_attention_mask(seq_len, device),
        runtime_gather_output=True,
    )
    scaled = logits.float() / temperature
    if getattr(model, "minite_strict", False):  # the same bits on every CPU, as the strict sampler
        logprobs = ops.log_softmax(scaled)
    else:  # what vLLM's sampler computes
        logprobs = torch.log_softmax(scaled, dim=-1)
    return logprobs[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1)
