"""Kernel-logic tests of miniTE's Triton kernels on CPU, through Triton's interpreter.

Each check runs in a subprocess with ``TRITON_INTERPRET=1`` (it must be set before Triton is
imported, and must not leak into other tests). The interpreter checks indexing, masking, the
quantizer's bits (same bytes as the torch reference) and the exact decode; it does not model the
GPU's BF16 MMA (it stores BF16 as raw integers), so GEMM results are checked against FP64 within
float32 accumulation error here, and bitwise on the GPU (tests/gpu).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHECKS = [
    "quantize",
    "quantize_two_pass",
    "quantize_bf16_words",
    "e2m1_rounding",
    "decode_operand",
    "gemm",
    "split_k",
    "grouped",
    "partials",
    "swiglu",
]


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_logic_in_interpreter(check: str) -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_cpu_tensors_take_the_torch_path() -> None:
    from minite_kernels import kernel_arch

    from minite_common import gemm_path

    assert kernel_arch("cpu") is None
    assert gemm_path("cpu") == "torch-exact-f64"


def test_blackwell_group_tiles_clamp_sizes() -> None:
    """The Blackwell grouped GEMM's row tiles (host side, never run on a device here): a negative
    size counts as 0 and rows past the total get no tile, as the Hopper kernel reads device sizes
    (the ``grouped`` check above), so bad sizes cannot reach out-of-bounds rows."""
    pytest.importorskip("triton")
    from minite_kernels.w4a4_gemm_sm100 import _group_tiles

    assert _group_tiles([-5, 8, 17, 1], 32, 16, 21, "cpu").tolist() == [[0, 8, 32], [8, 21, 64]]
    assert _group_tiles([0, 3, 17, 1], 32, 16, 21, "cpu").tolist() == [
        [0, 3, 32], [3, 20, 64], [19, 20, 64], [20, 21, 96]
    ]  # fmt: skip


def test_cuda_kernel_mode_and_cpu_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MINITE_CUDA_KERNELS`` picks off / on / auto, and CPU tensors never reach the CUDA C++
    kernel (nor compile it)."""
    pytest.importorskip("triton")
    from minite_kernels import cuda_jit, w4a4_gemm_cuda
    from minite_kernels.w4a4_gemm import LARGE_CONFIG

    from minite_common import quantize_nvfp4

    for value, mode in (("0", "off"), ("off", "off"), ("1", "on"), ("", "auto"), ("x", "auto")):
        monkeypatch.setenv("MINITE_CUDA_KERNELS", value)
        assert cuda_jit.mode() == mode
    a = quantize_nvfp4(torch.randn(2, 64))
    w = quantize_nvfp4(torch.randn(64, 64), amax="tensor", block_2d=True)
    y = torch.empty(2, 64, dtype=torch.bfloat16)
    monkeypatch.setenv("MINITE_CUDA_KERNELS", "1")
    assert w4a4_gemm_cuda.supports(a, w, y) and not w4a4_gemm_cuda.serves(a, w, y)
    assert w4a4_gemm_cuda.plan(16, 8192, 32768, 132) is None  # K too long for one cluster
    plan = w4a4_gemm_cuda.plan
    # mid M (when the wide-M kernel cannot read the weight): no split; two warpgroups per CTA
    # while the grid fits one CTA per SM
    assert plan(64, 8192, 8192, 132, ws=False) == ("mid", 64, 16, 1, 2, 0)
    assert plan(128, 8192, 8192, 132, ws=False).warpgroups == 1
    assert plan(17, 64, 16, 132).block_m == 32
    assert plan(257, 64, 16, 132) is None
    assert plan(257, 8192, 8192, 132, ws=False) is None
    # wide M: the batch tile with the least waves x measured CTA time (the fastest measured)
    assert plan(64, 8192, 8192, 132) == ("ws", 64, 1, 1, 1, 2)
    assert plan(100, 8192, 8192, 132).family == "ws" and plan(17, 8192, 8192, 132).family == "mid"
    tiles = {(m, n, k): plan(m, n, k, 132).block_m for m, n, k in (
        (128, 8192, 8192), (256, 8192, 8192), (384, 8192, 8192), (1024, 8192, 8192),
        (128, 2048, 4096), (256, 2048, 4096), (512, 2048, 4096), (256, 4096, 4096),
        (256, 5120, 2048), (128, 24576, 4096), (384, 24576, 4096), (384, 4096, 12288))}  # fmt: skip
    assert list(tiles.values()) == [128, 256, 128, 256, 64, 64, 128, 128, 256, 128, 128, 256]
    assert plan(1025, 8192, 8192, 132) is None  # past WS_MAX_M: the Triton large-M kernel
    assert plan(300, 5120, 2048, 132) is None  # K < 4096 above M = 256: the Triton kernel
    assert plan(300, 8192, 8192 + 16, 132) is None  # K % 32 != 0: no wide-M kernel
    w_odd = quantize_nvfp4(torch.randn(64, 2064), amax="tensor", block_2d=True)
    assert w4a4_gemm_cuda.ws_fits(w) and not w4a4_gemm_cuda.ws_fits(w_odd)
    # the auto mode's choices (where each kernel measured faster than the Triton one)
    preferred = w4a4_gemm_cuda.preferred
    assert preferred(1, 5120, 2048, 132)
    # M <= 16: the streamed kernel from 8 Mi weight elements (where it reads the operands), two
    # consumer warpgroups while there are at most two units per SM
    assert preferred(1, 8192, 8192, 132) and preferred(16, 2048, 4096, 132)
    assert not preferred(1, 8192, 8192, 132, stream=False)
    # below the streamed kernel's threshold, 8 < M <= 16: the register-A / mid-M plans of M = 32
    assert preferred(16, 1536, 2048, 132) and not preferred(16, 1536, 2048, 132, wide=False)
    assert not preferred(17, 8192, 8192, 132, ws=False, wide=False)
    assert plan(1, 8192, 8192, 132, stream=True) == ("stream", 8, 1, 1, 3, 0)
    assert plan(16, 2048, 4096, 132, stream=True) == ("stream", 16, 1, 1, 2, 0)
    assert plan(8, 8192, 8192 + 128, 132, stream=True).family == "small"  # K % 256 != 0
    assert plan(4, 1024, 2048, 132, stream=True).family == "small"  # 2 Mi weight elements
    assert plan(1, 8192, 8192, 132, splits=2, stream=True).family == "small"
    a_k, w_k = quantize_nvfp4(torch.randn(2, 512)), quantize_nvfp4(torch.randn(64, 512))
    a_odd = quantize_nvfp4(torch.randn(2, 2064))
    assert w4a4_gemm_cuda.stream_fits(a_k, w_k) and not w4a4_gemm_cuda.stream_fits(a, w)  # K 64
    assert not w4a4_gemm_cuda.stream_fits(a_odd, w_odd)
    assert preferred(64, 8192, 8192, 132)  # wide M: 128 CTAs
    assert not preferred(64, 4096, 4096, 132, wide=False)  # 64 CTAs: Triton splits K
    assert not preferred(64, 24576, 4096, 132, wide=False)  # 384 CTAs: 1.5 waves
    assert not preferred(32, 8192, 8192, 132, wide=False)
    assert preferred(32, 24576, 4096, 132)  # mid M: 384 CTAs
    assert preferred(65, 2048, 4096, 132)
    assert preferred(256, 8192, 8192, 132) and preferred(768, 24576, 4096, 132)
    # without the register-A kernel, M > 896 where the large-M kernel's grid fills >= 90% of its
    # last wave: the Triton kernel; with it, the register-A kernel up to M = 1536 (1024 at
    # K <= 1024)
    assert not preferred(1024, 24576, 4096, 132, wide=False)
    assert not preferred(1000, 8192, 8192, 132, wide=False)
    assert preferred(1024, 24576, 4096, 132) and preferred(1000, 8192, 8192, 132)
    assert preferred(1024, 6144, 4096, 132) and preferred(1024, 2048, 4096, 132)
    assert (LARGE_CONFIG.block_n, LARGE_CONFIG.block_m) == w4a4_gemm_cuda.LARGE_TILE
    assert not preferred(256, 8192, 8192, 132, ws=False, wide=False)  # mid M: 512 CTAs
    assert not preferred(1024, 5120, 2048, 132, wide=False) and preferred(1024, 5120, 2048, 132)
    assert preferred(1536, 5120, 2048, 132) and not preferred(1537, 5120, 2048, 132)
    assert preferred(1024, 5120, 1024, 132) and not preferred(1025, 5120, 1024, 132)
    assert not preferred(2048, 8192, 8192, 132)


