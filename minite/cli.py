"""The ``minite`` command line. Each subcommand lives in ``minite/commands/<name>.py`` and
exposes ``add_parser(subparsers)``, which registers it and sets ``func(args) -> int``.

A user error (a bad path, bad JSON, a refused checkpoint or config: :data:`USER_ERRORS`) prints
one line ``minite: error: ...`` and exits with status 2; any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys

from . import commands

#: Exceptions that report bad input (OSError: paths and files; ValueError: JSON, recipes,
#: configs, checkpoints miniTE refuses); the CLI prints them as one line.
USER_ERRORS = (OSError, ValueError)

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain(text: str) -> str:
    """Docstring ``text`` as plain help text: Sphinx roles and double backticks removed."""
    return _ROLE.sub(r"\1", text).replace("``", "")


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
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"minite: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
