"""``minite diagnose``: sampler-vs-learner mismatch, first divergent layer, quantizer health.

- ``minite diagnose logprobs SAMPLER.jsonl LEARNER.jsonl``: mismatch figures of two log-prob
  dumps (format: :func:`minite_common.diagnostics.read_logprob_file`).
- ``minite diagnose layers [MODEL_DIR]``: vLLM (miniTE) and Megatron (miniTE) run the same
  tokens; per-layer comparison, first divergent layer, execution-fingerprint diff and quantizer
  health of every layer.
- ``minite diagnose align [MODEL_DIR]``: the four-setup table of :mod:`minite.alignment`;
  ``--sampler-tp N --learner-tp M`` run vLLM and Megatron at those tensor-parallel degrees
  (``--setups ce``: only the miniTE and strict pairs; strict (e) stays exactly 1 at any degrees).
Without MODEL_DIR, the embedded tiny Qwen3 (``--moe``: Qwen3-MoE) is written to a temp dir.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from minite.cli import plain


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="measure and localize sampler/learner mismatch and quantizer health",
        description=plain(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")

    lp = sub.add_parser("logprobs", help="compare two JSONL log-prob dumps")
    lp.add_argument("sampler", type=Path)
    lp.add_argument("learner", type=Path)
    lp.add_argument("--allow-recipe-mismatch", action="store_true")
    lp.add_argument("--tis-cap", type=float, default=2.0)
    _outputs(lp)
    lp.set_defaults(func=run_logprobs)

    for name, helptext, func in (
        ("layers", "run both engines on one prompt and compare them layer by layer", run_layers),
        ("align", "the four-setup sampler/learner alignment table", run_align),
    ):
        sp = sub.add_parser(name, help=helptext)
        sp.add_argument("model_dir", nargs="?", type=Path, help="HF Qwen3 / Qwen3-MoE dir")
        sp.add_argument("--moe", action="store_true", help="embedded tiny model: Qwen3-MoE")
        sp.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
        sp.add_argument("--seed", type=int, default=0)
        if name == "align":
            sp.add_argument("--samples", type=int, default=4, help="completions per prompt")
            sp.add_argument("--max-tokens", type=int, default=16)
            sp.add_argument("--setups", default="abcde", help="which setups to run, e.g. 'ce'")
            sp.add_argument("--sampler-tp", type=int, default=1,
                            help="vLLM tensor-parallel size")  # fmt: skip
            sp.add_argument("--learner-tp", type=int, default=1,
                            help="Megatron tensor-parallel size (spawned gloo ranks)")  # fmt: skip
        _outputs(sp)
        sp.set_defaults(func=func)


def _outputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", type=Path, help="write the full report as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here")


def _model_dir(args: argparse.Namespace) -> Path:
    if args.model_dir is not None:
        return args.model_dir
    from minite.tiny_model import TinyModelSpec, write_tiny_model

    path = Path(tempfile.mkdtemp(prefix="minite-tiny-"))
    tp = max(getattr(args, "sampler_tp", 1), getattr(args, "learner_tp", 1))
    spec = TinyModelSpec(moe=args.moe, num_kv_heads=4 if tp > 2 else 2)  # KV heads split over TP
    return write_tiny_model(path, spec, seed=args.seed)


def _write_json(path: Path | None, payload: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(payload, indent=1, default=str))
        print(f"JSON report: {path}")


def run_logprobs(args: argparse.Namespace) -> int:
    from minite_common.diagnostics import compare_logprob_files, plot_report

    report = compare_logprob_files(
        args.sampler, args.learner, allow_recipe_mismatch=args.allow_recipe_mismatch,
        tis_cap=args.tis_cap,
    )  # fmt: skip
    print(report.table())
    _write_json(args.json, report.to_dict())
    if args.plot:
        print(f"plot: {plot_report(args.plot, report)}")
    return 0


def run_layers(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from minite.alignment import build_learner, layer_alignment, start_sampler, stop_sampler
    from minite_common import DEFAULT_RECIPE
    from minite_common.diagnostics import health_table, layer_health, plot_report
    from minite_megatron import export_hf_weights

    model_dir = _model_dir(args)
    ids = AutoTokenizer.from_pretrained(str(model_dir))(args.prompt)["input_ids"]
    llm = start_sampler(model_dir, seed=args.seed)
    model = build_learner(model_dir, nvfp4=True)
    comparison, fingerprint_diff, sampler = layer_alignment(llm, model, ids)
    stop_sampler(llm)
    print(comparison.table())
    print("execution fingerprints:", "identical" if not fingerprint_diff else "")
    for line in fingerprint_diff:
        print("  " + line)
    nvfp4 = {name.removesuffix(":input") for name in sampler if name.endswith(":input")}
    weights = {
        name.removesuffix(".weight"): tensor
        for name, tensor in export_hf_weights(model)
        if name.removesuffix(".weight") in nvfp4 and not DEFAULT_RECIPE.keeps_bf16(name[:-7])
    }
    activations = {name: sampler[f"{name}:input"] for name in sorted(nvfp4) if name in weights}
    health = layer_health(activations, weights, DEFAULT_RECIPE)
    print(health_table(health))
    _write_json(args.json, {
        "layers": comparison.rows, "first_divergent": comparison.first_divergent,
        "fingerprint_diff": fingerprint_diff, "health": health, "tokens": ids,
    })  # fmt: skip
    if args.plot:
        print(f"plot: {plot_report(args.plot, layers=comparison)}")
    return 0


def run_align(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from minite.alignment import four_setup_table, four_setups
    from minite_common.diagnostics import plot_report

    model_dir = _model_dir(args)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = args.prompt.split()
    prompts = [tok(" ".join(words[: i + 1]))["input_ids"] for i in range(len(words))]
    reports = four_setups(
        model_dir, prompts, n=args.samples, max_tokens=args.max_tokens, seed=args.seed,
        setups=args.setups, sampler_tp=args.sampler_tp, learner_tp=args.learner_tp,
    )  # fmt: skip
    if args.sampler_tp > 1 or args.learner_tp > 1:
        print(f"sampler TP={args.sampler_tp}, learner TP={args.learner_tp}")
    print(four_setup_table(reports))
    _write_json(args.json, {k: r.to_dict() for k, r in reports.items()})
    if args.plot and "c" in reports:
        print(f"plot: {plot_report(args.plot, reports['c'], title='(c) miniTE/miniTE')}")
    return 0
