"""GPU tests of miniTE's Triton kernels (issue 3), run on the lent H200.

Quantization: the GPU bytes equal the CPU reference's for the same input. GEMM: close to the CPU
exact result and to an FP64 product of the dequantized operands; a row's output bitwise the same
for every M, position, neighbour rows, tile configuration, decode variant and GEMM path; grouped
(MoE) rows bitwise equal to the dense kernel; every output element written.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from minite_common import (
    dequantize_nvfp4,
    exact_block_dot,
    expert_counts,
    gemm_path,
    grouped_w4a4_linear,
    nvfp4_gemm,
    quantize_nvfp4,
    w4a4_linear,
)
from minite_common.nvfp4 import NVFP4Tensor

pytestmark = pytest.mark.gpu

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _make(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """float32 CPU inputs of several distributions (specials: NaN/Inf/zero rows, -0)."""
    g = _gen(seed)
    if kind == "normal":
        return torch.randn(rows, k, generator=g)
    if kind == "heavy":  # rare huge outliers
        return torch.randn(rows, k, generator=g) / torch.rand(rows, k, generator=g).pow(2)
    if kind == "blocks":  # each 16-block its own magnitude 1e-6..1e6, some zero blocks
        mag = 10.0 ** (torch.rand(rows, k // 16, 1, generator=g) * 12 - 6)
        mag[torch.rand(mag.shape, generator=g) < 0.1] = 0.0
        return (torch.randn(rows, k // 16, 16, generator=g) * mag).reshape(rows, k)
    if kind == "ties":  # multiples of amax/12 land on or next to E2M1 rounding ties
        steps = torch.randint(-12, 13, (rows, k), generator=g).float() / 2
        return steps * 2.0 ** torch.randint(-20, 20, (rows, 1), generator=g).float()
    if kind == "specials":
        x = torch.randn(rows, k, generator=g)
        x[0 :: max(rows // 3, 1), 1] = float("nan")
        if rows > 1:
            x[1, -1] = float("inf")
        if rows > 2:
            x[2] = 0.0
        if rows > 3:
            x[3] = -0.0
        if rows > 4:
            x[4, :16] = -float("inf")
        return x
    raise ValueError(kind)


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.float16:
        x = torch.where(torch.isfinite(x), x.clamp(-60000, 60000), x)
    return x.to(dtype)


def _same_bytes(gpu: NVFP4Tensor, cpu: NVFP4Tensor) -> None:
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.scales.cpu().view(torch.uint8), cpu.scales.view(torch.uint8))
    dg, dc = gpu.decode_scale.cpu(), cpu.decode_scale
    assert dg.shape == dc.shape
    assert torch.equal(dg.isnan(), dc.isnan())
    assert torch.equal(dg.nan_to_num().view(torch.int32), dc.nan_to_num().view(torch.int32))


def test_dispatch_picks_hopper_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    from minite_kernels import kernel_arch

    major, _ = torch.cuda.get_device_capability()
    assert kernel_arch("cuda") == ("sm90" if major == 9 else "sm100" if major >= 10 else None)
    assert kernel_arch("cpu") is None
    if major == 9:
        assert gemm_path("cuda").startswith("triton-sm90")
    assert gemm_path("cpu") == "torch-exact-f64"
    monkeypatch.setenv("MINITE_BACKEND", "torch")
    assert kernel_arch("cuda") is None
    assert gemm_path("cuda") == "torch-exact-f64"


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("kind", ["normal", "heavy", "blocks", "ties", "specials"])
def test_quantize_same_bytes_as_cpu(dtype: torch.dtype, kind: str) -> None:
    # K past one pass of the generic kernel (BF16 rows: 16 and 32 warps), past the BF16-rows
    # kernel's (two passes, one row per program)
    shapes = [(1, 16), (33, 80), (70, 4096), (17, 20000), (260, 36000), (2, 70000)]
    for seed, (rows, k) in enumerate(shapes):
        x = _as_dtype(_make(kind, rows, k, seed), dtype)
        for amax, block_2d in (("row", False), ("tensor", False), ("tensor", True)):
            cpu = quantize_nvfp4(x, amax=amax, block_2d=block_2d)
            gpu = quantize_nvfp4(x.cuda(), amax=amax, block_2d=block_2d)
            _same_bytes(gpu, cpu)


def test_quantize_given_amax_saturation_and_views() -> None:
    x = _make("blocks", 48, 512, 7)
    amax_t = x.abs().amax()
    for g in (amax_t, amax_t * 0.01, amax_t * 1e6, torch.tensor(0.0), torch.tensor(float("inf"))):
        for block_2d in (False, True):
            cpu = quantize_nvfp4(x, amax="tensor", block_2d=block_2d, global_amax=g)
            gpu = quantize_nvfp4(x.cuda(), amax="tensor", block_2d=block_2d, global_amax=g.cuda())
            _same_bytes(gpu, cpu)
    rows_amax = x.abs().amax(1) * torch.rand(48, generator=_gen(1))
    _same_bytes(
        quantize_nvfp4(x.cuda(), global_amax=rows_amax.cuda()),
        quantize_nvfp4(x, global_amax=rows_amax),
    )
    assert (quantize_nvfp4(x.cuda(), amax="tensor", global_amax=amax_t * 0.01).scales.float()
            == 448).any()  # fmt: skip
    w = _make("normal", 512, 48, 3)
    _same_bytes(
        quantize_nvfp4(w.cuda().T, amax="tensor", block_2d=True),
        quantize_nvfp4(w.T, amax="tensor", block_2d=True),
    )
    empty = quantize_nvfp4(torch.zeros(0, 32, device="cuda"))
    assert empty.codes.shape == (0, 16)


def _fp64_reference(a: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    return dequantize_nvfp4(a, torch.float64) @ dequantize_nvfp4(w, torch.float64).T


def _cpu_exact(a: NVFP4Tensor, w: NVFP4Tensor) -> torch.Tensor:
    a, w = a.to("cpu"), w.to("cpu")
    return (exact_block_dot(a, w) * a.decode_scale[:, None]) * w.decode_scale


def test_gemm_close_to_cpu_exact_and_fp64() -> None:
    for m, n, k in [(37, 300, 4096), (1, 64, 8192), (600, 129, 1040)]:
        a = quantize_nvfp4(_make("heavy", m, k, m).cuda())
        w = quantize_nvfp4(_make("normal", n, k, n).cuda(), amax="tensor", block_2d=True)
        y = nvfp4_gemm(a, w, out_dtype=torch.float32).cpu()
        exact = _cpu_exact(a, w)
        ref64 = _fp64_reference(a.to("cpu"), w.to("cpu"))
        # fp32 accumulation over K: bounded by K * eps * sum|products| per element
        scale = (
            dequantize_nvfp4(a, torch.float64).abs() @ dequantize_nvfp4(w, torch.float64).abs().T
        )
        bound = 2 * k * 2.0**-24 * scale.cpu()
        assert ((y.double() - exact.double()).abs() <= bound).all()
        assert ((y.double() - ref64).abs() <= bound).all()
        # fp32 accumulation: exact for most inputs, ~4e-6 seen with heavy tails at K=4096
        assert (y - exact).norm() / exact.norm() < 2e-5
        assert (y.double() - ref64).norm() / ref64.norm() < 2e-5


def _poison_allocator() -> None:
    """Fill freed blocks of the caching allocator with NaN bytes, so unwritten outputs show."""
    blocks = [torch.full((s,), float("nan"), device="cuda") for s in (1 << 10, 1 << 16, 1 << 22)
              for _ in range(4)]  # fmt: skip
    torch.cuda.synchronize()
    del blocks


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemm_odd_shapes_bias_every_element_written(out_dtype: torch.dtype) -> None:
    shapes = [(1, 1, 16), (5, 17, 48), (3, 200, 272), (17, 33, 4112), (600, 40, 80), (513, 96, 256)]
    for i, (m, n, k) in enumerate(shapes):
        a = quantize_nvfp4(_make("normal", m, k, i).cuda())
        w = quantize_nvfp4(_make("normal", n, k, i + 50).cuda(), amax="tensor", block_2d=n >= 16)
        bias = torch.randn(n, generator=_gen(i)).cuda()
        for b in (None, bias):
            _poison_allocator()
            y = nvfp4_gemm(a, w, b, out_dtype=out_dtype)
            assert y.shape == (m, n) and y.dtype == out_dtype
            assert torch.isfinite(y).all(), "an output element was not written"
            exact = _cpu_exact(a, w) + (0 if b is None else b.cpu())
            tol = 1e-5 if out_dtype == torch.float32 else 1e-2
            assert (y.cpu().float() - exact).norm() <= tol * exact.norm() + 1e-6


def test_gemm_batch_invariant_across_m_positions_and_paths() -> None:
    from minite_kernels.w4a4_gemm import LARGE_M, DecodeConfig, LargeConfig, nvfp4_gemm_sm90

    n = 768
    # K = 2064: 5 fold chunks, the last one 16 elements (no wide-M kernel: K % 32 != 0); K = 4128:
    # the wide-M kernel serves 65 <= M <= 1024, its tiles of 64, 128 and 256 rows
    for k, ms in ((2064, (1, 3, 16, 17, 64, 65, 128, 257, LARGE_M, LARGE_M + 1, 4097)),
                  (4128, (65, 100, 200, 257, 700, 1024, 1025))):  # fmt: skip
        w = quantize_nvfp4(_make("normal", n, k, 1).cuda(), amax="tensor", block_2d=True)
        pool = _make("heavy", 4097, k, 2).cuda().bfloat16()
        probes = _make("normal", 3, k, 3).cuda().bfloat16()
        alone = [w4a4_linear(p[None], w) for p in probes]
        alone_f32 = [
            nvfp4_gemm(quantize_nvfp4(p[None]), w, out_dtype=torch.float32) for p in probes
        ]
        for m in ms:  # every tile config
            for pos in {0, m // 2, m - 1}:
                for i, p in enumerate(probes):
                    x = pool[:m].clone()
                    x[pos] = p
                    assert torch.equal(w4a4_linear(x, w)[pos], alone[i][0]), (k, m, pos, i)
                    y = nvfp4_gemm(quantize_nvfp4(x), w, out_dtype=torch.float32)
                    assert torch.equal(y[pos], alone_f32[i][0]), (k, m, pos, i)
    k = 2064
    w = quantize_nvfp4(_make("normal", n, k, 1).cuda(), amax="tensor", block_2d=True)
    pool = _make("heavy", 4097, k, 2).cuda().bfloat16()
    # every tile configuration, decode variant and both paths give the same bits
    a = quantize_nvfp4(pool[:300])
    base = nvfp4_gemm_sm90(a, w, out_dtype=torch.float32, config=DecodeConfig(64, 16, 4, 4))
    configs = [DecodeConfig(64, 16, 4, 2), DecodeConfig(128, 16, 8, 4), DecodeConfig(64, 64, 4, 3),
               DecodeConfig(128, 16, 4, 2), DecodeConfig(128, 16, 4, 2, split_k=3),
               DecodeConfig(128, 128, 8, 3), DecodeConfig(64, 16, 4, 4, split_k=1),
               DecodeConfig(64, 16, 4, 4, split_k=2), DecodeConfig(64, 16, 4, 4, split_k=5),
               DecodeConfig(64, 128, 4, 2, split_k=3), DecodeConfig(64, 16, 4, 3, 0, True),
               DecodeConfig(128, 64, 8, 3, 2, True), DecodeConfig(128, 128, 8, 3, 1, True),
               LargeConfig(), LargeConfig(tma=False), LargeConfig(128, 128, 64, 8, 8, 3, tma=False),
               LargeConfig(128, 128, 64, 8, 8, 4), LargeConfig(64, 64, 64, 1, 4, 2)]  # fmt: skip
    for cfg in configs:
        # the float32 bits-decode (interpreter fallback) needs more shared memory than
        # 128-row tiles with a streamed activation have: there only the PTX decode runs
        wide = isinstance(cfg, DecodeConfig) and cfg.a_decoded and cfg.block_n == 128
        for use_asm in (True,) if wide else (True, False):
            y = nvfp4_gemm_sm90(a, w, out_dtype=torch.float32, config=cfg, use_asm=use_asm)
            assert torch.equal(y, base), (cfg, use_asm)
    with pytest.raises(ValueError, match="wgmma"):
        DecodeConfig(32, 16, 4, 2)  # Triton's mma.sync fallback: different bits (measured)


def test_grouped_gemm_equals_dense_per_group() -> None:
    from minite_kernels.w4a4_gemm import DecodeConfig, LargeConfig, grouped_nvfp4_gemm_sm90

    g, n, k = 8, 256, 1024
    w = quantize_nvfp4(_make("normal", g * n, k, 4).cuda(), amax="tensor", block_2d=True)
    sizes = [0, 1, 17, 3, 0, 40, 128, 5]
    x = _make("heavy", sum(sizes), k, 5).cuda().bfloat16()
    y = grouped_w4a4_linear(x, w, sizes)
    a = quantize_nvfp4(x)
    start = 0
    for e, size in enumerate(sizes):
        if size:
            dense = w4a4_linear(x[start : start + size], w.narrow_rows(e * n, n))
            assert torch.equal(y[start : start + size], dense), e
            dense32 = nvfp4_gemm(a.narrow_rows(start, size), w.narrow_rows(e * n, n),
                                 out_dtype=torch.float32)  # fmt: skip
            for cfg in (DecodeConfig(64, 16, 4, 4), DecodeConfig(128, 128, 8, 3),
                        DecodeConfig(128, 8, 4, 2), LargeConfig(),
                        LargeConfig(tma=False)):  # fmt: skip
                got = grouped_nvfp4_gemm_sm90(a, w, sizes, torch.float32, config=cfg)
                assert torch.equal(got[start : start + size], dense32), (e, cfg)
        start += size
    # a row's result does not depend on how the other rows are routed
    other = [3, 1, 17, 0, 0, 40, 130, 3]
    y2 = grouped_w4a4_linear(x, w, other)
    assert torch.equal(y2[21:61], y[21:61])  # rows 21..60 are expert 5's in both routings
    # group sizes as a device tensor (read by the kernel), split K: the same bits
    on_device = torch.tensor(sizes, device="cuda")
    assert torch.equal(grouped_w4a4_linear(x, w, on_device), y)
    got = grouped_nvfp4_gemm_sm90(a, w, on_device, torch.float32,
                                  config=DecodeConfig(64, 16, 4, 4, split_k=2))  # fmt: skip
    ref = grouped_nvfp4_gemm_sm90(a, w, sizes, torch.float32, config=DecodeConfig(64, 16, 4, 4))
    assert torch.equal(got, ref)
    # bad device sizes (not checked on the host): a negative one counts as 0, sizes past T are cut
    # at T; no row outside x is read or written (an out-of-bounds access would raise here)
    bad = torch.tensor([-7, 1, 17, 3, 0, 40, 2**31 - 1, 5], device="cuda")
    cut = [0, 1, 17, 3, 0, 40, sum(sizes) - 61, 0]
    for cfg in (DecodeConfig(64, 16, 4, 4), DecodeConfig(64, 16, 4, 4, split_k=2), LargeConfig()):
        got = grouped_nvfp4_gemm_sm90(a, w, bad, torch.float32, config=cfg)
        want = grouped_nvfp4_gemm_sm90(a, w, cut, torch.float32, config=cfg)
        torch.cuda.synchronize()
        assert torch.equal(got, want), cfg


def test_grouped_large_path_equals_dense_per_group() -> None:
    """Groups averaging over LARGE_M rows take the pre-decoded (TMA) kernel by default: each
    group's rows bitwise the dense linear's, with K not a multiple of 128, an expert's rows not a
    multiple of the weight tile (tiles reach into the next expert), empty and one-row groups."""
    from minite_kernels.w4a4_gemm import LARGE_M

    g, n, k = 4, 192, 1040
    sizes = [0, 2100, 1, 700]
    assert sum(sizes) > LARGE_M * g
    w = quantize_nvfp4(_make("heavy", g * n, k, 8).cuda(), amax="tensor", block_2d=True)
    x = _make("heavy", sum(sizes), k, 9).cuda().bfloat16()
    y = grouped_w4a4_linear(x, w, torch.tensor(sizes, device="cuda"))
    assert torch.equal(y, grouped_w4a4_linear(x, w, sizes))
    start = 0
    for e, size in enumerate(sizes):
        if size:
            dense = w4a4_linear(x[start : start + size], w.narrow_rows(e * n, n))
            assert torch.equal(y[start : start + size], dense), e
        start += size


@pytest.mark.parametrize("tokens", [1, 16, 64, 256])
def test_grouped_decode_step_in_cuda_graph(tokens: int) -> None:
    """The MoE path as vLLM's decode step runs it: routing and group sizes on the device, the
    whole step captured in a CUDA graph and replayed on new routings; empty and one-row experts;
    each row bitwise equal to the dense linear against its expert."""
    g, n, k, top_k = 32, 128, 1536, 4
    w = quantize_nvfp4(_make("normal", g * n, k, 10).cuda(), amax="tensor", block_2d=True)
    x = torch.empty(tokens * top_k, k, device="cuda", dtype=torch.bfloat16)
    ids = torch.empty(tokens * top_k, dtype=torch.long, device="cuda")

    def step() -> torch.Tensor:
        order = torch.argsort(ids, stable=True)
        sizes = expert_counts(ids, g)
        return grouped_w4a4_linear(x.index_select(0, order), w, sizes), order

    gen = _gen(tokens)
    x.copy_(_make("normal", tokens * top_k, k, tokens).bfloat16())
    ids.copy_(torch.randint(0, g, (tokens * top_k,), generator=gen))
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, order = step()
    for trial in range(3):
        x.copy_(_make("heavy", tokens * top_k, k, 100 + trial).bfloat16())
        routed = torch.randint(0, g // 2, (tokens * top_k,), generator=gen)  # some experts empty
        ids.copy_(routed)
        graph.replay()
        torch.cuda.synchronize()
        rows = x.index_select(0, order)
        expert = ids[order]
        for e in expert.unique().tolist():
            sel = (expert == e).nonzero().flatten()
            dense = w4a4_linear(rows[sel], w.narrow_rows(e * n, n))
            assert torch.equal(out[sel], dense), (trial, e)


def test_w4a4_linear_matches_cpu_path() -> None:
    x = _make("normal", 9, 512, 8)
    w_cpu = quantize_nvfp4(_make("normal", 64, 512, 9), amax="tensor", block_2d=True)
    y_gpu = w4a4_linear(x.cuda().bfloat16(), w_cpu.to("cuda"))
    y_cpu = w4a4_linear(x.bfloat16(), w_cpu)
    diff = (y_gpu.cpu().float() - y_cpu.float()).abs()
    assert (diff <= 2 * 2.0**-8 * y_cpu.float().abs() + 1e-6).all()  # at most ~1 BF16 ulp
    nan_row = x.clone()
    nan_row[2, 5] = float("nan")
    out = w4a4_linear(nan_row.cuda(), w_cpu.to("cuda"))
    assert out[2].isnan().all() and torch.isfinite(out[[0, 1, 3]]).all()


def _assert_graph_replays_same_bits(w: NVFP4Tensor, rows_list, out_dtype: torch.dtype) -> None:
    """The default GEMM of ``rows`` x K activations against ``w``, captured in a CUDA graph and
    replayed on new inputs, gives the Triton decode GEMM's bits."""
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    k = w.cols
    for rows in rows_list:
        x = torch.zeros(rows, k, device="cuda", dtype=torch.bfloat16)
        nvfp4_gemm_sm90(quantize_nvfp4(x), w, None, out_dtype)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = nvfp4_gemm_sm90(quantize_nvfp4(x), w, None, out_dtype)
        for seed in (1, 2):
            x.copy_(_make("normal", rows, k, seed).cuda())
            graph.replay()
            config = decode_config(rows)
            want = nvfp4_gemm_sm90(quantize_nvfp4(x), w, None, out_dtype, config=config)
            assert torch.equal(y.view(torch.uint8), want.view(torch.uint8)), (rows, seed)


