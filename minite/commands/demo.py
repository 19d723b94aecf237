"""``minite demo``: the main job (see :mod:`minite.demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from minite.demo import DemoConfig

    d = DemoConfig()
    p = subparsers.add_parser(
        "demo",
        help="NVFP4 RL end to end: vLLM samples, Megatron learns, both bit-exact (CPU, minutes)",
        description="GRPO on single-digit addition with a tiny Qwen3: vLLM with "
        "quantization='minite' samples, Megatron-Core with the miniTE spec learns, weights sync "
        "into vLLM every step; prints reward and sampler/learner mismatch per step and writes a "
        "report (JSON + PNG).",
    )
    p.add_argument("--out", type=Path, default=d.out, help="report directory (%(default)s)")
    p.add_argument("--model", type=Path, help="an HF Qwen3 / Qwen3-MoE dir instead of the tiny one")
    p.add_argument("--moe", action="store_true", help="tiny Qwen3-MoE instead of dense")
    p.add_argument("--tiny", action="store_true", help="smaller and quicker (the CI variant)")
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--steps", type=int, default=d.steps, help="GRPO steps (%(default)s)")
    p.add_argument("--warmup-steps", type=int, help="supervised warm-start steps")
    p.add_argument("--group-size", type=int, default=d.group_size)
    p.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=d.compare,
        help="also run miniTE sampler + BF16 learner and plot both (default: yes)",
    )
    p.add_argument(
        "--strict",
        action=argparse.BooleanOptionalAction,
        default=d.strict,
        help="strict mode, bitwise-equal log-probs on CPU (default: yes)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from minite.demo import DemoConfig, run_demo

    cfg = DemoConfig(out=args.out, model=args.model, moe=args.moe, tiny=args.tiny,
                     hidden_size=args.hidden_size, num_layers=args.num_layers, steps=args.steps,
                     group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                     lr=args.lr, seed=args.seed, compare=args.compare,
                     strict=args.strict)  # fmt: skip
    if args.warmup_steps is not None:
        cfg.warmup_steps = args.warmup_steps
    run_demo(cfg)
    return 0
