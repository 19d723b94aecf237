"""Precision debugging per layer, applied identically in the sampler and the learner.

One :class:`DebugConfig` (YAML file or dict) selects layers by module-name patterns (shell-style
globs over whole HF-style names, see :func:`minite_common.recipe.check_module_pattern`) and turns
features on for them:

```yaml
output_dir: minite-debug        # JSON-lines stats go here, one file per engine process
tensorboard: false              # also write TensorBoard scalars (needs the tensorboard package)
rules:
  - layers: model.layers.1.mlp.down_proj
    disable_quantization: true  # run this GEMM in BF16 instead of NVFP4, in both engines
  - layers: '*.self_attn.o_proj'
    log_tensor_stats:
      tensors: [activation, weight, output, gradient]
      freq: 10                  # every 10th call of the layer (the learner adds gradients)
```

``disable_quantization`` works through the recipe (:meth:`DebugConfig.apply_to_recipe` adds the
patterns to ``bf16_modules``), so it changes the recipe fingerprint in both engines alike and the
diagnostics see both engines agree. Both plugins read the config from the ``MINITE_DEBUG_CONFIG``
environment variable (a path), which every vLLM worker process inherits, or from
:func:`activate`. With no active config every hook is a single ``None`` check.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .health import tensor_stats
from .nvfp4 import quantize_nvfp4
from .recipe import NVFP4Recipe, check_module_pattern, module_pattern_matches

ENV_VAR = "MINITE_DEBUG_CONFIG"
TENSOR_KINDS = ("activation", "weight", "output", "gradient")
_FEATURES = ("disable_quantization", "log_tensor_stats")


class DebugConfigError(ValueError):
    """A debug configuration is malformed or does not fit the model it is applied to."""


@dataclass(frozen=True)
class StatsRule:
    """Log statistics of ``tensors`` every ``freq``-th call of the matched layers."""

    tensors: tuple[str, ...] = TENSOR_KINDS
    freq: int = 1


@dataclass(frozen=True)
class DebugRule:
    """One rule: a module-name pattern and the features it turns on."""

    layers: str
    disable_quantization: bool = False
    log_tensor_stats: StatsRule | None = None

    def matches(self, name: str) -> bool:
        return module_pattern_matches(self.layers, name)


@dataclass(frozen=True)
class DebugConfig:
    """The whole debug configuration (see the module docstring for the YAML form)."""

    rules: tuple[DebugRule, ...] = ()
    output_dir: str = "minite-debug"
    tensorboard: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DebugConfig:
        """Parse and validate; unknown keys or features, patterns that are not module-name
        globs and values of the wrong type raise :class:`DebugConfigError`."""
        if not isinstance(d, Mapping):
            raise DebugConfigError(
                f"a debug config is a mapping with keys rules, output_dir, tensorboard; got "
                f"{type(d).__name__} {d!r}"
            )
        unknown = set(d) - {"rules", "output_dir", "tensorboard"}
        if unknown:
            raise DebugConfigError(f"unknown debug config keys {sorted(unknown)}")
        raw_rules = d.get("rules", [])
        if not isinstance(raw_rules, list):
            raise DebugConfigError(
                f"rules: expected a list of rules (each a mapping with 'layers'), got "
                f"{type(raw_rules).__name__} {raw_rules!r}"
            )
        rules = []
        for i, r in enumerate(raw_rules):
            if not isinstance(r, Mapping):
                raise DebugConfigError(
                    f"rule {i}: expected a mapping with 'layers' and features, got {r!r}"
                )
            if "layers" not in r:
                raise DebugConfigError(f"rule {i} has no 'layers' module-name pattern")
            bad = set(r) - {"layers", *_FEATURES}
            if bad:
                raise DebugConfigError(
                    f"rule {i}: unknown feature(s) {sorted(bad)}; known: {list(_FEATURES)}"
                )
            try:
                check_module_pattern(r["layers"], f"rule {i}: layers")
            except ValueError as e:
                raise DebugConfigError(str(e)) from None
            stats = r.get("log_tensor_stats")
            if stats is not None:
                stats = dict(stats) if isinstance(stats, Mapping) else {}
                tensors = stats.pop("tensors", TENSOR_KINDS)
                freq = stats.pop("freq", 1)
                if (
                    stats
                    or not isinstance(tensors, list | tuple)
                    or not set(tensors) <= set(TENSOR_KINDS)
                    or not isinstance(freq, int)
                    or isinstance(freq, bool)
                    or freq < 1
                ):
                    raise DebugConfigError(
                        f"rule {i}: log_tensor_stats takes tensors (a list from "
                        f"{list(TENSOR_KINDS)}) and freq (an integer >= 1); got "
                        f"{r['log_tensor_stats']!r}"
                    )
                stats = StatsRule(tensors=tuple(tensors), freq=freq)
            rules.append(
                DebugRule(
                    layers=r["layers"],
                    disable_quantization=_flag(r, "disable_quantization", f"rule {i}"),
                    log_tensor_stats=stats,
                )
            )
        return cls(
            rules=tuple(rules),
            output_dir=str(d.get("output_dir", "minite-debug")),
            tensorboard=_flag(d, "tensorboard", "debug config"),
        )

    @classmethod
    def disabling(cls, patterns: Iterable[str], **kwargs: Any) -> DebugConfig:
        """A configuration that runs the layers matching ``patterns`` (module-name globs) in
        BF16."""
        return cls(rules=tuple(DebugRule(p, disable_quantization=True) for p in patterns), **kwargs)

    @classmethod
    def load(cls, path: str | Path) -> DebugConfig:
        """Read a YAML (or JSON) file; errors (bad YAML, a bad config) name it."""
        import yaml

        with open(path) as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise DebugConfigError(f"{path}: not valid YAML ({e})") from None
        try:
            return cls.from_dict(data or {})
        except DebugConfigError as e:
            raise DebugConfigError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def apply_to_recipe(self, recipe: NVFP4Recipe) -> NVFP4Recipe:
        """The recipe with every ``disable_quantization`` pattern kept in BF16."""
        extra = tuple(r.layers for r in self.rules if r.disable_quantization)
        if not extra:
            return recipe
        return dataclasses.replace(recipe, bf16_modules=recipe.bf16_modules + extra)

    def stats_rule(self, name: str) -> StatsRule | None:
        """The stats settings of layer ``name`` (the first matching rule wins)."""
        for r in self.rules:
            if r.log_tensor_stats is not None and r.matches(name):
                return r.log_tensor_stats
        return None

    def check_layers(self, names: Iterable[str], engine: str) -> None:
        """Raise if a rule matches none of an engine's quantizable layer ``names``."""
        names = list(names)
        for i, r in enumerate(self.rules):
            if not any(r.matches(n) for n in names):
                raise DebugConfigError(
                    f"rule {i} ({r.layers!r}) matches no layer of the {engine}; its layers are "
                    f"named like {names[:3]}"
                )


