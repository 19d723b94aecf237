"""Multi-GPU learner benchmark: a Qwen3-30B-A3B-shaped GPTModel, expert parallelism, BF16 vs miniTE.

Each rank runs forward+backward of the same global batch share (``--seq`` x ``--micro-batch``
tokens) through a Megatron-Core ``GPTModel`` with ``--layers`` Qwen3-30B-A3B decoder layers
(hidden 2048, 32 q / 4 kv heads of 128, 128 experts of 768, top-8, vocabulary 151936), expert
parallelism over all ranks (``--gpus``; data parallelism over the same ranks for the dense
parameters, whose gradients are all-reduced as DDP would), for three variants built from the
same seed: Megatron's BF16 local spec (experts through ``SequentialMLP``, a host loop), the same
spec with grouped BF16 experts (``learner.BF16GroupedMLP``: ``torch._grouped_mm``, the fair BF16
peer) and the miniTE spec with grouped NVFP4 experts. Reports learner tokens/s (all ranks), the
ratios against both BF16 variants (the grouped one is the baseline), peak memory and the
step-time split (forward, backward, gradient all-reduce). NVLink multicast stays off
(``NCCL_NVLS_ENABLE=0``).

    python benchmarks/learner_multi_gpu.py --gpus 8 --layers 48 --out $OUT   # one 8-GPU node
    python benchmarks/learner_multi_gpu.py --cpu-smoke                       # 2 gloo ranks, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learner import SDPACoreAttention, bf16_grouped_spec  # noqa: E402  (the benchmarks' helpers)

QWEN3_30B_A3B = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, topk=8,
                     expert_ffn=768, vocab=151936)  # fmt: skip
TINY = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, experts=4, topk=2, expert_ffn=32,
            vocab=512)  # fmt: skip


def hf_config(shape: dict[str, int], layers: int) -> types.SimpleNamespace:
    """A Qwen3-MoE HF-style config for ``minite_megatron.transformer_config_from_hf``."""
    return types.SimpleNamespace(
        model_type="qwen3_moe", attention_bias=False, use_sliding_window=False,
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, rope_theta=1e6,
        num_hidden_layers=layers, hidden_size=shape["hidden"], intermediate_size=6144,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], rms_norm_eps=1e-6, vocab_size=shape["vocab"],
        max_position_embeddings=65536, tie_word_embeddings=False,
        num_experts=shape["experts"], num_experts_per_tok=shape["topk"],
        moe_intermediate_size=shape["expert_ffn"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[],
    )  # fmt: skip


def build_model(variant: str, args: argparse.Namespace, device: torch.device):
    """The GPTModel of ``variant`` ("bf16", "bf16_grouped" or "minite"), same seed for all."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    import minite_megatron as mm

    shape = TINY if args.cpu_smoke else QWEN3_30B_A3B
    hf = hf_config(shape, args.layers)
    dispatcher = "allgather" if args.cpu_smoke else "alltoall"  # alltoall needs CUDA streams
    config = mm.transformer_config_from_hf(
        hf, expert_model_parallel_size=args.gpus, moe_token_dispatcher_type=dispatcher
    )
    if variant in ("bf16", "bf16_grouped"):
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=config.normalization
        )
        if variant == "bf16_grouped":
            spec = bf16_grouped_spec(spec)
    else:
        spec = mm.get_gpt_decoder_block_minite_spec(config, grouped_experts=True)
    if device.type == "cuda":
        from minite_megatron.spec_tree import replace_class

        spec = replace_class(spec, DotProductAttention, SDPACoreAttention)
    torch.manual_seed(0)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(0)
    model = GPTModel(config, spec, **mm.gpt_model_kwargs_from_hf(hf))
    return model.to(device=device, dtype=torch.bfloat16)


