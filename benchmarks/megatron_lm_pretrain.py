"""Megatron-LM's own ``pretrain_gpt.py`` with the miniTE spec against ``--transformer-impl local``.

For each model (a small Qwen3-shaped dense model, a small Qwen3-MoE model) this runs Megatron-LM's
unmodified ``pretrain_gpt.py`` (``torchrun``, one GPU) from the same seed, on mock data with
Megatron's ``NullTokenizer``:

1. ``--transformer-impl local`` (Megatron's BF16 local spec, the reference);
2. the same arguments plus ``--spec minite_megatron.spec <layer spec>`` (NVFP4 linears);
3. for each spec named by ``--resume`` (default: miniTE), checkpoints every ``--save-interval``
   iterations in its run above, then a run resumed from iteration ``--resume-from``
   (``--load ... --ckpt-step``, the same ``--train-iters`` so the learning-rate schedule is the
   same) and stopped ``--resume-iters`` later (``--exit-interval``).

Losses are read exactly from the TensorBoard scalars Megatron-LM writes (``lm loss``, float32),
iteration times from its log lines. ``--out`` gets ``<model>.json`` (both curves, loss bits of the
resumed and original runs, median iteration times, the throughput ratio; rewritten after each run)
and ``logs.tar.gz``. ``plot`` draws the curves and their gap from those JSON files.

Device machine: ``benchmarks/megatron_lm_pretrain.sh BUNDLE OUT [run options]`` installs the
bundle of ``benchmarks/megatron_lm_bundle.sh`` (the Megatron-Core 0.19.2 wheel, Megatron-LM's
``pretrain_gpt.py`` and friends from the matching release) and calls ``run``. Then, anywhere::

    python benchmarks/megatron_lm_pretrain.py plot --out DIR dense.json moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

#: Qwen3-shaped models, small enough for a few hundred iterations in a couple of minutes.
#: Both: RMSNorm (eps 1e-6), q/k RMSNorm, SwiGLU, GQA with head_dim 128, RoPE base 1e6, untied
#: embeddings, no biases, no dropout. MoE: softmax over the top-k logits (Qwen3's renormalized
#: top-k), no shared expert, all-to-all dispatcher, expert parallelism 1.
MODELS: dict[str, dict] = {
    "dense": {
        "spec": "minite_qk_norm_layer_spec",
        "args": [
            "--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "3072",
            "--num-attention-heads", "16", "--num-query-groups", "8",
        ],
    },
    "moe": {
        "spec": "minite_moe_qk_norm_layer_spec",
        "args": [
            "--num-layers", "6", "--hidden-size", "1024", "--ffn-hidden-size", "3072",
            "--num-attention-heads", "16", "--num-query-groups", "4",
            "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "768",
            "--moe-token-dispatcher-type", "alltoall",
            "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3",
            "--expert-model-parallel-size", "1",
        ],
    },
}  # fmt: skip

#: Arguments shared by every run (the same for the local and the miniTE spec).
COMMON = [
    "--group-query-attention", "--kv-channels", "128", "--qk-layernorm",
    "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear",
    "--position-embedding-type", "rope", "--rotary-base", "1000000",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--bf16", "--transformer-impl", "local",
    # No Transformer Engine or APEX on the device machine: Megatron's own fallbacks.
    "--no-rope-fusion", "--no-persist-layer-norm", "--no-masked-softmax-fusion",
    "--no-bias-swiglu-fusion",  # a torch.compile per process: startup time, not numerics
    # What the miniTE spec needs (docs/integrations.md): APEX's fused wgrad would bypass NVFP4.
    "--no-gradient-accumulation-fusion",
    "--optimizer", "adam", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine",
    "--lr-warmup-iters", "20", "--weight-decay", "0.1", "--adam-beta2", "0.95",
    "--clip-grad", "1.0", "--init-method-std", "0.02",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
    "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000000",
    "--log-interval", "1", "--tensorboard-log-interval", "1", "--log-throughput",
    "--distributed-backend", "nccl",
]  # fmt: skip

_ITER_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+ .*?elapsed time per iteration \(ms\): ([\d.]+)"
    r".*?lm loss: ([\d.E+-]+)"
)


def _pretrain(mlm_dir: Path, argv: list[str], log: Path, tb: Path) -> int:
    """Run Megatron-LM's pretrain_gpt.py once under torchrun (one process); its exit status."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_port", "29511", str(mlm_dir / "pretrain_gpt.py"),
        *argv, "--tensorboard-dir", str(tb),
    ]  # fmt: skip
    env = {**os.environ, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(mlm_dir), env.get("PYTHONPATH", "")])
    start = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=mlm_dir)
    rc = proc.returncode
    print(f"  {log.name}: rc={rc}, {time.time() - start:.0f} s", flush=True)
    if rc:
        sys.stdout.write("\n".join(log.read_text().splitlines()[-40:]) + "\n")
    return rc


