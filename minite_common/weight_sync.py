"""Streamed, all-or-nothing weight sync from a learner to samplers over a collective group.

Engine-agnostic: rank 0 of a group (the learner's sending rank) broadcasts named tensors to every
other rank (the sampler's workers) in fixed-size buckets; a receiver stages each tensor as it
arrives through a :class:`Receiver` (the engine adapter) and commits only when every rank accepted
the whole update. Memory on each side is bounded by one bucket, the tensor being produced or
assembled, and what the receiver stages for its commit.

Wire protocol (every message from rank 0, in order):

- ``start``: ``{"version", "payload", "recipe_fingerprint", "bucket_bytes"}``; every receiver
  allocates one bucket of ``bucket_bytes``;
- ``data``: a bucket's index (``[name, dtype, shape, nbytes, offset]`` of each tensor that
  *starts* in it, offsets 16-byte aligned) and its payload, ``payload_bytes <= bucket_bytes``.
  Tensors are laid out back to back; one larger than what is left of a bucket continues at offset 0
  of the next bucket(s);
- ``end``: ``{"tensors", "bytes"}`` to check nothing was lost; then every rank votes (MIN
  all-reduce) and receivers commit only if all voted yes;
- ``abort``: the sender failed while producing its tensors; receivers drop what they staged.

A receiver that refuses a tensor (its adapter raises) drops its staging, keeps reading the stream
to its end so the group stays usable, votes no and raises that error. A broken group (the sender
died, a timeout) raises :class:`WeightSyncError` on every surviving rank, without a commit; the
group is then unusable and a new one must be connected.

Payloads: ``"nvfp4"`` (miniTE checkpoint-format tensors: ``.weight`` uint8 codes,
``.weight_scale`` E4M3 block scales, ``.weight_scale_2`` FP32 decode scale for each quantized HF
weight, BF16 for the rest) or ``"bf16"`` (HF weights that the sampler quantizes itself).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

PROTOCOL_VERSION = 1
PAYLOADS = ("nvfp4", "bf16")
#: Tensor starts in a bucket are aligned to this many bytes, so a receiver can view them in place.
ALIGN = 16
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 600.0

#: The dtypes a sync may carry (what the payloads use, plus the usual high-precision ones).
DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.float8_e4m3fn)
}


class WeightSyncError(RuntimeError):
    """The group broke during a sync (a rank died, a timeout). Nothing was committed; connect a
    new group before the next sync."""


class WeightSyncAborted(RuntimeError):
    """The sender aborted the sync while producing its tensors. Nothing was committed; the group
    stays usable."""


class Channel(Protocol):
    """A group of ``world_size`` ranks in which rank 0 sends."""

    rank: int
    world_size: int
    device: torch.device  # where buckets live

    def broadcast_message(self, message: dict[str, Any] | None) -> dict[str, Any]:
        """Rank 0 gives a small JSON-able ``message``; every rank returns it."""

    def broadcast_payload(self, buffer: torch.Tensor) -> None:
        """Broadcast uint8 ``buffer`` (on :attr:`device`) from rank 0 in place."""

    def all_agree(self, ok: bool) -> bool:
        """True on every rank iff every rank gave True."""

    def close(self) -> None:
        """Release the group."""


def _timeout(timeout_s: float) -> timedelta:
    return timedelta(seconds=timeout_s)


class GlooChannel:
    """A CPU group over gloo, made from torch alone (a ``TCPStore`` hosted by rank 0 at
    ``host:port`` and a ``ProcessGroupGloo`` outside torch.distributed's global state, so it lives
    beside a learner's or vLLM's own process groups). Every operation times out after
    ``timeout_s``."""

    device = torch.device("cpu")

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank, self.world_size = rank, world_size
        self._store = dist.TCPStore(
            host, port, world_size, rank == 0, timeout=_timeout(timeout_s),
            wait_for_workers=False,
        )  # fmt: skip
        prefixed = dist.PrefixStore("minite-weight-sync", self._store)
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, _timeout(timeout_s))
        self._root = dist.BroadcastOptions()
        self._root.rootRank = 0
        self._min = dist.AllreduceOptions()
        self._min.reduceOp = dist.ReduceOp.MIN

    def broadcast_message(self, message: dict[str, Any] | None) -> dict[str, Any]:
        data = json.dumps(message).encode() if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._pg.broadcast([size], self._root).wait()
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else (
            torch.empty(int(size), dtype=torch.uint8)
        )  # fmt: skip
        self._pg.broadcast([buf], self._root).wait()
        return message if self.rank == 0 else json.loads(bytes(buf.numpy()))

    def broadcast_payload(self, buffer: torch.Tensor) -> None:
        self._pg.broadcast([buffer], self._root).wait()

    def all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([int(ok)], dtype=torch.int64)
        self._pg.allreduce([flag], self._min).wait()
        return bool(flag.item())

    def close(self) -> None:
        self._pg = None
        self._store = None


class NcclChannel:
    """A GPU group for sampler workers and a learner on CUDA devices, through vLLM's own
    building blocks (imported here only): control messages and votes go through a
    ``StatelessProcessGroup`` (a TCPStore, so they time out after ``timeout_s``), bucket payloads
    through a ``PyNcclCommunicator`` on ``device``, on the current CUDA stream, synchronized before
    the bucket is read or refilled. Not run on this project's CPU machines (no vLLM CUDA build):
    it is written against vLLM 0.32's API and untested. An NCCL broadcast itself has no timeout:
    a sender that dies inside one is noticed at the next control message."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self._pg = StatelessProcessGroup.create(
            host=host, port=port, rank=rank, world_size=world_size,
            store_timeout=math.ceil(timeout_s),
        )  # fmt: skip
        self._comm = PyNcclCommunicator(self._pg, device=self.device)

    def broadcast_message(self, message: dict[str, Any] | None) -> dict[str, Any]:
        return self._pg.broadcast_obj(message, src=0)

    def broadcast_payload(self, buffer: torch.Tensor) -> None:
        stream = torch.cuda.current_stream(self.device)
        self._comm.broadcast(buffer, src=0, stream=stream)
        stream.synchronize()

    def all_agree(self, ok: bool) -> bool:
        return all(self._pg.all_gather_obj(bool(ok)))

    def close(self) -> None:
        self._comm = None
        self._pg = None


