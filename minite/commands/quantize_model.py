"""``minite quantize-model SRC DST``: write a pre-quantized miniTE checkpoint from a BF16 one."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

INDEX = "model.safetensors.index.json"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize-model",
        help="quantize a BF16 Hugging Face checkpoint to a miniTE NVFP4 checkpoint",
        description="Quantize every linear weight of the Hugging Face checkpoint SRC that the "
        "recipe does not keep in BF16, each HF tensor on its own (16x16 blocks, per-tensor amax), "
        "and write DST: packed codes (.weight), E4M3 block scales (.weight_scale), FP32 global "
        "decode scales (.weight_scale_2), other tensors unchanged, and config.json with the "
        "recipe in quantization_config. vLLM serves DST with `--quantization minite` (or none).",
    )
    p.add_argument(
        "src", type=Path, help="directory of a BF16 checkpoint (config.json, *.safetensors)"
    )
    p.add_argument("dst", type=Path, help="output directory (created; must be new or empty)")
    p.add_argument(
        "--recipe",
        type=Path,
        help="JSON file with NVFP4Recipe.to_dict() or a miniTE quantization_config "
        "(default: the default recipe)",
    )
    p.set_defaults(func=run)


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe=None) -> dict[str, int]:
    """Write the miniTE checkpoint of the BF16 checkpoint ``src`` to ``dst``, one safetensors
    file at a time; return counts of quantized and copied tensors.

    Atomic: everything is written into a temporary folder beside ``dst`` that is renamed to
    ``dst`` once complete, so a failure (a full disk, a refused tensor) leaves no ``dst`` and no
    temporary folder. ``dst`` must not exist or be an empty folder.
    """
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text())
    if "quantization_config" in config:
        raise ValueError(
            f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
            "quantize-model needs a BF16 checkpoint"
        )
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{src} holds no *.safetensors files")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        held = sorted(p.name for p in dst.iterdir())[:4] if dst.is_dir() else []
        raise FileExistsError(
            f"{dst} is not an empty folder{f' (it holds {held})' if held else ''}; quantize-model "
            "writes a whole checkpoint: choose a new or empty output folder"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{dst.name}.partial-", dir=dst.parent))
    try:
        counts = _write_checkpoint(src, partial, config, files, recipe)
        if dst.exists():
            dst.rmdir()
        partial.rename(dst)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return counts


def _write_checkpoint(
    src: Path, dst: Path, config: dict, files: list[Path], recipe
) -> dict[str, int]:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from minite_common import DEFAULT_RECIPE, quantize_weight
    from minite_common.checkpoint import nvfp4_to_state, quantization_config

    recipe = recipe or DEFAULT_RECIPE
    num_layers = config.get(
        "num_hidden_layers", config.get("text_config", {}).get("num_hidden_layers")
    )
    counts = {"quantized": 0, "copied": 0}
    weight_map = {}
    for file in files:
        out = {}
        with safe_open(str(file), "pt") as f:
            names = f.keys()
            for key in names:
                t = f.get_tensor(key)
                module, _, leaf = key.rpartition(".")
                if (
                    leaf == "weight"
                    and t.dim() == 2
                    and t.is_floating_point()
                    and not recipe.keeps_bf16(module, num_layers)
                ):
                    out.update(nvfp4_to_state(module, quantize_weight(t, recipe=recipe, name=key)))
                    counts["quantized"] += 1
                else:
                    out[key] = t
                    counts["copied"] += 1
        save_file(out, str(dst / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, file.name))
    if (src / INDEX).exists():
        total = sum((dst / f.name).stat().st_size for f in files)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (dst / INDEX).write_text(json.dumps(index, indent=2))
    config["quantization_config"] = quantization_config(recipe)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():
        if (
            other.is_file()
            and other.suffix != ".safetensors"
            and other.name not in ("config.json", INDEX)
        ):
            shutil.copy2(other, dst / other.name)
    return counts


def run(args: argparse.Namespace) -> int:
    recipe = None
    if args.recipe is not None:
        from minite_common.checkpoint import recipe_from_file

        recipe = recipe_from_file(args.recipe, "--recipe")
    start = time.perf_counter()
    counts = quantize_checkpoint(args.src, args.dst, recipe)
    print(
        f"wrote {args.dst}: {counts['quantized']} weights quantized to NVFP4, {counts['copied']} "
        f"tensors copied unchanged ({time.perf_counter() - start:.1f} s)"
    )
    return 0