def rank_main(rank: int, args: argparse.Namespace, result_file: str) -> None:
    """One rank: init, then time both variants; rank 0 writes the results."""
    from megatron.core import parallel_state

    import minite_megatron as mm

    cuda = not args.cpu_smoke
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{args.rendezvous}", rank=rank,
        world_size=args.gpus,
    )  # fmt: skip
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=args.gpus)
    mm.init_megatron(1)
    vocab = (TINY if args.cpu_smoke else QWEN3_30B_A3B)["vocab"]
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, vocab, (args.micro_batch, args.seq), generator=g).to(device)
    results = {}
    for variant in args.variants.split(","):
        model = build_model(variant, args, device)
        dense = [p for n, p in model.named_parameters() if ".experts." not in n]
        times: dict[str, list[float]] = {"fwd": [], "bwd": [], "allreduce": [], "step": []}

        def iteration(record: bool, model=model, dense=dense, times=times) -> None:
            for p in model.parameters():
                p.grad = None
            marks = [time.perf_counter()]
            lp = mm.token_logprobs(model, ids)
            loss = -lp.float().mean()
            _sync(device)
            marks.append(time.perf_counter())
            loss.backward()
            _sync(device)
            marks.append(time.perf_counter())
            grads = [p.grad for p in dense if p.grad is not None]
            flat = torch.cat([gr.reshape(-1).float() for gr in grads])
            dist.all_reduce(flat)  # data parallelism of the dense parameters, as DDP would
            _sync(device)
            marks.append(time.perf_counter())
            if record:
                for key, a, b in (("fwd", 0, 1), ("bwd", 1, 2), ("allreduce", 2, 3),
                                  ("step", 0, 3)):  # fmt: skip
                    times[key].append((marks[b] - marks[a]) * 1e3)

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for i in range(args.warmup + args.iters):
            iteration(record=i >= args.warmup)
        step_ms = [torch.tensor(statistics.median(times[k]), device=device) for k in times]
        for t in step_ms:  # the slowest rank sets the pace
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        res = {k: float(t) for k, t in zip(times, step_ms, strict=True)}
        res["tokens_per_s"] = args.gpus * args.seq * args.micro_batch / (res["step"] * 1e-3)
        if cuda:
            peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30, device=device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            res["peak_gib"] = float(peak)
        results[variant] = res
        del model, dense
        if cuda:
            torch.cuda.empty_cache()
    if rank == 0:
        Path(result_file).write_text(json.dumps(results))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count() or 2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="bf16,bf16_grouped,minite")
    p.add_argument("--cpu-smoke", action="store_true", help="2 gloo ranks, tiny model")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "multi-gpu-out")))
    args = p.parse_args()
    if args.cpu_smoke:
        args.gpus, args.layers, args.seq, args.micro_batch, args.iters = 2, 2, 64, 2, 1
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (device docs)
    args.out.mkdir(parents=True, exist_ok=True)
    args.rendezvous = tempfile.mktemp(prefix="minite-rdzv-")
    result_file = str(args.out / "learner_multi_gpu.json")
    mp.start_processes(rank_main, args=(args, result_file), nprocs=args.gpus,
                       start_method="spawn")  # fmt: skip
    results = json.loads(Path(result_file).read_text())
    shape = "tiny MoE" if args.cpu_smoke else "Qwen3-30B-A3B-shaped"
    print(f"{args.layers} {shape} layers, EP={args.gpus} on {args.gpus} ranks, "
          f"seq {args.seq} x micro-batch {args.micro_batch} per rank")  # fmt: skip
    print(f"{'variant':12s} {'tokens/s':>12s} {'step ms':>9s} {'fwd':>8s} {'bwd':>8s} "
          f"{'allreduce':>9s} {'peak GiB':>9s}")  # fmt: skip
    for variant, r in results.items():
        print(f"{variant:12s} {r['tokens_per_s']:12.0f} {r['step']:9.1f} {r['fwd']:8.1f} "
              f"{r['bwd']:8.1f} {r['allreduce']:9.1f} {r.get('peak_gib', 0):9.2f}")  # fmt: skip
    for base in ("bf16_grouped", "bf16"):
        if "minite" in results and base in results:
            ratio = results["minite"]["tokens_per_s"] / results[base]["tokens_per_s"]
            print(f"miniTE / {base} tokens/s: {ratio:.2f}x")


if __name__ == "__main__":
    main()
