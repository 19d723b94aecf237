"""Worker extension for RL: ``LLM(..., worker_extension_cls=minite_vllm.WORKER_EXTENSION)``, then
``llm.collective_rpc("update_weights_bf16", args=(pack_weights(state_dict),))`` and friends.

Every method runs on each worker; with tensor parallelism each rank receives the full HF tensors
and keeps its own shard. vLLM's RPC does not carry tensors intact between processes, so weights
travel as safetensors bytes (:func:`minite_vllm.pack_weights`); a list of ``(name, tensor)``
pairs is accepted too when the call stays in one process. ``collective_rpc`` returns one result
per worker.
"""

from __future__ import annotations

from typing import Any

import torch

from . import capture, pack_weights, unpack_weights, updates
from .config import MiniteConfig

WeightsArg = bytes | list[tuple[str, torch.Tensor]]


def _weights(weights: WeightsArg) -> list[tuple[str, torch.Tensor]]:
    return list(unpack_weights(weights).items()) if isinstance(weights, bytes) else weights


class MiniteWorkerExtension:
    """Methods vLLM mixes into its worker class (``self`` is the worker)."""

    def _minite_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def _minite_config(self) -> MiniteConfig:
        config = self.vllm_config.quant_config
        if not isinstance(config, MiniteConfig):
            raise RuntimeError(
                f"this engine runs quantization {type(config).__name__}, not minite; start it "
                "with quantization='minite' (or a miniTE checkpoint)"
            )
        return config

    def update_weights_bf16(self, weights: WeightsArg) -> None:
        """Load HF-named high-precision weights; NVFP4 layers re-quantize them in place.

        All-or-nothing: an unknown name, a wrong shape or a NaN raises before any weight changes.
        """
        self._minite_config()
        updates.update_weights_bf16(self._minite_model(), _weights(weights))

    def update_weights_quantized(self, weights: WeightsArg, recipe_fingerprint: str) -> None:
        """Load miniTE checkpoint-format tensors quantized under ``recipe_fingerprint``.

        All-or-nothing, like :meth:`update_weights_bf16`; a recipe mismatch raises first.
        """
        self._minite_config()
        updates.update_weights_quantized(
            self._minite_model(), _weights(weights), recipe_fingerprint
        )

    def get_quantized_weights(self, hf_names: list[str] | None = None) -> bytes:
        """This rank's NVFP4 tensors of ``hf_names`` (all if None) in checkpoint format, packed
        (read them with :func:`minite_vllm.unpack_weights`)."""
        return pack_weights(updates.quantized_weights(self._minite_model(), hf_names))

    def get_execution_fingerprints(self) -> dict[str, dict[str, Any]]:
        """``{hf_name: {"mode", "recipe", "kernel", "config"}}`` for every linear weight, expert,
        embedding and LM head (``kernel`` and ``config`` for NVFP4 ones only)."""
        return updates.execution_fingerprints(self._minite_model(), self._minite_config().recipe)

    def get_recipe_fingerprint(self) -> str:
        """The fingerprint of the NVFP4 recipe this engine runs."""
        return self._minite_config().recipe.fingerprint()

    def start_capture(self) -> None:
        """Record the next forward pass layer by layer (see :mod:`minite_vllm.capture`)."""
        capture.start_capture(self._minite_model())

    def finish_capture(self) -> bytes:
        """The recorded ``{"<hf module>:input|output": tensor}``, packed like the weights."""
        return pack_weights(capture.finish_capture(self._minite_model()))
