"""The W4A4 GEMM in CUDA C++ (``w4a4_gemm_sm90a.cu``) for Hopper at small, mid and wide M: small and
mid M decode the weight straight into wgmma's register operand (small M, streamed: a persistent grid
over (64 weight rows, 512-element fold chunk) units, a producer warpgroup filling a ring with the
weight and the decoded activation slice, or in ``w4a4_linear`` at 8 < M <= 16 with the block of an
activation image quantized by the launch before, consumer warpgroups running the chains, the
partials folded in order by the tile's last warpgroup; small M, clustered: the activation decoded
from its codes into shared memory, split K over a thread-block cluster whose first CTA folds the
partials from distributed shared memory; mid M: the activation decoded once by a first launch and
streamed through a ring); wide M is warp-specialized (producer warpgroups decode the weight into
shared memory and bulk-copy the decoded activation, consumer warpgroups run wgmma with both operands
in shared memory) or, the default at 16 < M <= 1536 (1024 where K <= 1024), register-A (a
producer warpgroup stages 128 weight rows' codes and the decoded activation, two consumer
warpgroups decode the codes into wgmma fragments; K split over fold chunks by a time model, through
a float32 workspace, over a two-CTA cluster whose second CTA hands each fold chunk's partial to the
first by bulk copy between their shared memories, or stream-K where the tiles outnumber the SMs:
one CTA per SM, the last waves' tiles shared as (tile, fold chunk) ranges that pass on a prefix).
On weights below ``STREAM_MIN_WEIGHT`` the mid-M and register-A defaults start at M = 9. It computes
the same bits as the Triton decode GEMM (contract v2 K order; tests pin this). By default it serves
the shapes where it measured faster than the Triton kernel on the H200 (:func:`serves`);
``MINITE_CUDA_KERNELS=1`` makes it serve every shape it supports, ``0`` turns it off; without NVRTC
or nvcc the Triton kernel serves everything."""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch
import triton

from . import cuda_jit
from .nvfp4_decode import CHUNK, code_words

#: Rows (M) up to which the small- and mid-M kernels serve the dense GEMM (small-M up to 16; the
#: wide-M kernel up to WS_MAX_M).
MAX_M = 256
SMALL_MAX_M = 16
#: Where the small-M kernel is the default (H200, benchmarks/NOTES_kernels.md): M <= 8 and at
#: most 16 Mi weight elements (Qwen3-30B-A3B's qkv and o: 1.26x and 1.34x cuBLAS at M = 1 against
#: the Triton kernel's 0.95x and 1.27x; on N = K = 8192 the Triton kernel stays ahead).
PREFERRED_MAX_M = 8
PREFERRED_MAX_WEIGHT = 1 << 24
#: Where the mid-M kernel is (it never splits K, so it needs a grid that covers the GPU):
#: 16 < M <= 32 with at least two CTAs per SM, 32 < M <= 64 with 0.7 to 2 per SM, every
#: 64 < M <= 128 (1.2-3.2x faster than the Triton kernel on all seven measured Qwen3 / square
#: shapes), 128 < M <= 256 while its CTAs fit one wave (two per SM).
#: Weight rows per CTA (one warpgroup of four warps, 16 rows each).
ROWS = 64
FOLD = 512
_BLOCK_MS = (8, 16)
_MID_BLOCK_MS = (32, 64)
_SPLITS = (1, 2, 4, 8)
_OUT_KINDS = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
#: CTAs per SM the small-M split aims at; shared memory per CTA for its decoded activation slice.
_CTAS_PER_SM = 4
_SMEM_BUDGET = 64 << 10
#: Decoded activation chunks in a mid-M CTA's ring (``RING`` in the CUDA source).
_RING = 4
#: Byte offsets between B's core matrices along K (LBO) and along the rows (SBO).
LBO, SBO = 128, 256
#: Wide-M kernels (``WS_KERNEL`` in the CUDA source): (batch rows per CTA, consumer warpgroups,
#: producer warpgroups); a stage holds a decoded 64 x 128 weight chunk and an activation chunk,
#: as many stages as fit ``_WS_RING_BYTES`` (at most 8; ``WsShape`` in the CUDA source).
_WS_BLOCK_MS = (128, 256)
_WS_WEIGHT_CHUNK = ROWS * 256
_WS_RING_BYTES = 204800
#: Measured time of one wide-M CTA per batch tile (N = K = 8192, H200), for the tile choice; per
#: 128-element chunk (the CTA time / 64) and a fixed cost for comparing with the register-A
#: kernel on its model's scale, where they compete (short K): 3.7 us, the median that the fit
#: set's K = 2048 points imply (3.3-3.9 on the other sets' at K = 1024-2048; H200, gemm_rows). With
#: 3 us the comparison picked this kernel at K = 1024 by 0.1 us modelled, 5120 x 1024 at M = 128:
#: 11.5 us measured against 10.8 for the unsplit 64-row wide plan; on five shapes not used to set
#: it (K = 512-1024) the wide plans it now picks instead ran 0.83-0.98x its time.
_WS_CTA_US = {64: 37.0, 128: 47.0, 256: 80.0}
_WS_CHUNK_US = {b: us / 64 for b, us in _WS_CTA_US.items()}
_WS_OVERHEAD_US = 3.7
#: The wide-M kernel also serves 256 < M <= WS_MAX_M where K >= _WS_WIDE_MIN_K.
WS_MAX_M = 1024
#: The Triton large-M kernel's tile (weight rows, tokens: ``w4a4_gemm.LARGE_CONFIG``), and the M
#: above which it takes over from the wide-M kernel where its grid fills the waves.
LARGE_TILE = (128, 256)
LARGE_OVER_WS_M = 896
_WS_WIDE_MIN_K = 4096
#: Streamed small-M kernels (``STREAM_KERNEL`` in the CUDA source): batch rows per CTA, consumer
#: warpgroups; ring stages of one unit (64 weight rows x 512 K: codes in rows padded to 288 bytes,
#: scales, the activation's K slice decoded), as many as fit the ring (at most 7).
_STREAM_BLOCK_MS = (8, 16)
_STREAM_WARPGROUPS = (2, 3)
#: Where the streamed kernel is the default: M <= 16 and at least this many weight elements (on
#: the H200 it was 1.1-1.7x the previous default from N = 2048, K = 4096 up, except N = K = 8192
#: and 6144 x 4096 at M = 16, 4-6% slower; below, 1536 x 2048 and 2048 x 768 lost at M = 1).
STREAM_MIN_WEIGHT = 1 << 23
#: Below that weight, 8 < M <= 16 takes the image families' plan for 16 < M <= 32 (32-row
#: tiles, :func:`_image_low_m`): on the H200 the Triton decode GEMM after the quantizer, the
#: previous default there, took 1.18-1.85x the time of these plans in `w4a4_linear` (22 weights of
#: 0.4-7.3 Mi elements, M = 9 / 16; benchmarks/NOTES_kernels.md, twentieth session).
IMAGE_MIN_M = 8
#: The streamed kernel's ring: a multiple of its consumer warpgroups (2, 3), one per stage
#: (``StreamShape::STAGES`` in the CUDA source says why).
_STREAM_STAGES = 6
#: The streamed kernel's batch tile that has an image-reading variant (w4a4_linear, 8 < M <= 16).
_STREAM_IMAGE_BLOCK_M = 16
#: The streamed kernel's rows variant (``w4a4_stream_rows_*``): the kernel quantizes BF16 rows
#: itself (M <= 8), at most this many elements (M x K), into shared memory beside its ring
#: (``STREAM_QROWS_MAX``, ``STREAM_QROWS_BYTES`` in the CUDA source). ``w4a4_linear`` takes it at
#: M = 1 only: there it ran 0.99-1.18x the separate quantizer's two launches at K <= 4096 (five
#: shapes), but 0.85-0.89x at K = 8192-17408 and 0.49-0.96x at M = 2-8 (each consumer thread
#: quantizes its blocks one after another before the first unit; H100, benchmarks/RESULTS.md).
STREAM_QUANT_MAX = 4096
_STREAM_QUANT_BYTES = 3440
#: The streamed kernel's ring of per-CTA-part arrival counters (``STREAM_PART_SLOTS`` ints).
_STREAM_PART_BYTES = 128
#: Bytes of one unit in the streamed kernel's unit layout (:func:`unit_layout`).
UNIT_BYTES = 18432
#: Wide-M kernels with register A (``WIDE_KERNEL`` in the CUDA source): batch rows per CTA; 128
#: weight rows per CTA (two consumer warpgroups), a stage per 128-element chunk (the rows' codes
#: and scales, WIDE_ROW_BYTES each, and the activation image's block), as many as fit the ring
#: (at most 8); split K over fold chunks where the grid would leave SMs idle.
_WIDE_BLOCK_MS = (32, 64, 128)
#: The register-A wide kernel is the default up to this M (where it reads the operands): above
#: M = 256 its modelled plan (mostly unsplit 128-row tiles) ran 0.92-2.09x the speed (geometric
#: mean 1.24x; faster on 52 of 54 points) of the previous defaults (the warp-specialized kernel at
#: K >= 4096, else the Triton decode GEMM up to M = 512 and the large-M kernel above) on nine
#: shapes at M = 288-1024; the two losses, to the large-M kernel at M = 1024, were 8% and 1%
#: (8192 x 1024, 7168 x 2048). With the stream-K variant, 1.07-1.5x the large-M kernel's speed at
#: M = 1100 on eight shapes, and at M = 1536 0.99-1.62x on the seven with K > 1024 (0.83x on
#: 8192 x 1024); mixed at 2048 (0.96-1.58x), slower at 4096 but on narrow weights (H200,
#: benchmarks/NOTES_kernels.md, 23rd session). At K <= 1024 (two fold chunks) it stops at 1024.
WIDE_MAX_M = 1536
WIDE_SHORT_K_MAX_M = 1024
WIDE_ROWS = 128
_WIDE_ROW_BYTES = 96
_WIDE_RING_BYTES = 204800
#: The two-CTA-cluster wide kernel's ring and partial slots (``WideShape<BN, 2>``).
_WIDE_C2_BYTES = 225280
_WIDE = ("wide", "wide_c2", "wide_sk", "wide_cf")
#: The wide kernels' time model (H200, graph replay; fitted to 90 measured (shape, tile, split)
#: points of seven shapes; the per-chunk costs of 64 and 128 refitted to 27 points after two
#: chains in flight): per 128-element chunk of a CTA, per batch tile (us); the epilogue; with
#: split K through the workspace a fold overhead, a cost per MB of one tile's partials (its last
#: CTA reads them back in chunk order, alone: ~110 GB/s) and per MB of all partials. The split
#: terms were refitted to 109 split points of ten shapes (benchmarks/NOTES_kernels.md,
#: eighteenth session): a total-MB term alone modelled half the split's cost at long K
#: (3584 x 18944, M = 128, four splits of 128-row tiles: 62 us modelled, 84 measured).
_WIDE_CHUNK_US = {32: 0.57, 64: 0.62, 128: 0.82}
_WIDE_EPILOGUE_US = {32: 3.0, 64: 4.0, 128: 6.0}
_WIDE_FOLD_US, _WIDE_TILE_FOLD_US_PER_MB, _WIDE_PARTIAL_US_PER_MB = 2.4, 9.2, 0.6
#: The two-CTA-cluster variant (``wide_c2``; fitted to 14 measured (shape, tile) points on one
#: wave, within 0.93-1.06x of them): a start-up and a cost per partial handed over, by tile.
_WIDE_C2_US, _WIDE_C2_HAND_OVER_US = 1.1, {32: 0.43, 64: 0.73, 128: 1.35}
#: The stream-K variant (``wide_sk``): a cost per segment (a tile's part) of a CTA's range: the
#: output or prefix store and the ring's restart on another tile; and a factor per batch tile:
#: against the whole-tile plans it replaced, it ran 5% (64-row tiles, 7 points) and 2.5% (128-row,
#: 41 points) slower than modelled on average (H200, benchmarks/NOTES_kernels.md, 23rd session).
_WIDE_SK_SEGMENT_US = 0.8
_WIDE_SK_FACTOR = {32: 1.05, 64: 1.05, 128: 1.02}
#: Split-K tile counters per (device, stream); a launch with more tiles does not split.
MAX_SPLIT_TILES = 1 << 16


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
        ("a_image", ctypes.c_void_p),
        ("a_chunks", ctypes.c_int),
        ("partials", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
        ("w_scales_src", ctypes.c_void_p),
        ("stride_ws_src", ctypes.c_longlong),
        ("pass_ctas", ctypes.c_int),
    ]


