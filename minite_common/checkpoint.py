"""On-disk form of miniTE NVFP4 weights (ModelOpt-style names) and ``quantization_config``.

For a linear whose BF16 weight is ``{prefix}.weight`` [N, K], a miniTE checkpoint stores:
- ``{prefix}.weight``          uint8 [N, K/2]   packed E2M1 codes (element 2i in the low nibble)
- ``{prefix}.weight_scale``    float8_e4m3fn [N, K/16]  block scales (16x16 tiles repeated per row)
- ``{prefix}.weight_scale_2``  float32 []       the global decode scale ``1 / S_enc``
and ``config.json`` carries ``quantization_config = {"quant_method": "minite", "recipe": {...},
"fingerprint": ...}``. Each HF tensor (q, k, v, gate, up, down, each expert) is its own NVFP4
tensor with its own global scale, exactly as :func:`quantize_weight` makes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .nvfp4 import NVFP4Tensor
from .recipe import NVFP4Recipe, RecipeMismatchError

QUANT_METHOD = "minite"
SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


def nvfp4_to_state(prefix: str, t: NVFP4Tensor) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized weight (``prefix`` is the module name)."""
    if t.decode_scale.dim() != 0:
        raise ValueError(
            f"{prefix}: a checkpoint stores one NVFP4 tensor per HF weight with a per-tensor "
            "decode scale; split fused weights (q/k/v, gate/up) before saving"
        )
    return {
        f"{prefix}.weight": t.codes,
        f"{prefix}.weight_scale": t.scales,
        f"{prefix}.weight_scale_2": t.decode_scale,
    }


#: The largest weight magnitude a global decode scale may imply. A valid tensor's decode scale is
#: ``amax / 2688`` (2688 = 6 x 448, the largest E2M1 code times the largest E4M3 block scale), so
#: ``decode_scale x 2688`` is the amax it was quantized from; 2^64 (about sqrt(FLT_MAX)) keeps the
#: products of such weights with activations of like magnitude finite in float32, and no trained
#: model comes near it. A larger scale (e.g. 1e30) is a corrupted checkpoint or update.
MAX_IMPLIED_AMAX = 2.0**64
_NVFP4_FIX = "re-create it with `minite quantize-model SRC DST` (or the learner's quantize_weight)"