@pytest.mark.parametrize("out_dtype", DTYPES)
def test_cuda_gemm_same_bits_as_triton(monkeypatch: pytest.MonkeyPatch, out_dtype) -> None:
    """The CUDA C++ GEMMs (wgmma with the weight decoded into registers; small M with the whole
    activation slice staged, mid M through a ring; wide M with producer warpgroups decoding the
    weight into shared memory) give the Triton decode GEMM's bits: every M they serve, every
    split count and wide-M tile, K not a multiple of 128, N not of 64, bias, per-row and
    per-tensor activation scales, heavy tails, CUDA graphs."""
    from minite_kernels import w4a4_gemm_cuda
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    monkeypatch.setenv("MINITE_CUDA_KERNELS", "1")
    assert w4a4_gemm_cuda.available(torch.device("cuda")), w4a4_gemm_cuda._broken(0)
    for n, k in ((8192, 8192), (200, 2064), (64, 16), (130, 528), (136, 2080), (768, 4096)):
        w = quantize_nvfp4(_make("normal", n, k, n).cuda(), amax="tensor", block_2d=True)
        bias = torch.randn(n, generator=_gen(k)).cuda().to(out_dtype)
        for m in (1, 2, 5, 8, 9, 16, 17, 33, 64, 100, 256, 300, 700):
            for kind, amax in (("normal", "row"), ("heavy", "row"), ("blocks", "tensor")):
                a = quantize_nvfp4(_make(kind, m, k, m + k).cuda(), amax=amax)
                want = nvfp4_gemm_sm90(a, w, bias, out_dtype, config=decode_config(m))
                forced = ((1, None), (2, None), (4, None), (8, None), (None, 1), (None, 2))
                for splits, wgs in forced if kind == "heavy" else ((None, None),):
                    if w4a4_gemm_cuda.plan(m, n, k, 132, splits, wgs) is None:
                        continue
                    got = torch.full_like(want, float("nan"))
                    w4a4_gemm_cuda.gemm(a, w, bias, got, 132, splits=splits, warpgroups=wgs)
                    where = (n, k, m, kind, splits, wgs)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                wide = kind == "heavy" and w4a4_gemm_cuda.ws_fits(w)
                for how in w4a4_gemm_cuda.WS_PLANS if wide else ():
                    got = torch.full_like(want, float("nan"))
                    w4a4_gemm_cuda.gemm(a, w, bias, got, 132, how=how)
                    where = (n, k, m, how)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                got = nvfp4_gemm_sm90(a, w, bias, out_dtype)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k, m, kind)
    # captured and replayed in a CUDA graph, on new inputs: the small-, mid- and wide-M kernels
    # (the activation decode too)
    w = quantize_nvfp4(_make("normal", 1024, 2048, 7).cuda(), amax="tensor", block_2d=True)
    _assert_graph_replays_same_bits(w, (4, 40, 100), out_dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_streamed_gemm_same_bits_as_triton(out_dtype: torch.dtype) -> None:
    """The streamed small-M kernel (persistent grid over weight-tile x fold-chunk units, partials
    folded in order by each tile's last warpgroup) gives the Triton decode GEMM's bits at every
    M <= 16, with two or three consumer warpgroups and either weight layout (canonical rows, the
    unit layout): one unit per warpgroup and many, a last fold chunk of 256 elements, N not a
    multiple of 64, a single fold chunk (direct store), bias, heavy tails, NaN / Inf / zero
    activation rows, per-tensor activation scales; its tile counters are left at zero; the
    default dispatch sends large weights to it; a CUDA graph replays it on new inputs (the
    counters buffer of the capture stream included)."""
    from dataclasses import replace

    from minite_kernels import w4a4_gemm_cuda
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    device = torch.device("cuda")
    assert w4a4_gemm_cuda.available(device), w4a4_gemm_cuda._broken(0)
    for n, k in ((8192, 8192), (2048, 4096), (4096, 2304), (1000, 768), (200, 512), (64, 256)):
        w = quantize_nvfp4(_make("heavy", n, k, n).cuda(), amax="tensor", block_2d=True)
        w_units = replace(w, kernel_layout=w4a4_gemm_cuda.UnitLayout(w.codes, w.scales))
        bias = torch.randn(n, generator=_gen(k)).cuda().to(out_dtype)
        for m in (1, 2, 5, 8, 9, 13, 16):
            for kind, amax in (("heavy", "row"), ("blocks", "tensor"), ("specials", "row")):
                a = quantize_nvfp4(_make(kind, m, k, m + k).cuda(), amax=amax)
                assert w4a4_gemm_cuda.stream_fits(a, w)
                want = nvfp4_gemm_sm90(a, w, bias, out_dtype, config=decode_config(m))
                for wgs in (2, 3):
                    for weight in (w, w_units):
                        got = torch.full_like(want, float("nan"))
                        how = w4a4_gemm_cuda.stream_plan(m, n, k, 132, wgs)
                        w4a4_gemm_cuda.gemm(a, weight, bias, got, 132, how=how)
                        where = (n, k, m, kind, wgs, weight is w_units)
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                got = nvfp4_gemm_sm90(a, w, bias, out_dtype)  # the default dispatch
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k, m)
    assert int(w4a4_gemm_cuda.split_counters(device).abs().sum()) == 0
    y = torch.empty(1, 4096, device="cuda")
    w = quantize_nvfp4(_make("normal", 2048, 4096, 3).cuda(), amax="tensor", block_2d=True)
    a = quantize_nvfp4(torch.zeros(1, 4096, device="cuda"))
    assert w4a4_gemm_cuda.plan(1, 2048, 4096, 132, ws=True, stream=True).family == "stream"
    assert w4a4_gemm_cuda.serves(a, w, y[:, :2048].contiguous())
    _assert_graph_replays_same_bits(w, (1, 4, 16), out_dtype)
    assert int(w4a4_gemm_cuda.split_counters(device).abs().sum()) == 0


