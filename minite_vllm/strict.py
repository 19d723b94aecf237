"""Strict mode in vLLM: the ops around the NVFP4 linears run :mod:`minite_common.ops`.

With a recipe whose ``strict_ops`` is on (``MINITE_RECIPE`` or a strict miniTE checkpoint), the
``minite`` quantization config makes vLLM compute everything the learner computes the same way,
through vLLM's public extension points:

- RMSNorm (with its fused residual add), the rotary embedding and ``SiluAndMul``: out-of-tree
  replacements of vLLM's custom ops (``CustomOp.register_oot``, in :func:`register_strict_ops`,
  called by the plugin in every process) whose public ``forward_native`` / ``forward_cpu`` /
  ``forward_cuda`` ... methods run the strict op. Each one checks, when the model is built,
  whether the engine runs a strict ``minite`` recipe; otherwise it is vLLM's own op, unchanged.
- Attention: :class:`~minite_vllm.strict_attention.StrictAttentionBackend`, registered as vLLM's
  ``CUSTOM`` attention backend and selected with ``attention_backend="CUSTOM"``
  (``--attention-backend CUSTOM``), which strict mode requires.
- LM head and MoE router (BF16): :func:`minite_common.ops.linear`; routed experts: routing,
  SwiGLU and the combine from :mod:`minite_common.ops` around the NVFP4 expert GEMMs (quantization
  methods of the ``minite`` config).
- The log-probs the sampler returns, and the CPU platform's backend choice: vLLM has no public
  hook for them; :mod:`minite_vllm.engine_patches` holds those two version-checked patches.

Strict mode needs eager execution (``enforce_eager=True``). It runs at any tensor-parallel degree
the model's shapes allow: its recipe turns on the TP-invariant reduction of row-parallel linears
(:mod:`minite_common.parallel`), attention heads and LM-head vocabulary columns are independent of
one another, and the sampler normalizes the gathered (whole-vocabulary) logits, so every TP degree
gives TP=1's bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from minite_common import ops

from .engine_patches import (
    STRICT_LOGITS,
    check_vllm_version,
    install_vllm_patches,
    vllm_patches_installed,
)
from .linear import MiniteBF16LinearMethod
from .moe import MiniteMoEMethod
from .strict_attention import (
    StrictAttentionBackend,
    register_strict_attention_backend,
    strict_attention_selected,
)
from .strict_forward import rotate, routed_experts

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

logger = init_logger(__name__)


def strict_enabled() -> bool:
    """Whether the vLLM config being built runs a ``minite`` recipe with ``strict_ops`` on;
    raises if it does but the engine would compile the model, use pipeline or expert parallelism
    (tensor parallelism is fine: its row-parallel reductions are TP-invariant) or another
    attention backend than miniTE's, or if vLLM is not a version :mod:`.engine_patches` was
    checked against."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.config.compilation import CompilationMode

    from .config import MiniteConfig

    config = get_current_vllm_config_or_none()
    quant = getattr(config, "quant_config", None)
    if not isinstance(quant, MiniteConfig) or not quant.recipe.strict_ops:
        return False
    if config.compilation_config.mode != CompilationMode.NONE:
        raise ValueError(
            "miniTE strict mode runs vLLM eagerly (torch.compile may fuse multiply-adds and change "
            "bits): start the engine with enforce_eager=True (--enforce-eager)"
        )
    check_vllm_version()
    if not strict_attention_selected(config):
        raise ValueError(
            "miniTE strict mode runs attention through miniTE's strict backend, registered as "
            "vLLM's CUSTOM attention backend: start the engine with attention_backend='CUSTOM' "
            "(--attention-backend CUSTOM)"
        )
    parallel = config.parallel_config
    if parallel.pipeline_parallel_size != 1 or parallel.enable_expert_parallel:
        raise NotImplementedError(
            "miniTE strict mode covers tensor parallelism (row-parallel linears combine their "
            "partial sums deterministically), not pipeline or expert parallelism"
        )
    return True


# -- custom ops ----------------------------------------------------------------------------------


