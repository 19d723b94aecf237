"""The ``minite`` command line. Each subcommand lives in ``minite/commands/<name>.py`` and
exposes ``add_parser(subparsers)``, which registers it and sets ``func(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from . import commands


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand found in :mod:`minite.commands`."""
    parser = argparse.ArgumentParser(
        prog="minite",
        description="miniTE: bit-exact NVFP4 (W4A4) between a vLLM sampler and a Megatron learner.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"{commands.__name__}.{info.name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``minite`` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
