"""vLLM's check that every parameter came from the checkpoint, kept on for ``minite`` models.

vLLM's ``DefaultModelLoader`` raises "Following weights were not initialized from checkpoint"
only for unquantized models (unless ``model_loader_extra_config={"enable_weights_track": true}``),
so under ``--quantization minite`` a checkpoint missing e.g. ``model.norm.weight`` would load with
that parameter left at its initial value. :class:`MiniteModelLoader`, registered for every load
format vLLM serves with its default loader, turns the check on for ``minite`` models. vLLM's
check exempts online-quantized layers; miniTE's layers check their own tensors (see
:meth:`minite_vllm.layer.NVFP4LayerMixin.check_complete`).
"""

from __future__ import annotations

import torch
from vllm.config import ModelConfig
from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from minite_common.checkpoint import QUANT_METHOD


class MiniteModelLoader(DefaultModelLoader):
    """vLLM's default loader, with the loaded-weights check on for ``minite`` models (unless
    the user set ``enable_weights_track``); the same as vLLM's for every other model."""

    def load_weights(self, model: torch.nn.Module, model_config: ModelConfig) -> None:
        if model_config.quantization == QUANT_METHOD and self.enable_weights_track is None:
            self.enable_weights_track = True
        super().load_weights(model, model_config)

    def track_weights_loading(
        self, model: torch.nn.Module, loaded_weights: set[str] | None, quantized: bool = False
    ) -> None:
        try:
            super().track_weights_loading(model, loaded_weights, quantized)
        except ValueError as e:
            raise ValueError(
                f"{e}: the checkpoint lacks these tensors, which would keep their initial values. "
                "Add them to the checkpoint (`minite quantize-model` copies every tensor it does "
                "not quantize; re-create a miniTE checkpoint from a complete BF16 one)"
            ) from None


def register_loader() -> None:
    """Serve every load format of vLLM's default loader with :class:`MiniteModelLoader`
    (idempotent; formats another plugin took over are left alone)."""
    for load_format, loader in list(_LOAD_FORMAT_TO_MODEL_LOADER.items()):
        if loader is DefaultModelLoader:
            _LOAD_FORMAT_TO_MODEL_LOADER[load_format] = MiniteModelLoader