def connect(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    *,
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
    device: torch.device | str | None = None,
) -> Channel:
    """Join the sync group (blocks until all ``world_size`` ranks joined). Rank 0, the sender,
    hosts the rendezvous at ``host:port``. ``backend`` is ``"gloo"`` (CPU buckets) or ``"nccl"``
    (buckets on CUDA ``device``; see :class:`NcclChannel`)."""
    if not 0 <= rank < world_size or world_size < 2:
        raise ValueError(
            f"weight sync: rank {rank} of world size {world_size}: a group needs the sender "
            "(rank 0) and at least one receiver"
        )
    if backend == "gloo":
        return GlooChannel(host, port, rank, world_size, timeout_s)
    if backend == "nccl":
        if device is None:
            raise ValueError("weight sync: backend 'nccl' needs the CUDA device of this rank")
        return NcclChannel(host, port, rank, world_size, timeout_s, torch.device(device))
    raise ValueError(f"weight sync: backend {backend!r} is not one of 'gloo', 'nccl'")


@dataclass(frozen=True)
class Header:
    """What a sync carries: ``payload`` (one of :data:`PAYLOADS`), the learner's recipe
    fingerprint (None if it did not give one) and the bucket size."""

    payload: str
    recipe_fingerprint: str | None
    bucket_bytes: int


