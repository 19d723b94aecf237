"""The streamed weight sync's NCCL branch (``NcclChannel``: vLLM's StatelessProcessGroup and
PyNcclCommunicator) between two processes on two GPUs: every byte arrives, and its time is
printed against one plain NCCL broadcast of the same bytes (run with ``-s``). Needs two CUDA GPUs
and vLLM's CUDA build; skipped otherwise (never run so far: the lent machines have no vLLM, and
the 2-GPU kind was not lent)."""

from __future__ import annotations

import importlib.util
import socket
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (CUDA)"),
]

TENSORS = 48
SHAPE = (4096, 2048)  # 4 MiB of codes per tensor: 192 MiB per sync
BUCKET = 64 << 20


def _tensors() -> list[tuple[str, torch.Tensor]]:
    """An NVFP4-like payload on the CPU: codes, scales and a decode scale per weight."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(TENSORS):
        codes = torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=g)
        out.append((f"w{i}.weight", codes))
        out.append((f"w{i}.weight_scale", codes[:, :256].clone().view(torch.float8_e4m3fn)))
        out.append((f"w{i}.weight_scale_2", torch.tensor(0.01)))
    return out


class _Keep:
    def begin(self, header):
        self.staged = {}

    def stage(self, name, tensor):
        self.staged[name] = tensor.clone()

    def finish(self):
        pass

    def commit(self):
        self.live = self.staged

    def discard(self):
        self.staged = None


def _rank(rank: int, port: int, results) -> None:
    from minite_common import weight_sync

    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    channel = weight_sync.connect("127.0.0.1", port, rank, 2, backend="nccl", device=device)
    tensors = _tensors()
    if rank == 0:
        on_gpu = [(n, t.to(device)) for n, t in tensors]
        torch.cuda.synchronize()
        start = time.perf_counter()
        stats = weight_sync.send_weights(channel, on_gpu, bucket_bytes=BUCKET)
        results["sync_s"] = time.perf_counter() - start
        results["bytes"], results["committed"] = stats.payload_bytes, stats.committed
    else:
        keep = _Keep()
        stats = weight_sync.receive_weights(channel, keep)
        results["equal"] = all(
            torch.equal(keep.live[n].cpu().view(torch.uint8), t.view(torch.uint8))
            for n, t in tensors
        )
    # The same bytes in one plain broadcast (after a warm-up): the link's time for them.
    raw = torch.empty(stats.wire_bytes, dtype=torch.uint8, device=device)
    channel.broadcast_payload(raw)
    start = time.perf_counter()
    channel.broadcast_payload(raw)
    if rank == 0:
        results["raw_s"] = time.perf_counter() - start


def test_nccl_sync_between_two_gpus_is_exact_and_timed_against_the_link():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_rank, args=(port, results), nprocs=2, join=True)
    assert results["committed"] and results["equal"]
    gbps = results["bytes"] / results["sync_s"] / 1e9
    print(f"sync {results['bytes'] / 2**20:.0f} MiB in {results['sync_s'] * 1e3:.1f} ms "
          f"({gbps:.1f} GB/s); one raw broadcast {results['raw_s'] * 1e3:.1f} ms")  # fmt: skip
    # The goal is within 1.5x of the link's time for these bytes; unmeasured so far, so
    # the ratio is printed for the record rather than asserted.
    print(f"sync / raw broadcast: {results['sync_s'] / results['raw_s']:.2f}x")
