"""Subcommands of the ``minite`` CLI, one module each (see :mod:`minite.cli`)."""
