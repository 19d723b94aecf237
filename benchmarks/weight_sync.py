"""Weight sync into vLLM's CPU engine: today's bytes-through-RPC against the streamed transport.

Writes Qwen3-shaped checkpoints locally (a dense one with Qwen3-0.6B's layer shapes, about 0.44B
parameters with the byte tokenizer's 272-token vocabulary, and a small Qwen3-MoE), starts the
real vLLM CPU engine on each with ``quantization="minite"``, and pushes a new set of weights into
it by each method, timed in the same run:

- ``rpc-bf16``: today's path, ``pack_weights`` (safetensors bytes of every BF16 tensor) through
  ``collective_rpc("update_weights_bf16")``; vLLM re-quantizes;
- ``rpc-nvfp4``: the same path with the learner's NVFP4 tensors (``update_weights_quantized``);
- ``stream-bf16``: :mod:`minite_vllm.sync` over gloo, BF16 payload, vLLM re-quantizes;
- ``stream-nvfp4``: :mod:`minite_vllm.sync` over gloo, the learner's NVFP4 tensors (default).

The learner's NVFP4 tensors are quantized before the clock starts, as the learner holds them
already (its forward pass computes with them); that time is reported separately. Peak memory is
what each process holds at its highest above its level before the sync: the sender (this
process) and vLLM's worker by glibc's count of allocated bytes (``mallinfo2``, sampled every
millisecond by a thread; in the worker, started through ``collective_rpc``), vLLM's engine-core
process by its anonymous resident memory (``RssAnon``). Every method runs
``--repeats`` times, interleaved; the table gives medians. After every sync the sampler's NVFP4
tensors are checked bitwise against ``quantize_weight`` of the pushed weights. Prints a table
last; ``--out DIR`` writes every run as JSON.

    python benchmarks/weight_sync.py [--models dense,moe] [--bucket-mib 64] [--repeats 3]
                                     [--out DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from minite.alignment import configure_cpu_engines, start_sampler, stop_sampler
from minite.tiny_model import TinyModelSpec, write_tiny_model
from minite_common import DEFAULT_RECIPE, quantize_weight
from minite_common.checkpoint import nvfp4_to_state

#: Qwen3-0.6B's layer shapes (28 layers, hidden 1024, 16 q / 8 kv heads of 128, FFN 3072).
DENSE = TinyModelSpec(hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8,
                      head_dim=128, intermediate_size=3072)  # fmt: skip
#: A small Qwen3-MoE: 8 layers of 32 experts (top 4, expert FFN 256), hidden 1024.
MOE = TinyModelSpec(moe=True, hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4,
                    head_dim=128, num_experts=32, experts_per_token=4,
                    moe_intermediate_size=256)  # fmt: skip
METHODS = ("rpc-bf16", "rpc-nvfp4", "stream-bf16", "stream-nvfp4")


class HeapPeak:
    """The peak of the bytes this process holds from malloc (glibc ``mallinfo2``: heap blocks in
    use plus mmapped blocks; torch's CPU tensors and Python's large objects come from there),
    sampled every ``interval_s`` by a thread; :meth:`stop` returns it above the level at the
    start, in MiB. Counts allocations, not resident pages, so memory that glibc keeps after a
    free neither hides a later peak nor counts as one."""

    def __init__(self, interval_s: float = 0.001) -> None:
        fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                  "uordblks", "fordblks", "keepcost")  # fmt: skip
        # Made here, not at module level: this class also travels to vLLM's worker by value.
        mallinfo2 = type("mallinfo2", (ctypes.Structure,),
                         {"_fields_": [(f, ctypes.c_size_t) for f in fields]})  # fmt: skip
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = mallinfo2
        self.in_use = lambda: (lambda m: m.uordblks + m.hblkhd)(libc.mallinfo2())
        self.base = self.peak = self.in_use()
        self.interval_s = interval_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.interval_s):
            self.peak = max(self.peak, self.in_use())

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        self.peak = max(self.peak, self.in_use())
        return (self.peak - self.base) / 2**20


class RssPeak:
    """The peak anonymous resident memory (``RssAnon``) of another process above its level at
    the start, sampled every 2 ms, in MiB (for vLLM's engine-core process, which runs no code of
    ours; what passes through it in these syncs are large buffers, which glibc maps and unmaps)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = self.peak = self._rss()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise KeyError("RssAnon")

    def _run(self) -> None:
        while not self.done.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return (self.peak - self.base) / 2**20


