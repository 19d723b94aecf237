"""Strict mode (``NVFP4Recipe(strict_ops=True)``): the reference ops of ``minite_common.ops`` and
the real engines running them, whose layer captures and token log-probs agree bitwise on CPU."""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minite.alignment import (
    STRICT_RECIPE,
    Rollouts,
    build_learner,
    learner_logprobs,
    sample,
    start_sampler,
    stop_sampler,
    sync_weights,
    weights_in_sync,
)
from minite_common import DEFAULT_RECIPE, NVFP4Recipe, RecipeMismatchError, ops
from minite_common.diagnostics import compare_layer_captures, logprob_mismatch

PROMPT_IDS = list(b"The quick brown fox jumps over the lazy dog 12+34=")
PROMPTS = [list(f"{a}+{b}=".encode()) for a, b in ((1, 2), (13, 4), (7, 8), (22, 19))]


def bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def same_rows(f, x: torch.Tensor) -> bool:
    """Whether ``f`` gives each row of ``x`` the same bits alone, in a batch and in a
    non-contiguous layout."""
    full = f(x)
    alone = torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])
    strided = f(torch.cat([x, x], dim=-1)[..., : x.shape[-1]])
    return torch.equal(full, alone) and torch.equal(full, strided)


# -- reference ops: accuracy against torch and batch invariance ----------------------------------


def test_elementary_functions_match_float64_torch():
    x = torch.randn(20000, dtype=torch.float64) * 40
    assert torch.allclose(ops.exp64(x), torch.exp(x), rtol=4e-16, atol=0)
    sin, cos = ops.sincos64(x * 1000)
    assert torch.allclose(sin, torch.sin(x * 1000), rtol=0, atol=1e-14)
    assert torch.allclose(cos, torch.cos(x * 1000), rtol=0, atol=1e-14)
    y = x.abs() + 1e-3
    assert torch.allclose(ops.log64(y), torch.log(y), rtol=0, atol=3e-15)
    e = ops.exp(torch.tensor([-math.inf, -200.0, 0.0, 200.0, math.nan]))
    assert e[:3].tolist() == [0.0, 0.0, 1.0] and e[3] == math.inf and e[4].isnan()


def test_fixed_sum_is_exact_under_trailing_zeros_and_close_to_sum():
    x = torch.randn(7, 37)
    s = ops.fixed_sum(x)
    assert torch.allclose(s, x.sum(-1), rtol=1e-5, atol=1e-5)
    for extra in (1, 27, 91):
        assert torch.equal(ops.fixed_sum(F.pad(x, (0, extra))), s)
    assert torch.equal(ops.fixed_sum(x.T.contiguous(), dim=0), s)


def test_transcendental_ops_do_not_depend_on_memory_position():
    # torch's own silu differs between its vectorized body and scalar tail; the reference not.
    g = torch.randn(4096) * 4
    full = ops.silu_mul(g, g)
    assert torch.equal(full[:301], torch.cat([ops.silu_mul(g[i : i + 1], g[i : i + 1])
                                             for i in range(301)]))  # fmt: skip
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.silu_mul(g, g), full)
    finally:
        torch.set_num_threads(threads)


def test_rms_norm_and_residual_add():
    x, w = bf16(33, 128, scale=3), (1 + 0.1 * bf16(128)).bfloat16()
    y = ops.rms_norm(x, w, 1e-6)
    ref = F.rms_norm(x.float(), (128,), w.float(), 1e-6)
    assert y.dtype == torch.bfloat16 and torch.allclose(y.float(), ref, rtol=8e-3, atol=1e-6)
    assert same_rows(lambda t: ops.rms_norm(t, w, 1e-6), x)
    r = bf16(33, 128, seed=1)
    y2, res = ops.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, x + r) and torch.equal(y2, ops.rms_norm(x + r, w, 1e-6))


