"""Worker extension for RL: ``LLM(..., worker_extension_cls=minite_vllm.WORKER_EXTENSION)``, then
``llm.collective_rpc("update_weights_bf16", args=(pack_weights(state_dict),))`` and friends.

Every method runs on each worker; with tensor parallelism each rank receives the full HF tensors
and keeps its own shard. Large updates stream through a collective group
(:mod:`minite_common.weight_sync`): ``init_weight_sync`` joins it once, ``receive_weights`` takes
one sync (see :mod:`minite_vllm.sync` for the driver side). Small ones may go through the RPC
itself as safetensors bytes (:func:`minite_vllm.pack_weights`, since vLLM's RPC does not carry
tensors intact between processes); a list of ``(name, tensor)`` pairs is accepted too when the
call stays in one process. ``collective_rpc`` returns one result per worker.
"""

from __future__ import annotations

from typing import Any

import torch

from minite_common import weight_sync

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

    def init_weight_sync(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        timeout_s: float = weight_sync.DEFAULT_TIMEOUT_S,
    ) -> int:
        """Join the sync group whose rank 0 (the learner's sender) hosts ``host:port``, as rank
        ``rank_offset + `` this worker's rank in vLLM (its TP/PP rank); returns that rank.
        Replaces a group joined before. ``backend`` "nccl" uses this worker's CUDA device."""
        self.close_weight_sync()
        rank = rank_offset + self.rank
        device = getattr(self, "device", None) if backend == "nccl" else None
        self._minite_channel = weight_sync.connect(
            host, port, rank, world_size, backend=backend, timeout_s=timeout_s, device=device
        )
        return rank

    def receive_weights(self) -> dict[str, Any]:
        """Receive one streamed sync (all-or-nothing; the previous weights keep serving if it
        fails); returns its :class:`~minite_common.weight_sync.SyncStats` as a dict. A broken
        group is closed: join a new one with ``init_weight_sync``."""
        self._minite_config()
        channel = getattr(self, "_minite_channel", None)
        if channel is None:
            raise RuntimeError(
                "receive_weights: this worker has no sync group; call init_weight_sync first "
                "(minite_vllm.sync.connect_weight_sync does)"
            )
        try:
            return updates.receive_weights(self._minite_model(), channel).to_dict()
        except weight_sync.WeightSyncError:
            self.close_weight_sync()
            raise

    def close_weight_sync(self) -> None:
        """Leave the sync group, if any."""
        channel = getattr(self, "_minite_channel", None)
        if channel is not None:
            channel.close()
        self._minite_channel = None

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

    def get_attention_backends(self) -> dict[str, str]:
        """``{layer name: qualified class name}`` of the attention backend vLLM chose for each
        attention layer (``layer.get_attn_backend()``)."""
        from vllm.model_executor.layers.attention import Attention

        return {
            m.layer_name: ".".join(m.get_attn_backend().full_cls_name())
            for m in self._minite_model().modules()
            if isinstance(m, Attention)
        }