def test_cuda_kernel_names_match_the_source() -> None:
    """Every CUDA kernel the host loads by name (``_kernel_names``: each plan's kernel, the image
    passes) is defined in ``w4a4_gemm_sm90a.cu`` after its macros expand, and every kernel defined
    there is one the host can launch. The streamed kernel reads BF16 rows only with the unit
    layout; its rows variant's shared-memory area is as large on both sides."""
    pytest.importorskip("triton")
    import re
    import shutil
    from pathlib import Path

    from minite_kernels import w4a4_gemm_cuda

    cpp = shutil.which("cpp")
    if cpp is None:
        pytest.skip("needs the C preprocessor (cpp) to expand the kernels' macros")
    source = Path(w4a4_gemm_cuda.__file__).with_name("w4a4_gemm_sm90a.cu")
    expanded = subprocess.run(
        [cpp, "-P", "-x", "c++", str(source)], capture_output=True, text=True, check=True
    ).stdout
    attribute = r"__\w+__\((?:[^()]|\([^()]*\))*\)\s*"  # __launch_bounds__(128 * (W + 1), 1)
    defined = re.findall(rf'extern "C" __global__ void\s+(?:{attribute})*(\w+)\s*\(', expanded)
    assert len(defined) == len(set(defined))
    assert set(defined) == set(w4a4_gemm_cuda._kernel_names())
    stream = w4a4_gemm_cuda.Plan("stream", 16, 1, 1, 3)
    assert stream.kernel_name(True, True, rows=True) == "w4a4_stream_image_m16_w3"
    assert stream.kernel_name(True, True) == "w4a4_stream_unit_m16_w3"
    with pytest.raises(ValueError, match="only beside units"):
        stream.kernel_name(True, False, rows=True)
    # at 8-row tiles the kernel quantizes the rows itself, into shared memory beside its ring
    quant = w4a4_gemm_cuda.Plan("stream", 8, 1, 1, 2)
    assert quant.kernel_name(True, True, rows=True) == "w4a4_stream_rows_m8_w2"
    assert quant.smem(rows=True) - quant.smem() == w4a4_gemm_cuda._STREAM_QUANT_BYTES
    assert quant.smem(rows=True) <= 227 * 1024  # Hopper's most per CTA
    assert stream.smem(rows=True) == stream.smem()
    # the ring has one consumer warpgroup per stage (StreamShape::STAGES), and every streamed
    # plan's shared memory fits a Hopper CTA
    stages = re.search(r"struct StreamShape \{.*?STAGES = (\d+);", source.read_text(), re.S)
    assert stages and int(stages.group(1)) == w4a4_gemm_cuda._STREAM_STAGES
    for wgs in w4a4_gemm_cuda._STREAM_WARPGROUPS:
        assert w4a4_gemm_cuda._STREAM_STAGES % wgs == 0
        for bm in w4a4_gemm_cuda._STREAM_BLOCK_MS:
            plan = w4a4_gemm_cuda.Plan("stream", bm, 1, 1, wgs)
            assert max(plan.smem(), plan.smem(rows=True)) <= 227 * 1024, plan
    defines = dict(re.findall(r"#define (STREAM_QROWS_\w+) (\d+)", source.read_text()))
    assert int(defines["STREAM_QROWS_MAX"]) == w4a4_gemm_cuda.STREAM_QUANT_MAX
    assert int(defines["STREAM_QROWS_BYTES"]) == w4a4_gemm_cuda._STREAM_QUANT_BYTES
    # the ring of per-CTA-part arrival counters sits behind the rows' area
    slots = re.search(r"#define STREAM_PART_SLOTS (\d+)", source.read_text())
    assert slots and 4 * int(slots.group(1)) == w4a4_gemm_cuda._STREAM_PART_BYTES


