"""Driver side of a streamed weight sync into a running vLLM ``LLM`` in this process.

The learner's sending rank is rank 0 of the sync group and hosts its rendezvous; the engine's
workers join as ranks ``1 + worker rank`` through miniTE's worker extension
(``init_weight_sync``), and each sync is one ``receive_weights`` RPC on the workers while this
process streams the tensors (:func:`minite_common.weight_sync.send_weights`) from a helper thread.
Frameworks that drive vLLM from elsewhere (Ray actors, an OpenAI server) make the same two calls
on the workers and run ``send_weights`` on their own sending rank (docs/vllm.md).
"""

from __future__ import annotations

import socket
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch

from minite_common import weight_sync
from minite_common.weight_sync import Channel, SyncStats

T = TypeVar("T")

_channels: weakref.WeakKeyDictionary[Any, Channel] = weakref.WeakKeyDictionary()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _beside_rpc(work: Callable[[], T], rpc: Callable[[], Any]) -> tuple[T, Any]:
    """Run ``work`` in a helper thread while ``rpc`` (a blocking ``collective_rpc``) runs here;
    raise the first root cause: ``work``'s own error, else the RPC's, else a transport error."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=run, name="minite-weight-sync", daemon=True)
    thread.start()
    try:
        answer = rpc()
    except BaseException as e:
        thread.join()
        sender = result.get("error")
        if sender is not None and not isinstance(sender, weight_sync.WeightSyncError):
            raise sender from e
        raise
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"], answer


def connect_weight_sync(
    llm: Any,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    backend: str = "gloo",
    timeout_s: float = weight_sync.DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
) -> Channel:
    """Create the sync group of this process (rank 0, the sender) and every worker of ``llm``
    (started with ``worker_extension_cls=minite_vllm.WORKER_EXTENSION``) and return the sender's
    channel; it is also what :func:`sync_weights` uses for ``llm`` from now on. ``device`` is the
    sender's CUDA device for ``backend="nccl"``."""
    llm.collective_rpc("get_recipe_fingerprint")  # raises now if the engine does not run miniTE
    workers = llm.llm_engine.vllm_config.parallel_config.world_size
    port = port or free_port(host)
    close_weight_sync(llm)
    channel, _ = _beside_rpc(
        lambda: weight_sync.connect(
            host, port, 0, 1 + workers, backend=backend, timeout_s=timeout_s, device=device
        ),
        lambda: llm.collective_rpc(
            "init_weight_sync", args=(host, port, 1 + workers, 1, backend, timeout_s)
        ),
    )
    _channels[llm] = channel
    return channel


def close_weight_sync(llm: Any) -> None:
    """Leave ``llm``'s sync group on both sides (no-op without one)."""
    channel = _channels.pop(llm, None)
    if channel is not None:
        channel.close()
        llm.collective_rpc("close_weight_sync")


def sync_weights(
    llm: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    payload: str = "nvfp4",
    recipe_fingerprint: str | None = None,
    bucket_bytes: int = weight_sync.DEFAULT_BUCKET_BYTES,
) -> SyncStats:
    """Stream ``weights`` (HF names; consumed lazily) into every worker of ``llm``,
    all-or-nothing, connecting the group first if needed (:func:`connect_weight_sync`); then reset
    the prefix cache (its K/V came from the old weights). ``payload`` ``"nvfp4"``: miniTE
    checkpoint-format tensors quantized under ``recipe_fingerprint`` (checked by the sampler);
    ``"bf16"``: HF weights the sampler quantizes (with a fingerprint, checked too). A refused
    update raises the receiver's error and the previous weights keep serving; a broken group
    raises :class:`~minite_common.weight_sync.WeightSyncError` and the next call reconnects."""
    channel = _channels.get(llm) or connect_weight_sync(llm)
    try:
        stats, _ = _beside_rpc(
            lambda: weight_sync.send_weights(
                channel, weights, payload=payload, recipe_fingerprint=recipe_fingerprint,
                bucket_bytes=bucket_bytes,
            ),
            lambda: llm.collective_rpc("receive_weights"),
        )  # fmt: skip
    except weight_sync.WeightSyncError:
        _channels.pop(llm, None)
        raise
    llm.reset_prefix_cache()
    return stats
