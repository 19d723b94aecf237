"""The NVFP4 recipe: one frozen description of how both engines quantize, and its fingerprint."""

from __future__ import annotations

import dataclasses
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
    r"(^|\.)embed_tokens$",
    r"(^|\.)lm_head$",
    r"\.mlp\.gate$",
    r"\.mlp\.shared_expert_gate$",
)

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class RecipeMismatchError(ValueError):
    """Two parties (engines, a checkpoint, a layer) were set up with different NVFP4 recipes."""


@dataclass(frozen=True)
class NVFP4Recipe:
    """How linear layers are quantized: NVFP4 (E2M1 codes, E4M3 scales per 16, FP32 global scale).

    The forward fields (block size, 2D weight blocks, activation amax) fix the bits that both
    engines compute; the learner-only fields (stochastic rounding, RHT) shape gradients only.
    ``bf16_modules`` are regular expressions over HF-style module names
    (``model.layers.0.mlp.gate``) whose layers stay in high precision, as do the first
    ``bf16_first_layers`` and the last ``bf16_last_layers`` decoder layers. ``strict_ops``
    (strict mode, off by default) makes both engines run the ops between the linears and the
    BF16 GEMMs through :mod:`minite_common.ops` too, so their log-probs agree bitwise on CPU.
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
        object.__setattr__(self, "bf16_modules", tuple(self.bf16_modules))
        for pattern in self.bf16_modules:
            re.compile(pattern)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (``strict_ops`` only when on) plus the contract
        version."""
        d = dataclasses.asdict(self)
        d["bf16_modules"] = list(self.bf16_modules)
        if not self.strict_ops:  # absent when off: recipes written before it keep their fingerprint
            del d["strict_ops"]
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

    def fingerprint(self) -> str:
        """Stable identifier of this recipe: equal fingerprints mean identical numerics."""
        return _fingerprint(self)

    def keeps_bf16(self, name: str, num_layers: int | None = None) -> bool:
        """Whether the module with HF-style ``name`` stays in high precision under this recipe."""
        if any(re.search(p, name) for p in self.bf16_modules):
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
