"""GPU tests of the strict-mode ops (issue 16, part 1): ``minite_common.ops`` on CUDA tensors runs
the Triton kernels of ``minite_kernels.strict_ops``.

Claims checked here: every op's GPU output is bitwise the CPU reference's (BF16 and float32,
random inputs and edge cases, non-power-of-two sizes); a row's bits do not depend on the batch it
is computed in (batch 1 against batches of 7, 64 and 256); the sampler's forms of attention over
a paged KV cache (chunked prefill, decode steps, mixed batches) give bitwise the rows of the
learner's full-sequence attention; repeated runs give the same bits; backward passes on the GPU
match autograd of the CPU reference closely (not bitwise: they are torch code, see docs/strict.md).
"""

from __future__ import annotations

import pytest
import torch

from minite_common import ops

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
BATCHES = (7, 64, 256)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}  # fmt: skip
    return t.view(ints[t.dtype]) if t.dtype in ints else t


def assert_same(gpu: torch.Tensor, cpu: torch.Tensor, what: str = "") -> None:
    """Bitwise equality of every non-NaN element (-0 differs from +0), NaN where the other is NaN.
    NaN payloads are not compared: x86 and the GPU generate different default NaNs."""
    assert gpu.dtype == cpu.dtype and gpu.shape == cpu.shape, (what, gpu.shape, cpu.shape)
    gpu, cpu = gpu.detach().cpu(), cpu.detach().cpu()
    a, b = _bits(gpu), _bits(cpu)
    differ = a != b
    if gpu.is_floating_point():
        nan = torch.isnan(gpu)
        assert torch.equal(nan, torch.isnan(cpu)), f"{what}: NaNs at different places"
        differ &= ~nan
    diff = differ.sum().item()
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _act(rows: int, d: int, seed: int, dtype: torch.dtype, edge: bool = True) -> torch.Tensor:
    """CPU activations with a spread of magnitudes; with ``edge``: a zero row, signed zeros,
    large and tiny values in the first rows."""
    g = _gen(seed)
    x = torch.randn(rows, d, generator=g) * 10.0 ** (torch.rand(rows, 1, generator=g) * 4 - 2)
    if edge and rows > 2:
        x[1] = 0.0
        n = min(d, 8)
        x[0, :n] = torch.tensor([0.0, -0.0, 3e4, -3e4, 1e-30, -1e-30, 60.0, -60.0])[:n]
        x[2] *= 1e6
    return x.to(dtype)


# -- every op: GPU bits == CPU bits -------------------------------------------------------------


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("d", (1, 96, 1000, 4096))
def test_norms_residual(dtype: torch.dtype, d: int) -> None:
    x = _act(300, d, 1, dtype)
    r = _act(300, d, 2, dtype)
    w = (1 + 0.1 * torch.randn(d, generator=_gen(3))).to(dtype)
    assert_same(ops.rms_norm(x.to(CUDA), w.to(CUDA), 1e-6), ops.rms_norm(x, w, 1e-6), "rms")
    y, res = ops.add_rms_norm(x.to(CUDA), r.to(CUDA), w.to(CUDA), 1e-5)
    y_ref, res_ref = ops.add_rms_norm(x, r, w, 1e-5)
    assert_same(y, y_ref, "add_rms_norm")
    assert_same(res, res_ref, "residual")
    assert_same(ops.residual_add(x.to(CUDA), r.to(CUDA)), ops.residual_add(x, r), "residual_add")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_swiglu_and_specials(dtype: torch.dtype) -> None:
    x = _act(257, 2 * 1376, 4, dtype)
    assert_same(ops.swiglu(x.to(CUDA)), ops.swiglu(x), "swiglu")
    g = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 100.0, -100.0, 1e-40])
    g = torch.cat([g, torch.linspace(-30, 30, 100001)]).to(dtype)
    u = torch.ones_like(g)
    assert_same(ops.silu_mul(g.to(CUDA), u.to(CUDA)), ops.silu_mul(g, u), "silu specials")


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_rope(dtype: torch.dtype) -> None:
    pos = torch.cat([torch.arange(300), torch.tensor([4095, 32767, 131071])])
    for rotary, dim, base in ((128, 128, 1e6), (64, 128, 1e4), (24, 40, 10000.0)):
        cos, sin = ops.rope_cos_sin(pos, rotary, base)
        cos_g, sin_g = ops.rope_cos_sin(pos.to(CUDA), rotary, base)
        assert_same(cos_g, cos, "cos")
        assert_same(sin_g, sin, "sin")
        x = _act(pos.numel() * 6, dim, 5, dtype).view(pos.numel(), 6, dim)
        got = ops.apply_rope(x.to(CUDA), cos_g[:, None], sin_g[:, None])
        assert_same(got, ops.apply_rope(x, cos[:, None], sin[:, None]), f"rope {rotary}/{dim}")