class Plan(NamedTuple):
    """How one GEMM runs: the kernel family, batch rows per CTA, fold chunks per CTA, the split
    count (the cluster size, small M), the (consumer) warpgroups per CTA (mid M, wide M) and the
    producer warpgroups (wide M)."""

    # "small", "mid", "ws" / "wide" (wide M: shared / register A; "wide_c2": register A, K split
    # over a two-CTA cluster; "wide_sk": register A, stream-K over ``splits`` CTAs; "wide_cf":
    # the "wide" kernel with its ``splits`` (2-8) CTAs of a tile launched as a cluster, which
    # fold the tile's partials together, each its share of the batch rows), "stream" (small M)
    family: str
    block_m: int
    per_split: int
    splits: int
    warpgroups: int = 1
    producers: int = 0

    def kernel_name(self, even_k: bool, units: bool = False, rows: bool = False) -> str:
        """The CUDA kernel's name (``even_k``: K % 128 == 0, and for the register-A wide kernels
        rows of codes and scales that 16- and 8-byte copies can read, :func:`_wide_even`; the
        streamed kernel has one variant per weight layout, ``units``: :func:`unit_layout`, its K
        a multiple of 256, and with the unit layout ones given the activation as BF16 ``rows``:
        at 16-row tiles reading the decoded image the launch before made of them, at 8-row tiles
        quantizing them itself)."""
        if self.family == "stream":
            if rows and not units:
                raise ValueError("the streamed kernel reads BF16 rows only beside units")
            kind = "rows_" if self.quantizes_rows(True) else "image_"
            layout = kind if rows else "unit_" if units else ""
            return f"w4a4_stream_{layout}m{self.block_m}_w{self.warpgroups}"
        if self.family in _WIDE:
            family = "wide" if self.family == "wide_cf" else self.family
            return f"w4a4_{family}_n{self.block_m}{'_even_k' if even_k else ''}"
        if self.family == "small":
            shape = f"small_m{self.block_m}_s{self.splits}"
        elif self.family == "mid":
            shape = f"mid_m{self.block_m}_w{self.warpgroups}"
        else:
            shape = f"ws_n{self.block_m}_c{self.warpgroups}_p{self.producers}"
        return f"w4a4_{shape}{'_even_k' if even_k else ''}"

    def threads(self) -> int:
        if self.family in ("stream", *_WIDE):  # and one producer warpgroup
            return 128 * (self.warpgroups + 1)
        return 128 * (self.warpgroups + self.producers)

    def quantizes_rows(self, rows: bool) -> bool:
        """Whether this plan's kernel, given the activation as BF16 ``rows``, quantizes them
        itself (the streamed kernel's 8-row rows variant) instead of reading the image an
        activation pass made."""
        return rows and self.family == "stream" and self.block_m != _STREAM_IMAGE_BLOCK_M

    def smem(self, rows: bool = False) -> int:
        """Dynamic shared memory per CTA (bytes; ``rows`` as for :meth:`kernel_name`)."""
        if self.family == "small":
            return self.per_split * self.block_m * 1024
        if self.family == "stream":  # stages (weight tile, decoded activation), barriers, flags
            # (the canonical layout's stage pads rows of codes to 288 bytes; the unit layout's is
            # 2 KB smaller); the rows variant's codes of the rows; the part counters
            stage = ROWS * (288 + 32) + self.block_m * 1024
            quant = _STREAM_QUANT_BYTES if self.quantizes_rows(rows) else 0
            return _STREAM_STAGES * (stage + 16) + 16 + quant + _STREAM_PART_BYTES
        if self.family in _WIDE:  # stages (weight codes, activation chunk), barriers, a flag;
            # a cluster's partial slots and their barriers; stream-K's 16-bit output tile
            # (WideShape)
            stage = WIDE_ROWS * _WIDE_ROW_BYTES + self.block_m * 256
            slots = 0 if self.family != "wide_c2" else 1 if self.block_m >= 128 else 2
            slot = self.block_m * 512
            ring = _WIDE_RING_BYTES if not slots else _WIDE_C2_BYTES - slots * slot
            out = self.block_m * (WIDE_ROWS * 2 + 16) if self.family == "wide_sk" else 0
            return min(8, ring // stage) * (stage + 16) + 16 + slots * (16 + slot) + out
        if self.family == "ws":  # the ring's stages (weight + activation chunk) and 2 barriers each
            stage = _WS_WEIGHT_CHUNK + self.block_m * 256
            stages = min(8, _WS_RING_BYTES // stage)
            return stages * (stage + 16)
        # each warpgroup's ring of decoded activation chunks; with two, two exchange buffers of
        # both warpgroups' partials
        chunks = self.warpgroups * _RING + (4 if self.warpgroups == 2 else 0)
        return chunks * self.block_m * 256


#: Every wide-M kernel, (batch rows per CTA, consumer, producer warpgroups).
WS_PLANS = (Plan("ws", 64, 1, 1, 1, 2), Plan("ws", 128, 1, 1, 2, 2), Plan("ws", 256, 1, 1, 2, 1))


def _kernel_names() -> list[str]:
    small = [Plan("small", b, 1, s) for b in _BLOCK_MS for s in _SPLITS]
    mid = [Plan("mid", b, 1, 1, w) for b in _MID_BLOCK_MS for w in (1, 2)]
    gemms = [p.kernel_name(e) for p in small + mid + list(WS_PLANS) for e in (False, True)]
    gemms += [
        Plan("stream", b, 1, 1, w).kernel_name(True, units)
        for b in _STREAM_BLOCK_MS
        for w in _STREAM_WARPGROUPS
        for units in (False, True)
    ]
    wides = [Plan(f, b, 1, 1, 2) for b in _WIDE_BLOCK_MS for f in _WIDE if f != "wide_cf"]
    gemms += [p.kernel_name(e) for p in wides for e in (False, True)]
    gemms += [
        Plan("stream", b, 1, 1, w).kernel_name(True, True, rows=True)
        for b in _STREAM_BLOCK_MS
        for w in _STREAM_WARPGROUPS
    ]
    image_ms = (_STREAM_IMAGE_BLOCK_M, *_MID_BLOCK_MS, *_WS_BLOCK_MS)
    passes = [f"w4a4_decode_act_m{b}" for b in image_ms[1:]]
    return gemms + passes + [f"w4a4_quantize_act_m{b}" for b in image_ms]


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
    ws, streamed, wide = ws_fits(w), stream_fits(a, w), wide_fits(a, w)
    if cuda_jit.mode() == "off" or not supports(a, w, y, ws, streamed, wide):
        return False
    return _chosen(a.rows, w, a.codes.device, ws, streamed, wide)


def _chosen(m: int, w, device: torch.device, ws: bool, streamed: bool, wide: bool) -> bool:
    """For an M-row GEMM against ``w`` that the kernels can serve: whether the mode sends it to
    them (not off; the kernels loaded on ``device``; ``auto``: where :func:`preferred`)."""
    mode = cuda_jit.mode()
    if mode == "off" or not available(device):
        return False
    return mode == "on" or preferred(m, w.rows, w.cols, _sms(device), ws, streamed, wide)


def preferred(
    m: int, n: int, k: int, sms: int, ws: bool = True, stream: bool = True, wide: bool = True
) -> bool:
    """Whether an M x N x K GEMM measured faster here than in the Triton kernel (the ``auto``
    mode's choice; ``ws`` / ``stream`` / ``wide``: the warp-specialized wide-M / streamed /
    register-A wide-M kernel can read the operands; H200 figures in
    benchmarks/NOTES_kernels.md)."""
    if stream and _stream_wanted(m, n, k):
        return True
    if wide and _wide_operands_default(m, n, k, sms) is not None:
        return True
    if m <= PREFERRED_MAX_M:
        return n * k <= PREFERRED_MAX_WEIGHT
    if m > MAX_M:
        return ws and _ws_wide_serves(m, k) and not _large_fills_waves(m, n, sms)
    if m <= SMALL_MAX_M:
        return False
    if ws and k % 32 == 0 and _ws_wanted(m, n, sms):
        return True
    ctas = triton.cdiv(m, 32 if m <= 32 else 64) * triton.cdiv(n, ROWS)
    if m <= 32:
        return ctas >= 2 * sms
    if m <= 64:
        return 7 * sms <= 10 * ctas <= 20 * sms
    return m <= 128 or ctas <= 2 * sms


def _sms(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _cluster_slots(index: int) -> tuple[int, ...]:
    try:
        kernels = cuda_jit.load("w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index))
        return tuple(
            min(
                kernels[how.kernel_name(True)].max_active_clusters(
                    how.threads(), how.smem(), size, index
                )
                for how in (Plan("wide_cf", b, 1, size, 2, 1) for b in _WIDE_BLOCK_MS)
            )
            for size in range(2, 9)
        )
    except cuda_jit.CudaJitError:  # the kernels do not load: no clustered plans
        return ()


def cluster_slots(device: torch.device) -> tuple[int, ...]:
    """How many clusters of 2, 3, ..., 8 register-A wide-M CTAs ``device`` holds at once (its
    GPCs' SMs decide: an H100 holds 66, 39, 30, 22, 17, 15, 15), the least over the batch tiles;
    cached per device; () where the kernels or the query fail."""
    return _cluster_slots(device.index if device.index is not None else torch.cuda.current_device())


def available(device: torch.device) -> bool:
    """Whether the CUDA C++ small-M GEMM can run on ``device`` (compiled and loaded)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] == 9 and _broken(index) is None


def supports(
    a,
    w,
    y: torch.Tensor,
    ws: bool | None = None,
    streamed: bool | None = None,
    wide: bool | None = None,
) -> bool:
    """Whether these operands fit the kernel (rows, K, alignment, output dtype; ``ws`` /
    ``streamed`` / ``wide``: the results of :func:`ws_fits` / :func:`stream_fits` /
    :func:`wide_fits`, computed when None)."""
    aligned = _rows_8b(a.codes) and _rows_8b(w.codes)
    ws = ws_fits(w) if ws is None else ws
    streamed = stream_fits(a, w) if streamed is None else streamed
    wide = wide_fits(a, w) if wide is None else wide
    how = plan(a.rows, w.rows, a.cols, 132, ws=ws, stream=streamed, wide=wide)
    return y.dtype in _OUT_KINDS and aligned and how is not None


def ws_fits(w) -> bool:
    """Whether the wide-M kernel can read this weight: 16-byte rows of codes (K % 32 == 0, aligned
    storage) and 2-byte pairs of scales."""
    codes, scales = w.codes, w.scales
    return (
        w.cols % 32 == 0
        and codes.data_ptr() % 16 == 0
        and codes.stride(0) % 16 == 0
        and scales.data_ptr() % 2 == 0
        and scales.stride(0) % 2 == 0
    )


def stream_fits(a, w) -> bool:
    """Whether the streamed small-M kernel can read these operands: 16-byte copies of whole
    256-element K slices (K % 256 == 0; codes and scales 16-byte aligned, rows too) and a
    tile counter per 64 weight rows."""
    return _stream_weight_fits(w) and all(_rows_16b(t) for t in (a.codes, a.scales))


def _rows_8b(codes: torch.Tensor) -> bool:
    """Whether rows of uint8 ``codes`` start 8-byte aligned (the kernels' code-word pairs)."""
    return codes.stride(0) % 8 == 0 and codes.data_ptr() % 8 == 0


def _rows_16b(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(1) == 1


def _stream_weight_fits(w) -> bool:
    return (
        w.cols % 256 == 0
        and triton.cdiv(w.rows, ROWS) <= MAX_SPLIT_TILES
        and _rows_16b(w.codes)
        and _rows_16b(w.scales)
    )


def wide_fits(a, w) -> bool:
    """Whether the register-A wide-M kernel can read these operands: K % 16 == 0, 8-byte aligned
    rows of codes, unit column strides, and a tile counter per (batch tile, 128 weight rows). Its
    ``_even_k`` variants read K % 128 == 0 with 16- and 8-byte copies (:func:`_wide_even`); the
    others any such K, the last chunk's codes zero-filled and the scales read from a copy in rows
    of whole chunks, zero-padded, that extra CTAs of the activation pass before write."""
    return _wide_weight_fits(a.rows, w)


def _wide_weight_fits(m: int, w) -> bool:
    return (
        w.cols % 16 == 0
        and _wide_tiles(m, w.rows, 32) <= MAX_SPLIT_TILES
        and _rows_8b(w.codes)
        and w.codes.stride(1) == 1
        and w.scales.stride(1) == 1
    )


def _wide_even(w) -> bool:
    """Whether the register-A wide kernel's ``_even_k`` variant reads ``w``: whole 128-element
    chunks (K % 128 == 0), 16-byte aligned rows of codes, 8-byte aligned rows of scales."""
    scales = w.scales
    return (
        w.cols % CHUNK == 0
        and _rows_16b(w.codes)
        and scales.data_ptr() % 8 == 0
        and scales.stride(0) * scales.element_size() % 8 == 0
    )


def _wide_tiles(m: int, n: int, block_m: int) -> int:
    """The register-A wide kernels' output tiles: ``block_m`` batch rows x 128 weight rows."""
    return triton.cdiv(m, block_m) * triton.cdiv(n, WIDE_ROWS)


def _wide_cta_chunks(k: int, splits: int, cluster: bool = False) -> int:
    """The most 128-element chunks one CTA of a K split runs, as the wide kernel deals fold
    chunks: split z takes fold chunks ``[z * F // splits, (z + 1) * F // splits)``, a cluster's
    CTA z every other one from z; K's last fold chunk is short where K % 512 != 0."""
    n_folds, per_fold = triton.cdiv(k, FOLD), FOLD // CHUNK
    last = triton.cdiv(k, CHUNK) - (n_folds - 1) * per_fold  # the last fold chunk's chunks
    folds = (
        [range(z, n_folds, 2) for z in range(2)]
        if cluster
        else [range(z * n_folds // splits, (z + 1) * n_folds // splits) for z in range(splits)]
    )
    return max(sum(last if f == n_folds - 1 else per_fold for f in fs) for fs in folds)


def wide_us(
    m: int, n: int, k: int, sms: int, block_m: int, splits: int, cluster: bool = False
) -> float:
    """The register-A wide-M kernel's modelled time (us) for a plan (``_WIDE_CHUNK_US``);
    ``cluster``: K split over two-CTA clusters (``splits`` 2, one wave of CTAs) instead of over
    CTAs that fold through a workspace (``wide_cf`` as ``wide``: at most its time, see
    :func:`cluster_folded`)."""
    tiles = _wide_tiles(m, n, block_m)
    n_folds = triton.cdiv(k, FOLD)
    t = triton.cdiv(tiles * splits, sms) * _wide_cta_chunks(k, splits, cluster)
    t *= _WIDE_CHUNK_US[block_m]
    t += _WIDE_EPILOGUE_US[block_m]
    if cluster:  # the second CTA hands each of its fold chunks' partials to the first
        t += _WIDE_C2_US + _WIDE_C2_HAND_OVER_US[block_m] * (n_folds // 2)
    elif splits > 1:  # split 0 keeps its prefix; the others write every fold chunk's partial
        tile_mb = (n_folds - n_folds // splits) * WIDE_ROWS * block_m * 4 / 1e6
        t += _WIDE_FOLD_US + (_WIDE_TILE_FOLD_US_PER_MB + _WIDE_PARTIAL_US_PER_MB * tiles) * tile_mb
    return t


def _sk_waves(tiles: int, ctas: int) -> int:
    """The stream-K variant's waves of whole tiles: all but the last one or two waves' worth, whose
    tiles (at least ``ctas``) the CTAs share by fold chunks."""
    return tiles // ctas if tiles % ctas == 0 else max(tiles // ctas - 1, 0)


def wide_sk_us(m: int, n: int, k: int, sms: int, block_m: int) -> float:
    """The stream-K variant's modelled time (us) on ``sms`` CTAs (for more tiles than SMs): the
    most chunks one CTA runs (whole tiles, then its share of the rest's fold chunks at their
    average chunks), the wide kernel's costs per chunk and launch, and a cost per segment
    (:data:`_WIDE_SK_SEGMENT_US`)."""
    tiles = _wide_tiles(m, n, block_m)
    n_folds, k_chunks = triton.cdiv(k, FOLD), triton.cdiv(k, CHUNK)
    waves = _sk_waves(tiles, sms)
    units = triton.cdiv((tiles - waves * sms) * n_folds, sms)  # shared fold chunks per CTA
    chunks = waves * k_chunks + triton.cdiv(units * k_chunks, n_folds)
    segments = waves + triton.cdiv(units, n_folds) + 1
    t = chunks * _WIDE_CHUNK_US[block_m] + _WIDE_EPILOGUE_US[block_m]
    return (t + segments * _WIDE_SK_SEGMENT_US) * _WIDE_SK_FACTOR[block_m]


def _wide_plan_us(m: int, n: int, k: int, sms: int, how: Plan) -> float:
    """The modelled time (us) of a register-A wide-M plan."""
    if how.family == "wide_sk":
        return wide_sk_us(m, n, k, sms, how.block_m)
    return wide_us(m, n, k, sms, how.block_m, how.splits, how.family == "wide_c2")


def wide_plan(
    m: int,
    n: int,
    k: int,
    sms: int,
    block_m: int | None = None,
    splits: int | None = None,
    cluster: bool | None = None,
    stream_k: bool | None = None,
) -> Plan | None:
    """The register-A wide-M kernel's plan (K % 16 == 0): batch tile ``block_m`` and K split
    over fold chunks ``splits``, by workspace or (``cluster``) over two-CTA clusters, or
    (``stream_k``, where the tiles outnumber the SMs) the tiles' fold chunks shared by one CTA
    per SM; each by default the least modelled time (:func:`wide_us`, :func:`wide_sk_us`) among
    the tiles up to twice M (32 always: several 32-row tiles beat one 64-row tile where that tile
    needs more splits, e.g. 2048 x 2048 at M = 64, 9.8 vs 11.8 us) and the splits whose grid fits
    one wave."""
    n_folds = triton.cdiv(k, FOLD)
    if (
        k % 16
        or block_m not in (None, *_WIDE_BLOCK_MS)
        or splits not in (None, *range(1, n_folds + 1))
        or (cluster and (splits not in (None, 2) or n_folds < 2))
        or (stream_k and (cluster or splits is not None))
    ):
        return None
    if block_m is not None:
        tiles = (block_m,)
    else:
        tiles = tuple(b for b in _WIDE_BLOCK_MS if b == _WIDE_BLOCK_MS[0] or b // 2 < m)
    options = []
    for b in tiles:
        ctas = _wide_tiles(m, n, b)  # per split
        if ctas > sms and stream_k is not False and not cluster and splits is None:
            per_cta = triton.cdiv(ctas * n_folds, sms)  # fold chunks
            options.append((wide_sk_us(m, n, k, sms, b), Plan("wide_sk", b, per_cta, sms, 2, 1)))
        if stream_k:
            continue
        # split K within one wave (as measured): later waves would wait on the partials
        if cluster or (cluster is None and splits is None and n_folds >= 2 and 2 * ctas <= sms):
            how = Plan("wide_c2", b, triton.cdiv(n_folds, 2), 2, 2, 1)
            options.append((wide_us(m, n, k, sms, b, 2, cluster=True), how))
        if cluster:
            continue
        for s in [splits] if splits is not None else range(1, n_folds + 1):
            if splits is not None or s == 1 or ctas * s <= sms:
                how = Plan("wide", b, triton.cdiv(n_folds, s), s, 2, 1)
                options.append((wide_us(m, n, k, sms, b, s), how))
    if not options:
        return None
    return min(options)[1]


@functools.cache
def _wide_default(m: int, n: int, k: int, sms: int, clusters: tuple[int, ...] = ()) -> Plan | None:
    """The wide kernel's plan where it is the default (16 < M <= :data:`WIDE_MAX_M`, or
    :data:`WIDE_SHORT_K_MAX_M` at K <= 1024, and
    8 < M <= 16 on small weights or K % 256 != 0, :func:`_image_low_m`; see
    :func:`_wide_wanted`), else None
    (cached: the dispatch asks per call, the model loops over tiles and split counts)."""
    max_m = WIDE_MAX_M if k > 2 * FOLD else WIDE_SHORT_K_MAX_M
    if not (SMALL_MAX_M < m <= max_m or _image_low_m(m, n, k)):
        return None
    how = wide_plan(m, n, k, sms)
    if how is None or not _wide_wanted(m, n, k, sms, how):
        return None
    return cluster_folded(how, m, n, clusters)


def cluster_folded(how: Plan, m: int, n: int, clusters: tuple[int, ...]) -> Plan:
    """``how``, a workspace split of 2-8 CTAs per tile (``wide``) whose tiles fit one wave of
    clusters (``clusters``: how many clusters of 2, 3, ..., 8 CTAs the device holds at once,
    :func:`cluster_slots`), as the same split folded by cluster (``wide_cf``): each tile's CTAs
    launched as one cluster, each folding its share of the tile's batch rows after one cluster
    barrier, instead of the last CTA to count in folding them all. Same bits; on an H100, of 59
    measured (shape, tile, split) points that fit one wave, 57 ran faster (up to 6.6 us), one
    even, one 0.5 us slower; past one wave 1.39-1.56x slower (benchmarks/RESULTS.md, twenty-ninth
    session). Any other plan is returned as it is."""
    s = how.splits
    fits = 2 <= s <= 1 + len(clusters) and _wide_tiles(m, n, how.block_m) <= clusters[s - 2]
    return how._replace(family="wide_cf") if how.family == "wide" and fits else how


def _wide_wanted(m: int, n: int, k: int, sms: int, how: Plan) -> bool:
    """Where the wide kernel is the default for 16 < M <= :data:`WIDE_MAX_M`: up to M = 32 while
    its tiles fit one wave (beyond, the mid-M kernel with two CTAs per SM measured faster:
    24576 x 4096, 39.7 vs 43.8 us), up to M = 256 while its modelled time is at most the
    warp-specialized kernel's (which once won on grids of 0.6-1 wave of 64-row tiles at short K,
    5120 x 2048 at M = 64, 13.0 vs 14.4; since the cluster split it ran 14.4 against 12.9 there,
    and it was the fastest plan on none of 201 measured points at M = 32-256), and always above
    (see :data:`WIDE_MAX_M`)."""
    if m <= 32:
        return _wide_tiles(m, n, how.block_m) <= sms
    if m > MAX_M:
        return True
    ws = _ws_plan(m, n, sms)
    waves = triton.cdiv(triton.cdiv(m, ws.block_m) * triton.cdiv(n, ROWS), sms)
    ws_us = waves * triton.cdiv(k, CHUNK) * _WS_CHUNK_US[ws.block_m] + _WS_OVERHEAD_US
    return _wide_plan_us(m, n, k, sms, how) <= ws_us


def _wide_operands_default(
    m: int, n: int, k: int, sms: int, clusters: tuple[int, ...] = ()
) -> Plan | None:
    """The default plan where the register-A wide kernel can read the operands: the mid-M
    kernel's at two fold chunks (:func:`_mid_default`), else the wide kernel's where it is the
    default (:func:`_wide_default`), else None."""
    return _mid_default(m, n, k, sms) or _wide_default(m, n, k, sms, clusters)


def _image_low_m(m: int, n: int, k: int) -> bool:
    """8 < M <= 16 on a weight below :data:`STREAM_MIN_WEIGHT` or one the streamed kernel cannot
    read (K % 256 != 0): the mid-M and wide kernels' defaults extend to it (see
    :data:`IMAGE_MIN_M`; at K % 256 != 0 on weights of 8.5-16.9 Mi elements, 4112 x 4112,
    3584 x 2368, 4096 x 4160 and 5120 x 2368, the wide plans ran 1.04-1.31x the speed of the
    Triton decode GEMM there at M = 12 and 16; H200, benchmarks/NOTES_kernels.md)."""
    small = n * k < STREAM_MIN_WEIGHT or k % 256 != 0
    return IMAGE_MIN_M < m <= SMALL_MAX_M and small


def _mid_default(m: int, n: int, k: int, sms: int) -> Plan | None:
    """The mid-M kernel's plan where it is the default over the wide kernels: two fold chunks
    (FOLD < K <= 2 FOLD), one per warpgroup of its 32-row two-warpgroup plan, at 16 < M <= 128
    (and 8 < M <= 16 where :func:`_image_low_m`) while that grid fits one wave.
    There the wide kernel can split K in two at most, and its fixed costs (producer ring,
    hand-over or workspace fold, epilogue through shared memory) outweigh its cheaper chunks.
    Set on 2048 / 5120 x 1024 and 2048 / 4096 x 768 (H200, gemm_rows: 0.86-0.98x the wide
    kernel's time at M = 24-96, even at M = 128, where four batch tiles each decode the weight);
    on seven shapes not used to set it (N = 1536-8192, K = 640-1024) 0.92-0.99x. Longer K and
    larger grids lost (2048 x 2048 at M = 32: 11.3 against 9.3 us; 4096 x 1536 at M = 24-64:
    10.9-11.1 against 9.4-10.3; 2048 x 1024 at M = 192: 14.2 against 9.4). A mid-kernel time
    model on the wide model's scale (0.93 us per chunk and warpgroup, 3.3 us) could not separate
    them: the margins (0-1 us) are below its error at two fold chunks."""
    bm = _MID_BLOCK_MS[0]
    if not (SMALL_MAX_M < m <= 128 or _image_low_m(m, n, k)) or not FOLD < k <= 2 * FOLD:
        return None
    return Plan("mid", bm, 2, 1, 2) if triton.cdiv(m, bm) * triton.cdiv(n, ROWS) <= sms else None


def stream_plan(m: int, n: int, k: int, sms: int, warpgroups: int | None = None) -> Plan | None:
    """The streamed small-M kernel's plan for M <= 16: batch tile 8 or 16; ``warpgroups``
    consumers, by default two while there are at most two units per SM (then every warpgroup
    has one unit and the grid spans more SMs), else three (measured faster on both sides); the
    grid is :func:`stream_grid`."""
    if m > _STREAM_BLOCK_MS[-1] or k % 256:
        return None
    bm = next(b for b in _STREAM_BLOCK_MS if m <= b)
    wgs = warpgroups or (2 if stream_units(n, k) <= 2 * sms else 3)
    return Plan("stream", bm, 1, 1, wgs) if wgs in _STREAM_WARPGROUPS else None


def _stream_wanted(m: int, n: int, k: int) -> bool:
    """Where the streamed kernel is the default (see ``STREAM_MIN_WEIGHT``)."""
    return m <= _STREAM_BLOCK_MS[-1] and k % 256 == 0 and n * k >= STREAM_MIN_WEIGHT


def stream_units(n: int, k: int) -> int:
    """Units of a streamed launch: 64 weight rows x one 512-element fold chunk each."""
    return triton.cdiv(n, ROWS) * triton.cdiv(k, FOLD)


#: Where the unit layout stores each code bit of a canonical word pair (code words 2t, 2t + 1 of a
#: row's 128-element chunk: nibble p of each is stream p's element). Stored word h (0, 1) holds
#: streams 4h .. 4h + 3; its element e is nibble 4h + e // 2 of canonical word e % 2, and
#: ``UNIT_CODE_BITS[e]`` gives the stored bit of that nibble's bits 0-3 (mantissa, exponent low,
#: exponent high, sign). With this placement the kernel's ``decode_pair_unit`` builds stream
#: 4h + i's BF16 pair (element bits on BF16 bits 6, 7, 8 and 15 of its half) from the stored word
#: w as w, w << 6, w rotated left by 10, and w rotated left by 12 or shifted left by 4, each under
#: a mask: 13 instructions per 8 codes with the scale multiplies, 7 of them on the integer pipe
#: (18 and 10 for the canonical words).
UNIT_CODE_BITS = (
    (6, 7, 8, 15), (22, 23, 24, 31), (0, 1, 2, 9), (16, 17, 18, 25),
    (28, 29, 30, 5), (12, 13, 14, 21), (26, 3, 4, 11), (10, 19, 20, 27),
)  # fmt: skip


def _unit_bit_moves() -> list[tuple[int, int]]:
    """(shift, source mask) per distinct shift of a canonical pair's 64 bits (word 2t low) into
    the stored pair: stored = OR of (pair & mask) shifted left by shift (right if negative)."""
    moves: dict[int, int] = {}
    for h in range(2):
        for e, bits in enumerate(UNIT_CODE_BITS):
            word, nibble = e % 2, 4 * h + e // 2
            for b, dst in enumerate(bits):
                src = 32 * word + 4 * nibble + b
                shift = 32 * h + dst - src
                moves[shift] = moves.get(shift, 0) | (1 << src)
    return sorted(moves.items())


_UNIT_BIT_MOVES = _unit_bit_moves()


def unit_code_words(codes: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """Canonical codes uint8 [N, K/2] (K % 16 == 0) with each word pair's bits placed as the unit
    layout stores them (``UNIT_CODE_BITS``), as a new tensor; made ``rows`` rows at a time."""
    out = torch.empty_like(codes)
    pairs, dst = codes.contiguous().view(torch.int64), out.view(torch.int64)
    for r in range(0, codes.shape[0], rows):
        x = pairs[r : r + rows]
        acc = torch.zeros_like(x)
        for shift, mask in _UNIT_BIT_MOVES:
            piece = x & (mask - (1 << 64) if mask >> 63 else mask)  # as a signed 64-bit value
            if shift >= 0:
                acc |= piece << shift
            else:  # arithmetic shift: drop the copies of the sign bit it brings in
                acc |= (piece >> -shift) & ((1 << (64 + shift)) - 1)
        dst[r : r + rows] = acc
    return out


def unit_layout(
    codes: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The streamed kernel's weight layout (lossless, made once per weight): codes uint8 [N, K/2]
    and scales (1 byte) [N, K/16] of an NVFP4 weight with K % 256 == 0 as uint8 [units x
    UNIT_BYTES], one 18 KB unit per (64 rows, 512-element fold chunk), tile-major (the streamed
    launch's unit order), rows past N and K zero. A unit holds the codes of its four 128-element
    chunks, then their scales, each in the order the consumer threads read them: per chunk c and
    warp w (rows 16 w + g and 16 w + g + 8, g = lane / 4, t = lane % 4), two 512-byte blocks of
    16 bytes per lane (code words 2t, 2t + 1 of both rows, then words 2t + 8, 2t + 9; each such
    pair's bits placed as ``UNIT_CODE_BITS`` says), and at 16384 + (4 c + w) * 128 four scale
    bytes per lane (blocks t of both rows, then blocks t + 4).

    ``out``: a layout of this shape to rewrite in place (it allocates the codes with their bits
    placed, and a 64-row tile for a last tile past N, before it writes any of it, so a refresh
    after a weight update cannot run out of memory half-way)."""
    n, k = codes.shape[0], codes.shape[1] * 2
    if k % 256 or tuple(scales.shape) != (n, k // 16):
        raise ValueError(f"unit_layout: needs K % 256 == 0 and scales [N, K/16]; got N={n} K={k}")
    tiles, folds = triton.cdiv(n, ROWS), triton.cdiv(k, FOLD)
    codes, scales = unit_code_words(codes), scales.contiguous().view(torch.uint8)
    if out is None:
        out = torch.zeros(tiles * folds * UNIT_BYTES, dtype=torch.uint8, device=codes.device)
    units = out.view(tiles, folds, UNIT_BYTES)
    full = n // ROWS
    if full < tiles:  # the last tile, zero-padded to 64 rows
        rest = n - full * ROWS
        pad_codes = codes.new_zeros(ROWS, k // 2)
        pad_scales = scales.new_zeros(ROWS, k // 16)
        pad_codes[:rest], pad_scales[:rest] = codes[full * ROWS :], scales[full * ROWS :]
    _fill_units(units[:full], codes[: full * ROWS], scales[: full * ROWS])
    if full < tiles:
        _fill_units(units[full:], pad_codes, pad_scales)
    return out


def _fill_units(units: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Write whole tiles (codes / scales of 64 x T rows) into ``units`` [T, folds, UNIT_BYTES] by
    strided copies: the whole fold chunks, then a last half one (K % 512 == 256)."""
    tiles, k = units.shape[0], codes.shape[1] * 2
    words = codes.view(torch.int32)  # [64 T, K / 8]
    dst_words = units[:, :, :16384].view(torch.int32)
    dst_scales = units[:, :, 16384:]
    whole = k // FOLD
    for f0, nf, nch in ((0, whole, 4), (whole, 1, (k % FOLD) // CHUNK)):
        if nf == 0 or nch == 0:
            continue
        src = words[:, f0 * 64 : f0 * 64 + nf * nch * 16]
        # rows (tile, warp, row half, g), words (fold, chunk, half, t, word of pair) ->
        # (tile, fold, chunk, warp, half, g, t, row half, word of pair)
        src = src.view(tiles, 4, 2, 8, nf, nch, 2, 4, 2).permute(0, 4, 5, 1, 6, 3, 7, 2, 8)
        dst_words[:, f0 : f0 + nf, : nch * 1024].view(tiles, nf, nch, 4, 2, 8, 4, 2, 2).copy_(src)
        src = scales[:, f0 * 32 : f0 * 32 + nf * nch * 8]
        # rows (tile, warp, row half, g), blocks (fold, chunk, block half, t) ->
        # (tile, fold, chunk, warp, g, t, block half, row half)
        src = src.view(tiles, 4, 2, 8, nf, nch, 2, 4).permute(0, 4, 5, 1, 3, 7, 6, 2)
        dst_scales[:, f0 : f0 + nf, : nch * 512].view(tiles, nf, nch, 4, 8, 4, 2, 2).copy_(src)


def _operand_key(codes: torch.Tensor, scales: torch.Tensor) -> tuple:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.device) for t in (codes, scales))


class UnitLayout:
    """A weight's :func:`unit_layout` and the operands it was made from. ``units`` keeps its
    storage for the layout's life (CUDA graphs capture its address): :meth:`refresh` rewrites it in
    place after the codes or scales changed in place."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor):
        self.units = unit_layout(codes, scales)
        self._key = _operand_key(codes, scales)
        self._versions = (codes._version, scales._version)

    def refresh(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Rewrite the layout from ``codes`` and ``scales`` (the tensors it was made from)."""
        if _operand_key(codes, scales) != self._key:
            raise ValueError(
                "kernel layout refresh: these are not the codes and scales the layout was made "
                "from (other storage, shape or strides); make a new layout for a new weight"
            )
        unit_layout(codes, scales, out=self.units)
        self._versions = (codes._version, scales._version)

    def units_for(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor | None:
        """The layout of these operands: None if they are other tensors (e.g. a row slice of the
        weight), rewritten first if they changed in place since (eager calls; a CUDA graph replay
        reads what the last refresh wrote)."""
        if _operand_key(codes, scales) != self._key:
            return None
        if (codes._version, scales._version) != self._versions:
            self.refresh(codes, scales)
        return self.units


def layout_for(w) -> UnitLayout | None:
    """``w``'s :class:`UnitLayout` where the streamed kernel is its default at small M (the CUDA
    kernels on and loaded, a shape of at least ``STREAM_MIN_WEIGHT`` elements, operands it can
    read), else None."""
    if (
        cuda_jit.mode() == "off"
        or w.rows * w.cols < STREAM_MIN_WEIGHT
        or not _stream_weight_fits(w)
        or not available(w.codes.device)
    ):
        return None
    return UnitLayout(w.codes, w.scales)


def stream_grid(n: int, k: int, sms: int, how: Plan) -> int:
    """CTAs of a streamed launch: one per SM at most, and about ``how.warpgroups`` units each."""
    return min(sms, triton.cdiv(stream_units(n, k), how.warpgroups))


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """Zeroed int32 tile counters for split-K launches on ``device``'s current stream, shared by
    the Triton decode kernel and the streamed kernel (each tile's last program resets its
    counter, so they stay zero between launches and graph replays; launches on one stream never
    overlap them)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _ws_wanted(m: int, n: int, sms: int) -> bool:
    """Where the wide-M kernel measured fastest: every M > 64; 32 < M <= 64 while its grid (one
    CTA per 64 weight rows) fills 0.6 to 1 wave."""
    return m > 64 or (m > 32 and 6 * sms <= 10 * triton.cdiv(n, ROWS) <= 10 * sms)


def _ws_wide_serves(m: int, k: int) -> bool:
    """Where the wide-M kernel also serves 256 < M <= 1024: K >= 4096 (faster than the Triton
    kernels on every such shape measured; at K = 2048 it was not)."""
    return m <= WS_MAX_M and k >= _WS_WIDE_MIN_K and k % 32 == 0


def _large_fills_waves(m: int, n: int, sms: int) -> bool:
    """Where the Triton large-M kernel beats the wide-M one below WS_MAX_M: M > LARGE_OVER_WS_M
    and its LARGE_TILE grid fills the last wave to >= 90% (H200, M = 1024: 294 vs 316 us on
    8192 x 8192, 447 vs 509 on 24576 x 4096, 228 vs 251 on 4096 x 12288, 81 vs 90 on 4096 x 4096;
    it lost at 0.73 and 0.48 of a wave, 6144 x 4096 and 2048 x 4096, and at M = 640)."""
    if m <= LARGE_OVER_WS_M:
        return False
    tiles = triton.cdiv(n, LARGE_TILE[0]) * triton.cdiv(m, LARGE_TILE[1])
    return 10 * tiles >= 9 * triton.cdiv(tiles, sms) * sms


def _ws_plan(m: int, n: int, sms: int) -> Plan:
    """The wide-M kernel's batch tile (of those up to M's next power of two): the one with the
    least waves x measured CTA time (H200, N = K = 8192: 37, 47, 80 us for tiles of 64, 128,
    256 rows), which picked the fastest tile on every shape measured."""
    candidates = [p for p in WS_PLANS if p.block_m // 2 < m]
    waves = [triton.cdiv(triton.cdiv(m, p.block_m) * triton.cdiv(n, ROWS), sms) for p in candidates]
    costs = [w * _WS_CTA_US[p.block_m] for w, p in zip(waves, candidates, strict=True)]
    return candidates[costs.index(min(costs))]


def plan(
    m: int,
    n: int,
    k: int,
    sms: int,
    splits: int | None = None,
    warpgroups: int | None = None,
    ws: bool = True,
    stream: bool = False,
    wide: bool = False,
    clusters: tuple[int, ...] = (),
) -> Plan | None:
    """How an M x N x K GEMM runs on ``sms`` SMs (``splits`` / ``warpgroups`` force the cluster
    size / the warpgroups per CTA of the small- / mid-M kernels: probes, tests; ``ws`` /
    ``stream`` / ``wide``: the warp-specialized wide-M / streamed / register-A wide-M kernel
    can read the operands, see :func:`ws_fits`, :func:`stream_fits` and :func:`wide_fits`;
    ``clusters``: the device's cluster slots, :func:`cluster_slots`, see :func:`cluster_folded`);
    None when the kernels cannot serve it (M too large, K too long for a cluster's shared
    memory)."""
    if stream and splits is None and warpgroups is None and _stream_wanted(m, n, k):
        return stream_plan(m, n, k, sms)
    if wide and splits is None and warpgroups is None:
        how = _wide_operands_default(m, n, k, sms, clusters)
        if how is not None:
            return how
    ws_ok = splits is None and warpgroups is None and ws and k % 32 == 0
    if m > MAX_M:
        return _ws_plan(m, n, sms) if ws_ok and _ws_wide_serves(m, k) else None
    if m > SMALL_MAX_M and ws_ok and _ws_wanted(m, n, sms):
        return _ws_plan(m, n, sms)
    if m > SMALL_MAX_M:  # mid M: never split (it measured slower at every shape)
        bm = next((b for b in _MID_BLOCK_MS if m <= b), _MID_BLOCK_MS[-1])
        if warpgroups is None:  # two per CTA while the grid is one CTA per SM at most
            warpgroups = 2 if triton.cdiv(m, bm) * triton.cdiv(n, ROWS) <= sms else 1
        ok = splits in (None, 1) and warpgroups in (1, 2)
        return Plan("mid", bm, triton.cdiv(k, FOLD), 1, warpgroups) if ok else None
    bm = next(b for b in _BLOCK_MS if m <= b)
    n_folds = triton.cdiv(k, FOLD)
    tiles = triton.cdiv(n, ROWS) * triton.cdiv(m, bm)
    wanted = min(triton.cdiv(_CTAS_PER_SM * sms, tiles), n_folds)
    # the most splits up to ``wanted`` whose activation slices fit, else more (fewer fold chunks
    # per CTA)
    options = [s for s in _SPLITS if s <= wanted][::-1] + [s for s in _SPLITS if s > wanted]
    for s in [splits] if splits is not None else options:
        candidate = Plan("small", bm, triton.cdiv(n_folds, s), s)
        if s in _SPLITS and candidate.smem() <= _SMEM_BUDGET:
            return candidate
    return None


def gemm(
    a,
    w,
    bias,
    y: torch.Tensor,
    sms: int,
    phase_times=None,
    splits: int | None = None,
    warpgroups: int | None = None,
    how: Plan | None = None,
) -> None:
    """``y = a @ w.T`` with the contract's epilogue (``y`` preallocated [M, N]). ``phase_times``
    (int64 [CTAs, 4], diagnostics): a build that records on the GPU's global timer each CTA's
    start, staged activation, main-loop end and finish (clustered small-M kernel), or its first
    consumer warpgroup's start, first stage ready, last unit (chunk) done and finish (streamed and
    register-A wide-M kernels).
    ``splits`` / ``warpgroups`` force the cluster size / the warpgroups per CTA, ``how`` the whole
    plan (probes, tests; same bits). The streamed kernel reads ``w.kernel_layout`` (a
    :class:`UnitLayout` of ``w``'s codes and scales) where there is one, else the canonical
    codes and scales (same bits)."""
    m, n, k = a.rows, w.rows, a.cols
    fits, streamed, wide = ws_fits(w), stream_fits(a, w), wide_fits(a, w)
    if how is None:
        slots = cluster_slots(a.codes.device)
        how = plan(m, n, k, sms, splits, warpgroups, fits, streamed, wide, slots)
    if how is None:
        raise ValueError(
            f"the CUDA C++ GEMM cannot serve {m}x{n}x{k} with splits={splits}, "
            f"warpgroups={warpgroups}"
        )
    if how.family == "ws" and not fits:
        raise ValueError("the wide-M CUDA C++ GEMM needs K % 32 == 0 and 16-byte aligned codes")
    if how.family == "stream" and not (m <= how.block_m and streamed):
        raise ValueError(
            f"the streamed CUDA C++ GEMM cannot serve {m}x{n}x{k}: it needs M <= {how.block_m}, "
            "K % 256 == 0 and 16-byte aligned codes and scales"
        )
    if how.family in _WIDE and not wide:
        raise ValueError(
            f"the register-A wide-M CUDA C++ GEMM cannot serve {m}x{n}x{k}: it needs K % 16 == 0 "
            "and 8-byte aligned rows of codes"
        )
    if how.family == "wide_cf" and not 2 <= how.splits <= min(8, triton.cdiv(k, FOLD)):
        raise ValueError(
            "the cluster-fold wide-M CUDA C++ GEMM splits K into 2..8 clustered CTAs of at least "
            f"one fold chunk each, got {how.splits} for K = {k}"
        )
    if how.family == "wide_sk":
        tiles = _wide_tiles(m, n, how.block_m)
        if not 0 < how.splits <= min(tiles, sms):
            raise ValueError(
                "the stream-K wide-M CUDA C++ GEMM runs on 1..min(tiles, SMs) CTAs (all "
                f"resident), got {how.splits} for {tiles} tiles on {sms} SMs"
            )
    layout = getattr(w, "kernel_layout", None) if how.family == "stream" else None
    w_units = layout.units_for(w.codes, w.scales) if isinstance(layout, UnitLayout) else None
    vector = a.decode_scale.dim() > 0
    adec = a.decode_scale if vector else a.decode_scale.reshape(1)
    act = _Activation(code_words(a.codes), a.scales, adec, adec.stride(0) if vector else 0)
    _launch(how, act, w, w_units, bias, y, m, k, sms, phase_times)


#: The kernel families that read the activation as a decoded image, made by a launch before theirs.
_IMAGE_FAMILIES = ("mid", "ws", *_WIDE)
#: The most rows :func:`gemm_rows` quantizes in the image pass: one CTA per row reads it twice
#: (amax, then codes); on the H200 that measured 1.02-1.15x the quantize-then-decode pair at
#: M = 32-64, 0.96-1.07x at M = 128-256 (about even; 0.99x on N = K = 8192 at 256) and 0.96-1.0x
#: at M = 512-1024 (benchmarks/NOTES_kernels.md).
ROWS_MAX_M = 256


class _Activation(NamedTuple):
    """The activation as the kernels read it: ``words`` int32 [M, *] (NVFP4 codes; BF16 element
    pairs when the image pass quantizes them), ``scales`` (None then), ``dec`` float32 decode
    scales (written by the quantizing pass) with ``dec_stride``."""

    words: torch.Tensor
    scales: torch.Tensor | None
    dec: torch.Tensor
    dec_stride: int


def rows_plan(x: torch.Tensor, w, out_dtype: torch.dtype) -> Plan | None:
    """The plan for ``quantize(x) @ w.T`` (per-row amax, the contract's activation quantizer) where
    :func:`gemm_rows` serves it, ``x`` being BF16 [M, K] with 16-byte aligned rows: the GEMM the
    quantized ``x`` would get by default reads a decoded activation image
    (:data:`_IMAGE_FAMILIES`) and 8 < M <= :data:`ROWS_MAX_M` (M <= 16 only where
    :func:`_image_low_m`), or it is the streamed kernel's plan (M <= 16) on a weight with its
    unit layout (:func:`_stream_rows_plan`); else None."""
    m, k = x.shape
    if not 0 < m <= ROWS_MAX_M or not _rows_operands_fit(x, w, out_dtype):
        return None
    if m <= SMALL_MAX_M:
        how = _stream_rows_plan(x, w)
        if how is not None or m <= _STREAM_BLOCK_MS[0]:
            return how
    if k % 16 or not _rows_8b(w.codes):
        return None
    ws, wide = ws_fits(w), _wide_weight_fits(m, w)  # the image families (not streamed)
    if not _chosen(m, w, x.device, ws, False, wide):
        return None
    how = plan(m, w.rows, k, _sms(x.device), ws=ws, wide=wide, clusters=cluster_slots(x.device))
    return how if how is not None and how.family in _IMAGE_FAMILIES else None


def _rows_operands_fit(x: torch.Tensor, w, out_dtype: torch.dtype) -> bool:
    """Whether the quantizing image pass can read ``x`` against ``w``: BF16 [M, K] rows, 16-byte
    aligned, on ``w``'s device, and an output type the epilogue writes."""
    return (
        x.dtype == torch.bfloat16
        and _rows_16b(x)
        and x.shape[1] == w.cols
        and x.device == w.codes.device
        and out_dtype in _OUT_KINDS
    )


def _stream_rows_plan(x: torch.Tensor, w) -> Plan | None:
    """M <= 16: the streamed kernel's plan where :func:`gemm_rows` serves it, on the unit layout.
    At 8 < M <= 16 (its 16-row tile) the image pass plus the image read by bulk copy measured
    1.01-1.11x the quantizer plus the producer's own decode on six of seven shapes and 0.97-1.0x
    on 2048 x 4096 (at M <= 8, 0.90-0.98x on five of seven: the 8-row image costs more L2 reads
    than one row's codes; H200, benchmarks/NOTES_kernels.md). At M = 1 with K <=
    :data:`STREAM_QUANT_MAX` the kernel quantizes the row itself (its rows variant): one launch,
    the row's quantization beside the first weight stages."""
    m, k = x.shape
    layout = getattr(w, "kernel_layout", None)
    if (
        k % 256
        or (m <= _STREAM_BLOCK_MS[0] and (m > 1 or k > STREAM_QUANT_MAX))
        or not isinstance(layout, UnitLayout)
        or layout.units_for(w.codes, w.scales) is None  # e.g. a row slice of the weight
        or not _stream_weight_fits(w)
        or not _chosen(m, w, x.device, False, True, False)
    ):
        return None
    how = plan(m, w.rows, k, _sms(x.device), ws=False, stream=True)
    return how if how is not None and how.family == "stream" else None


def gemm_rows(x: torch.Tensor, w, bias, y: torch.Tensor, how: Plan) -> None:
    """``y = quantize(x) @ w.T`` with the contract's epilogue for a :func:`rows_plan` plan: the
    launch that makes the activation image quantizes the BF16 rows ``x`` itself, or at M = 1 the
    streamed kernel does, before its first units (the same bits as the contract's quantizer
    followed by :func:`gemm`; one launch fewer)."""
    m, k = x.shape
    dec = torch.empty(m, dtype=torch.float32, device=x.device)
    act = _Activation(x.view(torch.int32), None, dec, 1)
    units = w.kernel_layout.units_for(w.codes, w.scales) if how.family == "stream" else None
    _launch(how, act, w, units, bias, y, m, k, _sms(x.device))


def _launch(
    how: Plan,
    act: _Activation,
    w,
    w_units: torch.Tensor | None,
    bias,
    y: torch.Tensor,
    m: int,
    k: int,
    sms: int,
    phase_times=None,
) -> None:
    """Launch plan ``how`` (after the activation image's pass where the family reads one)."""
    n = w.rows
    device = w.codes.device
    ww = code_words(w.codes)
    even = _wide_even(w) if how.family in _WIDE else k % CHUNK == 0
    pad = how.family in _WIDE and not even  # the pass writes the scales in whole chunks
    w_scales = w.scales
    if pad:
        w_scales = torch.empty(n, triton.cdiv(k, CHUNK) * 8, dtype=torch.uint8, device=device)
    wdec = w.decode_scale if w.decode_scale.dim() else w.decode_scale.reshape(1)
    bias32 = bias.float().contiguous() if bias is not None else None
    rows = WIDE_ROWS if how.family in _WIDE else ROWS  # weight rows per CTA
    n_tiles, m_tiles = triton.cdiv(n, rows), triton.cdiv(m, how.block_m)
    a_chunks = triton.cdiv(k, CHUNK)
    if how.family == "mid" and how.warpgroups == 2:  # whole fold-chunk pairs (zero padding)
        a_chunks = triton.cdiv(a_chunks, 2 * FOLD // CHUNK) * (2 * FOLD // CHUNK)
    quant = how.quantizes_rows(act.scales is None)  # then no activation pass
    image = partials = counters = None
    if (how.family in ("wide", "wide_cf") and how.splits > 1) or how.family == "wide_sk":
        # 256 threads x BM / 2 floats per (tile, fold chunk) of a split, per tile for stream-K's
        # prefixes (its counters are the tiles' flags)
        slots = 1 if how.family == "wide_sk" else triton.cdiv(k, FOLD)
        size = m_tiles * n_tiles * slots * 128 * how.block_m
        partials = torch.empty(size, dtype=torch.float32, device=device)
        counters = split_counters(device)
    if how.family == "stream":
        size = stream_units(n, k) * 128 * how.block_m // 2  # per unit, thread: BM / 2 floats
        partials = torch.empty(size, dtype=torch.float32, device=device)
        counters = split_counters(device)
    pass_ctas = 0  # the activation pass (image families): its CTAs, then those padding w_scales
    if (act.scales is None and not quant) or how.family in _IMAGE_FAMILIES:  # its decoded image
        size = m_tiles * a_chunks * how.block_m * 256
        image = torch.empty(size, dtype=torch.uint8, device=device)
        # BF16 rows (gemm_rows): one CTA per image row quantizes it; else a thread per code-word
        # pair decodes it
        rows_pass = act.scales is None
        pairs = m_tiles * how.block_m * a_chunks * 8
        pass_ctas = m_tiles * how.block_m if rows_pass else triton.cdiv(pairs, 256)
    pad_ctas = triton.cdiv(n * triton.cdiv(k, CHUNK), 256) if pad else 0  # a thread per 8 bytes
    p = _Params(
        (w_units if w_units is not None else ww).data_ptr(), w_scales.data_ptr(), wdec.data_ptr(),
        act.words.data_ptr(), act.scales.data_ptr() if act.scales is not None else None,
        act.dec.data_ptr(), bias32.data_ptr() if bias32 is not None else None, y.data_ptr(),
        phase_times.data_ptr() if phase_times is not None else None,
        ww.stride(0), w_scales.stride(0), act.words.stride(0),
        act.scales.stride(0) if act.scales is not None else 0, y.stride(0), y.stride(1),
        wdec.stride(0) if w.decode_scale.dim() else 0, act.dec_stride,
        m, n, k, how.per_split, _OUT_KINDS[y.dtype], LBO, SBO,
        image.data_ptr() if image is not None else None, a_chunks,
        partials.data_ptr() if partials is not None else None,
        counters.data_ptr() if counters is not None else None,
        w.scales.data_ptr(), w.scales.stride(0), pass_ctas,
    )  # fmt: skip
    index = device.index if device.index is not None else torch.cuda.current_device()
    defines = ("MINITE_PHASE_TIMING",) if phase_times is not None else ()
    kernels = cuda_jit.load(
        "w4a4_gemm_sm90a.cu", _kernel_names(), torch.device("cuda", index), defines
    )
    if image is not None:
        name = "quantize" if rows_pass else "decode"
        activation_pass = kernels[f"w4a4_{name}_act_m{how.block_m}"]
        activation_pass.launch((pass_ctas + pad_ctas, 1, 1), 256, 0, p, device, pdl=True)
    if how.family == "small":
        grid = (n_tiles, how.splits, m_tiles)
    elif how.family == "stream":
        grid = (stream_grid(n, k, sms, how), 1, 1)
    elif how.family == "wide_sk":
        grid = (how.splits, 1, 1)
    else:  # the M tiles of one weight slice side by side: the slice is read from L2 once
        grid = (m_tiles, n_tiles, how.splits if how.family in _WIDE else 1)
    kernel = kernels[how.kernel_name(even, w_units is not None, act.scales is None)]
    # programmatic dependent launch: the CTAs start and prefetch their first weight chunks into
    # L2 while the previous kernel (the activation's quantize or decode) finishes
    cluster_z = how.splits if how.family == "wide_cf" else 1
    smem = how.smem(rows=act.scales is None)
    kernel.launch(grid, how.threads(), smem, p, device, pdl=True, cluster_z=cluster_z)