def test_rope_matches_the_float32_formula_and_is_per_position():
    pos = torch.arange(300)
    cos, sin = ops.rope_cos_sin(pos, 32, 1e6)
    inv = 1.0 / (1e6 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32))
    angle = pos[:, None].double() * inv
    assert torch.allclose(cos.double(), angle.cos(), atol=1e-7)
    assert torch.allclose(sin.double(), angle.sin(), atol=1e-7)
    c1, s1 = ops.rope_cos_sin(pos[[7, 200]], 32, 1e6)
    assert torch.equal(c1, cos[[7, 200]]) and torch.equal(s1, sin[[7, 200]])
    x = bf16(300, 4, 32, scale=2)
    y = ops.apply_rope(x, cos[:, None], sin[:, None])
    x1, x2 = x.float().chunk(2, -1)
    c, s = angle.float().cos()[:, None], angle.float().sin()[:, None]
    ref = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    assert torch.allclose(y.float(), ref, rtol=8e-3, atol=1e-2)
    partial = ops.apply_rope(x, cos[:, None, :8], sin[:, None, :8])  # rotary_dim 16 of 32
    assert torch.equal(partial[..., 16:], x[..., 16:])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_causal_attention_decode_equals_prefill_and_matches_torch(kv_heads):
    q, k, v = (
        bf16(40, 4, 32, seed=0),
        bf16(40, kv_heads, 32, seed=1),
        bf16(40, kv_heads, 32, seed=2),
    )
    pos = torch.arange(40)
    out = ops.causal_attention(q, k, v, pos, 32**-0.5)
    kr, vr = (t.repeat_interleave(4 // kv_heads, 1).transpose(0, 1).float() for t in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).float(), kr, vr, is_causal=True)
    assert torch.allclose(out.float(), ref.transpose(0, 1), rtol=8e-3, atol=8e-3)
    for t in (0, 1, 17, 39):  # a decode step reads only keys 0..t from the cache
        step = ops.causal_attention(q[t : t + 1], k[: t + 1], v[: t + 1], pos[t : t + 1], 32**-0.5)
        assert torch.equal(step, out[t : t + 1])
    # keys past the queries (a padded batch) change nothing; chunking changes nothing
    k2, v2 = torch.cat([k, bf16(9, kv_heads, 32, seed=3)]), torch.cat([v, bf16(9, kv_heads, 32)])
    assert torch.equal(ops.causal_attention(q, k2, v2, pos, 32**-0.5), out)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_causal_attention_chunks_and_gradients(monkeypatch, kv_heads):
    q = bf16(24, 4, 16, seed=0).float().requires_grad_()
    k, v = (bf16(24, kv_heads, 16, seed=s).float().requires_grad_() for s in (1, 2))
    pos = torch.arange(24)
    out = ops.causal_attention(q, k, v, pos, 0.25)
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 4 * 24 * 16 * 5)  # 5 queries per chunk
    assert torch.equal(ops.causal_attention(q, k, v, pos, 0.25), out)
    out.square().sum().backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ops._attention_plain(*ref, pos, 0.25).square().sum().backward()
    for a, b in zip((q, k, v), ref, strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_gemm_backward_matches_autograd(monkeypatch, kv_heads):
    """The GPU's attention backward (float64 GEMMs, run here on CPU tensors) against autograd of
    the plain-torch attention, with queries at later positions than their index and chunks of
    5 queries."""
    q = bf16(24, 4, 16, seed=0).float()
    k, v = (bf16(30, kv_heads, 16, seed=s).float() for s in (1, 2))
    pos = torch.arange(24) + 6
    go = bf16(24, 4, 16, seed=3).float()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ops._attention_plain(*ref, pos, 0.25).backward(go)
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 4 * 30 * 5 // 4)  # 5 queries per chunk
    got = ops._attention_backward_gemm(q, k, v, pos, 0.25, go)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b.grad, rtol=1e-4, atol=1e-5)


def test_linear_is_row_invariant_and_matches_matmul(monkeypatch):
    x, w = bf16(37, 128, seed=0), bf16(272, 128, seed=1)
    y = ops.linear(x, w)
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.float(), (x.float() @ w.float().T), rtol=8e-3, atol=1e-2)
    assert same_rows(lambda t: ops.linear(t, w), x)
    monkeypatch.setattr(ops, "CHUNK_ELEMENTS", 128 * 50)  # 50 columns, one row per chunk
    assert torch.equal(ops.linear(x, w), y)
    assert torch.equal(ops.linear(x.view(37, 1, 128), w).view(37, 272), y)
    xf, wf = x.float().requires_grad_(), w.float().requires_grad_()
    ops.linear(xf, wf, out_dtype=torch.float32).sum().backward()
    assert torch.allclose(xf.grad, w.float().sum(0).expand(37, 128), rtol=1e-5, atol=1e-4)