def test_kernel_layout_follows_weight_updates_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A weight's kernel layout (the streamed kernel's unit layout) changes no bit and follows
    the weight: refreshed in place after an in-place update, a captured CUDA graph replays with
    the new weight; an eager call after an in-place write refreshes it itself; a row slice or a
    copy of the weight does not use it; ``MINITE_KERNEL_LAYOUT=0`` makes none; small weights
    (not served by the streamed kernel) get none."""
    from minite_kernels import w4a4_gemm_cuda
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    from minite_common import refresh_kernel_layout, with_kernel_layout

    n, k = 2048, 4096  # 8 Mi elements: the streamed kernel's smallest default weight
    old, new = (quantize_nvfp4(_make("heavy", n, k, s).cuda(), amax="tensor", block_2d=True)
                for s in (11, 12))  # fmt: skip
    w = with_kernel_layout(old.to("cpu").to("cuda"))  # a weight of its own
    assert isinstance(w.kernel_layout, w4a4_gemm_cuda.UnitLayout)
    assert with_kernel_layout(w) is w
    small = quantize_nvfp4(_make("normal", 1024, 4096, 1).cuda(), amax="tensor", block_2d=True)
    assert with_kernel_layout(small).kernel_layout is None
    monkeypatch.setenv("MINITE_KERNEL_LAYOUT", "0")
    assert with_kernel_layout(old).kernel_layout is None
    monkeypatch.delenv("MINITE_KERNEL_LAYOUT")

    def want(weight: NVFP4Tensor, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_gemm_sm90(quantize_nvfp4(x), weight, config=decode_config(x.shape[0]))

    xs = {m: torch.zeros(m, k, device="cuda", dtype=torch.bfloat16) for m in (1, 16)}
    graphs, outs = {}, {}
    for m, x in xs.items():
        w4a4_linear(x, w)
        graphs[m] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[m]):
            outs[m] = w4a4_linear(x, w)
    for m, x in xs.items():
        x.copy_(_make("normal", m, k, m).cuda())
        graphs[m].replay()
        assert torch.equal(outs[m], want(old, x)), m
    # an in-place update (as a weight sync commits it), then the refresh: the graphs follow
    w.codes.copy_(new.codes)
    w.scales.copy_(new.scales)
    w.decode_scale.copy_(new.decode_scale)
    refresh_kernel_layout(w)
    for m, x in xs.items():
        graphs[m].replay()
        assert torch.equal(outs[m], want(new, x)), m
    # an in-place write without a refresh: the next eager call notices it (version counter),
    # its refresh the kernel right before the GEMM (whose early start must not read stale units)
    w.codes.copy_(old.codes)
    w.scales.copy_(old.scales)
    w.decode_scale.copy_(old.decode_scale)
    a = quantize_nvfp4(xs[16])
    assert torch.equal(nvfp4_gemm(a, w), want(old, xs[16]))
    w.codes.copy_(new.codes)
    w.scales.copy_(new.scales)
    w.decode_scale.copy_(new.decode_scale)
    assert torch.equal(w4a4_linear(xs[1], w), want(new, xs[1]))
    w.codes.copy_(old.codes)
    w.scales.copy_(old.scales)
    w.decode_scale.copy_(old.decode_scale)
    assert torch.equal(w4a4_linear(xs[1], w), want(old, xs[1]))
    graphs[16].replay()
    assert torch.equal(outs[16], want(old, xs[16]))
    # a row slice and a copy do not read the layout made for the whole weight
    rows = w.narrow_rows(64, 1024)
    assert rows.kernel_layout is None and w.to("cuda").kernel_layout is None
    sliced = NVFP4Tensor(w.codes[64:1088], w.scales[64:1088], w.decode_scale,
                         torch.Size((1024, k)), w.dtype, w.block_2d, w.recipe_fingerprint,
                         kernel_layout=w.kernel_layout)  # fmt: skip
    assert w.kernel_layout.units_for(sliced.codes, sliced.scales) is None
    y = torch.empty(16, 1024, dtype=torch.bfloat16, device="cuda")
    a = quantize_nvfp4(xs[16])
    w4a4_gemm_cuda.gemm(a, sliced, None, y, 132, how=w4a4_gemm_cuda.stream_plan(16, 1024, k, 132))
    assert torch.equal(y, want(rows, xs[16]))
    with pytest.raises(ValueError, match="not the codes and scales"):
        w.kernel_layout.refresh(sliced.codes, sliced.scales)


def _scales_at_offset(w: NVFP4Tensor, offset: int) -> NVFP4Tensor:
    """``w`` with its scales stored ``offset`` bytes into a larger buffer (same values)."""
    flat = torch.zeros(w.scales.numel() + offset, dtype=torch.uint8, device=w.scales.device)
    scales = flat[offset:].view(w.scales.shape).view(w.scales.dtype)
    scales.copy_(w.scales)
    return dataclasses.replace(w, scales=scales, kernel_layout=None)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_wide_gemm_same_bits_as_triton(out_dtype: torch.dtype) -> None:
    """The register-A wide-M kernel (two consumer warpgroups decoding 128 weight rows' staged
    codes into wgmma fragments, K split over fold chunks with the partials folded in order by
    each tile's last CTA) gives the Triton decode GEMM's bits: batch tiles of 32, 64 and 128,
    one to every fold chunk per split (uneven splits, a last fold chunk of 256 elements), N not
    a multiple of 128, M across tiles, bias, heavy tails, per-tensor activation scales; its tile
    counters are left at zero; the default dispatch sends 16 < M <= 1024 to it; a CUDA graph
    replays it on new inputs."""
    from minite_kernels import w4a4_gemm_cuda
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    device = torch.device("cuda")
    assert w4a4_gemm_cuda.available(device), w4a4_gemm_cuda._broken(0)
    for n, k in ((2048, 4096), (4096, 2304), (1000, 768), (200, 512), (192, 1280)):
        w = quantize_nvfp4(_make("heavy", n, k, n).cuda(), amax="tensor", block_2d=True)
        bias = torch.randn(n, generator=_gen(k)).cuda().to(out_dtype)
        folds = -(-k // 512)
        for m in (17, 32, 33, 64, 100, 129, 256, 300, 1000):
            for kind, amax in (("heavy", "row"), ("blocks", "tensor")):
                a = quantize_nvfp4(_make(kind, m, k, m + k).cuda(), amax=amax)
                assert w4a4_gemm_cuda.wide_fits(a, w)
                want = nvfp4_gemm_sm90(a, w, bias, out_dtype, config=decode_config(m))
                for block_m in (32, 64, 128):
                    for splits in sorted({1, 2, 3, folds} & set(range(1, folds + 1))):
                        got = torch.full_like(want, float("nan"))
                        how = w4a4_gemm_cuda.wide_plan(m, n, k, 132, block_m, splits)
                        w4a4_gemm_cuda.gemm(a, w, bias, got, 132, how=how)
                        where = (n, k, m, kind, block_m, splits)
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                    # K split over a two-CTA cluster (partials handed over in shared memory)
                    got = torch.full_like(want, float("nan"))
                    how = w4a4_gemm_cuda.Plan("wide_c2", block_m, -(-folds // 2), 2, 2, 1)
                    w4a4_gemm_cuda.gemm(a, w, bias, got, 132, how=how)
                    where = (n, k, m, kind, block_m, "c2")
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                    # the workspace split launched as clusters that fold the tile together, each
                    # CTA its share of the batch rows (uneven shares, some empty at 8 splits)
                    for splits in sorted({2, 3, min(folds, 8)} & set(range(2, folds + 1))):
                        got = torch.full_like(want, float("nan"))
                        how = w4a4_gemm_cuda.Plan(
                            "wide_cf", block_m, -(-folds // splits), splits, 2, 1
                        )
                        w4a4_gemm_cuda.gemm(a, w, bias, got, 132, how=how)
                        where = (n, k, m, kind, block_m, "cf", splits)
                        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
                got = nvfp4_gemm_sm90(a, w, bias, out_dtype)  # the default dispatch
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k, m)
    assert int(w4a4_gemm_cuda.split_counters(device).abs().sum()) == 0
    for m in (64, 300, 1024):
        assert w4a4_gemm_cuda.plan(m, 2048, 4096, 132, stream=True, wide=True).family == "wide"
    w = quantize_nvfp4(_make("normal", 2048, 4096, 5).cuda(), amax="tensor", block_2d=True)
    _assert_graph_replays_same_bits(w, (20, 64, 200, 700), out_dtype)
    assert int(w4a4_gemm_cuda.split_counters(device).abs().sum()) == 0


def test_cluster_folded_default_plans_same_bits() -> None:
    """The device's cluster slots (clusters of 2..8 wide-M CTAs it holds at once) are sane; where
    the default plan is a workspace split whose tiles fit one wave of them, the dispatch folds it
    by cluster (``wide_cf``), from quantized operands and from BF16 rows (``w4a4_linear``'s
    path), with the Triton decode GEMM's bits; elsewhere the plan is as without slots."""
    from minite_kernels import quantized_rows_gemm
    from minite_kernels import w4a4_gemm_cuda as cu
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    device = torch.device("cuda")
    sms, slots = cu._sms(device), cu.cluster_slots(device)
    assert len(slots) == 7 and list(slots) == sorted(slots, reverse=True), slots
    assert all(0 < count * size <= sms for size, count in enumerate(slots, 2)), slots
    folded = 0
    # Qwen3-4B down, Qwen2.5-7B down, Qwen3-30B-A3B qkv at TP = 4, 2048 x 4096
    for n, k in ((2560, 9728), (3584, 18944), (1280, 2048), (2048, 4096)):
        w = quantize_nvfp4(_make("heavy", n, k, n).cuda(), amax="tensor", block_2d=True)
        bias = torch.randn(n, generator=_gen(k)).cuda().bfloat16()
        for m in (17, 40, 64, 96):
            unfolded = cu.plan(m, n, k, sms, ws=cu.ws_fits(w), wide=True)
            how = cu.plan(m, n, k, sms, ws=cu.ws_fits(w), wide=True, clusters=slots)
            assert how == cu.cluster_folded(unfolded, m, n, slots), (n, k, m)
            folded += how.family == "wide_cf"
            x = _as_dtype(_make("heavy", m, k, m + n).cuda(), torch.bfloat16)
            a = quantize_nvfp4(x)
            want = nvfp4_gemm_sm90(a, w, bias, torch.bfloat16, config=decode_config(m))
            got = nvfp4_gemm_sm90(a, w, bias, torch.bfloat16)  # the default dispatch
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, m)
            assert cu.rows_plan(x, w, torch.bfloat16) == how, (n, k, m)
            got = quantized_rows_gemm(x, w, bias, torch.bfloat16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, m, "rows")
    assert folded >= 4  # e.g. 7B down at M = 40-64 (28 tiles of 4 CTAs) on 132-SM Hoppers


