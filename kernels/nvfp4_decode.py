"""NVFP4 -> BF16 decoding, exact: the in-register decode used by the W4A4 GEMM, and a kernel that
writes whole decoded operands (the large-M GEMM's inputs) in the GEMM's K order.

A decoded element is ``code * f32(scale) * 2^-7`` in BF16, exact: ``code * scale`` has at most 6
significant bits and lies in [2^-10, 2688]. The 2^-7 comes from the fast decode, which builds the
BF16 bit pattern of the E2M1 code directly (``(n & 7) << 6`` is the code times 2^-126, subnormal
codes included) and folds 2^126 into the block scale, which then fits BF16 only as
``scale * 2^119``. The GEMM epilogue multiplies the float32 accumulator by 2^14 (exact).

Codes are read as 32-bit words of 8 nibbles (elements 8j..8j+7 of a row). K order: per chunk of
``CHUNK`` = 128 elements (16 words), 8 streams, stream p holding nibble p of every word (elements
8j + p); the GEMMs sum stream 0, then 1, ..., 7, one 16-element MMA step each, chunk after chunk
(128 rather than 256: half the decoded weight is live in registers at a time).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._fp import e4m3_to_f32

CHUNK = 128
CHUNK_K = tl.constexpr(CHUNK)
STREAMS = 8

# Two code words ($8, $9: elements 0 and 1 of the pack) and their two E4M3 scale bytes ($10) ->
# eight BF16 pairs $0..$7, $p = (nibble p of word 0, nibble p of word 1) * scale * 2^-7.
# Scales: e4m3x2 -> f16x2 -> f32 * 2^119 -> bf16x2. Codes: prmt gathers byte i of both words into
# the two 16-bit lanes; a nibble n becomes ((n&7)<<6 | (n&8)<<12) (one multiply by two shifts
# that never overlap, then a mask): the BF16 of code * 2^-126; one BF16x2 multiply scales it.
_DECODE_ASM = tl.constexpr(
    """
{
.reg .b32 s, t, u;
.reg .b16 sb, sx;
.reg .f16 h0, h1;
.reg .f32 f0, f1;
mov.b32 {sb, sx}, $10;
cvt.rn.f16x2.e4m3x2 s, sb;
mov.b32 {h0, h1}, s;
cvt.f32.f16 f0, h0;
cvt.f32.f16 f1, h1;
mul.rn.f32 f0, f0, 0f7B000000;
mul.rn.f32 f1, f1, 0f7B000000;
cvt.rn.bf16x2.f32 s, f1, f0;
"""
    + "".join(
        f"""prmt.b32 t, $8, $9, {sel};
and.b32 u, t, 0x000F000F;
mul.lo.u32 u, u, 0x1040;
and.b32 u, u, 0x81C081C0;
mul.rn.bf16x2 ${2 * i}, u, s;
and.b32 u, t, 0x00F000F0;
mul.lo.u32 u, u, 0x104;
and.b32 u, u, 0x81C081C0;
mul.rn.bf16x2 ${2 * i + 1}, u, s;
"""
        for i, sel in enumerate(("0x4400", "0x5511", "0x6622", "0x7733"))
    )
    + "}"
)


@triton.jit
def _e2m1_to_f32(nibble):
    """E2M1 code (int32 in 0..15) -> its float32 value, sign of zero kept; no subnormals."""
    mag = nibble & 7
    normal = ((mag << 22) + (126 << 23)).to(tl.float32, bitcast=True)  # 2^(e-1) * (1 + m/2)
    value = tl.where(mag >= 2, normal, mag.to(tl.float32) * 0.5)
    return tl.where((nibble & 8) != 0, -value, value)


@triton.jit
def _decode_stream(words, scale, p: tl.constexpr):
    return (_e2m1_to_f32((words >> (4 * p)) & 0xF) * scale).to(tl.bfloat16)


@triton.jit
def decode_nvfp4_words(words, scales, USE_ASM: tl.constexpr):
    """Code words int32 [R, W] (8 nibbles each) and the E4M3 scale byte of each word uint8
    [R, W] -> 8 BF16 tensors [R, W]: stream p = nibble p of each word times scale times 2^-7.

    USE_ASM: PTX bit-pattern decode, two elements per instruction (GPU only); else float32
    arithmetic (any backend, Triton's interpreter included). Both give the same values."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            _DECODE_ASM,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
            [words, scales],
            dtype=(tl.bfloat16,) * 8,
            is_pure=True,
            pack=2,
        )
    s = e4m3_to_f32(scales) * 0.0078125
    return (
        _decode_stream(words, s, 0),
        _decode_stream(words, s, 1),
        _decode_stream(words, s, 2),
        _decode_stream(words, s, 3),
        _decode_stream(words, s, 4),
        _decode_stream(words, s, 5),
        _decode_stream(words, s, 6),
        _decode_stream(words, s, 7),
    )


@triton.jit
def _decode_operand_kernel(
    words_ptr,
    stride_w,
    scales_ptr,
    stride_s,
    out_ptr,
    stride_o,
    rows,
    K,
    USE_ASM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """Rows [pid0*BLOCK_R, +BLOCK_R), chunks [pid1*CHUNKS, +CHUNKS): stream p of a chunk to
    out[:, chunk*CHUNK + p*CHUNK/8 + j]; elements past K are written as zeros. Each chunk's row is
    stored whole (256 contiguous bytes): the streams are interleaved in registers first."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    WORDS: tl.constexpr = CHUNK_K // 8
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    rows64 = offs_r.to(tl.int64)
    n_chunks = tl.cdiv(K, CHUNK_K)
    for c in tl.static_range(CHUNKS):
        chunk = pid_c * CHUNKS + c
        if chunk < n_chunks:
            offs_w = chunk * WORDS + tl.arange(0, WORDS)
            w_ok = r_ok[:, None] & (offs_w < K // 8)[None, :]
            words = tl.load(
                words_ptr + rows64[:, None] * stride_w + offs_w[None, :], mask=w_ok, other=0
            )
            scales = tl.load(
                scales_ptr + rows64[:, None] * stride_s + (offs_w // 2)[None, :], mask=w_ok, other=0
            )
            s = decode_nvfp4_words(words, scales, USE_ASM)
            # [R, word j, q, b, c] = stream q + 2b + 4c of word j, then [R, c, b, q, j] = [R, 128]
            t = tl.join(
                tl.join(tl.join(s[0], s[1]), tl.join(s[2], s[3])),
                tl.join(tl.join(s[4], s[5]), tl.join(s[6], s[7])),
            )
            t = tl.reshape(tl.permute(t, 0, 4, 3, 2, 1), (BLOCK_R, CHUNK_K))
            offs_o = chunk * CHUNK_K + tl.arange(0, CHUNK_K)
            tl.store(out_ptr + rows64[:, None] * stride_o + offs_o[None, :], t, mask=r_ok[:, None])


#: Rows and chunks per program of ``_decode_operand_kernel``: on the H200 (2026-12-04) 16 x 2 at
#: 4 warps moved 2.6-2.9 TB/s on 8192^2, 24576 x 4096, 4096 x 12288 weights and a 1024 x 8192
#: activation, 1.4x the previous kernel (one chunk of 32 rows, each stream stored apart).
_DECODE_ROWS, _DECODE_CHUNKS = 16, 2


def decode_operand(codes: torch.Tensor, scales: torch.Tensor, *, use_asm: bool) -> torch.Tensor:
    """BF16 ``[rows, ceil(K/CHUNK)*CHUNK]``: each element ``code*scale*2^-7`` in the GEMM's K order
    (per CHUNK the 8 streams), zero past K; codes/scales as in NVFP4Tensor."""
    rows, k = codes.shape[0], codes.shape[1] * 2
    chunks = triton.cdiv(k, CHUNK)
    out = torch.empty(rows, chunks * CHUNK, dtype=torch.bfloat16, device=codes.device)
    if rows:
        words = code_words(codes)
        grid = (triton.cdiv(rows, _DECODE_ROWS), triton.cdiv(chunks, _DECODE_CHUNKS))
        _decode_operand_kernel[grid](
            words, words.stride(0), scales.view(torch.uint8), scales.stride(0), out, out.stride(0),
            rows, k, USE_ASM=use_asm, BLOCK_R=_DECODE_ROWS, CHUNKS=_DECODE_CHUNKS, num_warps=4,
        )  # fmt: skip
    return out


def code_words(codes: torch.Tensor) -> torch.Tensor:
    """The packed codes uint8 [rows, K/2] (row-contiguous) as int32 words [rows, K/8]."""
    return codes.view(torch.int32)