def _worker_peak_start(self) -> None:
    """Runs in vLLM's worker: start a :class:`HeapPeak` there."""
    self._bench_peak = HeapPeak()


def _worker_peak_stop(self) -> float:
    return self._bench_peak.stop()


def _engine_core_pid() -> int:
    for child in psutil.Process().children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) + child.name():
            return child.pid
    raise RuntimeError("no vLLM engine-core process found")


def nvfp4_state(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The learner's NVFP4 payload: each linear weight's checkpoint tensors (BF16 for the
    embeddings, LM head, norms and MoE router, which the default recipe keeps in BF16)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        if t.dim() == 2 and not any(s in name for s in ("embed", "lm_head", "mlp.gate.")):
            out.update(nvfp4_to_state(name.removesuffix(".weight"), quantize_weight(t)))
        else:
            out[name] = t
    return out


def sampler_matches(llm, expected: dict[str, torch.Tensor]) -> bool:
    """Whether the sampler's NVFP4 tensors are bitwise ``expected``'s."""
    from minite_vllm import unpack_weights

    held = unpack_weights(llm.collective_rpc("get_quantized_weights")[0])
    bits = lambda t: t.view(torch.uint8) if t.dtype.itemsize == 1 else t
    return bool(held) and all(
        torch.equal(bits(t), bits(expected[n].reshape(t.shape))) for n, t in held.items()
    )


def push(method: str, llm, bf16: dict, nvfp4: dict, bucket_bytes: int) -> dict[str, Any]:
    """One sync by ``method``; returns its bytes and the sender's stats."""
    from minite_vllm import pack_weights
    from minite_vllm.sync import sync_weights

    fingerprint = DEFAULT_RECIPE.fingerprint()
    if method.startswith("rpc"):
        data = pack_weights(bf16 if method == "rpc-bf16" else nvfp4)
        if method == "rpc-bf16":
            llm.collective_rpc("update_weights_bf16", args=(data,))
        else:
            llm.collective_rpc("update_weights_quantized", args=(data, fingerprint))
        llm.reset_prefix_cache()
        return {"bytes": len(data), "buckets": None}
    payload = method.removeprefix("stream-")
    weights = bf16 if payload == "bf16" else nvfp4
    stats = sync_weights(llm, iter(weights.items()), payload=payload,
                         recipe_fingerprint=fingerprint, bucket_bytes=bucket_bytes)  # fmt: skip
    assert stats.committed
    return {"bytes": stats.payload_bytes, "wire_bytes": stats.wire_bytes,
            "buckets": stats.buckets}  # fmt: skip


def measure(llm, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn``; add its time and the peak memory (MiB above the level before) of the sender
    (this process), vLLM's engine-core process and its worker."""
    gc.collect()
    llm.collective_rpc(_worker_peak_start)
    sender, core = HeapPeak(), RssPeak(_engine_core_pid())
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peaks = {"sender": sender.stop(), "engine-core": core.stop(),
             "worker": llm.collective_rpc(_worker_peak_stop)[0]}  # fmt: skip
    return {**result, "seconds": seconds, "peak_mib": peaks}


def bench_model(
    name: str,
    spec: TinyModelSpec,
    root: Path,
    bucket_bytes: int,
    methods: list[str],
    repeats: int,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    from safetensors.torch import load_file

    t = time.perf_counter()
    a = write_tiny_model(root / f"{name}-a", spec, seed=0)
    b = write_tiny_model(root / f"{name}-b", spec, seed=1)
    log(f"{name}: wrote two checkpoints in {time.perf_counter() - t:.0f} s")
    targets = {}
    for key, path in (("a", a), ("b", b)):
        hf = load_file(path / "model.safetensors")
        t = time.perf_counter()
        targets[key] = (hf, nvfp4_state(hf), time.perf_counter() - t)
    params = sum(v.numel() for v in targets["a"][0].values())
    log(f"{name}: the learner-side quantization of the NVFP4 payload took "
        f"{targets['a'][2]:.1f} s (not in the sync times)")  # fmt: skip
    t = time.perf_counter()
    llm = start_sampler(a, max_num_seqs=4, max_model_len=256)
    log(f"{name}: {params / 1e9:.3f}B parameters; engine up in {time.perf_counter() - t:.0f} s")
    rows = []
    try:
        for i, method in enumerate(methods * repeats):
            key = "b" if i % 2 == 0 else "a"  # alternate, so every sync changes every tensor
            bf16, nvfp4, quantize_s = targets[key]
            row = measure(llm, lambda m=method, w=(bf16, nvfp4): push(m, llm, *w, bucket_bytes))
            row |= {"model": name, "params": params, "method": method,
                    "learner_quantize_s": quantize_s if method.endswith("nvfp4") else None,
                    "bitwise_ok": sampler_matches(llm, nvfp4)}  # fmt: skip
            rows.append(row)
            log(f"{name} {method}: {row['bytes'] / 2**20:.1f} MiB in {row['seconds']:.2f} s, "
                f"peaks {row['peak_mib']}, bitwise {row['bitwise_ok']}")  # fmt: skip
    finally:
        stop_sampler(llm)
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, method): the median time and peaks of its runs."""
    out = []
    for key in dict.fromkeys((r["model"], r["method"]) for r in rows):
        runs = [r for r in rows if (r["model"], r["method"]) == key]
        roles = runs[0]["peak_mib"]
        out.append(runs[0] | {
            "seconds": statistics.median(r["seconds"] for r in runs), "runs": len(runs),
            "peak_mib": {k: statistics.median(r["peak_mib"][k] for r in runs) for k in roles},
            "bitwise_ok": all(r["bitwise_ok"] for r in runs),
        })  # fmt: skip
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`medians` with ratios to stream-bf16 (bytes) and rpc-bf16 (time)."""
    lines = ["| model | method | MiB moved | bytes vs stream-bf16 | buckets | seconds (median) | "
             "speed vs rpc-bf16 | peak MiB sender | peak MiB engine core | peak MiB worker | "
             "bitwise |", "|---" * 11 + "|"]  # fmt: skip
    rows = medians(rows)
    for r in rows:
        same = [x for x in rows if x["model"] == r["model"]]
        b16 = next((x["bytes"] for x in same if x["method"] == "stream-bf16"), math.nan)
        rpc = next((x["seconds"] for x in same if x["method"] == "rpc-bf16"), math.nan)
        p = r["peak_mib"]
        lines.append(
            f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['method']} | "
            f"{r['bytes'] / 2**20:.1f} | {b16 / r['bytes']:.2f}x fewer | {r['buckets'] or '-'} | "
            f"{r['seconds']:.2f} | {rpc / r['seconds']:.2f}x | {p.get('sender', 0):.0f} | "
            f"{p.get('engine-core', 0):.0f} | {p.get('worker', 0):.0f} | {r['bitwise_ok']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dense,moe")
    parser.add_argument("--bucket-mib", type=float, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the worker-side memory probe
    configure_cpu_engines()
    torch.manual_seed(0)
    bucket_bytes = int(args.bucket_mib * 2**20) // 16 * 16
    specs = {"dense": DENSE, "moe": MOE, "tiny": TinyModelSpec()}  # tiny: a quick smoke run
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="minite-weight-sync-") as tmp:
        for name in args.models.split(","):
            rows += bench_model(name, specs[name], Path(tmp), bucket_bytes,
                                args.methods.split(","), args.repeats, print)  # fmt: skip
    now = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = (f"Device: 2-core CPU, torch {torch.__version__}, vLLM CPU engine, gloo; bucket "
              f"{bucket_bytes / 2**20:g} MiB; {now}")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "weight_sync.json").write_text(json.dumps(rows, indent=1))
    print(header)
    print(table(rows))


if __name__ == "__main__":
    main()