def test_wide_gemm_any_k_same_bits_as_triton() -> None:
    """The register-A wide-M kernels' variants for K % 128 != 0 (the last chunk's codes
    zero-filled past K, in 8-byte blocks where rows are not 16-byte aligned; the scales from a
    copy zero-padded to whole chunks) give the
    Triton decode GEMM's bits: K % 128 = 16 / 64 / 80 / 112 and K < 128, scales stored at any
    offset (also where K % 128 == 0), N not a multiple of 128, every batch tile, workspace and
    cluster splits, bias, float32 out, NaN / Inf / zero rows; the default dispatch and
    ``w4a4_linear`` serve such K with them, also in a CUDA graph."""
    from minite_kernels import w4a4_gemm_cuda as cu
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    for n, k in ((1040, 1040), (300, 2368), (130, 80), (200, 1008), (264, 4176)):
        w = quantize_nvfp4(_make("heavy", n, k, n + 1).cuda(), amax="tensor", block_2d=True)
        assert not cu._wide_even(w)
        bias = torch.randn(n, generator=_gen(k)).cuda().float()
        folds = -(-k // 512)
        for m, kind in ((17, "specials"), (64, "heavy"), (300, "normal")):
            a = quantize_nvfp4(_make(kind, m, k, m + k).cuda())
            assert cu.wide_fits(a, w)
            want = nvfp4_gemm_sm90(a, w, bias, torch.float32, config=decode_config(m))
            for block_m in (32, 64, 128):
                plans = [cu.wide_plan(m, n, k, 132, block_m, s) for s in sorted({1, folds})]
                if folds >= 2:
                    plans.append(cu.Plan("wide_c2", block_m, -(-folds // 2), 2, 2, 1))
                for how in plans:
                    got = torch.full_like(want, float("nan"))
                    cu.gemm(a, w, bias, got, 132, how=how)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                        n,
                        k,
                        m,
                        how,
                    )
            assert cu.plan(m, n, k, 132, wide=True).family in ("wide", "wide_c2", "mid")
            got = nvfp4_gemm_sm90(a, w, bias, torch.float32)  # the default dispatch
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k, m)
            x = _make(kind, m, k, m + k).cuda().bfloat16()
            ref = nvfp4_gemm_sm90(
                quantize_nvfp4(x), w, None, torch.bfloat16, config=decode_config(m)
            )
            assert torch.equal(w4a4_linear(x, w).view(torch.int16), ref.view(torch.int16))
    assert int(cu.split_counters(torch.device("cuda")).abs().sum()) == 0
    w = quantize_nvfp4(_make("normal", 1040, 1040, 3).cuda(), amax="tensor", block_2d=True)
    # scales stored off any alignment, also at K % 128 == 0 (which the even variant then cannot
    # read): the padded copy serves
    w1024 = quantize_nvfp4(_make("normal", 640, 1024, 4).cuda(), amax="tensor", block_2d=True)
    assert cu._wide_even(w1024)
    for w_odd in (_scales_at_offset(w, 3), _scales_at_offset(w1024, 1)):
        a = quantize_nvfp4(_make("heavy", 100, w_odd.cols, 5).cuda())
        assert cu.wide_fits(a, w_odd) and not cu._wide_even(w_odd)
        want = nvfp4_gemm_sm90(a, w_odd, None, torch.bfloat16, config=decode_config(100))
        got = nvfp4_gemm_sm90(a, w_odd, None, torch.bfloat16)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), w_odd.cols
    _assert_graph_replays_same_bits(w, (20, 200), torch.bfloat16)


def test_wide_stream_k_same_bits_as_triton() -> None:
    """The register-A wide kernel's stream-K variant (whole tiles in waves, the last one or two
    waves' worth of tiles shared by fold chunks, a tile's running sum handed from one CTA to the
    next through the workspace) gives the Triton decode GEMM's bits: every batch tile, under two
    waves of tiles and several, a tile count the CTAs divide, one fold chunk, K % 128 != 0, N and
    M off the tiles, bias, three output types, NaN / Inf / zero rows, fewer CTAs than SMs; its
    flags are left at zero; it refuses more CTAs than tiles or SMs; the default dispatch and a
    CUDA graph serve it."""
    from minite_kernels import w4a4_gemm_cuda as cu
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    device = torch.device("cuda")
    cases = (
        (8192, 1024, (320,)), (5000, 2064, (500,)), (3000, 1040, (777,)), (8192, 512, (300,)),
        (4224, 2048, (512, 1024)), (2056, 2048, (2100,)),
    )  # fmt: skip
    for n, k, ms in cases:
        w = quantize_nvfp4(_make("heavy", n, k, n + 2).cuda(), amax="tensor", block_2d=True)
        bias = torch.randn(n, generator=_gen(k)).cuda()
        for m in ms:
            kinds = (
                (torch.bfloat16, "heavy"),
                (torch.float32, "specials"),
                (torch.float16, "blocks"),
            )
            for out, kind in kinds:
                a = quantize_nvfp4(_make(kind, m, k, m + k).cuda())
                want = nvfp4_gemm_sm90(a, w, bias.to(out), out, config=decode_config(min(m, 512)))
                plans = []
                for block_m in (32, 64, 128):
                    how = cu.wide_plan(m, n, k, 132, block_m, stream_k=True)
                    if -(-m // block_m) * -(-n // 128) <= 132:  # one wave: no stream-K
                        assert how is None, (n, k, m, block_m)
                        continue
                    assert how.splits == 132, (n, k, m, block_m)
                    plans += [how, how._replace(splits=100)]
                for how in plans:
                    got = torch.full_like(want, float("nan"))
                    cu.gemm(a, w, bias.to(out), got, 132, how=how)
                    where = (n, k, m, kind, how)
                    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), where
    assert int(cu.split_counters(device).abs().sum()) == 0
    w = quantize_nvfp4(_make("normal", 8192, 1024, 7).cuda(), amax="tensor", block_2d=True)
    a = quantize_nvfp4(_make("normal", 320, 1024, 8).cuda())
    y = torch.empty(320, 8192, dtype=torch.bfloat16, device=device)
    for ctas in (0, 133):
        with pytest.raises(ValueError, match="stream-K"):
            cu.gemm(a, w, None, y, 132, how=cu.Plan("wide_sk", 128, 1, ctas, 2, 1))
    assert cu.plan(320, 8192, 1024, 132, wide=True).family == "wide_sk"
    _assert_graph_replays_same_bits(w, (320,), torch.bfloat16)
    assert int(cu.split_counters(device).abs().sum()) == 0


def test_fold_chunk_partials_combine_to_the_gemm_across_k_shards() -> None:
    """nvfp4_gemm_partials of K shards starting on multiples of 512, concatenated and folded by
    fold_partials, equal the unsharded GEMM bitwise (BF16 and float32 out, bias, every M path)."""
    from minite_kernels import fold_partials, nvfp4_gemm_partials

    from minite_common.nvfp4 import NVFP4Tensor

    def shard(t, s, e):
        return NVFP4Tensor(t.codes[:, s // 2 : e // 2], t.scales[:, s // 16 : e // 16],
                           t.decode_scale, torch.Size([t.rows, e - s]), t.dtype, t.block_2d,
                           t.recipe_fingerprint)  # fmt: skip

    n, k = 768, 4 * 512 + 64
    w = quantize_nvfp4(_make("normal", n, k, 4).cuda(), amax="tensor", block_2d=True)
    bias = torch.randn(n, generator=_gen(5)).cuda().bfloat16()
    for m in (1, 16, 100, 600):
        a = quantize_nvfp4(_make("heavy", m, k, m).cuda())
        for cuts in ((0, k), (0, 1024, k), (0, 512, 1024, 2048, k)):
            parts = torch.cat([nvfp4_gemm_partials(shard(a, s, e), shard(w, s, e))
                               for s, e in zip(cuts[:-1], cuts[1:], strict=True)])  # fmt: skip
            for out in (torch.float32, torch.bfloat16):
                want = nvfp4_gemm(a, w, bias, out_dtype=out)
                got = fold_partials(parts, a.decode_scale, w.decode_scale, bias, out)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (m, cuts, out)


@pytest.mark.parametrize("mode", ["auto", "1"])
def test_quantized_rows_gemm_same_bits_as_quantize_then_gemm(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The activation pass that quantizes BF16 rows itself (w4a4_linear at 16 < M <= 256 on the
    image-reading CUDA kernels, at 8 < M <= 16 on them for a weight below the streamed kernel's
    threshold and on the streamed kernel's image variant for a weight with its kernel layout),
    and at M = 1 the streamed kernel quantizing the row itself (K <= STREAM_QUANT_MAX, kernel
    layout), give the bits of the quantizer followed by nvfp4_gemm and by the Triton decode
    GEMM: every input kind (ties, subnormal and saturated block scales, NaN/Inf/zero rows),
    bias, three output types, strided rows, N and K off the tile sizes; it serves where it
    should, and replays in CUDA graphs."""
    from minite_kernels import quantized_rows_gemm
    from minite_kernels import w4a4_gemm_cuda as cu
    from minite_kernels.w4a4_gemm import decode_config, nvfp4_gemm_sm90

    from minite_common import with_kernel_layout

    if mode == "1":
        monkeypatch.setenv("MINITE_CUDA_KERNELS", "1")
    served = set()
    # 8192 x 512 at M = 256: the warp-specialized kernel's default
    shapes = (
        (5120, 2048), (2048, 4096), (1000, 1040), (4096, 4096), (8200, 1024), (8200, 1056),
        (1536, 768), (1024, 2048), (8192, 512), (2048, 8192),
    )  # fmt: skip
    for i, (n, k) in enumerate(shapes):
        w0 = quantize_nvfp4(_make("normal", n, k, 40 + i).cuda(), amax="tensor", block_2d=True)
        bias = torch.randn(n, generator=_gen(50 + i)).cuda().bfloat16()
        layouts = [(w0, m) for m in (1, 9, 16, 17, 40, 64, 129, 256, 300, 1024)]
        layouts += [(with_kernel_layout(w0), m) for m in (1, 2, 3, 4, 5, 8, 9, 12, 16)]
        for w, m in layouts:
            kind = ("normal", "heavy", "blocks", "ties", "specials")[(m + i) % 5]
            wide = torch.zeros(m, k + 16, dtype=torch.bfloat16, device="cuda")
            x = wide[:, :k].copy_(_as_dtype(_make(kind, m, k, m + i).cuda(), torch.bfloat16))
            a = quantize_nvfp4(x)
            for out, b in ((torch.bfloat16, None), (torch.float32, bias), (torch.float16, bias)):
                got = quantized_rows_gemm(x, w, b, out)
                plan = cu.rows_plan(x, w, out)
                assert (got is None) == (plan is None), (n, k, m)
                small = n * k < cu.STREAM_MIN_WEIGHT or k % 256 != 0
                quant = m == 1 and k <= cu.STREAM_QUANT_MAX and not small
                if w.kernel_layout is not None and quant:  # the streamed kernel quantizes them
                    assert plan is not None and plan.family == "stream", (n, k, m)
                    assert plan.kernel_name(True, True, rows=True).startswith("w4a4_stream_rows")
                assert plan is None or 8 < m <= cu.ROWS_MAX_M or quant, (n, k, m)
                assert plan is None or m > 16 or w.kernel_layout is not None or small, (n, k, m)
                if mode == "auto" and small and 8 < m <= 16 and k % 128 == 0:
                    assert plan is not None and plan.family in ("mid", "wide", "wide_cf"), (n, k, m)
                if got is None:
                    continue
                served.add(plan.family)
                want = nvfp4_gemm(a, w, b, out_dtype=out)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (n, k, m, out)
                if m <= 256:
                    triton_y = nvfp4_gemm_sm90(a, w, b, out, config=decode_config(m))
                    assert torch.equal(got.view(torch.uint8), triton_y.view(torch.uint8))
            y = w4a4_linear(x, w)  # the public path (fused where served), rows batch-invariant
            assert torch.equal(y.view(torch.int16), nvfp4_gemm(a, w).view(torch.int16))
            assert torch.equal(w4a4_linear(x[:1], w).view(torch.int16), y[:1].view(torch.int16))
    assert {"wide", "ws", "stream"} <= served, served
    if mode == "1":
        assert "mid" in served, served
    # captured: the pass quantizes the rows written before each replay
    plain = quantize_nvfp4(_make("normal", 5120, 2048, 60).cuda(), amax="tensor", block_2d=True)
    for m, w in ((64, plain), (12, with_kernel_layout(plain)), (1, with_kernel_layout(plain))):
        x = torch.zeros(m, 2048, dtype=torch.bfloat16, device="cuda")
        assert cu.rows_plan(x, w, torch.bfloat16) is not None
        w4a4_linear(x, w)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = w4a4_linear(x, w)
        for kind in ("normal", "specials"):
            x.copy_(_as_dtype(_make(kind, m, 2048, 61).cuda(), torch.bfloat16))
            graph.replay()
            want = nvfp4_gemm(quantize_nvfp4(x), w)
            assert torch.equal(y.view(torch.int16), want.view(torch.int16)), (m, kind)


_RING_STRESS = """
import torch
from minite_common import quantize_nvfp4, w4a4_linear, with_kernel_layout
from minite_kernels import w4a4_gemm_cuda as cu
g = torch.Generator(device="cuda").manual_seed(7)
n, k = 28672, 4096  # about 27 units per CTA on 132 SMs: five rounds of the ring per launch
ws = [
    with_kernel_layout(quantize_nvfp4(
        torch.randn(n, k, device="cuda", generator=g).bfloat16(), amax="tensor", block_2d=True))
    for _ in range(2)
]
sms = torch.cuda.get_device_properties(0).multi_processor_count
for m in (9, 16, 4):
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    how = cu.rows_plan(x, ws[0], torch.bfloat16) or cu.plan(m, n, k, sms, stream=True)
    assert how.family == "stream" and how.warpgroups == 3, how
    want = [w4a4_linear(x, w) for w in ws]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        w4a4_linear(x, ws[0])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [w4a4_linear(x, ws[i % 2]) for i in range(200)]
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    for i, y in enumerate(outs):
        assert torch.equal(y.view(torch.int16), want[i % 2].view(torch.int16)), (m, i)
print("ok")
"""


def test_streamed_ring_survives_many_back_to_back_launches() -> None:
    """The streamed kernel's ring under 30000 back-to-back graph-replayed launches (M = 9 and 16:
    the image variant after its image pass; M = 4: the producer decoding the activation) on a
    weight whose CTAs take about five rounds of the ring: every launch ends (a child process
    under a time limit, so a hang fails here instead of stalling the suite) with the eager
    bits. With the stages shared round-robin by the consumer warpgroups (5 stages, 3
    warpgroups) the first 10000 launches at M = 9 hung on an H100 (2026-12-06)."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", _RING_STRESS], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
