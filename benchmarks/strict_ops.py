"""Strict-mode ops on the GPU against torch's default ops (issue 16, part 1).

    mkdir -p /tmp/pk && ln -sfn $PWD/kernels /tmp/pk/minite_kernels
    PYTHONPATH=$PWD:/tmp/pk python3 benchmarks/strict_ops.py [--tokens 256,4096] [--out DIR]

Each row times one op of ``minite_common.ops`` on CUDA tensors (the Triton kernels of
``minite_kernels.strict_ops``: fixed reduction trees, float64 transcendentals, no FMA) and the
op a default (non-strict) engine runs for the same job (``F.rms_norm``, ``F.silu(g) * u``,
``F.linear`` / cuBLAS, ``F.scaled_dot_product_attention``, ``torch.softmax``/``log_softmax``,
a torch rotary), forward only, BF16 activations, Qwen3-8B-like shapes (hidden 4096, 32 query /
8 KV heads of 128, FFN 12288, vocabulary 151936, 128 experts top-8). Medians of
``triton.testing.do_bench``; the ratio is strict / default. Decode attention reads a paged cache
(block size 16) of ``--context`` tokens per sequence; one sequence per token of the batch.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from minite_common import ops

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, EXPERTS, TOP_K = (
    4096, 32, 8, 128, 12288, 151936, 128, 8,
)  # fmt: skip


def _bf16(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A default engine's NeoX rotary in torch (float32 math, the input's dtype out)."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def cases(tokens: int, context: int) -> dict[str, tuple]:
    """name -> (strict callable, default callable)."""
    x = _bf16(tokens, HIDDEN)
    r = _bf16(tokens, HIDDEN)
    w = _bf16(HIDDEN, scale=0.1) + 1
    gu = _bf16(tokens, 2 * FFN)
    q = _bf16(tokens, HEADS, HEAD_DIM)
    pos = torch.arange(tokens, device="cuda")
    cos, sin = ops.rope_cos_sin(pos, HEAD_DIM, 1e6)
    logits = _bf16(tokens, EXPERTS)
    lm_w = _bf16(VOCAB, HIDDEN, scale=HIDDEN**-0.5)
    vocab_logits = _bf16(tokens, VOCAB, scale=3).float()
    y = _bf16(tokens, TOP_K, HIDDEN)
    weights = torch.rand(tokens, TOP_K, device="cuda")
    # learner's full causal sequence: one sequence of `tokens` tokens
    k_seq, v_seq = _bf16(tokens, KV_HEADS, HEAD_DIM), _bf16(tokens, KV_HEADS, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    # sampler's decode: `tokens` sequences of `context` tokens in a paged cache
    bs = 16
    nb = -(-context // bs)
    kc = _bf16(tokens * nb, bs, KV_HEADS, HEAD_DIM)
    vc = _bf16(tokens * nb, bs, KV_HEADS, HEAD_DIM)
    table = torch.randperm(tokens * nb, device="cuda", dtype=torch.int32).view(tokens, nb)
    starts, lens = list(range(tokens + 1)), [context] * tokens
    kd = kc[table.long()].view(tokens, nb * bs, KV_HEADS, HEAD_DIM)[:, :context]
    vd = vc[table.long()].view(tokens, nb * bs, KV_HEADS, HEAD_DIM)[:, :context]

    def sdpa_full():
        qt, kt, vt = (t.transpose(0, 1)[None] for t in (q, k_seq, v_seq))
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    def sdpa_decode():  # the default engine's kernel reads the cache in place; SDPA on a gather
        return F.scaled_dot_product_attention(
            q[:, :, None], kd.transpose(1, 2), vd.transpose(1, 2), enable_gqa=True
        )

    return {
        "residual_add": (lambda: ops.residual_add(x, r), lambda: x + r),
        "rms_norm": (lambda: ops.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (HIDDEN,), w, 1e-6)),
        "add_rms_norm": (
            lambda: ops.add_rms_norm(x, r, w, 1e-6),
            lambda: F.rms_norm(x + r, (HIDDEN,), w, 1e-6),
        ),
        "swiglu": (lambda: ops.swiglu(gu), lambda: F.silu(gu[:, :FFN]) * gu[:, FFN:]),
        "rope (q)": (
            lambda: ops.apply_rope(q, cos[:, None], sin[:, None]),
            lambda: rope_torch(q, cos[:, None], sin[:, None]),
        ),
        "router softmax+top-k": (
            lambda: ops.topk_routing(logits, TOP_K, True),
            lambda: torch.topk(torch.softmax(logits.float(), -1), TOP_K, -1),
        ),
        "moe_combine": (
            lambda: ops.moe_combine(y, weights),
            lambda: (y * weights[..., None].bfloat16()).sum(1),
        ),
        "lm_head linear": (lambda: ops.linear(x, lm_w), lambda: F.linear(x, lm_w)),
        "log_softmax": (
            lambda: ops.log_softmax(vocab_logits),
            lambda: torch.log_softmax(vocab_logits, -1),
        ),
        "attention full seq": (
            lambda: ops.causal_attention(q, k_seq, v_seq, pos, scale),
            sdpa_full,
        ),
        f"attention decode ctx {context}": (
            lambda: ops.paged_attention(q, kc, vc, table, starts, lens, scale),
            sdpa_decode,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'op':28s} {'tokens':>6s} {'strict ms':>10s} {'default ms':>10s} {'ratio':>8s}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for name, (strict, default) in cases(tokens, args.context).items():
            t_strict = triton.testing.do_bench(strict, warmup=5, rep=50)
            t_default = triton.testing.do_bench(default, warmup=5, rep=50)
            rows.append({"op": name, "tokens": tokens, "strict_ms": t_strict,
                         "default_ms": t_default, "ratio": t_strict / t_default})  # fmt: skip
            print(f"{name:28s} {tokens:6d} {t_strict:10.4f} {t_default:10.4f} "
                  f"{t_strict / t_default:8.2f}", flush=True)  # fmt: skip
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(),
                "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "triton": triton.__version__, "rows": rows}  # fmt: skip
        (args.out / "strict_ops.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
