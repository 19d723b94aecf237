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


def nvfp4_from_state(
    prefix: str,
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    recipe: NVFP4Recipe,
    dtype: torch.dtype = torch.bfloat16,
) -> NVFP4Tensor:
    """Rebuild NVFP4 weight ``prefix`` of logical ``shape`` [N, K]; raise naming what is wrong."""
    missing = [f"{prefix}.{s}" for s in SUFFIXES if f"{prefix}.{s}" not in tensors]
    if missing:
        raise ValueError(
            f"{prefix}: the miniTE checkpoint lacks {missing}; re-create it with "
            "`minite quantize-model SRC DST`"
        )
    n, k = shape
    codes, scales, dec = (tensors[f"{prefix}.{s}"] for s in SUFFIXES)
    if tuple(dec.shape) == (1,):
        dec = dec.reshape(())
    expected = {
        "weight": (torch.uint8, (n, k // 2)),
        "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
        "weight_scale_2": (torch.float32, ()),
    }
    for suffix, tensor in zip(SUFFIXES, (codes, scales, dec), strict=True):
        want_dtype, want_shape = expected[suffix]
        got_shape = tuple(tensor.shape)
        if tensor.dtype != want_dtype or got_shape != want_shape:
            raise ValueError(
                f"{prefix}.{suffix}: expected {want_dtype} {list(want_shape)}, found "
                f"{tensor.dtype} {list(got_shape)} (for a [{n}, {k}] layer)"
            )
    if not bool(torch.isfinite(dec)) or float(dec) <= 0:
        raise ValueError(f"{prefix}.weight_scale_2: global decode scale {float(dec)} is invalid")
    if bool(torch.isnan(scales.float()).any()):
        raise ValueError(f"{prefix}.weight_scale: holds NaN block scales")
    return NVFP4Tensor(
        codes=codes,
        scales=scales,
        decode_scale=dec,
        shape=torch.Size((n, k)),
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