class _StrictForward:
    """Routes every public ``forward_*`` method of a vLLM ``CustomOp`` (the one vLLM dispatches to
    for the platform and compilation mode) to ``forward_strict`` when ``minite_strict`` is set,
    and to vLLM's own method otherwise."""

    minite_strict = False

    def forward_strict(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _route(self, method: str, args: tuple, kwargs: dict) -> Any:
        if self.minite_strict:
            return self.forward_strict(*args, **kwargs)
        return getattr(super(), method)(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_native", args, kwargs)

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_cpu", args, kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_cuda", args, kwargs)

    def forward_hip(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_hip", args, kwargs)

    def forward_xpu(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_xpu", args, kwargs)

    def forward_oot(self, *args: Any, **kwargs: Any) -> Any:
        return self._route("forward_oot", args, kwargs)


class StrictRMSNorm(_StrictForward, RMSNorm):
    """vLLM's ``RMSNorm``; in strict mode :func:`ops.rms_norm` / :func:`ops.add_rms_norm`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()
        STRICT_LOGITS[:] = [True] if self.minite_strict else []  # the model built last decides
        if self.minite_strict and (not self.has_weight or self.variance_size_override is not None):
            raise NotImplementedError(
                "miniTE strict mode: RMSNorm without weight or with var_hidden_size"
            )

    def forward_strict(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.variance_epsilon)
        return ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)


class StrictRotaryEmbedding(_StrictForward, RotaryEmbedding):
    """vLLM's ``RotaryEmbedding``; in strict mode :func:`~minite_vllm.strict_forward.rotate`
    (:func:`ops.rope_cos_sin` + :func:`ops.apply_rope`, NeoX layout) on each token's position."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()
        if self.minite_strict and not self.is_neox_style:
            raise NotImplementedError("miniTE strict mode: GPT-J (interleaved) rotary layout")

    def forward_strict(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rotate(positions, query, key, self.head_size, self.rotary_dim, self.base)


class StrictSiluAndMul(_StrictForward, SiluAndMul):
    """vLLM's ``SiluAndMul``; in strict mode :func:`ops.swiglu`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.minite_strict = strict_enabled()

    def forward_strict(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu(x)


#: vLLM class replaced -> miniTE's strict subclass (``CustomOp.register_oot`` keys on the name).
STRICT_OPS: dict[type[CustomOp], type[CustomOp]] = {
    RMSNorm: StrictRMSNorm,
    RotaryEmbedding: StrictRotaryEmbedding,
    SiluAndMul: StrictSiluAndMul,
}


def register_strict_ops() -> None:
    """Register the strict subclasses as vLLM's out-of-tree ops and the strict attention backend
    as vLLM's ``CUSTOM`` backend, and apply :mod:`minite_vllm.engine_patches` on the vLLM versions
    they were checked against (idempotent). All of it behaves exactly like vLLM's own code unless
    the engine runs a strict ``minite`` recipe."""
    install_vllm_patches()
    register_strict_attention_backend()
    for base, strict in STRICT_OPS.items():
        name = base.__name__
        if op_registry_oot.get(name) is strict:
            continue
        if name in op_registry_oot:
            logger.warning(
                "miniTE: another plugin replaces vLLM's %s (%s); miniTE strict mode will refuse "
                "to run",
                name,
                op_registry_oot[name].__name__,
            )
            continue
        registered_name = base.name  # register_oot renames the class; keep vLLM's op name
        CustomOp.register_oot(strict, name=name)
        strict.name = registered_name


def check_strict_ops_registered() -> None:
    """Raise unless every op of :data:`STRICT_OPS` resolves to miniTE's strict subclass and the
    patches of :mod:`minite_vllm.engine_patches` are in place."""
    oot = op_registry_oot
    missing = [b.__name__ for b, s in STRICT_OPS.items() if oot.get(b.__name__) is not s]
    if missing:
        raise RuntimeError(
            f"miniTE strict mode: vLLM's {missing} are not replaced by miniTE's strict ops "
            "(is the minite plugin loaded, and no other plugin replacing them?)"
        )
    if not vllm_patches_installed():
        raise RuntimeError(
            "miniTE strict mode: minite_vllm.engine_patches is not installed in this process "
            "(is the minite plugin loaded?)"
        )


# -- BF16 GEMMs and routed experts ---------------------------------------------------------------


class StrictLMHeadMethod(UnquantizedEmbeddingMethod):
    """The LM head's logits through :func:`ops.linear` (the embedding lookup is vLLM's)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Nothing to pack: the strict GEMM reads ``layer.weight``."""

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class StrictBF16LinearMethod(MiniteBF16LinearMethod):
    """Layers the recipe keeps in BF16 (e.g. the MoE router) through :func:`ops.linear`; a
    row-parallel one only at TP 1 (its all-reduce of rounded partial outputs depends on TP)."""

    def create_weights(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
            raise NotImplementedError(
                f"miniTE strict mode ({layer.prefix}): a BF16 row-parallel linear at TP="
                f"{layer.tp_size} would all-reduce rounded partial outputs; keep it in NVFP4 "
                "(drop it from bf16_modules) or run TP=1"
            )
        super().create_weights(layer, *args, **kwargs)

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias)


class StrictMoEMethod(MiniteMoEMethod):
    """NVFP4 routed experts whose routing, activation and combine are :mod:`minite_common.ops`.

    It takes the router logits itself (a "monolithic" method) and runs
    :func:`~minite_vllm.strict_forward.routed_experts`: :func:`ops.topk_routing`, each
    (token, expert) row through the expert's NVFP4 GEMMs, :func:`ops.swiglu`,
    :func:`ops.moe_combine` in slot order.
    """

    @property
    def is_monolithic(self) -> bool:
        return True

    def apply_monolithic(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        unsupported = {
            "grouped top-k": layer.use_grouped_topk,
            "a custom routing function": layer.custom_routing_function is not None,
            f"scoring function {layer.scoring_func!r}": layer.scoring_func != "softmax",
            "a routed scaling factor": layer.routed_scaling_factor != 1.0,
            "an expert score bias": layer.e_score_correction_bias is not None,
        }
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise NotImplementedError(f"miniTE strict mode ({layer.layer_name}): {bad}")
        combined = routed_experts(
            x,
            router_logits,
            layer.top_k,
            layer.renormalize,
            self.gemm_weight(layer, "w13_"),
            lambda act, group_sizes: self.down_proj(layer, act, group_sizes),
            self.num_experts,
            self.recipe,
        )
        return self.tp_output(combined)


def strict_layer_method(layer: torch.nn.Module) -> Any:
    """The strict handling of a layer that is neither linear nor routed experts: an attention
    layer must run miniTE's strict backend (None is returned: no weights), the LM head gets
    :class:`StrictLMHeadMethod`; anything else None."""
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    check_strict_ops_registered()
    if isinstance(layer, Attention):
        if layer.get_attn_backend() is not StrictAttentionBackend:
            raise NotImplementedError(
                f"miniTE strict mode ({layer.layer_name}): vLLM chose the attention backend "
                f"{layer.get_attn_backend().get_name()}, not miniTE's strict backend (CUSTOM); "
                "start the engine with attention_backend='CUSTOM'"
            )
    elif isinstance(layer, ParallelLMHead):
        return StrictLMHeadMethod()
    return None