def test_topk_routing_and_combine():
    logits = bf16(64, 8, scale=2)
    logits[0, 3] = logits[0, 5] = 9.0  # a tie goes to the lower expert index
    probs = torch.softmax(logits.float(), -1)
    top, ids_ref = torch.topk(probs, 2, dim=-1)
    w, ids = ops.topk_routing(logits, 2, renormalize=True)
    assert ids[0].tolist() == [3, 5]
    assert torch.equal(ids.sort(-1)[0], ids_ref.sort(-1)[0])
    assert torch.allclose(w, top / top.sum(-1, keepdim=True), atol=1e-6)
    w_all, _ = ops.topk_routing(logits, 2, renormalize=False)
    assert torch.allclose(w_all, top, atol=1e-6)
    assert same_rows(lambda t: ops.topk_routing(t, 2, True)[0], logits)
    y = bf16(64, 2, 128, seed=4)
    out = ops.moe_combine(y, w)
    ref = w[:, :1] * y[:, 0].float() + w[:, 1:] * y[:, 1].float()
    assert torch.equal(out, ref.bfloat16())


def test_swiglu_matches_torch():
    x = bf16(33, 512, scale=3)
    gate, up = x.float().chunk(2, -1)
    assert torch.allclose(ops.swiglu(x).float(), F.silu(gate) * up, rtol=8e-3, atol=1e-3)
    assert same_rows(ops.swiglu, x)


