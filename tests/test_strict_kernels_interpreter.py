"""The strict-mode Triton kernels (``minite_kernels.strict_ops``) on CPU, through Triton's
interpreter: each kernel's output is bitwise the torch reference of ``minite_common.ops``.

The interpreter runs the kernels' float32/float64 arithmetic with numpy (IEEE, no FMA), so these
checks cover the formulas, the fixed reduction trees (including the streamed, bit-reversed stack
of long reductions), masking, paging and padding. It truncates float32 -> BF16 casts (the GPU
rounds), so the checks use float32 activations; ``tests/gpu/test_gpu_strict_ops.py`` checks BF16
and the compiled kernels on a GPU. Each check runs in a subprocess with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from minite_common import ops

CHECKS = ["elementwise", "rows", "linear", "attention"]


@pytest.mark.parametrize("check", CHECKS)
def test_strict_kernel_in_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _paged(k: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` [T, Hk, D] scattered into a cache [blocks, block_size, Hk, D] in shuffled blocks."""
    blocks = -(-k.shape[0] // block_size)
    order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(seed))[:blocks]
    cache = torch.randn(blocks + 3, block_size, *k.shape[1:])
    pos = torch.arange(k.shape[0])
    cache[order[pos // block_size], pos % block_size] = k
    return cache, order.unsqueeze(0)


def test_paged_attention_reference_rows() -> None:
    """CPU path: a chunked prefill and decode steps over a paged cache give the full sequence's
    rows bitwise; bad metadata is refused."""
    torch.manual_seed(0)
    t, heads, kv_heads, dim = 23, 4, 2, 24
    q, k, v = torch.randn(t, heads, dim), torch.randn(t, kv_heads, dim), torch.randn(t, 2, 16)
    full = ops.causal_attention(q, k, v, torch.arange(t), 0.2)
    kc, table = _paged(k, 4, 1)
    vc, _ = _paged(v, 4, 1)
    prefill = ops.paged_attention(q[:9], kc, vc, table, [0, 9], [9], 0.2)
    assert torch.equal(prefill, full[:9])
    chunk = ops.paged_attention(q[9:20], kc, vc, table, [0, 11], [20], 0.2)
    assert torch.equal(chunk, full[9:20])
    for pos in range(20, t):
        step = ops.paged_attention(q[pos : pos + 1], kc, vc, table, [0, 1], [pos + 1], 0.2)
        assert torch.equal(step, full[pos : pos + 1])
    # two sequences in one call (the second is the first's decode at position 21)
    both = ops.paged_attention(
        torch.cat([q[:5], q[21:22]]), kc, vc, torch.cat([table, table]), [0, 5, 6], [5, 22], 0.2
    )
    assert torch.equal(both, torch.cat([full[:5], full[21:22]]))
    again = ops.paged_attention(torch.cat([q[:5], q[21:22]]), kc, vc, torch.cat([table, table]),
                                torch.tensor([0, 5, 6]), torch.tensor([5, 22]), 0.2)  # fmt: skip
    assert torch.equal(again, both)
    with pytest.raises(ValueError, match="paged_attention"):
        ops.paged_attention(q[:3], kc, vc, table, [0, 3], [2], 0.2)


def _ptx(fn, sig: dict[str, str], consts: dict[str, int], fusion: bool) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **dict.fromkeys(consts, "constexpr")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    options = {"enable_fp_fusion": fusion}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def test_kernels_compile_for_hopper_without_fma() -> None:
    """Every strict kernel compiled for sm_90 (PTX, ptxas) under the launch options has no fused
    multiply-add and no approximate division or square root; with fusion on, Triton would fuse."""
    pytest.importorskip("triton")
    import re

    from minite_kernels import strict_ops as kern

    b, f, i = "*bf16", "*fp32", "i32"
    elementwise = {"n": i}
    kernels = [
        (kern._residual_add_kernel, {"x_ptr": b, "r_ptr": b, "y_ptr": b, **elementwise},
         {"BLOCK": 1024}),
        (kern._silu_mul_kernel, {"g_ptr": b, "u_ptr": b, "y_ptr": b, **elementwise},
         {"BLOCK": 1024}),
        (kern._rope_kernel, {"x_ptr": b, "c_ptr": f, "s_ptr": f, "y_ptr": b, "D": i, "HALF": i},
         {"BLOCK": 64}),
        (kern._moe_combine_kernel, {"y_ptr": b, "w_ptr": f, "o_ptr": b, "SLOTS": i, "HID": i},
         {"BLOCK": 1024}),
        (kern._rms_norm_kernel, {"x_ptr": b, "w_ptr": b, "y_ptr": b, "D": i, "eps": "fp32"},
         {"P": 4096, "LP": 12}),
        (kern._softmax_kernel, {"x_ptr": f, "y_ptr": f, "E": i}, {"P": 128, "LP": 7}),
        (kern._log_softmax_kernel, {"x_ptr": f, "y_ptr": f, "V": i},
         {"BLOCK": 1024, "S": 1024, "LS": 10, "L": 8}),
        (kern._linear_kernel, {"x_ptr": b, "w_ptr": b, "y_ptr": f, "M": i, "N": i, "K": i,
                               "sxm": i, "swn": i},
         {"BM": 16, "BN": 16, "S": 16, "LS": 4, "L": 8}),
        (kern._linear_kernel, {"x_ptr": b, "w_ptr": b, "y_ptr": f, "M": i, "N": i, "K": i,
                               "sxm": i, "swn": i},
         {"BM": 1, "BN": 64, "S": 16, "LS": 4, "L": 8}),
    ]  # fmt: skip
    attn = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "o_ptr"), b)
    attn |= {"s_ptr": f, **dict.fromkeys(("tok_ptr", "pos_ptr", "seq_ptr", "len_ptr", "bt_ptr"),
                                         "*i32")}  # fmt: skip
    attn |= {"scale": "fp32"} | dict.fromkeys(
        [
            "H",
            "GROUP",
            "D",
            "DV",
            "BS",
            "bt_stride",
            "sq_t",
            "sq_h",
            "sk_b",
            "sk_o",
            "sk_h",
            "sv_b",
            "sv_o",
            "sv_h",
            "so_t",
            "so_h",
        ],
        i,
    )
    for s, levels in ((1, 0), (128, 8)):
        consts = {"DP": 128, "LDP": 7, "DVP": 128, "BJ": 16, "S": s, "LS": s.bit_length() - 1}
        kernels.append((kern._attention_kernel, attn, {**consts, "L": levels}))
    for fn, sig, consts in kernels:
        ptx = _ptx(fn, sig, consts, fusion=kern.LAUNCH["enable_fp_fusion"])
        for pattern in (r"\bfma\.", r"\.approx", r"div\.full", r"\.ftz"):
            assert not re.search(pattern, ptx), (fn.fn.__name__, pattern)
    fused = _ptx(kernels[1][0], kernels[1][1], kernels[1][2], fusion=True)
    assert re.search(r"\bfma\.", fused)