def test_wide_kernel_plans() -> None:
    """The register-A wide-M kernel: which operands it reads (any K % 16 == 0; the ``_even_k``
    variants where K % 128 == 0 with 16- / 8-byte aligned rows), and its plans (batch tile and K
    split by the time model; split K only within one wave; the default for 16 < M <= 256 where
    it models faster than the warp-specialized kernel, up to M = 32 only within one wave, and
    for 256 < M <= 1024)."""
    pytest.importorskip("triton")
    from minite_kernels import w4a4_gemm_cuda

    from minite_common import quantize_nvfp4

    a, w = quantize_nvfp4(torch.randn(2, 512)), quantize_nvfp4(torch.randn(64, 512))
    a_odd, w_odd = quantize_nvfp4(torch.randn(2, 2064)), quantize_nvfp4(torch.randn(64, 2064))
    assert w4a4_gemm_cuda.wide_fits(a, w) and w4a4_gemm_cuda.wide_fits(a_odd, w_odd)
    assert w4a4_gemm_cuda._wide_even(w) and not w4a4_gemm_cuda._wide_even(w_odd)
    # scales off an 8-byte boundary (a row slice at K = 1056: 66 bytes per row): the variant that
    # reads a copy of them in whole chunks
    w_cut = quantize_nvfp4(torch.randn(64, 1056)).narrow_rows(1, 63)
    assert w4a4_gemm_cuda.wide_fits(a_odd, w_cut) and not w4a4_gemm_cuda._wide_even(w_cut)
    even, wide = (
        w4a4_gemm_cuda.Plan("wide", 64, 1, 1, 2, 1),
        w4a4_gemm_cuda.Plan("wide_c2", 32, 1, 2, 2, 1),
    )
    assert (
        even.kernel_name(True) == "w4a4_wide_n64_even_k"
        and even.kernel_name(False) == "w4a4_wide_n64"
    )
    assert wide.kernel_name(False) == "w4a4_wide_c2_n32"
    plan, wide_plan, us = w4a4_gemm_cuda.plan, w4a4_gemm_cuda.wide_plan, w4a4_gemm_cuda.wide_us
    # K split over two-CTA clusters where the grid fits one wave and the model prefers it
    assert plan(64, 8192, 8192, 132, wide=True) == ("wide_c2", 64, 8, 2, 2, 1)
    assert plan(64, 5120, 2048, 132, wide=True) == ("wide_c2", 64, 2, 2, 2, 1)
    assert plan(128, 8192, 8192, 132, wide=True) == ("wide", 64, 16, 1, 2, 1)
    assert plan(256, 8192, 8192, 132, wide=True) == ("wide", 128, 16, 1, 2, 1)
    assert plan(32, 2048, 4096, 132, wide=True) == ("wide", 32, 1, 8, 2, 1)
    assert plan(256, 4096, 4096, 132, wide=True).block_m == 64  # 128-row tiles: 64 CTAs
    # a tile's workspace partials are read back by its last CTA alone: at long K the cluster
    # split wins (3584 x 18944, M = 128: 67 us against 84 for four splits of 128-row tiles)
    assert plan(128, 3584, 18944, 132, wide=True) == ("wide_c2", 64, 19, 2, 2, 1)
    # 32-row tiles beyond M = 32 (2048 x 2048, M = 64: 9.8 us against 11.8 for 64-row tiles)
    assert plan(64, 2048, 2048, 132, wide=True) == ("wide", 32, 1, 4, 2, 1)
    assert plan(32, 24576, 4096, 132, wide=True).family == "mid"  # 192 tiles: 1.5 waves
    # two fold chunks: the mid-M kernel's 32-row tiles, one fold chunk per warpgroup, where they
    # fit one wave (2048 x 1024 at M = 64: 7.3 us against 8.3 for the cluster split)
    assert plan(64, 2048, 1024, 132, wide=True) == ("mid", 32, 2, 1, 2, 0)
    assert plan(32, 5120, 1024, 132, wide=True) == ("mid", 32, 2, 1, 2, 0)
    assert plan(24, 4096, 768, 132, wide=True) == ("mid", 32, 2, 1, 2, 0)
    assert plan(96, 4096, 768, 132, wide=True).family == "wide"  # 192 CTAs of 32 rows
    assert plan(32, 4096, 512, 132, wide=True).family == "wide"  # one fold chunk
    assert w4a4_gemm_cuda.preferred(64, 2048, 1024, 132)
    assert plan(192, 2048, 1024, 132, wide=True).family == "wide"  # 192 CTAs of 32 rows
    assert plan(32, 2048, 2048, 132, wide=True).family == "wide"  # four fold chunks
    # the warp-specialized kernel's fixed cost at short K (5120 x 1024 at M = 128: 11.5 us
    # against 10.8 for unsplit 64-row wide tiles)
    assert plan(128, 5120, 1024, 132, wide=True) == ("wide", 64, 2, 1, 2, 1)
    # K % 128 != 0: the variants that zero-fill the last chunk (the warp-specialized kernel and
    # the Triton kernels served it before, 0.23-0.5x cuBLAS)
    assert plan(64, 8192, 8192 + 32, 132, wide=True) == ("wide_c2", 64, 9, 2, 2, 1)
    assert plan(64, 8192, 8192 + 32, 132, wide=False).family == "ws"
    assert plan(1, 8192, 8192, 132, stream=True, wide=True).family == "stream"
    # 256 < M <= 1536: the wide kernel's modelled plan (8192 x 8192 at M = 384: 119.5 us against
    # 138.2 for the warp-specialized kernel; 5120 x 2048 at M = 384: 20.0 against 29.2 for the
    # Triton decode GEMM), stream-K where the tiles outnumber the SMs and it models faster
    # (8192 x 8192 at M = 384: 98.3 us against 122.7 for two waves of whole tiles), the Triton
    # kernels past it (past 1024 at K <= 1024)
    assert plan(300, 8192, 8192, 132, wide=True) == ("wide_sk", 128, 24, 132, 2, 1)
    assert plan(384, 5120, 2048, 132, wide=True) == ("wide", 128, 4, 1, 2, 1)
    assert plan(1024, 8192, 8192, 132, wide=True) == ("wide", 128, 16, 1, 2, 1)  # 3.9 waves
    assert plan(1536, 8192, 8192, 132, wide=True).family in ("wide", "wide_sk")
    # the stream-K model's factor: Qwen3-30B-A3B qkv at M = 256 stays on whole 128-row tiles
    # (21.6 us against 22.7 for stream-K over 64-row tiles)
    assert plan(256, 5120, 2048, 132, wide=True) == ("wide", 128, 4, 1, 2, 1)
    assert plan(1537, 8192, 8192, 132, wide=True) is None
    assert plan(1024, 8192, 1024, 132, wide=True).family == "wide"
    assert plan(1025, 8192, 1024, 132, wide=True) is None
    assert plan(300, 8192, 8192 + 32, 132, wide=True) == ("wide_sk", 128, 25, 132, 2, 1)
    assert plan(300, 5120, 2048 + 64, 132, wide=True) == ("wide", 128, 5, 1, 2, 1)
    assert plan(160, 12288, 4096, 132, wide=True) == ("wide_sk", 128, 12, 132, 2, 1)
    # stream-K: whole tiles in waves but the last one or two waves' worth, shared by fold chunks
    waves = w4a4_gemm_cuda._sk_waves
    assert (waves(512, 132), waves(264, 132), waves(200, 132), waves(132, 132)) == (2, 2, 0, 1)
    sk = w4a4_gemm_cuda.Plan("wide_sk", 128, 24, 132, 2, 1)
    assert sk.kernel_name(True) == "w4a4_wide_sk_n128_even_k" and sk.threads() == 384
    assert sk.smem() == 4 * (128 * 96 + 128 * 256 + 16) + 16 + 128 * 272  # its own output tile
    assert wide_plan(300, 8192, 8192, 132, stream_k=False).family == "wide"
    assert wide_plan(300, 8192, 8192, 132, 64, stream_k=True).family == "wide_sk"
    assert wide_plan(64, 8192, 8192, 132, stream_k=True) is None  # 64 tiles: one wave
    assert wide_plan(300, 8192, 8192, 132, splits=2, stream_k=True) is None
    assert plan(300, 5120, 2048 + 64, 132, wide=False) is None
    # 8 < M <= 16 below the streamed kernel's threshold: the plans of M = 17-32 (2048 x 768 at
    # M = 16: 7.1 us against 11.3 for the Triton decode GEMM); the streamed kernel above it
    for n, k in ((2048, 768), (1024, 2048), (2560, 2560), (4096, 512)):
        for m in (9, 12, 16):
            assert plan(m, n, k, 132, wide=True) == plan(17, n, k, 132, wide=True), (n, k, m)
            assert w4a4_gemm_cuda.preferred(m, n, k, 132)
        assert plan(8, n, k, 132, wide=True).family == "small"
    assert plan(12, 2048, 768, 132, wide=True) == ("mid", 32, 2, 1, 2, 0)
    assert plan(16, 2560, 2560, 132, wide=True) == ("wide", 32, 1, 5, 2, 1)
    assert plan(16, 5120, 2048, 132, stream=True, wide=True).family == "stream"
    assert plan(16, 4096, 4096, 132, wide=True).family == "small"  # a streamed weight's shape
    # ... and where the streamed kernel cannot read the weight (K % 256 != 0; 3584 x 2368 at
    # M = 12: 11.4 us against 14.5 for the Triton decode GEMM)
    assert plan(12, 3584, 2368, 132, wide=True) == plan(17, 3584, 2368, 132, wide=True)
    assert plan(16, 4096, 4160, 132, wide=True).family == "wide"
    assert plan(8, 4096, 4160, 132, wide=True).family == "small"
    assert not w4a4_gemm_cuda.preferred(16, 4096, 4096, 132, stream=False)
    for m, n, k in ((17, 8192, 8192), (64, 2048, 4096), (200, 6144, 4096), (256, 4096, 12288)):
        how = wide_plan(m, n, k, 132)
        tiles = -(-m // how.block_m) * -(-n // w4a4_gemm_cuda.WIDE_ROWS)
        assert how.splits == 1 or tiles * how.splits <= 132  # one wave
        in_cluster = how.family == "wide_c2"
        modelled = us(m, n, k, 132, how.block_m, how.splits, in_cluster)
        assert all(modelled <= us(m, n, k, 132, how.block_m, s) for s in range(1, 3))
        assert modelled <= us(m, n, k, 132, how.block_m, 2, cluster=True) or tiles * 2 > 132
    assert wide_plan(64, 8192, 8192, 132, cluster=False) == ("wide", 64, 8, 2, 2, 1)
    assert wide_plan(64, 8192, 8192, 132, 32, cluster=True) == ("wide_c2", 32, 8, 2, 2, 1)
    assert wide_plan(64, 8192, 8192, 132, 32, 3, cluster=True) is None  # a cluster is 2 CTAs
    assert wide_plan(64, 8192, 512, 132, cluster=True) is None  # one fold chunk
    assert wide_plan(64, 8192, 8192, 132, 32, 3) == ("wide", 32, 6, 3, 2, 1)
    assert wide_plan(64, 8192, 8192, 132, 48, 1) is None  # no such tile
    assert wide_plan(64, 8192, 8192, 132, 64, 17) is None  # more splits than fold chunks
    assert wide_plan(64, 8192, 8192 + 64, 132) == ("wide_c2", 64, 9, 2, 2, 1)
    assert wide_plan(64, 8192, 8192 + 8, 132) is None  # K % 16 != 0
    # a workspace split folds by cluster where its tiles fit one wave of clusters of its size
    # (an H100's slots for 2..8 CTAs); other plans, and splits past one wave, stay as they are
    slots, folded = (66, 39, 30, 22, 17, 15, 15), w4a4_gemm_cuda.cluster_folded
    split = wide_plan(64, 3584, 18944, 132)
    assert split == ("wide", 64, 10, 4, 2, 1)  # 28 tiles of 4 CTAs: 30 clusters fit
    assert folded(split, 64, 3584, slots) == ("wide_cf", 64, 10, 4, 2, 1)
    assert plan(64, 3584, 18944, 132, wide=True, clusters=slots).family == "wide_cf"
    assert plan(64, 3584, 18944, 132, wide=True).family == "wide"  # no slots known
    assert folded(split, 64, 3840, slots).family == "wide_cf"  # 30 tiles: the 30 slots
    assert folded(split, 64, 3968, slots) == split  # 31 tiles: past one wave of clusters
    assert folded(split, 64, 3584, slots[:2]) == split  # no slot count for 4-CTA clusters
    for how in (wide_plan(64, 8192, 8192, 132), wide_plan(17, 8192, 8192, 132)):
        assert how.family != "wide" or how.splits == 1
        assert folded(how, 64, 8192, slots) == how
    # the most chunks one CTA runs, as the kernel deals fold chunks (the last one short at
    # K % 512 != 0): 4112 = 8 fold chunks + 16 elements, split 4 ways as 2, 2, 2, 3
    chunks = w4a4_gemm_cuda._wide_cta_chunks
    assert [chunks(4112, s) for s in (1, 2, 3, 4)] == [33, 17, 12, 9]
    assert chunks(1040, 2, cluster=True) == 5 and chunks(8192, 2, cluster=True) == 32
    assert chunks(2304, 4) == 6 and chunks(4096, 3) == 12
    # ... so four splits at M = 16 on 4096 x 4112 (15.9 us against 17.8 for three)
    assert plan(16, 4096, 4112, 132, wide=True) == ("wide", 32, 3, 4, 2, 1)


def test_large_kernel_rule() -> None:
    """Where the Triton kernels serve (on Hopper only where the CUDA C++ kernels are off or cannot
    read the operands): the large-M kernel above M = 512, and above M = 256 where K % 128 != 0
    (there the decode GEMM's 128 x 128 tiles are slowest)."""
    pytest.importorskip("triton")
    from minite_kernels.w4a4_gemm import _large_wanted

    assert not _large_wanted(256, 4112) and _large_wanted(257, 4112) and _large_wanted(384, 1040)
    assert not _large_wanted(512, 4096) and _large_wanted(513, 4096) and not _large_wanted(16, 4112)


def test_decode_gemm_split_rule() -> None:
    """The Triton decode GEMM's automatic split along K: about four programs per SM; MMA-heavy
    tiles only when under-filled; 8-row tiles (grouped decode steps) only where a program is
    spared two fold chunks (H200: 0.78-0.90x the time where this keeps the whole K)."""
    pytest.importorskip("triton")
    from minite_kernels.w4a4_gemm import GROUPED_FEW_ROWS_CONFIG, _splits

    assert GROUPED_FEW_ROWS_CONFIG.block_m == 8
    assert _splits(16, 64, 16, 132) == 9 and _splits(64, 70, 16, 132) == 1
    assert _splits(64, 20, 16, 132) == 27  # an under-filled launch of MMA-heavy tiles
    # Qwen3-30B-A3B experts at one token: 8 routed rows, 128-row weight tiles
    assert _splits(8, 8 * 16, 2, 132) == 1  # 768 -> 2048: a split would spare one fold chunk
    assert _splits(8, 8 * 12, 4, 132) == 4  # 2048 -> 2 x 768: three spared
    assert _splits(8, 16 * 12, 4, 132) == 2  # two tokens: two programs per tile
    assert _splits(8, 32 * 12, 4, 132) == 1  # four tokens: the programs fill the GPU
    assert _splits(8, 8 * 32, 3, 132) == 1  # 1536 -> 4096: two splits spare one chunk


def _unit_pair(w0: int, w1: int) -> list[int]:
    """A canonical code-word pair as the unit layout stores it, bit by bit from
    ``UNIT_CODE_BITS``: stored word h, element e = nibble 4h + e // 2 of canonical word e % 2."""
    from minite_kernels.w4a4_gemm_cuda import UNIT_CODE_BITS

    out = [0, 0]
    for h in range(2):
        for e, bits in enumerate(UNIT_CODE_BITS):
            nibble = ((w0, w1)[e % 2] & 0xFFFFFFFF) >> (4 * (4 * h + e // 2)) & 0xF
            for b, at in enumerate(bits):
                out[h] |= (nibble >> b & 1) << at
    return [v - (1 << 32) if v >> 31 else v for v in out]


def _unit_layout_by_reading_order(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The streamed kernel's unit layout built element by element from what each consumer thread
    reads (the canonical kernel's ``stream_raw``: rows r0 = 16 warp + lane / 4 and r0 + 8, code
    words 2t, 2t + 1, 2t + 8, 2t + 9 and scale blocks t, t + 4 of each 128-element chunk), each
    word pair's bits placed by ``_unit_pair``."""
    n, k = codes.shape[0], codes.shape[1] * 2
    tiles, folds = -(-n // 64), -(-k // 512)
    out = torch.zeros(tiles * folds, 18432, dtype=torch.uint8)
    words, sc = codes.view(torch.int32), scales.view(torch.uint8)
    for tile in range(tiles):
        for fold in range(folds):
            unit = out[tile * folds + fold]
            for c in range(min(4, k // 128 - 4 * fold)):
                ch = 4 * fold + c
                for warp in range(4):
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        rows = [r if r < n else None for r in (64 * tile + 16 * warp + g,) * 2]
                        rows[1] = rows[0] + 8 if rows[0] is not None and rows[0] + 8 < n else None

                        def word(r, j, ch=ch):
                            return 0 if r is None else int(words[r, 16 * ch + j])

                        def scale(r, b, ch=ch):
                            return 0 if r is None else int(sc[r, 8 * ch + b])

                        r0, r1 = rows
                        lo = _unit_pair(word(r0, 2 * t), word(r0, 2 * t + 1))
                        lo += _unit_pair(word(r1, 2 * t), word(r1, 2 * t + 1))
                        hi = _unit_pair(word(r0, 2 * t + 8), word(r0, 2 * t + 9))
                        hi += _unit_pair(word(r1, 2 * t + 8), word(r1, 2 * t + 9))
                        at = (4 * c + warp) * 1024 + 16 * lane
                        unit[at : at + 16] = torch.tensor(lo, dtype=torch.int32).view(torch.uint8)
                        at += 512
                        unit[at : at + 16] = torch.tensor(hi, dtype=torch.int32).view(torch.uint8)
                        at = 16384 + (4 * c + warp) * 128 + 4 * lane
                        s4 = [scale(r0, t), scale(r1, t), scale(r0, t + 4), scale(r1, t + 4)]
                        unit[at : at + 4] = torch.tensor(s4, dtype=torch.uint8)
    return out.reshape(-1)


def test_unit_layout_words_decode_to_the_canonical_pairs() -> None:
    """The unit layout's bit placement and the kernel's ``decode_pair_unit`` agree: emulating its
    pieces (w, w << 6, w rotated left by 10, and w rotated left by 12 or shifted left by 4, each
    under its mask) on every stored word of random codes gives, for each stream p, the BF16 pair
    pattern that ``decode_pair`` builds from the canonical words (code bits 0-2 at 6-8, bit 3 at
    15, word 2t in the low half), before the scale multiply both share."""
    pytest.importorskip("triton")
    from minite_kernels.w4a4_gemm_cuda import unit_code_words

    def rotl(x: int, n: int) -> int:
        return (x << n | x >> (32 - n)) & 0xFFFFFFFF

    def pattern(nibble: int) -> int:
        return (nibble & 7) << 6 | (nibble & 8) << 12

    pair, rot12 = 0x81C081C0, 0x00400040
    g = torch.Generator().manual_seed(11)
    codes = torch.randint(0, 256, (24, 64), dtype=torch.uint8, generator=g)
    codes[0] = 0xFF  # every bit set
    canon = codes.view(torch.int32).tolist()
    stored = unit_code_words(codes, rows=5).view(torch.int32).tolist()
    for row, row_stored in zip(canon, stored, strict=True):
        for j in range(0, len(row), 2):
            w0, w1 = row[j] & 0xFFFFFFFF, row[j + 1] & 0xFFFFFFFF
            for h in range(2):
                w = row_stored[j + h] & 0xFFFFFFFF
                pieces = [w & pair, (w << 6) & pair, rotl(w, 10) & pair]
                pieces += [rotl(w, 12) & rot12 | (w << 4) & pair & ~rot12]
                for i, t in enumerate(pieces):
                    p = 4 * h + i
                    want = pattern(w0 >> (4 * p) & 0xF) | pattern(w1 >> (4 * p) & 0xF) << 16
                    assert t == want, (j, p)


def test_unit_layout_is_the_consumers_reading_order() -> None:
    """The streamed kernel's weight layout (made once per weight) holds exactly the bytes each
    consumer thread reads from the canonical rows, rows past N and chunks past K zero: whole and
    half fold chunks, N not a multiple of 64; rewriting it in place gives the same bytes; bad
    shapes are refused; on the CPU no weight gets one."""
    pytest.importorskip("triton")
    from minite_kernels import w4a4_gemm_cuda

    from minite_common import quantize_nvfp4, with_kernel_layout

    g = torch.Generator().manual_seed(5)
    for n, k in ((64, 512), (100, 768), (130, 1280), (16, 256)):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales = torch.randint(0, 256, (n, k // 16), dtype=torch.uint8, generator=g)
        scales = scales.view(torch.float8_e4m3fn)
        want = _unit_layout_by_reading_order(codes, scales)
        assert torch.equal(w4a4_gemm_cuda.unit_layout(codes, scales), want), (n, k)
        # rewritten in place over another weight's layout (a weight update)
        out = w4a4_gemm_cuda.unit_layout(codes.flip(0), scales.view(torch.uint8).flip(1))
        assert torch.equal(w4a4_gemm_cuda.unit_layout(codes, scales, out=out), want)
    with pytest.raises(ValueError, match="K % 256"):
        w4a4_gemm_cuda.unit_layout(codes[:, :64], scales[:, :8])
    w = quantize_nvfp4(torch.randn(4096, 2048), amax="tensor", block_2d=True)
    assert with_kernel_layout(w) is w and w.kernel_layout is None


# ---- worker side (runs under TRITON_INTERPRET=1) ----


def _inputs(rows: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    magnitude = 10.0 ** (torch.rand(rows, k // 16, 1, generator=g) * 12 - 6)
    x = torch.randn(rows, k, generator=g) * magnitude.repeat_interleave(16, 2).view(rows, k)
    x[torch.rand(rows, k, generator=g) < 0.05] = 0.0
    if rows > 2:
        x[1, 3] = float("nan")
        x[2] = 0.0
    if rows > 4:
        x[4, -1] = float("inf")
    if dtype == torch.float16:
        x = torch.where(torch.isfinite(x), x.clamp(-60000, 60000), x)
    return x.to(dtype)


def _assert_same_bytes(codes, scales, decode, ref) -> None:
    assert torch.equal(codes, ref.codes)
    assert torch.equal(scales.view(torch.uint8), ref.scales.view(torch.uint8))
    assert torch.equal(decode.isnan(), ref.decode_scale.isnan())
    assert torch.equal(decode.nan_to_num(), ref.decode_scale.nan_to_num())


def _check_quantize() -> None:
    from minite_kernels.nvfp4_quantize import quantize_nvfp4_triton

    from minite_common import quantize_nvfp4

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for seed, (rows, k) in enumerate([(1, 16), (5, 48), (33, 272)]):
            x = _inputs(rows, k, seed, dtype)
            for amax, block_2d in (("row", False), ("tensor", False), ("tensor", True)):
                for view in (x, x.t().contiguous().t()):
                    ref = quantize_nvfp4(view, amax=amax, block_2d=block_2d)
                    got = quantize_nvfp4_triton(view, amax=amax, block_2d=block_2d)
                    _assert_same_bytes(*got, ref)
    x = _inputs(33, 64, 9).nan_to_num(0.0, 0.0, 0.0)
    amax = x.abs().amax()
    for g in (amax, amax * 0.01, amax * 1e6, torch.tensor(0.0), torch.tensor(float("inf"))):
        for block_2d in (False, True):
            ref = quantize_nvfp4(x, amax="tensor", block_2d=block_2d, global_amax=g)
            _assert_same_bytes(
                *quantize_nvfp4_triton(x, amax="tensor", block_2d=block_2d, global_amax=g), ref
            )
    rows_amax = x.abs().amax(1) * 0.3
    ref = quantize_nvfp4(x, global_amax=rows_amax)
    _assert_same_bytes(*quantize_nvfp4_triton(x, amax="row", block_2d=False,
                                              global_amax=rows_amax), ref)  # fmt: skip


def _check_quantize_bf16_words() -> None:
    """The BF16 per-row kernel (int32 words, ``_quantize_bf16_rows_kernel``) against the torch
    reference: a row and many rows, K not a power of two, given row amax, NaN/Inf/-0 and
    ties of the E2M1 grid, and views it must decline (odd offset or stride: generic kernel)."""
    import minite_kernels.nvfp4_quantize as q

    from minite_common import quantize_nvfp4

    launched = []
    kernel = q._quantize_bf16_rows_kernel
    q._quantize_bf16_rows_kernel = _Spy(kernel, launched)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) / 6.0
    for seed, (rows, k) in enumerate([(1, 16), (7, 272), (300, 48), (2, 16400)]):
        x = _inputs(rows, k, seed, torch.bfloat16)
        x[0, :8] = (ties * x[0, 8:].float().abs().max()).to(torch.bfloat16)  # near-ties
        x[-1, -2:] = torch.tensor([-0.0, -1e-38])
        ref = quantize_nvfp4(x, amax="row")
        _assert_same_bytes(*q.quantize_nvfp4_triton(x, amax="row", block_2d=False), ref)
        finite = x.float().nan_to_num(0.0, 0.0, 0.0).abs().amax(1)
        for g in (finite * 0.3, finite * 1e6, torch.zeros(rows)):
            ref = quantize_nvfp4(x, global_amax=g)
            got = q.quantize_nvfp4_triton(x, amax="row", block_2d=False, global_amax=g)
            _assert_same_bytes(*got, ref)
    assert len(launched) == 16, len(launched)  # K past the generic kernel's one pass included
    x = _inputs(5, 96, 3, torch.bfloat16)
    odd, even = torch.zeros(5, 97, dtype=torch.bfloat16), torch.zeros(5, 98, dtype=torch.bfloat16)
    odd[:, :96], odd[:, 1:], even[:, :96] = x, x, x
    # odd row stride and odd offset: the generic kernel; an even row stride: words (49 per row)
    for view, words in ((odd[:, :96], False), (odd[:, 1:], False), (even[:, :96], True)):
        ref = quantize_nvfp4(view, amax="row")
        before = len(launched)
        _assert_same_bytes(*q.quantize_nvfp4_triton(view, amax="row", block_2d=False), ref)
        assert len(launched) - before == words


class _Spy:
    """A Triton kernel stand-in that records its launches and forwards them."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def _check_e2m1_rounding() -> None:
    """The integer/magic-number E2M1 rounding (``e2m1_code_rne``, ``e2m1_round_nearest``,
    ``e2m1_round_stochastic``) against the formulas they replaced (kept here as the reference),
    bitwise, on every BF16 value in [0, 6], random float32, the grid's ties and their float32
    neighbours, subnormals, and uniforms at 0, 1 - 2^-24 and exactly at the fractions."""
    import triton
    from e2m1_reference import rounding_kernel

    g = torch.Generator().manual_seed(0)
    bf16 = torch.arange(0, 0x40C1, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.25, 0.75, 1.25, 1.75, 2.5,
                         3.5, 5.0])  # fmt: skip
    near = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    tiny = torch.tensor([1e-45, 1e-40, 1.2e-38, 1e-30])
    a = torch.cat([bf16[bf16 <= 6.0], torch.rand(40000, generator=g) * 6, near, tiny])
    a = a.clamp(0.0, 6.0).contiguous()
    u = (torch.randint(0, 2**24, a.shape, generator=g).float() * 2.0**-24).contiguous()
    u[:3] = torch.tensor([0.0, 1.0 - 2.0**-24, 0.5])
    steps = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    frac = a / steps - torch.floor(a / steps)
    u[-len(near) :] = frac[-len(near) :]  # u exactly at the fraction: the lower neighbour
    out = torch.empty(a.numel(), 6, dtype=torch.int32)
    rounding_kernel[(triton.cdiv(a.numel(), 4096),)](a, u, out, a.numel(), BLOCK=4096)
    for old, new, what in ((0, 1, "code"), (2, 3, "nearest"), (4, 5, "stochastic")):
        bad = (out[:, old] != out[:, new]).nonzero()
        assert bad.numel() == 0, f"{what}: a={a[bad[:5, 0]].tolist()} u={u[bad[:5, 0]].tolist()}"
    assert (out[:, 4] != out[:, 2]).any()  # the stochastic draws do move values


def _check_quantize_two_pass() -> None:
    import minite_kernels.nvfp4_quantize as q

    q._SINGLE_PASS_MAX_K = 16  # force the chunked two-pass row path on small shapes
    from minite_common import quantize_nvfp4

    for rows, k in [(3, 1040), (6, 48), (300, 48)]:  # one row per program; then four
        x = _inputs(rows, k, rows)
        ref = quantize_nvfp4(x, amax="row")
        _assert_same_bytes(*q.quantize_nvfp4_triton(x, amax="row", block_2d=False), ref)


def _check_decode_operand() -> None:
    from minite_kernels.nvfp4_decode import CHUNK, decode_operand

    from minite_common import quantize_nvfp4, unpack_codes
    from minite_common.nvfp4 import E2M1_VALUES

    for rows, k in [(3, 16), (17, 272), (2, 512)]:
        t = quantize_nvfp4(_inputs(rows, k, k).nan_to_num(0.0, 0.0, 0.0))
        got = decode_operand(t.codes, t.scales, use_asm=False)
        values = torch.tensor(E2M1_VALUES)[unpack_codes(t.codes).long()]
        exact = values * t.scales.float().repeat_interleave(16, 1) * 2.0**-7
        padded = -(-k // CHUNK) * CHUNK
        exact = torch.nn.functional.pad(exact, (0, padded - k))
        order = exact.view(rows, padded // CHUNK, CHUNK // 8, 8).transpose(2, 3)  # 8 streams
        assert torch.equal(got.float(), order.reshape(rows, padded))
        assert torch.equal(got.float().signbit(), order.reshape(rows, padded).signbit())


def _reference(a, w, bias=None) -> torch.Tensor:
    from minite_common import dequantize_nvfp4

    y = dequantize_nvfp4(a, torch.float64) @ dequantize_nvfp4(w, torch.float64).T
    return y if bias is None else y + bias.double()


def _assert_close(y: torch.Tensor, ref: torch.Tensor, k: int, a, w) -> None:
    from minite_common import dequantize_nvfp4

    scale = dequantize_nvfp4(a, torch.float64).abs() @ dequantize_nvfp4(w, torch.float64).abs().T
    bound = 4 * (k + 4) * 2.0**-24 * (scale + ref.abs()) + 1e-30
    assert ((y.double() - ref).abs() <= bound).all()


def _check_gemm() -> None:
    from minite_kernels.w4a4_gemm import DecodeConfig, LargeConfig, nvfp4_gemm_sm90

    from minite_common import quantize_nvfp4

    configs = [
        DecodeConfig(64, 16, 4, 1),
        DecodeConfig(64, 32, 4, 1),
        LargeConfig(64, 16, 64, 2, 4, 1),
    ]
    for m, n, k in [(1, 1, 16), (5, 33, 48), (17, 40, 272)]:
        a = quantize_nvfp4(_inputs(m, k, m).nan_to_num(0.0, 0.0, 0.0))
        w = quantize_nvfp4(_inputs(n, k, n + 1).nan_to_num(0.0, 0.0, 0.0), amax="tensor",
                           block_2d=True)  # fmt: skip
        bias = torch.randn(n)
        for cfg in configs:
            for b in (None, bias):
                y = nvfp4_gemm_sm90(a, w, b, torch.float32, config=cfg, use_asm=False)
                _assert_close(y, _reference(a, w, b), k, a, w)
            y16 = nvfp4_gemm_sm90(a, w, bias, torch.bfloat16, config=cfg, use_asm=False)
            assert y16.dtype == torch.bfloat16 and torch.isfinite(y16).all()
    a = quantize_nvfp4(_inputs(4, 32, 1))  # row 1 holds a NaN: its outputs are NaN
    w = quantize_nvfp4(_inputs(8, 32, 2).nan_to_num(0.0, 0.0, 0.0), amax="tensor")
    y = nvfp4_gemm_sm90(a, w, None, torch.float32, config=configs[0], use_asm=False)
    assert y[1].isnan().all() and torch.isfinite(y[[0, 2, 3]]).all()


def _check_split_k() -> None:
    """Split-K programs (chunk partials in a workspace, the tile's last program folds them) give
    bitwise the unsplit kernel's result (same tiles), for every split count; fold chunks of 512
    elements, the last one shorter; the tile counters return to zero."""
    from minite_kernels import w4a4_gemm as g
    from minite_kernels.w4a4_gemm import DecodeConfig, nvfp4_gemm_sm90

    from minite_common import quantize_nvfp4

    m, n, k = 3, 64, 2 * g.FOLD + 48
    a = quantize_nvfp4(_inputs(m, k, 11).nan_to_num(0.0, 0.0, 0.0))
    w = quantize_nvfp4(_inputs(n, k, 12).nan_to_num(0.0, 0.0, 0.0), amax="tensor", block_2d=True)
    base = nvfp4_gemm_sm90(a, w, None, torch.float32, config=DecodeConfig(64, 16, 4, 1, 1),
                           use_asm=False)  # fmt: skip
    _assert_close(base, _reference(a, w), k, a, w)
    for splits in (0, 2, 3):
        for a_decoded in (False, True):  # activation decoded per program, or once up front
            cfg = DecodeConfig(64, 16, 4, 1, splits, a_decoded)
            y = nvfp4_gemm_sm90(a, w, None, torch.float32, config=cfg, use_asm=False)
            assert torch.equal(y, base), cfg
    assert int(g.w4a4_gemm_cuda.split_counters(a.device).abs().sum()) == 0


def _check_grouped() -> None:
    from minite_kernels.w4a4_gemm import (
        DecodeConfig,
        LargeConfig,
        grouped_nvfp4_gemm_sm90,
        nvfp4_gemm_sm90,
    )

    from minite_common import quantize_nvfp4

    g, n, k = 4, 32, 80
    sizes = [0, 3, 17, 1]
    a = quantize_nvfp4(_inputs(sum(sizes), k, 5).nan_to_num(0.0, 0.0, 0.0))
    w = quantize_nvfp4(_inputs(g * n, k, 6).nan_to_num(0.0, 0.0, 0.0), amax="tensor",
                       block_2d=True)  # fmt: skip
    y = grouped_nvfp4_gemm_sm90(a, w, sizes, torch.float32, config=DecodeConfig(64, 16, 4, 1),
                                use_asm=False)  # fmt: skip
    on_device = torch.tensor(sizes)  # the kernel reads the sizes itself (no host tile table)
    y2 = grouped_nvfp4_gemm_sm90(a, w, on_device, torch.float32,
                                 config=DecodeConfig(64, 16, 4, 1, 2), use_asm=False)  # fmt: skip
    assert torch.equal(y, y2)
    # Device sizes are not checked on the host: a negative one counts as 0, and rows past T are
    # neither read nor written (no out-of-bounds access), as host sizes cut at T would give
    for cfg in (DecodeConfig(64, 16, 4, 1, 2), LargeConfig(64, 16, 64, 2, 4, 1)):
        got = grouped_nvfp4_gemm_sm90(a, w, torch.tensor([-5, 2**31 - 1, 17, 1]), torch.float32,
                                      config=cfg, use_asm=False)  # fmt: skip
        cut = grouped_nvfp4_gemm_sm90(a, w, torch.tensor([0, 21, 0, 0]), torch.float32,
                                      config=cfg, use_asm=False)  # fmt: skip
        assert torch.equal(got, cut), cfg
    # The pre-decoded (large) kernel, groups walked on the device, tiles crossing groups and
    # experts: each group's rows as the dense kernel of the same tiles gives them (the
    # interpreter's float32 dot sums a BLOCK_K at once, so compare within one configuration)
    for cfg in (LargeConfig(64, 16, 64, 2, 4, 1), LargeConfig(64, 32, 32, 1, 4, 1)):
        y3 = grouped_nvfp4_gemm_sm90(a, w, on_device, torch.float32, config=cfg, use_asm=False)
        start = 0
        for e, size in enumerate(sizes):
            ae, we = a.narrow_rows(start, size), w.narrow_rows(e * n, n)
            dense = nvfp4_gemm_sm90(ae, we, None, torch.float32, config=cfg, use_asm=False)
            assert torch.equal(y3[start : start + size], dense), (cfg, e)
            start += size
    start = 0
    for e, size in enumerate(sizes):
        if size:
            ae, we = a.narrow_rows(start, size), w.narrow_rows(e * n, n)
            _assert_close(y[start : start + size], _reference(ae, we), k, ae, we)
        start += size


def _k_shard(t, start: int, end: int):
    """Columns [start, end) of an NVFP4Tensor (a row-parallel rank's K slice)."""
    from minite_common.nvfp4 import NVFP4Tensor

    return NVFP4Tensor(
        t.codes[:, start // 2 : end // 2], t.scales[:, start // 16 : end // 16], t.decode_scale,
        torch.Size([t.rows, end - start]), t.dtype, t.block_2d, t.recipe_fingerprint,
    )  # fmt: skip


def _check_partials() -> None:
    """Fold-chunk partials: folded with the epilogue they equal the GEMM bitwise, and K shards
    starting on multiples of FOLD give the full GEMM's partials (the TP-invariant combine)."""
    from minite_kernels.w4a4_gemm import (
        FOLD,
        fold_partials,
        nvfp4_gemm_partials_sm90,
        nvfp4_gemm_sm90,
    )

    from minite_common import quantize_nvfp4

    m, n, k = 3, 64, 3 * FOLD + 48
    a = quantize_nvfp4(_inputs(m, k, 21).nan_to_num(0.0, 0.0, 0.0))
    w = quantize_nvfp4(_inputs(n, k, 22).nan_to_num(0.0, 0.0, 0.0), amax="tensor", block_2d=True)
    bias = torch.randn(n)
    parts = nvfp4_gemm_partials_sm90(a, w, use_asm=False)
    assert parts.shape == (4, m, n)
    # float32 out only: the interpreter truncates to BF16 (the GPU rounds; tests/gpu checks it)
    full = nvfp4_gemm_sm90(a, w, bias, torch.float32, use_asm=False)
    assert torch.equal(
        fold_partials(parts, a.decode_scale, w.decode_scale, bias, torch.float32), full
    )
    cuts = (0, FOLD, 3 * FOLD, k)  # three ranks: 1, 2 and 1 fold chunks
    shards = [
        nvfp4_gemm_partials_sm90(_k_shard(a, s, e), _k_shard(w, s, e), use_asm=False)
        for s, e in zip(cuts[:-1], cuts[1:], strict=True)
    ]
    assert torch.equal(torch.cat(shards), parts)


def _check_swiglu() -> None:
    """The fused SwiGLU kernels' indexing, masks and formulas against the torch composition
    (numpy's exp here, so within one BF16 rounding step; bitwise on the GPU: tests/gpu)."""
    from minite_kernels.swiglu import swiglu_backward, swiglu_forward

    from minite_common.grouped import _ExpertSwiGLU

    for t, f, dtype in ((7, 40, torch.float32), (9, 600, torch.bfloat16), (1, 16, torch.bfloat16)):
        g = torch.Generator().manual_seed(t)
        x = (torch.randn(t, 2 * f, generator=g) * 4).to(dtype)
        probs = torch.rand(t, generator=g)
        grad = torch.randn(t, f, generator=g).to(dtype)
        for p in (None, probs):
            xr = x.clone().requires_grad_()
            pr = probs.clone().requires_grad_()
            act = _ExpertSwiGLU.apply(xr)
            ref = act if p is None else (act * pr.unsqueeze(-1)).to(dtype)
            ref.backward(grad)
            y = swiglu_forward(x, p)
            dx, dp = swiglu_backward(grad, x, p, need_probs_grad=True)
            step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-18
            for got, want in ((y, ref.detach()), (dx, xr.grad)):
                assert got.dtype == dtype and got.shape == want.shape
                diff = (got.float() - want.float()).abs()
                assert bool((diff <= step * (want.float().abs() + 1)).all()), float(diff.max())
                if dtype == torch.bfloat16:  # float32 keeps the exps' last-bit differences
                    assert float((got == want).float().mean()) > 0.97
            if p is None:
                assert dp is None
            else:
                torch.testing.assert_close(dp, pr.grad, rtol=2e-2, atol=1e-3)


if __name__ == "__main__":
    globals()[f"_check_{sys.argv[1]}"]()
    print("ok", sys.argv[1])
