"""Shared test set-up: CPU-friendly engine settings, tiny model directories, GPU skipping."""

from __future__ import annotations

import os

import pytest
import torch

# vLLM's CPU build: bounded KV cache, no thread pinning, no hub, no telemetry
# (docs/contract.md section 10).
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3 (dense) model directory with random BF16 weights and a byte tokenizer."""
    from minite.tiny_model import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_dense"), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3-MoE model directory (8 experts, top-2) with random BF16 weights."""
    from minite.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny_moe"), TinyModelSpec(moe=True), seed=0)


@pytest.fixture(scope="module")
def megatron_world():
    """Megatron-Core initialized in this process (one rank) for a test module, torn down after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from minite_megatron import init_megatron

    init_megatron(1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(params=["dense", "moe"])
def hf_dir(request, tiny_dense_dir, tiny_moe_dir):
    """Each tiny model directory in turn: dense Qwen3, then Qwen3-MoE."""
    return tiny_dense_dir if request.param == "dense" else tiny_moe_dir