def _tb_losses(tb: Path) -> dict[int, float]:
    """The exact float32 ``lm loss`` scalars Megatron-LM wrote to TensorBoard, by iteration."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("lm loss")}


def _iter_times(log: Path) -> dict[int, float]:
    """Megatron-LM's 'elapsed time per iteration (ms)' by iteration (log interval 1)."""
    return {int(m[1]): float(m[2]) for m in _ITER_LINE.finditer(log.read_text())}


def _median_ms(times: dict[int, float], skip: int, exclude: set[int]) -> float:
    return statistics.median(t for i, t in times.items() if i > skip and i not in exclude)


def _resume_check(original: dict[int, float], resumed: dict[int, float], start: int) -> dict:
    """Compare a resumed run's losses with the original run's, bit for bit."""
    steps = sorted(resumed)
    return {
        "from": start,
        # A resumed run that logs iteration start + 1 first did load the checkpoint.
        "first_iteration": steps[0] if steps else None,
        "iterations": [
            {
                "iteration": i,
                "resumed": float.hex(resumed[i]),
                "original": float.hex(original[i]),
                "equal": resumed[i] == original[i],
            }
            for i in steps
        ],
    }


def run_model(name: str, a: argparse.Namespace, work: Path, out: Path) -> dict:
    """The runs of one model; writes ``<name>.json`` after each run (a cut-off run keeps the rest).

    ``local`` and ``minite`` train from the same seed; each spec in ``a.resume`` also saves
    checkpoints and is resumed from iteration ``a.resume_from`` for ``a.resume_iters`` iterations.
    """
    model = MODELS[name]
    base = [
        *COMMON, *model["args"], "--seed", str(a.seed),
        "--seq-length", str(a.seq), "--max-position-embeddings", str(a.seq),
        "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.global_batch),
        "--train-iters", str(a.iters),
    ]  # fmt: skip
    specs = {"local": [], "minite": ["--spec", "minite_megatron.spec", model["spec"]]}
    resume = a.resume.split(",") if a.resume else []
    runs, every = {}, a.save_interval
    for impl, spec in specs.items():
        save = ["--save", str(work / f"{name}_{impl}_ckpt"), "--save-interval", str(every)]
        runs[impl] = [*base, *spec, *(save if impl in resume else [])]
    stop = a.resume_from + a.resume_iters
    for impl in resume:
        runs[f"{impl}_resumed"] = [
            *base, *specs[impl], "--load", str(work / f"{name}_{impl}_ckpt"),
            "--ckpt-step", str(a.resume_from), "--exit-interval", str(stop),
        ]  # fmt: skip
    saves = set(range(a.save_interval, a.iters + 1, a.save_interval))
    tokens = a.global_batch * a.seq
    result: dict = {
        "model": name,
        "model_args": model["args"],
        "spec": specs["minite"],
        "common_args": COMMON,
        "seq": a.seq,
        "global_batch": a.global_batch,
        "micro_batch": a.micro_batch,
        "iters": a.iters,
        "loss": {},
        "median_ms_per_iter": {},
        "tokens_per_s": {},
        "resume": {},
    }
    losses: dict[str, dict[int, float]] = {}
    for run, argv in runs.items():
        log, tb = work / f"{name}_{run}.log", work / f"{name}_{run}_tb"
        if _pretrain(a.mlm_dir, argv, log, tb):
            if not run.endswith("_resumed"):
                raise SystemExit(f"pretrain_gpt.py failed, log {log}")
            result["resume"][run[: -len("_resumed")]] = {"error": f"failed, see {log.name}"}
            continue
        losses[run] = _tb_losses(tb)
        if run in specs:
            result["loss"][run] = {str(i): v for i, v in sorted(losses[run].items())}
            ms = _median_ms(_iter_times(log), a.warmup, saves)
            result["median_ms_per_iter"][run] = ms
            result["tokens_per_s"][run] = tokens / ms * 1e3
        else:
            impl = run[: -len("_resumed")]
            result["resume"][impl] = _resume_check(losses[impl], losses[run], a.resume_from)
        if {"local", "minite"} <= set(result["median_ms_per_iter"]):
            ms = result["median_ms_per_iter"]
            result["throughput_ratio_minite_over_local"] = ms["local"] / ms["minite"]
        (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    ms, last = result["median_ms_per_iter"], a.iters
    summary = [
        f"{name}: loss@{last} local {losses['local'][last]:.4f}",
        f"minite {losses['minite'][last]:.4f}",
        f"ms/iter local {ms['local']:.1f} minite {ms['minite']:.1f}",
        f"ratio {result['throughput_ratio_minite_over_local']:.3f}x",
    ]
    for impl, check in result["resume"].items():
        its = check.get("iterations", [])
        summary.append(
            f"{impl} resumed at {check.get('first_iteration')}: "
            f"bitwise {sum(c['equal'] for c in its)}/{len(its)}"
        )
    print(" | ".join(summary), flush=True)
    return result


def cmd_run(a: argparse.Namespace) -> None:
    a.mlm_dir = a.mlm_dir.resolve()
    work, out = a.work.resolve(), a.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    try:
        for name in a.models.split(","):
            run_model(name, a, work, out)
    finally:
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            for log in sorted(work.glob("*.log")):
                tar.add(log, arcname=log.name)


def cmd_plot(a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(Path(p).read_text()) for p in a.results]
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), squeeze=False)
    for col, r in enumerate(results):
        local = {int(i): v for i, v in r["loss"]["local"].items()}
        minite = {int(i): v for i, v in r["loss"]["minite"].items()}
        steps = sorted(set(local) & set(minite))
        ax = axes[0][col]
        ax.plot(steps, [local[i] for i in steps], label="--transformer-impl local (BF16)")
        ax.plot(steps, [minite[i] for i in steps], label="--spec minite_megatron.spec (NVFP4)")
        ax.set_yscale("log")
        ax.set_title(
            f"{r['model']}: pretrain_gpt.py, throughput "
            f"{r['throughput_ratio_minite_over_local']:.2f}x local"
        )
        ax.set_ylabel("lm loss")
        ax.legend()
        gap = axes[1][col]
        gap.plot(steps, [minite[i] - local[i] for i in steps], color="C3")
        gap.axhline(0.0, color="k", lw=0.5)
        gap.set_yscale("symlog", linthresh=1e-3)
        gap.set_xlabel("iteration")
        gap.set_ylabel("loss gap, miniTE - local (symlog)")
    fig.tight_layout()
    a.out.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out / "megatron_lm_pretrain_loss.png", dpi=110)
    print(a.out / "megatron_lm_pretrain_loss.png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run pretrain_gpt.py (GPU)")
    r.add_argument("--mlm-dir", type=Path, required=True, help="Megatron-LM sources")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--work", type=Path, default=Path("/tmp/mlm_pretrain"))
    r.add_argument("--models", default="dense,moe")
    r.add_argument("--iters", type=int, default=300)
    r.add_argument("--save-interval", type=int, default=150)
    r.add_argument("--resume", default="minite", help="specs to save and resume: minite,local")
    r.add_argument("--resume-from", type=int, default=150)
    r.add_argument("--resume-iters", type=int, default=5)
    r.add_argument("--seq", type=int, default=1024)
    r.add_argument("--micro-batch", type=int, default=8)
    r.add_argument("--global-batch", type=int, default=16)
    r.add_argument("--seed", type=int, default=1234)
    r.add_argument("--warmup", type=int, default=10, help="iterations left out of the timing")
    q = sub.add_parser("plot", help="plot loss curves and gap from run's JSON files")
    q.add_argument("results", nargs="+")
    q.add_argument("--out", type=Path, default=Path("."))
    a = p.parse_args()
    {"run": cmd_run, "plot": cmd_plot}[a.cmd](a)


if __name__ == "__main__":
    main()