def test_log_softmax_is_row_invariant_and_close_to_torch():
    """Both engines use ops.log_softmax in strict mode (vLLM's sampler through
    minite_vllm.strict); it treats each row alone and is within float32 rounding of torch's."""
    logits = bf16(96, 272, scale=4)
    full = ops.log_softmax(logits)
    assert full.dtype == torch.float32
    assert torch.allclose(full, logits.log_softmax(-1, dtype=torch.float32), rtol=0, atol=2e-6)
    assert same_rows(ops.log_softmax, logits)
    assert torch.equal(ops.log_softmax(logits.view(8, 12, 272)).view(96, 272), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(ops.log_softmax(logits), full)
    finally:
        torch.set_num_threads(threads)
    x = logits.float().requires_grad_()
    ops.log_softmax(x).gather(-1, torch.arange(96)[:, None] % 272).sum().backward()
    ref = logits.float().requires_grad_()
    torch.log_softmax(ref, -1).gather(-1, torch.arange(96)[:, None] % 272).sum().backward()
    assert torch.allclose(x.grad, ref.grad, rtol=0, atol=1e-6)


def test_sqrt_is_correctly_rounded():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(200000, generator=g) * 10.0 ** torch.randint(-30, 30, (200000,), generator=g)
    y = ops.sqrt(x)
    mid_up = (y.double() + torch.nextafter(y, torch.full_like(y, math.inf)).double()) / 2
    mid_down = (y.double() + torch.nextafter(y, torch.zeros_like(y)).double()) / 2
    assert bool((mid_down * mid_down < x.double()).all() & (mid_up * mid_up > x.double()).all())
    special = torch.tensor([0.0, 1.0, 4.0, math.inf, -1.0, math.nan])
    assert torch.equal(ops.sqrt(special)[:4], torch.tensor([0.0, 1.0, 2.0, math.inf]))
    assert ops.sqrt(special)[4:].isnan().all()


def test_strict_gradients_match_torch():
    """The fixed-order backward formulas (RMSNorm, linear, softmax, MoE combine) against
    autograd through torch's own ops."""
    x, w = bf16(37, 128, seed=0).float(), bf16(128, seed=1).float() + 1
    a = [t.clone().requires_grad_() for t in (x, w)]
    b = [t.clone().requires_grad_() for t in (x, w)]
    gy = bf16(37, 128, seed=2).float()
    (ops.rms_norm(*a, 1e-6) * gy).sum().backward()
    (F.rms_norm(b[0], (128,), b[1], 1e-6) * gy).sum().backward()
    for p, q in zip(a, b, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    x, w = bf16(37, 64, seed=3).float(), bf16(272, 64, seed=4).float()
    a = [t.clone().requires_grad_() for t in (x, w)]
    b = [t.clone().requires_grad_() for t in (x, w)]
    gy = bf16(37, 272, seed=5).float()
    (ops.linear(*a) * gy).sum().backward()
    ((b[0] @ b[1].T) * gy).sum().backward()
    for p, q in zip(a, b, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-4)
    logits, gw = bf16(9, 8, seed=6).float(), bf16(9, 8, seed=7).float()
    a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    (ops.softmax(a) * gw).sum().backward()
    (torch.softmax(b, -1) * gw).sum().backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    out, weights, gy = bf16(9, 2, 16, seed=8), bf16(9, 2, seed=9).float(), bf16(9, 16, seed=10)
    a = [t.clone().float().requires_grad_() for t in (out, weights)]
    b = [t.clone().float().requires_grad_() for t in (out, weights)]
    (ops.moe_combine(*a) * gy.float()).sum().backward()
    ((b[1].unsqueeze(-1) * b[0]).sum(1) * gy.float()).sum().backward()
    for p, q in zip(a, b, strict=True):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-4)


#: Caps every CPU kernel library at AVX2 and one thread: what an AVX2-only machine computes.
RESTRICTED_CPU_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX2", "OMP_NUM_THREADS": "1"}  # fmt: skip

_STRICT_OPS_SCRIPT = r"""
import hashlib, torch
from minite_common import ops, quantize_weight, random_hadamard_transform, w4a4_linear_train
torch.manual_seed(0)
def bf16(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).bfloat16()
def leaf(t):
    return t.detach().clone().requires_grad_()
outs = []
x, w = leaf(bf16(70, 256)), leaf(bf16(256) + 1)
y = ops.rms_norm(x, w, 1e-6); y.float().square().sum().backward(); outs += [y, x.grad, w.grad]
q, k, v = leaf(bf16(40, 4, 64)), leaf(bf16(40, 2, 64)), leaf(bf16(40, 2, 64))
y = ops.causal_attention(q, k, v, torch.arange(40), 0.125)
y.float().square().sum().backward(); outs += [y, q.grad, k.grad, v.grad]
x, w = leaf(bf16(70, 256)), leaf(bf16(300, 256))
y = ops.linear(x, w); y.float().square().sum().backward(); outs += [y, x.grad, w.grad]
z = leaf(bf16(70, 300, scale=4).float())
lp = ops.log_softmax(z); lp[:, 7].sum().backward(); outs += [lp, z.grad]
e, r = leaf(bf16(70, 4, 256)), leaf(bf16(70, 64).float())
wts, ids = ops.topk_routing(r, 4, renormalize=True)
y = ops.moe_combine(e, wts); y.float().square().sum().backward(); outs += [y, e.grad, r.grad]
cos, sin = ops.rope_cos_sin(torch.arange(40), 64, 1e6)
outs += [ops.swiglu(bf16(70, 512)), ops.apply_rope(bf16(40, 4, 64), cos[:, None], sin[:, None])]
outs += [ops.sqrt(torch.rand(100000)), random_hadamard_transform(torch.randn(64, 512))]
torch.manual_seed(1)  # the NVFP4 learner linear: stochastic rounding and the RHT in backward
xw, ww = leaf(bf16(70, 256)), leaf(bf16(128, 256))
y = w4a4_linear_train(xw, ww, quantize_weight(ww.detach())); y.float().square().sum().backward()
outs += [y, xw.grad, ww.grad]
h = hashlib.sha256()
for t in outs:
    h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
z = torch.randn(70, 300)  # a control: torch's own kernel, whose bits follow the CPU
c = hashlib.sha256(torch.log_softmax(z, -1).numpy().tobytes()).hexdigest()
print(h.hexdigest(), c)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_strict_ops_give_the_same_bits_with_restricted_cpu_kernels():
    """Every strict op, forward and backward (and the NVFP4 learner linear's backward), gives the
    same bits when torch, oneDNN and MKL are capped at AVX2 and one thread: the strict path uses
    no kernel whose bits follow the CPU."""

    def run(extra: dict[str, str]) -> list[str]:
        env = {k: v for k, v in os.environ.items() if k not in RESTRICTED_CPU_ENV} | extra
        proc = subprocess.run([sys.executable, "-c", _STRICT_OPS_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split()

    default, restricted = run({}), run(RESTRICTED_CPU_ENV)
    assert default[0] == restricted[0]
    if default[1] == restricted[1]:
        pytest.skip("torch's log_softmax gives the same bits with AVX2 kernels here (no AVX-512)")


def test_strict_switch_is_a_fingerprinted_recipe_field():
    assert DEFAULT_RECIPE.strict_ops is False and "strict_ops" not in DEFAULT_RECIPE.to_dict()
    assert STRICT_RECIPE.to_dict()["strict_ops"] is True
    assert NVFP4Recipe.from_dict(STRICT_RECIPE.to_dict()) == STRICT_RECIPE
    assert (
        NVFP4Recipe.from_dict({**DEFAULT_RECIPE.to_dict(), "strict_ops": False}) == DEFAULT_RECIPE
    )
    assert STRICT_RECIPE.fingerprint() != DEFAULT_RECIPE.fingerprint()
    with pytest.raises(RecipeMismatchError):
        logprob_mismatch([[-1.0]], [[-1.0]], sampler_fingerprint=STRICT_RECIPE.fingerprint(),
                         learner_fingerprint=DEFAULT_RECIPE.fingerprint())  # fmt: skip


def test_vllm_ops_are_vllms_own_unless_the_recipe_is_strict():
    from vllm.config import AttentionConfig, CompilationConfig, VllmConfig, set_current_vllm_config
    from vllm.config.compilation import CompilationMode
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import minite_vllm
    from minite_vllm.config import MiniteConfig

    minite_vllm.register()
    x, r = bf16(3, 64, seed=5), bf16(3, 64, seed=6)
    with set_current_vllm_config(VllmConfig(quant_config=MiniteConfig(DEFAULT_RECIPE))):
        norm, act = RMSNorm(64, eps=1e-6), SiluAndMul()
        assert not norm.minite_strict and not act.minite_strict
        assert torch.equal(norm(x), RMSNorm.forward_native(norm, x))  # vLLM's own formula
    eager = CompilationConfig(mode=CompilationMode.NONE)
    custom = AttentionConfig(backend=AttentionBackendEnum.CUSTOM)
    config = VllmConfig(quant_config=MiniteConfig(STRICT_RECIPE), compilation_config=eager,
                        attention_config=custom)  # fmt: skip
    with set_current_vllm_config(config):
        norm, act = RMSNorm(64, eps=1e-6), SiluAndMul()
        assert norm.minite_strict and act.minite_strict
        assert torch.equal(norm(x), ops.rms_norm(x, norm.weight, 1e-6))
        for a, b in zip(norm(x, r), ops.add_rms_norm(x, r, norm.weight, 1e-6), strict=True):
            assert torch.equal(a, b)
        assert torch.equal(act(torch.cat([x, r], -1)), ops.silu_mul(x, r))
        for forward in (norm.forward_native, norm.forward_cpu, norm.forward_cuda):  # public
            assert torch.equal(forward(x), ops.rms_norm(x, norm.weight, 1e-6))
    cpu_attn = VllmConfig(quant_config=MiniteConfig(STRICT_RECIPE), compilation_config=eager)
    with set_current_vllm_config(cpu_attn), pytest.raises(ValueError, match="CUSTOM"):
        RMSNorm(64)  # strict mode runs only on miniTE's attention backend
    compiled = VllmConfig(quant_config=MiniteConfig(STRICT_RECIPE))
    with set_current_vllm_config(compiled), pytest.raises(ValueError, match="enforce_eager"):
        RMSNorm(64)


# -- the real engines ----------------------------------------------------------------------------


@dataclasses.dataclass
class StrictRun:
    kind: str
    sampler_capture: dict[str, torch.Tensor]
    learner_capture: dict[str, torch.Tensor]
    rollouts: Rollouts  # sampled before the update
    learner_logprobs: list[torch.Tensor]
    updated_rollouts: Rollouts  # sampled after one learner step and a weight sync
    updated_learner_logprobs: list[torch.Tensor]
    attention_backends: dict[str, str]  # layer name -> the backend class vLLM chose
    learner_attention: torch.nn.Module  # the learner's first self-attention module
    learner_position_embedding: str


@pytest.fixture(scope="module", params=["dense", "moe"])
def strict_run(request, tiny_dense_dir, tiny_moe_dir):
    """Both engines in strict mode on one model: captures of one prefill, sampled rollouts scored
    by the learner, then the same after one training step of the learner and a weight sync."""
    from vllm import SamplingParams

    from minite_megatron import token_logprobs
    from minite_megatron.capture import capture_layers
    from minite_vllm import unpack_weights

    model_dir = tiny_dense_dir if request.param == "dense" else tiny_moe_dir
    llm = start_sampler(model_dir, recipe=STRICT_RECIPE, max_model_len=256)
    try:
        learner = build_learner(model_dir, nvfp4=True, recipe=STRICT_RECIPE)
        attention = learner.decoder.layers[0].self_attention
        backends = llm.collective_rpc("get_attention_backends")[0]
        llm.collective_rpc("start_capture")
        llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=1),
                     use_tqdm=False)  # fmt: skip
        sampler_capture = unpack_weights(llm.collective_rpc("finish_capture")[0])
        learner_capture = capture_layers(learner, torch.tensor(PROMPT_IDS))
        rollouts = sample(llm, PROMPTS, n=3, max_tokens=12, temperature=1.0, seed=1)
        scores = learner_logprobs(learner, rollouts.prompts, rollouts.completions)

        optimizer = torch.optim.SGD(learner.parameters(), lr=0.05)
        ids = torch.tensor([rollouts.prompts[0] + rollouts.completions[0]])
        (-token_logprobs(learner, ids).sum()).backward()
        optimizer.step()
        sync_weights(llm, learner)
        assert weights_in_sync(llm, learner)
        updated = sample(llm, PROMPTS, n=2, max_tokens=8, temperature=1.0, seed=2)
        updated_scores = learner_logprobs(learner, updated.prompts, updated.completions)
    finally:
        stop_sampler(llm)
    yield StrictRun(request.param, sampler_capture, learner_capture, rollouts, scores, updated,
                    updated_scores, backends, attention,
                    learner.position_embedding_type)  # fmt: skip


def test_strict_engine_runs_minites_registered_attention_backend(strict_run):
    """vLLM itself chose miniTE's backend for every attention layer: the one registered in its
    attention-backend registry's CUSTOM slot, selected by the public attention-backend setting."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from minite_vllm.strict_attention import STRICT_BACKEND_PATH, StrictAttentionBackend

    assert AttentionBackendEnum.CUSTOM.get_class() is StrictAttentionBackend
    assert len(strict_run.attention_backends) == 2  # both layers of the tiny model
    assert set(strict_run.attention_backends.values()) == {STRICT_BACKEND_PATH}


def test_strict_learner_attention_comes_from_spec_submodules(strict_run):
    """Megatron's own SelfAttention runs; the strict ops sit in its core_attention submodule
    (rotary embedding included: the GPTModel applies none of its own)."""
    from megatron.core.transformer.attention import SelfAttention

    from minite_megatron.strict import StrictDotProductAttention, StrictRMSNorm

    attention = strict_run.learner_attention
    assert type(attention) is SelfAttention
    assert isinstance(attention.core_attention, StrictDotProductAttention)
    assert attention.core_attention.rotary is not None
    assert isinstance(attention.q_layernorm, StrictRMSNorm)
    assert strict_run.learner_position_embedding == "none"


def test_engine_version_guards_name_the_checked_versions():
    """Strict mode's remaining engine patches refuse engine versions they were not checked
    against, with an error naming the checked versions and the fix."""
    import vllm
    from megatron.core import package_info

    from minite_megatron.engine_patches import check_megatron_version
    from minite_vllm.engine_patches import check_vllm_version

    for version in ("0.32.0+cpu", "0.32.0", "0.32.4", vllm.__version__):
        check_vllm_version(version)
    for version in ("0.33.0", "0.31.2+cpu", "0.320.0", "1.32.0", "nightly"):
        message = r"checked against vLLM 0\.32.*vLLM " + re.escape(version)
        with pytest.raises(RuntimeError, match=message):
            check_vllm_version(version)
    for version in ("0.16.1", "0.19.2", "0.19.0rc1", package_info.__version__):
        check_megatron_version(version)
    for version in ("0.17.0", "0.15.3", "0.190.0", "1.16.1"):
        message = r"Megatron-Core 0\.16, 0\.19.*Core " + re.escape(version)
        with pytest.raises(RuntimeError, match=message):
            check_megatron_version(version)


def test_strict_spec_needs_the_rotary_base():
    from minite_megatron.spec import strict_rotary

    assert strict_rotary(1e6) == 1e6
    with pytest.raises(ValueError, match="position_embedding_type='none'"):
        strict_rotary(None)


def test_strict_layer_captures_are_bitwise_equal(strict_run):
    comparison = compare_layer_captures(strict_run.sampler_capture, strict_run.learner_capture,
                                        order=list(strict_run.learner_capture))  # fmt: skip
    print(comparison.table())
    assert comparison.first_divergent is None
    names = {row["name"] for row in comparison.rows}
    assert all(row["bitwise_equal"] for row in comparison.rows)
    mlp = "mlp:output" if strict_run.kind == "moe" else "mlp.down_proj:input"
    inner = ("self_attn.q_norm:output", "self_attn.attn.query:input", "self_attn.o_proj:input", mlp)
    expected = [f"model.layers.1.{name}" for name in inner] + ["model.norm:output"]
    assert set(expected) <= names


@pytest.mark.parametrize("after_update", [False, True], ids=["initial", "after-update"])
def test_strict_sampler_and_learner_logprobs_are_bitwise_equal(strict_run, after_update):
    r = strict_run.updated_rollouts if after_update else strict_run.rollouts
    lp = strict_run.updated_learner_logprobs if after_update else strict_run.learner_logprobs
    assert r.fingerprint == STRICT_RECIPE.fingerprint()
    assert sum(len(c) for c in r.completions) >= 16
    report = logprob_mismatch(r.logprobs, lp, sampler_fingerprint=r.fingerprint,
                              learner_fingerprint=STRICT_RECIPE.fingerprint())  # fmt: skip
    assert report.summary["frac_bitwise_equal"] == 1.0
    assert report.summary["token_mult_prob_error"] == 1.0
    for sampler_lp, learner_lp in zip(r.logprobs, lp, strict=True):
        assert torch.equal(torch.tensor(sampler_lp, dtype=torch.float32), learner_lp)


def test_strict_sampler_driver_gives_vllms_logprobs(strict_run, tiny_dense_dir, tiny_moe_dir):
    """``minite.strict_sampler.StrictSampler`` (the stand-in for vLLM's scheduler, model runner,
    model code and sampler that the GPU end-to-end test runs) gives the real strict vLLM engine's
    log-prob bits on the tokens that engine sampled, under its own schedule (two sequences at a
    time, 5-token prompt chunks, blocks of 4)."""
    from minite.strict_sampler import StrictSampler

    r = strict_run.rollouts
    model_dir = tiny_dense_dir if strict_run.kind == "dense" else tiny_moe_dir
    driver = StrictSampler(model_dir, STRICT_RECIPE, block_size=4, num_blocks=64, max_num_seqs=2,
                           max_num_batched_tokens=8, max_prefill_chunk=5)  # fmt: skip
    seqs, trace = driver.generate(r.prompts, arrivals=range(len(r.prompts)), forced=r.completions)
    assert max(trace.prefill_chunks) >= 2 and trace.mixed_steps
    for seq, completion, sampler_lp in zip(seqs, r.completions, r.logprobs, strict=True):
        assert seq.completion == completion
        assert torch.equal(seq.logprobs, torch.tensor(sampler_lp, dtype=torch.float32))