def _flag(d: Mapping[str, Any], key: str, where: str) -> bool:
    """``d[key]`` (False when absent), which must be a real boolean: ``"no"`` is not False."""
    value = d.get(key, False)
    if not isinstance(value, bool):
        raise DebugConfigError(
            f"{where}: {key} must be true or false (a YAML boolean), got {value!r}"
        )
    return value


def check_same_layers(a: Iterable[str], b: Iterable[str], config: DebugConfig) -> None:
    """Raise if a rule selects a layer in one engine but not in the other."""
    a, b = set(a), set(b)
    for r in config.rules:
        only = sorted({n for n in a ^ b if r.matches(n)})
        if only:
            raise DebugConfigError(
                f"rule {r.layers!r} selects layers present in one engine only: {only[:5]}"
            )


@dataclass
class DebugSession:
    """The active configuration in one process, with per-layer call counters and the writers.

    ``recipe`` is the engine's recipe: statistics quantize tensors the way it does.
    """

    config: DebugConfig
    engine: str
    recipe: NVFP4Recipe = field(default_factory=NVFP4Recipe)
    calls: dict[str, int] = field(default_factory=dict)
    _file: Any = None
    _tb: Any = None

    def next_call(self, name: str) -> tuple[int, StatsRule | None]:
        """Count a call of layer ``name``; return its index and the stats rule if due now."""
        rule = self.config.stats_rule(name)
        index = self.calls.get(name, 0)
        self.calls[name] = index + 1
        if rule is None or index % rule.freq:
            return index, None
        return index, rule

    def log(self, name: str, kind: str, call: int, x: torch.Tensor) -> None:
        """Append one stats record for tensor ``kind`` of layer ``name``."""
        recipe = self.recipe
        x2 = x.detach().reshape(-1, x.shape[-1])
        quantizable = x2.shape[-1] % 16 == 0 and x2.dtype.is_floating_point and x2.numel()
        block_2d = kind == "weight" and recipe.weight_block_2d
        amax = "tensor" if kind in ("weight", "gradient") else recipe.activation_amax
        q = quantize_nvfp4(x2, amax=amax, block_2d=block_2d, recipe=recipe) if quantizable else None
        record = {"engine": self.engine, "layer": name, "tensor": kind, "call": call,
                  **tensor_stats(x2, q)}  # fmt: skip
        if self._file is None:
            out = Path(self.config.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._file = open(out / f"{self.engine}-{os.getpid()}.jsonl", "a")  # noqa: SIM115
            if self.config.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out / f"tb-{self.engine}-{os.getpid()}"))
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, float) and math.isfinite(value):
                    self._tb.add_scalar(f"{name}/{kind}/{key}", value, call)


