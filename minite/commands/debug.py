"""``minite debug``: per-layer precision debugging applied identically in both engines.

- ``minite debug check CONFIG.yaml [MODEL_DIR]``: validate a debug configuration against a model
  (unknown features, patterns that match no layer of either engine, layers in one engine only).
- ``minite debug bisect --signal MODULE:FUNCTION [MODEL_DIR]``: find the layer whose NVFP4
  quantization causes most of a signal, in about log2(layers) rounds. ``FUNCTION(model_dir,
  bf16_layers) -> float`` runs your check with those HF layers' GEMMs in BF16 in both engines
  (e.g. by writing a debug config with :meth:`DebugConfig.disabling` and pointing
  ``MINITE_DEBUG_CONFIG`` at it) and returns the figure to minimize. The default signal,
  ``minite.debug_signals:nvfp4_logprob_error``, is the learner's mean |log-prob difference|
  against its BF16 model on a fixed text.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
from pathlib import Path

from minite.cli import plain


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "debug",
        help="per-layer precision debugging (BF16 switches, tensor stats, bisection)",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    check = sub.add_parser("check", help="validate a debug config against a model")
    check.add_argument("config", type=Path)
    check.add_argument("model_dir", nargs="?", type=Path)
    check.set_defaults(func=run_check)
    bisect = sub.add_parser("bisect", help="narrow down the layers responsible for a signal")
    bisect.add_argument("model_dir", nargs="?", type=Path)
    bisect.add_argument("--signal", default="minite.debug_signals:nvfp4_logprob_error",
                        help="MODULE:FUNCTION(model_dir, bf16_layers) -> float")  # fmt: skip
    bisect.add_argument("--json", type=Path, help="write the rounds as JSON here")
    bisect.set_defaults(func=run_bisect)


def _model_dir(path: Path | None) -> Path:
    if path is not None:
        return path
    from minite.tiny_model import write_tiny_model

    return write_tiny_model(Path(tempfile.mkdtemp(prefix="minite-tiny-")))


def run_check(args: argparse.Namespace) -> int:
    from minite.debug_signals import quantizable_layers, sampler_layers
    from minite_common.debug import DebugConfig, check_same_layers

    config = DebugConfig.load(args.config)
    model_dir = _model_dir(args.model_dir)
    learner, sampler = quantizable_layers(model_dir), sampler_layers(model_dir)
    config.check_layers(learner, "learner")
    config.check_layers(sampler, "sampler")
    check_same_layers(learner, sampler, config)
    print(f"{args.config}: {len(config.rules)} rules, all valid for {model_dir}")
    return 0


def run_bisect(args: argparse.Namespace) -> int:
    from minite.debug_signals import quantizable_layers
    from minite_common.debug import bisect_layers

    module, _, name = args.signal.partition(":")
    signal = getattr(importlib.import_module(module), name)
    model_dir = _model_dir(args.model_dir)
    layers = quantizable_layers(model_dir)
    layer, history = bisect_layers(layers, lambda bf16: signal(model_dir, bf16))
    print(f"most responsible layer: {layer}")
    if args.json:
        args.json.write_text(json.dumps({"layer": layer, "rounds": history}, indent=1))
    return 0