@dataclass(frozen=True)
class SyncStats:
    """What one sync moved: tensors, their bytes, the bytes broadcast (payload plus alignment
    padding), the buckets, the wall time, and whether every receiver committed."""

    tensors: int
    payload_bytes: int
    wire_bytes: int
    buckets: int
    seconds: float
    committed: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Receiver(Protocol):
    """The engine side of a sync. Any exception from :meth:`begin`, :meth:`stage` or
    :meth:`finish` rejects the whole update (it is raised after the vote)."""

    def begin(self, header: Header) -> None:
        """Prepare staging for an update described by ``header``; raise to refuse it."""

    def stage(self, name: str, tensor: torch.Tensor) -> None:
        """Check and stage one tensor; ``tensor`` may be a view of the bucket, valid during the
        call only (copy what you keep)."""

    def finish(self) -> None:
        """All tensors arrived: the last checks (e.g. every quantized weight complete)."""

    def commit(self) -> None:
        """Every rank accepted: make the staged update live."""

    def discard(self) -> None:
        """Drop everything staged (the live weights were never touched)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if bucket_bytes < ALIGN or bucket_bytes % ALIGN:
        raise ValueError(
            f"weight sync: bucket_bytes={bucket_bytes} must be a positive multiple of {ALIGN}"
        )


def _transport(what: str, done: int, e: BaseException) -> WeightSyncError:
    return WeightSyncError(
        f"weight sync: the group broke while {what} after {done} payload bytes ({e}); nothing "
        "was committed and the previous weights keep serving; connect a new group before the "
        "next sync"
    )


def send_weights(
    channel: Channel,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    payload: str = "nvfp4",
    recipe_fingerprint: str | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> SyncStats:
    """Rank 0: stream ``weights`` (consumed lazily, one tensor at a time) to every receiver in
    buckets of ``bucket_bytes``; return the stats with ``committed`` from the receivers' vote.
    An exception while iterating ``weights`` aborts the sync on every rank and is re-raised; a
    broken group raises :class:`WeightSyncError`."""
    if channel.rank != 0:
        raise ValueError(f"weight sync: only rank 0 sends (this is rank {channel.rank})")
    if payload not in PAYLOADS:
        raise ValueError(f"weight sync: payload {payload!r} is not one of {PAYLOADS}")
    _check_bucket_bytes(bucket_bytes)
    start = time.perf_counter()
    sent = {"bytes": 0, "wire": 0, "buckets": 0, "tensors": 0}
    header = Header(payload, recipe_fingerprint, bucket_bytes)

    def message(kind: str, body: Any) -> None:
        try:
            channel.broadcast_message({"kind": kind, "body": body})
        except Exception as e:
            raise _transport(f"sending the {kind} message", sent["bytes"], e) from e

    message("start", {"version": PROTOCOL_VERSION, **asdict(header)})
    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=channel.device)
    index: list[list[Any]] = []
    cursor = 0

    def flush() -> None:
        nonlocal cursor, index
        message("data", {"index": index, "payload_bytes": cursor})
        try:
            channel.broadcast_payload(bucket[:cursor])
        except Exception as e:
            raise _transport("sending a bucket", sent["bytes"], e) from e
        sent["wire"] += cursor
        sent["buckets"] += 1
        cursor, index = 0, []

    try:
        for name, tensor in weights:
            dtype = _dtype_name(name, tensor)
            data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            cursor = _aligned(cursor)
            if cursor >= bucket_bytes:
                flush()
            index.append([name, dtype, list(tensor.shape), data.numel(), cursor])
            done = 0
            while True:
                take = min(data.numel() - done, bucket_bytes - cursor)
                bucket[cursor : cursor + take].copy_(data[done : done + take])
                cursor, done = cursor + take, done + take
                if done == data.numel():
                    break
                flush()
            sent["bytes"] += data.numel()
            sent["tensors"] += 1
    except WeightSyncError:
        raise
    except BaseException as e:
        # If even the abort cannot go out, the receivers see a broken group; the cause is ``e``.
        with contextlib.suppress(WeightSyncError):
            message("abort", f"{type(e).__name__}: {e}")
        raise
    if cursor or index:
        flush()
    message("end", {"tensors": sent["tensors"], "bytes": sent["bytes"]})
    try:
        committed = channel.all_agree(True)
    except Exception as e:
        raise _transport("waiting for the receivers' vote", sent["bytes"], e) from e
    return SyncStats(
        sent["tensors"], sent["bytes"], sent["wire"], sent["buckets"],
        time.perf_counter() - start, committed,
    )  # fmt: skip


def _dtype_name(name: str, tensor: Any) -> str:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"weight sync: {name}: expected a torch.Tensor, got {type(tensor)}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise TypeError(
            f"weight sync: {name}: dtype {tensor.dtype} is not carried (one of {sorted(DTYPES)})"
        )
    return dtype


class _Assembly:
    """One tensor of the stream while its bytes arrive."""

    def __init__(self, entry: list[Any], device: torch.device) -> None:
        self.name, self.dtype, shape, self.nbytes, _ = entry
        self.shape = tuple(int(s) for s in shape)
        self.data: torch.Tensor | None = None
        self.filled = 0
        self.device = device

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"weight sync: {self.name}: dtype {self.dtype} is not carried")
        itemsize = DTYPES[self.dtype].itemsize
        if any(s < 0 for s in self.shape) or math.prod(self.shape) * itemsize != self.nbytes:
            raise ValueError(
                f"weight sync: {self.name}: {self.nbytes} bytes do not make a {self.dtype} "
                f"tensor {list(self.shape)}"
            )

    def take(self, bucket: torch.Tensor, offset: int, available: int) -> torch.Tensor | None:
        """Take this tensor's next bytes from ``bucket[offset:offset+available]``; return the
        tensor once complete (a view of the bucket when it lies in one piece there)."""
        n = min(self.nbytes - self.filled, available)
        if self.filled == 0 and n == self.nbytes:
            return self._typed(bucket[offset : offset + n])
        if self.data is None:
            self.data = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self.data[self.filled : self.filled + n].copy_(bucket[offset : offset + n])
        self.filled += n
        return self._typed(self.data) if self.filled == self.nbytes else None

    def _typed(self, data: torch.Tensor) -> torch.Tensor:
        return data.view(DTYPES[self.dtype]).reshape(self.shape)


def receive_weights(channel: Channel, receiver: Receiver) -> SyncStats:
    """A receiving rank: read one sync from rank 0 into ``receiver``; commit if every rank
    accepted, else raise the error this rank met (or say another rank refused). Raises
    :class:`WeightSyncAborted` if the sender aborted and :class:`WeightSyncError` if the group
    broke; in every failure the receiver's staging is discarded."""
    start = time.perf_counter()
    got = {"bytes": 0, "wire": 0, "buckets": 0, "tensors": 0}
    error: BaseException | None = None
    staging = False

    def reject(e: BaseException) -> None:
        nonlocal error, staging
        if error is None:
            error = e
        if staging:
            staging = False
            receiver.discard()

    def message(expect: str) -> dict[str, Any]:
        try:
            msg = channel.broadcast_message(None)
        except Exception as e:
            raise _transport(f"waiting for the {expect} message", got["bytes"], e) from e
        if msg["kind"] == "abort":
            raise WeightSyncAborted(
                f"weight sync: the sender aborted ({msg['body']}); nothing was committed and the "
                "previous weights keep serving"
            )
        return msg

    try:
        msg = message("start")
        body = msg["body"]
        if msg["kind"] != "start" or body.get("version") != PROTOCOL_VERSION:
            raise WeightSyncError(
                f"weight sync: expected a version-{PROTOCOL_VERSION} start message, got "
                f"{msg['kind']!r} {body!r}; sender and receivers run different miniTE versions"
            )
        header = Header(body["payload"], body["recipe_fingerprint"], body["bucket_bytes"])
        try:
            if header.payload not in PAYLOADS:
                raise ValueError(f"weight sync: unknown payload {header.payload!r}")
            receiver.begin(header)
            staging = True
        except Exception as e:
            reject(e)
        bucket = torch.empty(header.bucket_bytes, dtype=torch.uint8, device=channel.device)
        pending: _Assembly | None = None
        while True:
            msg = message("next")
            if msg["kind"] == "end":
                break
            size, index = msg["body"]["payload_bytes"], msg["body"]["index"]
            try:
                channel.broadcast_payload(bucket[:size])
            except Exception as e:
                raise _transport("receiving a bucket", got["bytes"], e) from e
            got["wire"] += size
            got["buckets"] += 1
            pieces = [(pending, 0)] if pending is not None else []
            pieces += [(_Assembly(entry, channel.device), entry[4]) for entry in index]
            pending = None
            for piece, offset in pieces:
                try:
                    piece.check()
                    if offset % ALIGN or not 0 <= offset <= size:
                        raise ValueError(f"weight sync: {piece.name}: bad offset {offset}")
                except ValueError as e:
                    raise WeightSyncError(f"{e}; the stream is corrupt") from e
                tensor = piece.take(bucket, offset, size - offset)
                if tensor is None:
                    pending = piece
                    continue
                got["bytes"] += piece.nbytes
                got["tensors"] += 1
                if staging:
                    try:
                        receiver.stage(piece.name, tensor)
                    except Exception as e:
                        reject(e)
        end = msg["body"]
        if pending is not None or (end["tensors"], end["bytes"]) != (got["tensors"], got["bytes"]):
            raise WeightSyncError(
                f"weight sync: the sender sent {end['tensors']} tensors ({end['bytes']} bytes), "
                f"{got['tensors']} ({got['bytes']} bytes) arrived whole"
            )
        if staging:
            try:
                receiver.finish()
            except Exception as e:
                reject(e)
        try:
            agreed = channel.all_agree(error is None)
        except Exception as e:
            raise _transport("voting", got["bytes"], e) from e
    except BaseException:
        if staging:
            receiver.discard()
        raise
    if not agreed:
        if staging:
            receiver.discard()
        if error is not None:
            raise error
        raise ValueError(
            "weight sync: another receiving rank refused the update (its error is in its log); "
            "nothing was committed and the previous weights keep serving"
        )
    receiver.commit()
    return SyncStats(
        got["tensors"], got["bytes"], got["wire"], got["buckets"],
        time.perf_counter() - start, True,
    )  # fmt: skip
