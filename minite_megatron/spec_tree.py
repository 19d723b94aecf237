"""One walker over Megatron spec trees, for every rewrite miniTE makes of them (NVFP4 linears,
grouped experts, strict modules, the benchmarks' class swaps).

A spec tree is made of ``ModuleSpec`` (module, params, submodules, metainfo), ``functools.partial``
(Megatron 0.19 writes some specs that way), submodule dataclasses and lists; the rewrite keeps
that structure, so each Megatron-Core release gets the shape it expects.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from megatron.core.transformer.spec_utils import ModuleSpec

#: What a visitor returns to keep walking into a node (any other value replaces the node).
DESCEND = object()

Visitor = Callable[[Any, tuple[str, ...]], Any]


def map_spec(obj: Any, visit: Visitor, path: tuple[str, ...] = ()) -> Any:
    """A copy of the spec tree ``obj`` in which every node that ``visit(node, path)`` replaces
    (returns anything but :data:`DESCEND`) is replaced, the children of the others mapped.

    ``path`` holds the dataclass field names from the root to the node. Every node is visited:
    ``ModuleSpec`` and ``partial`` nodes, then their ``module`` / ``func`` (classes, at the same
    path), arguments and submodules, dataclass fields and list items. ``params`` and
    ``metainfo`` dicts are copied, not walked.
    """
    new = visit(obj, path)
    if new is not DESCEND:
        return new
    if isinstance(obj, ModuleSpec):
        return ModuleSpec(
            module=map_spec(obj.module, visit, path),
            params=dict(obj.params),
            submodules=map_spec(obj.submodules, visit, path),
            metainfo=dict(getattr(obj, "metainfo", None) or {}),
        )
    if isinstance(obj, functools.partial):
        return functools.partial(
            map_spec(obj.func, visit, path),
            *(map_spec(a, visit, path) for a in obj.args),
            **{k: map_spec(v, visit, path) for k, v in obj.keywords.items()},
        )
    if isinstance(obj, list):
        return [map_spec(o, visit, path) for o in obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj,
            **{
                f.name: map_spec(getattr(obj, f.name), visit, (*path, f.name))
                for f in dataclasses.fields(obj)
                if f.init
            },
        )
    return obj


def replace_class(obj: Any, old: type, new: type) -> Any:
    """A copy of the spec tree ``obj`` with the class ``old`` replaced by ``new`` everywhere."""
    return map_spec(obj, lambda node, _: new if node is old else DESCEND)