def test_kernel_forward_keeps_reference_gradients() -> None:
    """The GPU route of the plain-torch ops (a kernel forward, the reference's autograd for the
    backward) gives the reference's gradients; here the "kernel" is the reference itself."""
    torch.manual_seed(0)
    g, u = torch.randn(4, 10, requires_grad=True), torch.randn(4, 10, requires_grad=True)
    grad = torch.randn(4, 10)
    want = torch.autograd.grad(ops._silu_mul_ref(g, u), (g, u), grad)
    y = ops._dispatch(lambda a, b: ops._silu_mul_ref(a, b).detach(), ops._silu_mul_ref, g, u)
    assert torch.equal(y, ops._silu_mul_ref(g, u))
    got = torch.autograd.grad(y, (g, u), grad)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    x = torch.randn(3, 2, 8, requires_grad=True)
    cos, sin = ops.rope_cos_sin(torch.arange(3), 6, 1e4)
    y = ops._dispatch(
        lambda *a: ops._apply_rope_ref(*a).detach(),
        ops._apply_rope_ref,
        x,
        cos[:, None],
        sin[:, None],
    )
    (gx,) = torch.autograd.grad(y, (x,), torch.ones_like(y))
    (want_x,) = torch.autograd.grad(ops._apply_rope_ref(x, cos[:, None], sin[:, None]), (x,),
                                    torch.ones_like(y))  # fmt: skip
    assert torch.equal(gx, want_x)


