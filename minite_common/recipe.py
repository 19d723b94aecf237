"""The NVFP4 recipe: one frozen description of how both engines quantize, and its fingerprint."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

#: Version of the numerical contract (docs/contract.md). Bump on any change to the bits.
#: v2: the Hopper GEMM sums K in 512-element chunks folded in order (v1: one chain over K).
CONTRACT_VERSION = 2

#: HF-style module names that stay in BF16 by default: embeddings, LM head and MoE routers.
DEFAULT_BF16_MODULES: tuple[str, ...] = (
    "{,*.}embed_tokens",
    "{,*.}lm_head",
    "*.mlp.gate",
    "*.mlp.shared_expert_gate",
)

#: Bounds of one module-name pattern (characters, and names it expands to through braces).
MAX_PATTERN_LENGTH = 256
MAX_PATTERN_ALTERNATIVES = 64
_REGEX_ONLY = set("\\()^$|+")
_BRACES = re.compile(r"\{([^{}]*)\}")

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class RecipeMismatchError(ValueError):
    """Two parties (engines, a checkpoint, a layer) were set up with different NVFP4 recipes."""


@dataclass(frozen=True)
class NVFP4Recipe:
    """How linear layers are quantized: NVFP4 (E2M1 codes, E4M3 scales per 16, FP32 global scale).

    The forward fields (block size, 2D weight blocks, activation amax) fix the bits that both
    engines compute; the learner-only fields (stochastic rounding, RHT) shape gradients only.
    ``bf16_modules`` are module-name patterns (see :func:`check_module_pattern`) over HF-style
    module names (``model.layers.0.mlp.gate``) whose layers stay in high precision, as do the
    first ``bf16_first_layers`` and the last ``bf16_last_layers`` decoder layers. ``strict_ops``
    (strict mode, off by default) makes both engines run the ops between the linears and the
    BF16 GEMMs through :mod:`minite_common.ops` too, so their log-probs agree bitwise on CPU.
    ``tp_invariant`` (off by default, implied by ``strict_ops``) makes row-parallel linears
    combine the ranks' partial accumulators deterministically (:mod:`minite_common.parallel`)
    instead of all-reducing rounded outputs, so their outputs do not depend on the TP degree.
    """

    block_size: int = 16
    weight_block_2d: bool = True
    activation_amax: str = "row"
    grad_stochastic_rounding: bool = True
    wgrad_rht: bool = True
    bf16_modules: tuple[str, ...] = DEFAULT_BF16_MODULES
    bf16_first_layers: int = 0
    bf16_last_layers: int = 0
    strict_ops: bool = False
    tp_invariant: bool = False

    def __post_init__(self) -> None:
        if self.block_size != 16:
            raise ValueError(f"NVFP4 uses blocks of 16 elements; got block_size={self.block_size}")
        if self.activation_amax not in ("row", "tensor"):
            raise ValueError(
                f"activation_amax must be 'row' (batch-invariant, the default) or 'tensor' "
                f"(diagnostic comparisons only); got {self.activation_amax!r}"
            )
        if self.bf16_first_layers < 0 or self.bf16_last_layers < 0:
            raise ValueError("bf16_first_layers and bf16_last_layers must be >= 0")
        if isinstance(self.bf16_modules, str):
            raise ValueError(
                f"bf16_modules must be a list of module-name patterns, got the string "
                f"{self.bf16_modules!r}; write [{self.bf16_modules!r}]"
            )
        object.__setattr__(self, "bf16_modules", tuple(self.bf16_modules))
        for pattern in self.bf16_modules:
            check_module_pattern(pattern, "NVFP4Recipe.bf16_modules")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``strict_ops`` and ``tp_invariant`` only when on) plus
        the contract version."""
        d = dataclasses.asdict(self)
        d["bf16_modules"] = list(self.bf16_modules)
        for flag in ("strict_ops", "tp_invariant"):
            if not d[flag]:  # absent when off: recipes written before it keep their fingerprint
                del d[flag]
        d["contract_version"] = CONTRACT_VERSION
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NVFP4Recipe:
        """Inverse of :meth:`to_dict`; refuses a dict written under another contract version."""
        d = dict(d)
        version = d.pop("contract_version", CONTRACT_VERSION)
        if version != CONTRACT_VERSION:
            raise RecipeMismatchError(
                f"recipe was written under miniTE contract v{version}; this miniTE implements "
                f"v{CONTRACT_VERSION}. Re-quantize the checkpoint with this version."
            )
        d.pop("fingerprint", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown NVFP4Recipe fields {unknown}; known: {sorted(known)}")
        if "bf16_modules" in d:
            d["bf16_modules"] = tuple(d["bf16_modules"])
        return cls(**d)

    @property
    def deterministic_tp(self) -> bool:
        """Whether row-parallel linears use the TP-invariant reduction (``tp_invariant`` or
        ``strict_ops``)."""
        return self.tp_invariant or self.strict_ops

    def fingerprint(self) -> str:
        """Stable identifier of this recipe: equal fingerprints mean identical numerics."""
        return _fingerprint(self)

    def keeps_bf16(self, name: str, num_layers: int | None = None) -> bool:
        """Whether the module with HF-style ``name`` stays in high precision under this recipe."""
        if any(module_pattern_matches(p, name) for p in self.bf16_modules):
            return True
        match = _LAYER_INDEX.search(name)
        if match is None:
            return False
        index = int(match.group(1))
        if index < self.bf16_first_layers:
            return True
        if self.bf16_last_layers:
            if num_layers is None:
                raise ValueError(
                    f"recipe keeps the last {self.bf16_last_layers} layers in BF16, so the layer "
                    f"count is needed to place {name!r}"
                )
            return index >= num_layers - self.bf16_last_layers
        return False


def check_module_pattern(pattern: Any, where: str) -> None:
    """Raise naming ``where`` unless ``pattern`` is a valid module-name pattern.

    A pattern is a shell-style glob matched against the *whole* HF module name, case-sensitively:
    ``*`` matches any run of characters (dots included), ``?`` one character, ``[abc]`` /
    ``[!abc]`` one character of / not of a set, ``{a,b}`` one of the comma-separated
    alternatives; every other character, ``.`` included, is literal. So ``*.mlp.gate`` keeps
    every MoE router, ``{,*.}lm_head`` the LM head at the top or inside a wrapper, and
    ``model.layers.1.self_attn.{q,k,v}_proj`` one attention projection. Regular-expression
    syntax (a backslash, ``( ) ^ $ | +``) is refused rather than read as literal text. A pattern
    holds at most :data:`MAX_PATTERN_LENGTH` characters and expands to at most
    :data:`MAX_PATTERN_ALTERNATIVES` globs, each matched without backtracking between its stars,
    so matching a name costs at most (name length x pattern length) steps per glob.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(
            f"{where}: a module-name pattern must be a non-empty string, got {pattern!r}"
        )
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ValueError(
            f"{where}: pattern {pattern[:40]!r}... has {len(pattern)} characters, more than "
            f"{MAX_PATTERN_LENGTH}; split it into several patterns"
        )
    regex_only = "".join(sorted(_REGEX_ONLY & set(pattern)))
    if regex_only:
        raise ValueError(
            f"{where}: pattern {pattern!r} uses regular-expression syntax ({regex_only}); module "
            "patterns are shell-style globs over the whole name (e.g. '*.mlp.gate', "
            "'model.layers.{0,1}.*'): rewrite it as one (re-quantize a checkpoint whose recipe "
            "holds regular expressions)"
        )
    try:
        _module_globs(pattern)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def module_pattern_matches(pattern: str, name: str) -> bool:
    """Whether module-name ``pattern`` (see :func:`check_module_pattern`) matches all of
    ``name``."""
    return any(glob.match(name) is not None for glob in _module_globs(pattern))


@functools.lru_cache(maxsize=1024)
def _module_globs(pattern: str) -> tuple[re.Pattern[str], ...]:
    """``pattern`` with its braces expanded, each alternative compiled (fnmatch turns every
    ``*`` into an atomic group, so a match never backtracks across stars)."""
    todo, globs = [pattern], []
    while todo:
        glob = todo.pop()
        brace = _BRACES.search(glob)
        if brace is None:
            if "{" in glob or "}" in glob:
                raise ValueError(f"pattern {pattern!r} has unbalanced braces")
            globs.append(glob)
            continue
        head, tail = glob[: brace.start()], glob[brace.end() :]
        todo += [head + option + tail for option in brace.group(1).split(",")]
        if len(todo) + len(globs) > MAX_PATTERN_ALTERNATIVES:
            raise ValueError(
                f"pattern {pattern!r} expands to more than {MAX_PATTERN_ALTERNATIVES} "
                "alternatives; split it into several patterns"
            )
    return tuple(re.compile(fnmatch.translate(g)) for g in globs)


@functools.lru_cache(maxsize=64)
def _fingerprint(recipe: NVFP4Recipe) -> str:
    canonical = json.dumps(recipe.to_dict(), sort_keys=True, separators=(",", ":"))
    return f"nvfp4-v{CONTRACT_VERSION}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"


DEFAULT_RECIPE = NVFP4Recipe()


def check_fingerprints(expected: str, got: str, where: str) -> None:
    """Raise :class:`RecipeMismatchError` naming ``where`` unless the two fingerprints are equal."""
    if expected != got:
        raise RecipeMismatchError(
            f"{where}: NVFP4 recipe fingerprint {got!r} differs from the expected {expected!r}. "
            "Both engines (and any pre-quantized checkpoint) must use the same NVFP4Recipe; "
            "re-quantize with the same recipe or pass the matching recipe."
        )
