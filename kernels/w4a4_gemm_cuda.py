"""The small-M W4A4 GEMM in CUDA C++ (``w4a4_gemm_sm90a.cu``) for Hopper: the weight decoded
straight into wgmma's register operand, the activation decoded from its codes into shared memory
once per CTA, split K over a thread-block cluster whose first CTA folds the partials from
distributed shared memory. It computes the same bits as the Triton decode GEMM (contract v2 K
order; tests pin this). By default it serves the shapes where it measured faster than the Triton
kernel on the H200 (:func:`preferred`); ``MINITE_CUDA_KERNELS=1`` makes it serve every shape it
supports, ``0`` turns it off; without NVRTC or nvcc the Triton kernel serves everything."""

from __future__ import annotations

import ctypes
import functools

import torch
import triton

from . import cuda_jit
from .nvfp4_decode import CHUNK, code_words

#: Rows (M) up to which the CUDA C++ kernel can serve the dense GEMM.
MAX_M = 16
#: Where it is the default (H200, benchmarks/NOTES_kernels.md): M <= 8 and at most 16 Mi weight
#: elements (Qwen3-30B-A3B's qkv and o: 1.26x and 1.34x cuBLAS at M = 1 against the Triton
#: kernel's 0.95x and 1.27x; on N = K = 8192 the Triton kernel stays ahead).
PREFERRED_MAX_M = 8
PREFERRED_MAX_WEIGHT = 1 << 24
#: Weight rows per CTA (one warpgroup of four warps, 16 rows each).
ROWS = 64
FOLD = 512
_BLOCK_MS = (8, 16)
_SPLITS = (1, 2, 4, 8)
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
#: CTAs per SM the split aims at; shared memory per CTA for its decoded activation slice.
_CTAS_PER_SM = 4
_SMEM_BUDGET = 64 << 10
#: Byte offsets between B's core matrices along K (LBO) and along the rows (SBO).
LBO, SBO = 128, 256


class _Params(ctypes.Structure):
    _fields_ = [
        ("w_words", ctypes.c_void_p),
        ("w_scales", ctypes.c_void_p),
        ("w_dec", ctypes.c_void_p),
        ("a_words", ctypes.c_void_p),
        ("a_scales", ctypes.c_void_p),
        ("a_dec", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("phase_times", ctypes.c_void_p),
        ("stride_ww", ctypes.c_longlong),
        ("stride_ws", ctypes.c_longlong),
        ("stride_aw", ctypes.c_longlong),
        ("stride_as", ctypes.c_longlong),
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


def _kernel_name(bm: int, splits: int, even_k: bool) -> str:
    return f"w4a4_small_m{bm}_s{splits}{'_even_k' if even_k else ''}"


def _kernel_names() -> list[str]:
    return [_kernel_name(b, s, e) for b in _BLOCK_MS for s in _SPLITS for e in (False, True)]


@functools.cache
def _broken(index: int) -> str | None:
    """Why the CUDA C++ kernels cannot run on device ``index`` (None: they can)."""
    try:
        cuda_jit.load("w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index))
    except cuda_jit.CudaJitError as exc:
        return str(exc)
    return None


def serves(a, w, y: torch.Tensor) -> bool:
    """Whether this GEMM goes to the CUDA C++ kernel (the mode, the shape, the device)."""
    mode = cuda_jit.mode()
    if mode == "off" or not supports(a, w, y):
        return False
    if mode == "auto" and (a.rows > PREFERRED_MAX_M or w.rows * w.cols > PREFERRED_MAX_WEIGHT):
        return False
    return available(a.codes.device)


def available(device: torch.device) -> bool:
    """Whether the CUDA C++ small-M GEMM can run on ``device`` (compiled and loaded)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9 and _broken(index) is None


def supports(a, w, y: torch.Tensor) -> bool:
    """Whether these operands fit the kernel (rows, K, alignment, output dtype)."""
    aligned = all(c.stride(0) % 8 == 0 and c.data_ptr() % 8 == 0 for c in (a.codes, w.codes))
    return (
        a.rows <= MAX_M
        and y.dtype in _OUT_KINDS
        and aligned
        and plan(a.rows, w.rows, a.cols, 132) is not None
    )


def block_m(rows: int) -> int:
    return next(bm for bm in _BLOCK_MS if rows <= bm)


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int] | None:
    """(BLOCK_M, fold chunks per CTA, splits: the cluster size) for an M x N x K GEMM on ``sms``
    SMs; None when K is too long for a cluster's shared memory."""
    bm = block_m(m)
    n_folds = triton.cdiv(k, FOLD)
    tiles = triton.cdiv(n, ROWS) * triton.cdiv(m, bm)
    per_cta = _SMEM_BUDGET // (bm * 1024)  # fold chunks whose activation fits one CTA
    wanted = min(triton.cdiv(_CTAS_PER_SM * sms, tiles), n_folds)
    splits = max([s for s in _SPLITS if s <= wanted] + [1])
    while splits <= _SPLITS[-1] and triton.cdiv(n_folds, splits) > per_cta:
        splits *= 2
    if splits > _SPLITS[-1]:
        return None
    return bm, triton.cdiv(n_folds, splits), splits


def gemm(a, w, bias, y: torch.Tensor, sms: int, phase_times=None) -> None:
    """``y = a @ w.T`` with the contract's epilogue (``y`` preallocated [M, N]). ``phase_times``
    (int64 [CTAs, 4], diagnostics): a build that records each CTA's start, staged activation,
    main-loop end and finish on the GPU's global timer."""
    m, n, k = a.rows, w.rows, a.cols
    device = a.codes.device
    bm, per_split, splits = plan(m, n, k, sms)
    ww, aw = code_words(w.codes), code_words(a.codes)
    wdec = w.decode_scale if w.decode_scale.dim() else w.decode_scale.reshape(1)
    adec = a.decode_scale if a.decode_scale.dim() else a.decode_scale.reshape(1)
    bias32 = bias.float().contiguous() if bias is not None else None
    p = _Params(
        ww.data_ptr(), w.scales.data_ptr(), wdec.data_ptr(), aw.data_ptr(), a.scales.data_ptr(),
        adec.data_ptr(), bias32.data_ptr() if bias32 is not None else None, y.data_ptr(),
        phase_times.data_ptr() if phase_times is not None else None,
        ww.stride(0), w.scales.stride(0), aw.stride(0), a.scales.stride(0), y.stride(0),
        y.stride(1), wdec.stride(0) if w.decode_scale.dim() else 0,
        adec.stride(0) if a.decode_scale.dim() else 0,
        m, n, k, per_split, _OUT_KINDS[y.dtype], LBO, SBO,
    )  # fmt: skip
    index = device.index if device.index is not None else torch.cuda.current_device()
    defines = ("MINITE_PHASE_TIMING",) if phase_times is not None else ()
    kernels = cuda_jit.load(
        "w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index), defines
    )
    grid = (triton.cdiv(n, ROWS), splits, triton.cdiv(m, bm))
    kernel = kernels[_kernel_name(bm, splits, k % CHUNK == 0)]
    kernel.launch(grid, 128, per_split * bm * 1024, p, device)
