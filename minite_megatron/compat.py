"""Feature detection across Megatron-Core releases (0.16 and 0.19 differ in keyword sets)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any


@functools.cache
def _parameter_names(fn: Callable[..., Any]) -> frozenset[str] | None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn`` accepts (all of them if it takes ``**kwargs``)."""
    names = _parameter_names(fn)
    if names is None:
        return dict(kwargs)
    return {k: v for k, v in kwargs.items() if k in names}


def megatron_core_version() -> str:
    """The installed Megatron-Core version string."""
    from megatron.core.package_info import __version__

    return __version__