@pytest.mark.parametrize("experts,top_k", ((8, 2), (60, 4), (128, 8)))
def test_routing_and_combine(experts: int, top_k: int) -> None:
    logits = _act(300, experts, 6, torch.bfloat16, edge=False)
    logits[0, :4] = 2.0  # ties: the lower expert wins
    for renorm in (True, False):
        w, ids = ops.topk_routing(logits.to(CUDA), top_k, renorm)
        w_ref, ids_ref = ops.topk_routing(logits, top_k, renorm)
        assert_same(w, w_ref, "routing weights")
        assert torch.equal(ids.cpu(), ids_ref)
    assert_same(ops.softmax(logits.float().to(CUDA)), ops.softmax(logits.float()), "softmax")
    y = _act(300 * top_k, 1000, 7, torch.bfloat16).view(300, top_k, 1000)
    assert_same(ops.moe_combine(y.to(CUDA), w), ops.moe_combine(y, w_ref), "moe_combine")


@pytest.mark.parametrize("k,n", ((1, 7), (100, 33), (1000, 300), (4096, 512)))
def test_linear(k: int, n: int) -> None:
    x = _act(70, k, 8, torch.bfloat16)
    w = (torch.randn(n, k, generator=_gen(9)) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, generator=_gen(10)).to(torch.bfloat16)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = ops.linear(x.to(CUDA), w.to(CUDA), bias.to(CUDA), out_dtype=out_dtype)
        assert_same(got, ops.linear(x, w, bias, out_dtype=out_dtype), f"linear {k}x{n}")


@pytest.mark.parametrize("vocab", (1, 1000, 32000, 151936))
def test_log_softmax(vocab: int) -> None:
    x = _act(9, vocab, 11, torch.bfloat16, edge=False).float() * 3
    x[1] = 0.0
    x[2, 0] = 80.0
    x[3, : min(vocab, 5)] = -float("inf")
    assert_same(ops.log_softmax(x.to(CUDA)), ops.log_softmax(x), f"log_softmax {vocab}")


def _qkv(t: int, heads: int, kv_heads: int, dim: int, seed: int, dtype=torch.bfloat16):
    g = _gen(seed)
    q = torch.randn(t, heads, dim, generator=g).to(dtype)
    k = (torch.randn(t, kv_heads, dim, generator=g) * 2).to(dtype)
    v = torch.randn(t, kv_heads, dim, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("t,heads,kv_heads,dim", ((1, 4, 4, 64), (37, 8, 2, 128), (300, 4, 1, 80)))
def test_causal_attention_full(t: int, heads: int, kv_heads: int, dim: int) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = _qkv(t, heads, kv_heads, dim, t, dtype)
        pos = torch.arange(t)
        got = ops.causal_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), pos.to(CUDA), dim**-0.5)
        assert_same(got, ops.causal_attention(q, k, v, pos, dim**-0.5), f"attention t={t}")


