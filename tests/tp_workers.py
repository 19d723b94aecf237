"""Spawned gloo workers of the tensor-parallel tests (importable by the spawned processes)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEADLINE_S = 420


def run_ranks(fn: Callable[..., None], world: int, tmp_path: Path, *args: Any) -> None:
    """Run ``fn(rank, world, rendezvous_file, *args)`` in ``world`` spawned processes (gloo);
    fail the test if one fails or they do not finish in time."""
    context = mp.start_processes(
        _entry,
        args=(fn, world, str(tmp_path / f"rendezvous-{world}-{time.monotonic_ns()}"), args),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + DEADLINE_S
    while not context.join(timeout=2):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{world} gloo workers did not finish within {DEADLINE_S} s")


def _entry(rank: int, fn: Callable[..., None], world: int, init_file: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
