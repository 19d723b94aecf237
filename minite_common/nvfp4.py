"""NVFP4 tensors and the contract's quantizer (docs/contract.md sections 1-3), in plain torch.

This module is the reference of the format: every other implementation (the Triton kernels on the
GPU) must produce the same bytes. All arithmetic is float32 with IEEE division and round to nearest
even, in exactly the order the contract writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import minite_kernels
import torch
from minite_kernels.dispatch import kernel_arch

from .recipe import DEFAULT_RECIPE, NVFP4Recipe

BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
FLT_MAX = torch.finfo(torch.float32).max
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: The value of each 4-bit E2M1 code (bit 3 is the sign).
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)

# Rounding thresholds on |v| between consecutive E2M1 magnitudes, ties to the even code: a
# magnitude moves past threshold i when it is greater (strict) or at least (inclusive) the value.
_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                    (3.5, True), (5.0, False))  # fmt: skip


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """A 2D tensor ``[rows, K]`` in NVFP4, quantized over its last dimension.

    ``codes`` uint8 ``[rows, K/2]`` (element 2i in the low nibble), ``scales`` float8_e4m3fn
    ``[rows, K/16]`` (one per 16 elements, unswizzled; with 2D blocks each 16x16 tile's scale is
    repeated on its 16 rows), ``decode_scale`` float32 ``[rows]`` (per-row amax, or a per-channel
    expansion) or 0-d (per-tensor amax). Value = code * f32(scale) * decode_scale.
    ``recipe_fingerprint`` names the recipe it was quantized under. ``kernel_layout``: a
    kernel-friendly copy of ``codes`` and ``scales`` (see
    :func:`~minite_common.linear.with_kernel_layout`), never part of the numbers; the kernels use
    it only while it matches these very codes and scales.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    decode_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block_2d: bool = False
    recipe_fingerprint: str = DEFAULT_RECIPE.fingerprint()
    kernel_layout: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        rows, k = self.shape
        if self.codes.dtype != torch.uint8 or tuple(self.codes.shape) != (rows, k // 2):
            raise ValueError(
                f"NVFP4Tensor codes must be uint8 [{rows}, {k // 2}], got "
                f"{self.codes.dtype} {list(self.codes.shape)}"
            )
        if self.scales.dtype != torch.float8_e4m3fn or tuple(self.scales.shape) != (rows, k // 16):
            raise ValueError(
                f"NVFP4Tensor scales must be float8_e4m3fn [{rows}, {k // 16}], got "
                f"{self.scales.dtype} {list(self.scales.shape)}"
            )
        if self.decode_scale.dtype != torch.float32 or self.decode_scale.shape not in (
            torch.Size([]),
            torch.Size([rows]),
        ):
            raise ValueError(
                f"NVFP4Tensor decode_scale must be float32 of shape [] or [{rows}], got "
                f"{self.decode_scale.dtype} {list(self.decode_scale.shape)}"
            )

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> NVFP4Tensor:
        """The same tensor on ``device``."""
        return replace(
            self,
            codes=self.codes.to(device),
            scales=self.scales.to(device),
            decode_scale=self.decode_scale.to(device),
            kernel_layout=None,
        )

    def channel_decode_scale(self) -> torch.Tensor:
        """The decode scale as a float32 vector ``[rows]`` (expanded if per-tensor)."""
        return self.decode_scale.expand(self.rows).contiguous()

    def narrow_rows(self, start: int, length: int) -> NVFP4Tensor:
        """Rows ``start:start+length`` (views); 2D tiles may not be cut."""
        if self.block_2d and (start % BLOCK or (length % BLOCK and start + length != self.rows)):
            raise ValueError(
                f"cannot cut rows {start}:{start + length} of a 2D-block NVFP4 tensor: row "
                "slices must start and end on multiples of 16 so that no 16x16 tile is split"
            )
        dec = self.decode_scale
        return replace(
            self,
            codes=self.codes.narrow(0, start, length),
            scales=self.scales.narrow(0, start, length),
            decode_scale=dec if dec.dim() == 0 else dec.narrow(0, start, length),
            shape=torch.Size((length, self.cols)),
            kernel_layout=None,
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See :func:`dequantize_nvfp4`."""
        return dequantize_nvfp4(self, dtype)


def cat_rows(parts: list[NVFP4Tensor]) -> NVFP4Tensor:
    """Stack NVFP4 tensors along rows (e.g. q, k, v); decode scales become per-row vectors.

    Each part keeps its own codes, block scales and decode scale, so no bit changes.
    """
    if not parts:
        raise ValueError("cat_rows needs at least one NVFP4Tensor")
    first = parts[0]
    for p in parts[1:]:
        if p.cols != first.cols or p.recipe_fingerprint != first.recipe_fingerprint:
            raise ValueError(
                "cat_rows: parts must share K and recipe; got "
                f"K={[q.cols for q in parts]}, recipes={[q.recipe_fingerprint for q in parts]}"
            )
        if p.block_2d != first.block_2d:
            raise ValueError("cat_rows: cannot mix 1x16 and 16x16-block NVFP4 tensors")
    if first.block_2d and any(p.rows % BLOCK for p in parts[:-1]):
        raise ValueError("cat_rows: 2D-block parts (except the last) need a multiple of 16 rows")
    return NVFP4Tensor(
        codes=torch.cat([p.codes for p in parts]),
        scales=torch.cat([p.scales for p in parts]),
        decode_scale=torch.cat([p.channel_decode_scale() for p in parts]),
        shape=torch.Size((sum(p.rows for p in parts), first.cols)),
        dtype=first.dtype,
        block_2d=first.block_2d,
        recipe_fingerprint=first.recipe_fingerprint,
    )


def check_quantizable(x: torch.Tensor, what: str = "tensor") -> None:
    """Raise a clear error unless ``x`` is a 2D float tensor whose last dimension is a positive
    multiple of 16."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{what}: NVFP4 quantizes float32, bfloat16 or float16 tensors, got {x.dtype}; "
            "cast it first (e.g. x.to(torch.bfloat16))"
        )
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2D tensor [rows, K], got shape {list(x.shape)}")
    if x.shape[1] == 0 or x.shape[1] % BLOCK:
        raise ValueError(
            f"{what}: the quantized (last) dimension K={x.shape[1]} must be a positive multiple of "
            "16 (NVFP4 scales blocks of 16 elements); pad K or keep this layer in BF16"
        )


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """``S_enc = min(f32(2688 / amax), FLT_MAX)``, 1 where amax is 0 or the result is 0."""
    amax = amax.float()
    s_enc = torch.clamp(torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax, max=FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def _block_amax(x: torch.Tensor, block_2d: bool) -> torch.Tensor:
    rows, k = x.shape
    mag = x.abs()
    if not block_2d:
        return mag.view(rows, k // BLOCK, BLOCK).amax(dim=-1)
    padded = -(-rows // BLOCK) * BLOCK
    if padded != rows:
        mag = torch.cat([mag, mag.new_zeros(padded - rows, k)])
    tiles = mag.view(padded // BLOCK, BLOCK, k // BLOCK, BLOCK).amax(dim=(1, 3))
    return tiles.repeat_interleave(BLOCK, dim=0)[:rows]


def _e2m1_round_nearest(v: torch.Tensor) -> torch.Tensor:
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for threshold, inclusive in _E2M1_THRESHOLDS:
        code += (mag >= threshold if inclusive else mag > threshold).to(torch.uint8)
    return code


def _e2m1_round_stochastic(v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    values = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=v.device)
    mag = v.abs()
    low = (torch.bucketize(mag, values, right=True) - 1).clamp(max=7)
    high = (low + 1).clamp(max=7)
    lo_val, hi_val = values[low], values[high]
    width = torch.where(high > low, hi_val - lo_val, torch.ones_like(mag))
    u = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
    return torch.where(u * width < mag - lo_val, high, low).to(torch.uint8)


def _given_amax(
    global_amax: torch.Tensor | float, amax: str, rows: int, device: torch.device
) -> torch.Tensor:
    g = torch.as_tensor(global_amax, dtype=torch.float32, device=device)
    if amax == "tensor" and g.numel() == 1:
        return g.reshape(())
    if amax == "row" and g.shape in (torch.Size([]), torch.Size([rows])):
        return g.expand(rows)
    raise ValueError(
        f"global_amax of shape {list(g.shape)} does not fit amax={amax!r} with {rows} rows "
        "(expected a scalar, or one value per row for amax='row')"
    )


def quantize_nvfp4(
    x: torch.Tensor,
    *,
    amax: str = "row",
    block_2d: bool = False,
    recipe: NVFP4Recipe = DEFAULT_RECIPE,
    global_amax: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> NVFP4Tensor:
    """Quantize a 2D float tensor to NVFP4 over its last dimension, bit-exact to recipe v1.

    ``amax="row"`` gives one global scale per row (activations), ``"tensor"`` one for the whole
    tensor (weights); ``global_amax`` overrides the computed amax (tensor-parallel shards pass the
    MAX-reduced amax of the full tensor). ``block_2d`` uses 16x16 tiles (a partial last tile acts
    as zero-padded). ``stochastic`` rounds codes stochastically (learner gradients only).
    A row (or tensor) holding NaN/Inf is quantized with those elements as 0 and gets a NaN decode
    scale, so everything computed from it is NaN, never a finite wrong number.
    """
    check_quantizable(x)
    if amax not in ("row", "tensor"):
        raise ValueError(f"amax must be 'row' or 'tensor', got {amax!r}")
    if block_2d and amax != "tensor":
        raise ValueError(
            "16x16 blocks need one global scale for the whole tile (amax='tensor'); per-row "
            "amax would give a tile's rows different scales and break the W/W^T symmetry"
        )
    rows, k = x.shape
    if not stochastic and kernel_arch(x.device):  # Triton kernel on sm_90+: the same bytes
        given = None if global_amax is None else _given_amax(global_amax, amax, rows, x.device)
        codes, scales, decode = minite_kernels.quantize_nvfp4(
            x, amax=amax, block_2d=block_2d, global_amax=given
        )
        return NVFP4Tensor(
            codes=codes,
            scales=scales,
            decode_scale=decode,
            shape=torch.Size((rows, k)),
            dtype=x.dtype,
            block_2d=block_2d,
            recipe_fingerprint=recipe.fingerprint(),
        )
    x32 = x.float()
    finite = torch.isfinite(x32)
    x32 = torch.where(finite, x32, torch.zeros_like(x32))
    if amax == "row":
        nonfinite = ~finite.all(dim=1)
        amax_v = x32.abs().amax(dim=1) if rows else x32.new_zeros(0)
    else:
        nonfinite = ~finite.all()
        amax_v = x32.abs().amax() if x32.numel() else x32.new_zeros(())
    if global_amax is not None:
        amax_v = _given_amax(global_amax, amax, rows, x.device)
    s_enc = global_encode_scale(amax_v)
    s_dec = torch.ones_like(s_enc) / s_enc
    s_enc_b, s_dec_b = (
        (s_enc.unsqueeze(-1), s_dec.unsqueeze(-1)) if amax == "row" else (s_enc, s_dec)
    )

    sixth = torch.tensor(1.0 / 6.0, dtype=torch.float32, device=x.device)
    block_scale_f32 = torch.clamp(_block_amax(x32, block_2d) * (s_enc_b * sixth), max=E4M3_MAX)
    scales = block_scale_f32.to(torch.float8_e4m3fn)
    block_dec = scales.float() * s_dec_b
    encode = torch.clamp(torch.ones_like(block_dec) / block_dec, max=FLT_MAX)
    scaled = torch.clamp(x32 * encode.repeat_interleave(BLOCK, dim=1), -E2M1_MAX, E2M1_MAX)
    if stochastic:
        magnitude = _e2m1_round_stochastic(scaled, generator)
    else:
        magnitude = _e2m1_round_nearest(scaled)
    codes = magnitude | ((scaled < 0).to(torch.uint8) << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    decode = torch.where(nonfinite, torch.full_like(s_dec, float("nan")), s_dec)
    return NVFP4Tensor(
        codes=packed.contiguous(),
        scales=scales.contiguous(),
        decode_scale=decode.contiguous(),
        shape=torch.Size((rows, k)),
        dtype=x.dtype,
        block_2d=block_2d,
        recipe_fingerprint=recipe.fingerprint(),
    )


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 ``[rows, K/2]`` packed codes -> uint8 ``[rows, K]`` 4-bit codes (low nibble first)."""
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2)


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``f32(f32(code * f32(scale)) * decode_scale)`` as ``dtype`` (default: the original dtype)."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=t.device)
    values = lut[unpack_codes(t.codes).long()]
    scaled = values * t.scales.float().repeat_interleave(BLOCK, dim=1)
    dec = t.decode_scale.unsqueeze(-1) if t.decode_scale.dim() else t.decode_scale
    return (scaled * dec).to(dtype or t.dtype)