# ---- worker side (runs under TRITON_INTERPRET=1) ----


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def _edge(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zeros of both signs, large values, tiny (subnormal) ones in its first row."""
    flat = x.view(-1)
    vals = torch.tensor([0.0, -0.0, 88.0, -88.0, 1e30, -1e30, 1e-40, -3e-39, 20.0, -20.0])
    flat[: vals.numel()] = vals[: flat.numel()]
    return x


def _check_elementwise() -> None:
    from minite_kernels import strict_ops as kern

    g = torch.Generator().manual_seed(1)
    x = _edge(torch.randn(7, 45, generator=g) * 4)
    u = torch.randn(7, 45, generator=g)
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    xs = torch.cat([x.view(-1), special])
    us = torch.cat([u.view(-1), torch.ones(3)])
    assert _bits_equal(kern.silu_mul(xs, us), ops.silu_mul(xs, us))
    assert _bits_equal(kern.residual_add(xs, us), ops.residual_add(xs, us))
    # rotary: [T, H, D] with 2*half < D (pass-through tail), cos/sin [T, 1, half]
    pos = torch.tensor([0, 1, 5, 100, 4095, 70000])
    cos, sin = ops.rope_cos_sin(pos, 12, 1e6)
    q = _edge(torch.randn(6, 3, 20, generator=g))
    got = kern.apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1))
    assert _bits_equal(got, ops.apply_rope(q, cos.unsqueeze(1), sin.unsqueeze(1)))
    y = _edge(torch.randn(5, 3, 37, generator=g) * 10)
    w = torch.rand(5, 3, generator=g)
    assert _bits_equal(kern.moe_combine(y, w), ops.moe_combine(y, w))


def _check_rows() -> None:
    from minite_kernels import strict_ops as kern

    g = torch.Generator().manual_seed(2)
    for d in (1, 37, 64, 1000):
        x = torch.randn(5, d, generator=g) * 3
        x[1] = 0.0
        x[2] *= 1e15
        w = torch.randn(d, generator=g)
        assert _bits_equal(kern.rms_norm(x, w, 1e-6), ops.rms_norm(x, w, 1e-6)), d
        r = torch.randn(5, d, generator=g)
        assert _bits_equal(kern.residual_add(x, r), ops.residual_add(x, r))
    logits = torch.randn(6, 60, generator=g) * 5
    logits[0, :4] = torch.tensor([3.0, 3.0, -float("inf"), 3.0])  # ties and a masked expert
    logits[1] = 7.0
    assert _bits_equal(kern.softmax(logits), ops.softmax(logits))
    # log-softmax: short rows and a long one (2**14 padded: all 8 stack levels in use)
    for v in (1, 5, 3000, 9000):
        x = torch.randn(2, v, generator=g) * 8
        x[1, 0] = 60.0
        assert _bits_equal(kern.log_softmax(x), ops.log_softmax(x)), v
    # the interpreter's rows are each a program: batch invariance is structural, still check it
    x = torch.randn(9, 300, generator=g)
    assert _bits_equal(kern.log_softmax(x)[4:5], kern.log_softmax(x[4:5]))


def _check_linear() -> None:
    from minite_kernels import strict_ops as kern

    g = torch.Generator().manual_seed(3)
    for k, n in ((1, 5), (37, 19), (1100, 9)):
        x = torch.randn(7, k, generator=g).to(torch.bfloat16)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        want = ops.linear(x, w, out_dtype=torch.float32)
        assert _bits_equal(kern.linear(x, w), want), (k, n)
        assert _bits_equal(kern.linear(x[3:4], w), want[3:4])  # batch 1 vs batch 7
    x = torch.randn(20, 300, generator=g).to(torch.bfloat16)  # 16 x 16 tiles (M > 8)
    w = torch.randn(40, 300, generator=g).to(torch.bfloat16)
    want = ops.linear(x, w, out_dtype=torch.float32)
    assert _bits_equal(kern.linear(x, w), want)
    assert _bits_equal(kern.linear(x[17:18], w), want[17:18])
    x = torch.randn(3, 50, generator=g)  # float32 operands
    w = torch.randn(20, 50, generator=g)
    assert _bits_equal(kern.linear(x, w), ops.linear(x, w))


def _check_attention() -> None:
    from minite_kernels import strict_ops as kern

    g = torch.Generator().manual_seed(4)
    for t, heads, dim, dim_v in ((1, 2, 8, 8), (13, 4, 24, 16), (37, 2, 16, 12)):
        q = torch.randn(t, heads, dim, generator=g)
        k = torch.randn(t, 2, dim, generator=g) * 3
        v = torch.randn(t, 2, dim_v, generator=g)
        full = ops.causal_attention(q, k, v, torch.arange(t), 0.3)
        assert _bits_equal(kern.causal_attention(q, k, v, torch.arange(t), 0.3), full), t
        # sampler's forms: chunked prefill + decode steps over a shuffled paged cache
        kc, table = _paged(k, 8, t)
        vc, _ = _paged(v, 8, t)
        cut = max(0, t - 3)
        seq_ids = torch.zeros(cut, dtype=torch.int64)
        prefill = kern.paged_attention(
            q[:cut], kc, vc, table, seq_ids, torch.arange(cut), [cut], 0.3
        )
        assert _bits_equal(prefill, full[:cut])
        steps = range(cut, t)
        decode = torch.cat([
            kern.paged_attention(
                q[p : p + 1], kc, vc, table, torch.zeros(1, dtype=torch.int64),
                torch.tensor([p]), [p + 1], 0.3,
            )
            for p in steps
        ])  # fmt: skip
        assert _bits_equal(decode, full[cut:])
    # a batch mixing a prefill chunk and two decodes of different lengths (different trees)
    t = 24
    q = torch.randn(t, 2, 16, generator=g)
    k, v = torch.randn(t, 1, 16, generator=g), torch.randn(t, 1, 16, generator=g)
    full = ops.causal_attention(q, k, v, torch.arange(t), 0.25)
    kc, table = _paged(k, 16, 7)
    vc, _ = _paged(v, 16, 7)
    rows = torch.cat([torch.arange(3, 9), torch.tensor([15, 23])])
    got = kern.paged_attention(
        q[rows], kc, vc, table.repeat(3, 1), torch.tensor([0] * 6 + [1, 2]), rows, [9, 16, 24],
        0.25,
    )  # fmt: skip
    assert _bits_equal(got, full[rows])


if __name__ == "__main__":
    globals()[f"_check_{sys.argv[1]}"]()
    print("ok", sys.argv[1])
