"""The small-M W4A4 GEMM in CUDA C++ (``w4a4_gemm_sm90a.cu``) for Hopper: the weight decoded
straight into wgmma's register operand, the BF16 activation staged once per CTA in shared memory.
It computes the same bits as the Triton decode GEMM (contract v2 K order; tests pin this), and
serves M up to :data:`MAX_M` when the CUDA C++ kernels are enabled (``MINITE_CUDA_KERNELS=1``)
and available (:mod:`.cuda_jit`). Opt-in for now: on the H200 it is not yet faster than the
Triton kernel (benchmarks/NOTES_kernels.md has the phase timings and what is next)."""

from __future__ import annotations

import ctypes
import functools

import torch
import triton

from . import cuda_jit
from .nvfp4_decode import CHUNK, code_words, decode_operand

#: Rows (M) up to which the CUDA C++ kernel serves the dense GEMM.
MAX_M = 16
#: Weight rows per CTA (one warpgroup of four warps, 16 rows each).
ROWS = 64
FOLD = 512
_BLOCK_MS = (8, 16)
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
#: Shared memory for one CTA's activation slice, and CTAs per SM the split aims at.
_SMEM_BUDGET = 64 << 10
_CTAS_PER_SM = 4
#: Byte offsets between B's core matrices along K (LBO) and along the rows (SBO).
LBO, SBO = 128, 256


class _Params(ctypes.Structure):
    _fields_ = [
        ("w_words", ctypes.c_void_p),
        ("w_scales", ctypes.c_void_p),
        ("w_dec", ctypes.c_void_p),
        ("ad", ctypes.c_void_p),
        ("a_dec", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("partials", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("phase_times", ctypes.c_void_p),
        ("stride_ww", ctypes.c_longlong),
        ("stride_ws", ctypes.c_longlong),
        ("stride_ad", ctypes.c_longlong),
        ("stride_ym", ctypes.c_longlong),
        ("stride_yn", ctypes.c_longlong),
        ("w_dec_stride", ctypes.c_int),
        ("a_dec_stride", ctypes.c_int),
        ("M", ctypes.c_int),
        ("N", ctypes.c_int),
        ("K", ctypes.c_int),
        ("chunks_per_split", ctypes.c_int),
        ("out_kind", ctypes.c_int),
        ("lbo", ctypes.c_uint),
        ("sbo", ctypes.c_uint),
    ]


def _kernel_names() -> list[str]:
    return [f"w4a4_small_m{bm}{suffix}" for bm in _BLOCK_MS for suffix in ("", "_even_k")]


@functools.cache
def _broken(index: int) -> str | None:
    """Why the CUDA C++ kernels cannot run on device ``index`` (None: they can)."""
    try:
        cuda_jit.load("w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index))
    except cuda_jit.CudaJitError as exc:
        return str(exc)
    return None


def available(device: torch.device) -> bool:
    """Whether the CUDA C++ small-M GEMM serves ``device`` (enabled, compiled and loaded)."""
    if not cuda_jit.enabled() or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9 and _broken(index) is None


def supports(a, w, y: torch.Tensor) -> bool:
    """Whether these operands fit the kernel (rows, alignment, output dtype)."""
    ww = w.codes
    return (
        a.rows <= MAX_M
        and y.dtype in _OUT_KINDS
        and ww.stride(0) % 8 == 0
        and ww.data_ptr() % 8 == 0
        and ww.stride(1) == 1
    )


def block_m(rows: int) -> int:
    return next(bm for bm in _BLOCK_MS if rows <= bm)


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, fold chunks per CTA, splits) for an M x N x K GEMM on ``sms`` SMs."""
    bm = block_m(m)
    n_folds = triton.cdiv(k, FOLD)
    tiles = triton.cdiv(n, ROWS) * triton.cdiv(m, bm)
    by_smem = max(1, _SMEM_BUDGET // (FOLD * bm * 2))
    wanted = max(1, triton.cdiv(_CTAS_PER_SM * sms, tiles))
    per_split = max(triton.cdiv(n_folds, wanted), triton.cdiv(n_folds, by_smem * wanted), 1)
    per_split = min(per_split, by_smem, n_folds)
    return bm, per_split, triton.cdiv(n_folds, per_split)


def gemm(
    a, w, bias, y: torch.Tensor, sms: int, counters_for, use_asm: bool, phase_times=None
) -> None:
    """``y = a @ w.T`` with the contract's epilogue (``y`` preallocated [M, N]). ``phase_times``
    (int64 [CTAs, 4], diagnostics): a build that records each CTA's start, staged activation,
    main-loop end and finish on the GPU's global timer."""
    m, n, k = a.rows, w.rows, a.cols
    device = a.codes.device
    bm, per_split, splits = plan(m, n, k, sms)
    ad = decode_operand(a.codes, a.scales, use_asm=use_asm)
    ww = code_words(w.codes)
    wdec = w.decode_scale if w.decode_scale.dim() else w.decode_scale.reshape(1)
    adec = a.decode_scale if a.decode_scale.dim() else a.decode_scale.reshape(1)
    bias32 = bias.float().contiguous() if bias is not None else None
    if splits > 1:
        partials = torch.empty(triton.cdiv(k, FOLD), m, n, dtype=torch.float32, device=device)
        counters = counters_for(device)
    else:
        partials = counters = None
    p = _Params(
        ww.data_ptr(), w.scales.data_ptr(), wdec.data_ptr(), ad.data_ptr(), adec.data_ptr(),
        bias32.data_ptr() if bias32 is not None else None, y.data_ptr(),
        partials.data_ptr() if partials is not None else None,
        counters.data_ptr() if counters is not None else None,
        phase_times.data_ptr() if phase_times is not None else None,
        ww.stride(0), w.scales.stride(0), ad.stride(0), y.stride(0), y.stride(1),
        wdec.stride(0) if w.decode_scale.dim() else 0,
        adec.stride(0) if a.decode_scale.dim() else 0,
        m, n, k, per_split, _OUT_KINDS[y.dtype], LBO, SBO,
    )  # fmt: skip
    index = device.index if device.index is not None else torch.cuda.current_device()
    defines = ("MINITE_PHASE_TIMING",) if phase_times is not None else ()
    kernels = cuda_jit.load(
        "w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index), defines
    )
    name = f"w4a4_small_m{bm}{'_even_k' if k % CHUNK == 0 else ''}"
    smem = per_split * (FOLD // CHUNK) * 8 * bm * 32
    smem = min(smem, triton.cdiv(ad.shape[1], CHUNK) * 8 * bm * 32)
    grid = (triton.cdiv(n, ROWS), splits, triton.cdiv(m, bm))
    kernels[name].launch(grid, 128, smem, p, device)