_ACTIVATED: dict[str, DebugSession | None] = {}
_FROM_ENV: dict[tuple[str, str], DebugSession] = {}


def activate(config: DebugConfig | None, engine: str) -> None:
    """Make ``config`` the debug configuration of ``engine`` in this process (None: off, whatever
    the environment says); call it before the engine builds its model. :func:`deactivate`
    returns to the environment variable."""
    _ACTIVATED[engine] = None if config is None else DebugSession(config, engine)


def deactivate(engine: str) -> None:
    """Forget :func:`activate` for ``engine``: ``MINITE_DEBUG_CONFIG`` decides again."""
    _ACTIVATED.pop(engine, None)


def session(engine: str) -> DebugSession | None:
    """The active session of ``engine``: from :func:`activate`, else ``MINITE_DEBUG_CONFIG``.

    Engines consult it while building their layers only, so with no configuration nothing is
    hooked and the forward and backward paths run no debug code at all."""
    if engine in _ACTIVATED:
        return _ACTIVATED[engine]
    path = os.environ.get(ENV_VAR)
    if not path:
        return None
    if (engine, path) not in _FROM_ENV:
        _FROM_ENV[(engine, path)] = DebugSession(DebugConfig.load(path), engine)
    return _FROM_ENV[(engine, path)]


def debug_recipe(recipe: NVFP4Recipe, engine: str) -> NVFP4Recipe:
    """``recipe`` with the active debug configuration's BF16 layers (unchanged when none), and
    the session set to quantize its statistics that way. Both plugins call this once."""
    s = session(engine)
    if s is None:
        return recipe
    s.recipe = s.config.apply_to_recipe(recipe)
    return s.recipe


def linear_hook(
    engine: str, names: Sequence[str], weight: Callable[[str], torch.Tensor | None]
) -> Callable | None:
    """A forward hook that logs the statistics the active configuration asks for on the linear
    holding HF weights ``names`` (input activation, ``weight(name)``, output, and in training
    the output gradient). None when no rule logs these layers, so nothing is hooked."""
    s = session(engine)
    if s is None or not any(s.config.stats_rule(n) for n in names):
        return None

    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        for name in names:
            call, rule = s.next_call(name)
            if rule is None:
                continue
            if "activation" in rule.tensors:
                s.log(name, "activation", call, args[0])
            w = weight(name) if "weight" in rule.tensors else None
            if w is not None:
                s.log(name, "weight", call, w)
            if "output" in rule.tensors:
                s.log(name, "output", call, out)
            if "gradient" in rule.tensors and out.requires_grad:
                out.register_hook(lambda g, name=name, call=call: s.log(name, "gradient", call, g))

    return hook


def bisect_layers(
    layers: Sequence[str],
    signal: Callable[[list[str]], float],
    *,
    log: Callable[[str], None] = print,
) -> tuple[str, list[dict[str, Any]]]:
    """Find the layer whose quantization causes most of a signal, in ~log2(len(layers)) rounds.

    ``signal(bf16_layers)`` runs the user's check with those layers' GEMMs in BF16 (in both
    engines) and returns the mismatch or loss figure (lower is better). Each round keeps the half
    whose switch to BF16 lowers the signal more. Returns the layer and the rounds' records.
    """
    if not layers:
        raise ValueError("bisect_layers needs at least one layer name")
    candidates = list(layers)
    history = [{"bf16_layers": [], "signal": signal([])}]
    log(f"baseline (all NVFP4): {history[0]['signal']:.6g}")
    while len(candidates) > 1:
        half = len(candidates) // 2
        first, second = candidates[:half], candidates[half:]
        s_first, s_second = signal(first), signal(second)
        history += [{"bf16_layers": first, "signal": s_first},
                    {"bf16_layers": second, "signal": s_second}]  # fmt: skip
        candidates = first if s_first <= s_second else second
        log(
            f"BF16 {first[0]}..({len(first)}): {s_first:.6g} | "
            f"BF16 {second[0]}..({len(second)}): {s_second:.6g} -> keep {len(candidates)}"
        )
    return candidates[0], history