def _paged_cache(k: torch.Tensor, block_size: int, seed: int):
    """``k`` [T, Hk, D] scattered over shuffled blocks of a cache [blocks, block_size, Hk, D]."""
    blocks = -(-k.shape[0] // block_size)
    perm = torch.randperm(blocks + 5, generator=_gen(seed))[:blocks]
    cache = torch.randn(blocks + 5, block_size, *k.shape[1:], generator=_gen(seed + 1)).to(k.dtype)
    p = torch.arange(k.shape[0])
    cache[perm[p // block_size], p % block_size] = k
    return cache, perm


def test_paged_prefill_and_decode_give_full_rows() -> None:
    """vLLM's forms: a prefill in chunks, then one decode step per token, over a paged cache in
    shuffled blocks: bitwise the full-sequence rows (GPU) and the CPU reference's rows."""
    t, heads, kv_heads, dim, bs = 300, 8, 2, 128, 16
    q, k, v = _qkv(t, heads, kv_heads, dim, 12)
    scale = dim**-0.5
    full = ops.causal_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), torch.arange(t, device=CUDA),
                                scale)  # fmt: skip
    assert_same(full, ops.causal_attention(q, k, v, torch.arange(t), scale), "full")
    kc, table = _paged_cache(k, bs, 13)
    vc, _ = _paged_cache(v, bs, 13)
    kc, vc, table = kc.to(CUDA), vc.to(CUDA), table[None].to(CUDA)
    qg = q.to(CUDA)
    chunks = (0, 17, 64, 200)  # chunked prefill: 17, 47 and 136 new tokens
    for lo, hi in zip(chunks[:-1], chunks[1:], strict=True):
        got = ops.paged_attention(qg[lo:hi], kc, vc, table, [0, hi - lo], [hi], scale)
        assert_same(got, full[lo:hi].cpu(), f"prefill chunk {lo}:{hi}")
    for p in range(200, t):
        got = ops.paged_attention(qg[p : p + 1], kc, vc, table, [0, 1], [p + 1], scale)
        assert_same(got, full[p : p + 1].cpu(), f"decode {p}")
    # the vLLM CPU cache layout [blocks, Hk, block_size, D], passed as a strided view
    kt = kc.transpose(1, 2).contiguous().transpose(1, 2)
    vt = vc.transpose(1, 2).contiguous().transpose(1, 2)
    got = ops.paged_attention(qg[250:251], kt, vt, table, [0, 1], [251], scale)
    assert_same(got, full[250:251].cpu(), "strided cache")


@pytest.mark.parametrize("batch", (1,) + BATCHES)
def test_decode_batches_are_row_invariant(batch: int) -> None:
    """Sequences of different lengths in one decode batch: each row is the bits of its sequence's
    full-sequence attention row (CPU reference). Sequence 0 has the same tokens at every batch
    size, in different blocks: its row has the same bits at batch 1, 7, 64 and 256."""
    heads, kv_heads, dim, bs = 8, 2, 128, 16
    g = _gen(batch)
    lens = torch.randint(1, 700, (batch,), generator=g).tolist()
    lens[0] = 300
    total = sum(-(-n // bs) for n in lens) + 3
    kc = torch.randn(total, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    vc = torch.randn(total, bs, kv_heads, dim, generator=g).to(torch.bfloat16)
    width = max(-(-n // bs) for n in lens)
    table = torch.zeros(batch, width, dtype=torch.int64)
    free = torch.randperm(total, generator=g)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        table[i, :nb] = free[used : used + nb]
        used += nb
    q = torch.randn(batch, heads, dim, generator=g).to(torch.bfloat16)
    q0, k0, v0 = _qkv(300, heads, kv_heads, dim, 7)  # sequence 0: fixed across batch sizes
    p0 = torch.arange(300)
    kc[table[0, p0 // bs], p0 % bs] = k0
    vc[table[0, p0 // bs], p0 % bs] = v0
    q[0] = q0[-1]
    out = ops.paged_attention(
        q.to(CUDA), kc.to(CUDA), vc.to(CUDA), table.to(CUDA), list(range(batch + 1)), lens, 0.1
    )
    ref0 = ops.causal_attention(q0[-1:], k0, v0, torch.tensor([299]), 0.1)
    assert_same(out[:1], ref0, f"sequence 0 at batch {batch}")
    for i in range(1, min(batch, 12)):
        n = lens[i]
        p = torch.arange(n)
        blk = table[i, p // bs]
        ref = ops.causal_attention(q[i : i + 1], kc[blk, p % bs], vc[blk, p % bs],
                                   torch.tensor([n - 1]), 0.1)  # fmt: skip
        assert_same(out[i : i + 1], ref, f"decode row {i} (len {n}) at batch {batch}")


@pytest.mark.parametrize("op", ("rms_norm", "swiglu", "linear", "log_softmax", "softmax", "rope"))
def test_rows_batch_invariant(op: str) -> None:
    """A row computed at batch 1 has the bits it has inside batches of 7, 64 and 256."""
    d = 2048
    x = _act(256, d, 20, torch.bfloat16).to(CUDA)
    w = (torch.randn(d, generator=_gen(21)) * 0.1 + 1).to(torch.bfloat16).to(CUDA)
    wl = (torch.randn(999, d, generator=_gen(22)) / 45).to(torch.bfloat16).to(CUDA)
    pos = torch.arange(256, device=CUDA) * 13
    cos, sin = ops.rope_cos_sin(pos, 128, 1e6)
    fn = {
        "rms_norm": lambda t, s: ops.rms_norm(t, w, 1e-6),
        "swiglu": lambda t, s: ops.swiglu(t),
        "linear": lambda t, s: ops.linear(t, wl),
        "log_softmax": lambda t, s: ops.log_softmax(t.float()),
        "softmax": lambda t, s: ops.softmax(t[:, :64].float()),
        "rope": lambda t, s: ops.apply_rope(
            t.view(t.shape[0], 16, 128), cos[s, None], sin[s, None]
        ),  # fmt: skip
    }[op]
    full = fn(x, slice(0, 256))
    for i in (0, 5, 255):
        assert_same(fn(x[i : i + 1], slice(i, i + 1)), full[i : i + 1].cpu(), f"{op} row {i}")
    for b in BATCHES:
        for start in (0, 256 - b):
            part = fn(x[start : start + b], slice(start, start + b))
            assert_same(part, full[start : start + b].cpu(), f"{op} batch {b} at {start}")


def test_deterministic_repeats() -> None:
    q, k, v = _qkv(513, 8, 2, 128, 30)
    q, k, v = q.to(CUDA), k.to(CUDA), v.to(CUDA)
    pos = torch.arange(513, device=CUDA)
    first = ops.causal_attention(q, k, v, pos, 0.088)
    x = _act(64, 4096, 31, torch.bfloat16).to(CUDA)
    w = (torch.randn(4000, 4096, generator=_gen(32)) / 64).to(torch.bfloat16).to(CUDA)
    lin = ops.linear(x, w)
    for _ in range(3):
        assert_same(ops.causal_attention(q, k, v, pos, 0.088), first.cpu(), "attention repeat")
        assert_same(ops.linear(x, w), lin.cpu(), "linear repeat")


def test_torch_route_on_gpu_is_exact_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MINITE_BACKEND=torch`` runs the torch reference code on the GPU: the same bits."""
    monkeypatch.setenv("MINITE_BACKEND", "torch")
    x = _act(33, 200, 40, torch.bfloat16)
    w = torch.randn(200, generator=_gen(41)).to(torch.bfloat16)
    assert_same(ops.rms_norm(x.to(CUDA), w.to(CUDA), 1e-6), ops.rms_norm(x, w, 1e-6), "rms")
    assert_same(ops.log_softmax(x.to(CUDA).float()), ops.log_softmax(x.float()), "log_softmax")
    q, k, v = _qkv(40, 4, 2, 64, 42)
    pos = torch.arange(40)
    got = ops.causal_attention(q.to(CUDA), k.to(CUDA), v.to(CUDA), pos.to(CUDA), 0.125)
    assert_same(got, ops.causal_attention(q, k, v, pos, 0.125), "attention")


# -- backward (torch code on the GPU: close to the CPU reference's autograd) ---------------------


def _grads(fn, inputs, grad):
    ins = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*ins)
    return torch.autograd.grad(out, [t for t in ins if t.requires_grad], grad)


def test_backward_matches_cpu_reference() -> None:
    g = _gen(50)
    t, heads, kv_heads, dim = 64, 4, 2, 64
    q, k, v = _qkv(t, heads, kv_heads, dim, 51, torch.float32)
    x = torch.randn(t, 256, generator=g)
    w = torch.randn(256, generator=g)
    wl = torch.randn(96, 256, generator=g) / 16
    cos, sin = ops.rope_cos_sin(torch.arange(t), 32, 1e4)
    cases = {
        "attention": (
            lambda a, b, c: ops.causal_attention(a, b, c, torch.arange(t, device=a.device), 0.125),
            (q, k, v),
        ),  # fmt: skip
        "rms_norm": (lambda a, b: ops.rms_norm(a, b, 1e-6), (x, w)),
        "linear": (lambda a, b: ops.linear(a, b), (x, wl)),
        "swiglu": (lambda a: ops.swiglu(a), (x,)),
        "residual_add": (lambda a, b: ops.residual_add(a, b), (x, x * 0.5)),
        "rope": (
            lambda a: ops.apply_rope(a, cos.to(a.device)[:, None], sin.to(a.device)[:, None]),
            (q,),
        ),  # fmt: skip
        "log_softmax": (lambda a: ops.log_softmax(a), (x,)),
        "softmax": (lambda a: ops.softmax(a), (x,)),
    }
    for name, (fn, inputs) in cases.items():
        out = fn(*inputs)
        grad = torch.randn(out.shape, generator=_gen(52))
        want = _grads(fn, inputs, grad)
        got = _grads(fn, [t.to(CUDA) for t in inputs], grad.to(CUDA))
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5, msg=name)