def expected_nvfp4_state(shape: tuple[int, int]) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """``{suffix: (dtype, shape)}`` of the checkpoint tensors of an NVFP4 weight of logical
    ``shape`` [N, K] (``weight_scale_2`` is 0-d; [1] is accepted too)."""
    n, k = shape
    return {
        "weight": (torch.uint8, (n, k // 2)),
        "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
        "weight_scale_2": (torch.float32, ()),
    }


def check_nvfp4_state_tensor(
    prefix: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, int]
) -> None:
    """Raise naming ``{prefix}.{suffix}`` unless ``tensor`` is a valid checkpoint tensor
    ``suffix`` (one of :data:`SUFFIXES`) of the NVFP4 weight ``prefix`` of logical ``shape``
    [N, K]: the dtype and exact shape of :func:`expected_nvfp4_state`; block scales that are
    neither negative (sign bit set) nor NaN; a global decode scale that is finite, > 0 and at
    most ``MAX_IMPLIED_AMAX / 2688``."""
    name = f"{prefix}.{suffix}"
    want_dtype, want_shape = expected_nvfp4_state(shape)[suffix]
    got_shape = tuple(tensor.shape)
    if got_shape == (1,) and want_shape == ():
        got_shape = ()
    if tensor.dtype != want_dtype or got_shape != want_shape:
        raise ValueError(
            f"{name}: expected {want_dtype} {list(want_shape)} (the miniTE format of a "
            f"{list(shape)} weight), found {tensor.dtype} {list(tensor.shape)}; {_NVFP4_FIX}"
        )
    if suffix == "weight_scale":
        bits = tensor.view(torch.uint8)
        if bool((bits > 0x7E).any()):  # 0x7F: NaN; from 0x80 on: the sign bit is set
            negative = int((bits >= 0x80).sum() - (bits == 0xFF).sum())
            raise ValueError(
                f"{name}: holds {negative} negative and {int(((bits & 0x7F) == 0x7F).sum())} NaN "
                f"E4M3 block scales; block scales are >= 0; {_NVFP4_FIX}"
            )
    elif suffix == "weight_scale_2":
        dec = float(tensor.reshape(()))
        if not (dec > 0 and dec * 2688 <= MAX_IMPLIED_AMAX):  # NaN fails too
            raise ValueError(
                f"{name}: global decode scale {dec:.6g} is not in (0, "
                f"{MAX_IMPLIED_AMAX / 2688:.4g}] (it implies a weight amax of decode scale x 2688, "
                f"at most 2^64); {_NVFP4_FIX}"
            )


def nvfp4_from_state(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    recipe: NVFP4Recipe,
    dtype: torch.dtype = torch.bfloat16,
) -> NVFP4Tensor:
    """Rebuild NVFP4 weight ``prefix`` of logical ``shape`` [N, K]; raise naming what is wrong
    (see :func:`check_nvfp4_state_tensor`)."""
    missing = [f"{prefix}.{s}" for s in SUFFIXES if f"{prefix}.{s}" not in tensors]
    if missing:
        raise ValueError(
            f"{prefix}: the miniTE checkpoint lacks {missing}; re-create it with "
            "`minite quantize-model SRC DST`"
        )
    for suffix in SUFFIXES:
        check_nvfp4_state_tensor(prefix, suffix, tensors[f"{prefix}.{suffix}"], shape)
    codes, scales, dec = (tensors[f"{prefix}.{s}"] for s in SUFFIXES)
    return NVFP4Tensor(
        codes=codes,
        scales=scales,
        decode_scale=dec.reshape(()),
        shape=torch.Size(shape),
        dtype=dtype,
        block_2d=recipe.weight_block_2d,
        recipe_fingerprint=recipe.fingerprint(),
    )


def quantization_config(recipe: NVFP4Recipe) -> dict[str, Any]:
    """The ``quantization_config`` entry of a miniTE checkpoint's ``config.json``."""
    return {
        "quant_method": QUANT_METHOD,
        "recipe": recipe.to_dict(),
        "fingerprint": recipe.fingerprint(),
    }


def recipe_from_quantization_config(cfg: Mapping[str, Any]) -> NVFP4Recipe:
    """The recipe of a miniTE checkpoint; refuses configs whose stored fingerprint disagrees."""
    if cfg.get("quant_method") != QUANT_METHOD:
        raise ValueError(f"not a miniTE checkpoint: quant_method={cfg.get('quant_method')!r}")
    recipe = NVFP4Recipe.from_dict(cfg.get("recipe", {}))
    stored = cfg.get("fingerprint")
    if stored is not None and stored != recipe.fingerprint():
        raise RecipeMismatchError(
            f"checkpoint quantization_config: stored fingerprint {stored!r} does not match its "
            f"recipe ({recipe.fingerprint()!r}); the config was edited or written by another "
            "miniTE version; re-quantize the checkpoint"
        )
    return recipe


def recipe_from_file(path: str | Path, where: str) -> NVFP4Recipe:
    """The recipe in JSON file ``path`` (``NVFP4Recipe.to_dict()`` or a whole miniTE
    ``quantization_config``); errors name ``where`` (e.g. ``--recipe``) and the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise type(e)(f"{where}: cannot read the recipe file {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: {path} holds a JSON {type(data).__name__}; a recipe file holds one object, "
            "NVFP4Recipe.to_dict() or a miniTE quantization_config"
        )
    try:
        if data.get("quant_method") == QUANT_METHOD:
            return recipe_from_quantization_config(data)
        return NVFP4Recipe.from_dict(data)
    except (ValueError, TypeError) as e:
        error = type(e) if isinstance(e, ValueError) else ValueError
        raise error(f"{where} ({path}): {e}") from e
