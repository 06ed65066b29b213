"""The space of a sweep - which overrides vary, and how - and its expansion into named trials.

In a runs file, a run with a ``sweep:`` block is a family: it does not train itself; each of its
trials is a run that inherits every setting of it, with the swept overrides on top::

    lr_grid < net:
      sweep:
        params:
          optim.lr: [1e-3, 3e-3, 1e-2]            # a list: every value (one axis of a grid)
          model.hidden: {choice: [32, 64, 128]}    # drawn: choice, uniform, loguniform, int
          model.dropout: {uniform: [0.0, 0.5]}
        samples: 4          # draws of the drawn ones for each point of the grid (default 1)
        seed: 0             # the draws are the same on every run of the queue
        metric: valid_loss  # what the summary ranks the trials by, and mode: min or max
        mode: min

On the command line, ``--sweep 'optim.lr=1e-3,3e-3,1e-2'`` or ``--sweep 'optim.lr=loguniform(1e-4,1e-1)'``.
A ``search:`` block next to ``sweep:`` explores the same space with a model instead (queue/search.py).

Why names from values: ``lr_grid-lr0.001-hidden64`` says what a folder holds, and the same values
give the same name on every run of the queue - which is how a finished trial is found and skipped.
Drawn values are rounded to 4 significant digits (the name shows 3) and drawn from a generator seeded
by (seed, sample, grid point), so adding samples or grid values never changes the existing trials.
"""

from __future__ import annotations

import difflib
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Sequence

from multigpu import validate
from multigpu.errors import ConfigError, shown
from multigpu.queue.sweep_values import (
    MAX_VALUE_TEXT,
    checked_value,
    checked_values,
    written_values,
)
from multigpu.queue.trial_names import labels_of, stable_text, trial_name, value_text
from multigpu.validate import Rule, checked

#: Trials one sweep (or one search) may have: a typo such as an axis of 1000 values times three more is
#: refused before a single folder is written.
MAX_TRIALS = 10_000
MAX_PARAMS = 64
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "int")
SAMPLERS = ("tpe", "random")
PRUNERS = ("none", "asha", "median")


@dataclass(frozen=True)
class Param:
    """One swept override: a list of values (``grid``) or a distribution to draw from."""

    key: str
    kind: str  # "grid" or one of DISTRIBUTIONS
    values: tuple[Any, ...] = ()  # grid and choice
    low: float = 0.0  # uniform, loguniform, int
    high: float = 0.0

    @property
    def drawn(self) -> bool:
        return self.kind != "grid"

    def draw(self, rng: random.Random) -> Any:
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "int":
            return rng.randint(int(self.low), int(self.high))
        if self.kind == "uniform":
            return _round(rng.uniform(self.low, self.high))
        return _round(math.exp(rng.uniform(math.log(self.low), math.log(self.high))))

    def holds(self, value: Any) -> bool:
        """``value`` is one this parameter can take (a value read back from a study file is checked so)."""
        if self.kind in ("grid", "choice"):
            return any(type(value) is type(v) and value == v for v in self.values)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            return False
        if self.kind == "int" and (not float(value).is_integer()):
            return False
        return self.low <= value <= self.high

    def describe(self) -> str:
        if self.kind in ("grid", "choice"):
            text = ", ".join(value_text(v) for v in self.values[:8]) + (
                ", ..." if len(self.values) > 8 else ""
            )
            return f"[{text}]" if self.kind == "grid" else f"choice({text})"
        return f"{self.kind}({value_text(self.low)}, {value_text(self.high)})"

    def record(self) -> dict[str, Any]:
        """As plain data, for the sweep's record (and the plot's axis: log for loguniform)."""
        if self.kind in ("grid", "choice"):
            return {"kind": self.kind, "values": list(self.values)}
        return {"kind": self.kind, "low": self.low, "high": self.high}


@dataclass(frozen=True)
class SearchSettings:
    """``search:``: a model-based exploration of the sweep's space with Optuna (queue/search.py)."""

    trials: int
    sampler: str = "tpe"
    pruner: str = "none"
    seed: int = 0
    #: TPE: trials drawn at random before the model takes over (default: min(10, trials)).
    startup_trials: Optional[int] = None
    #: Pruners: median: no pruning before this step; asha: the first rung's steps (0: from the first trial).
    min_steps: int = 0
    #: median: trials that must finish before it prunes (default 5); asha: trials that must pass a rung first.
    min_trials: Optional[int] = None


@dataclass(frozen=True)
class Space:
    """A family's ``sweep:`` (and ``search:``) block, checked."""

    params: tuple[Param, ...]
    samples: int = 1
    seed: int = 0
    metric: str = "valid_loss"
    mode: str = "min"
    search: Optional[SearchSettings] = None

    def count(self) -> int:
        """Trials of a grid/random sweep: points of the grid times samples (or the search's trials)."""
        if self.search is not None:
            return self.search.trials
        total = self.samples
        for param in self.params:
            if not param.drawn:
                total *= len(param.values)
        return total


@dataclass(frozen=True)
class Point:
    """One trial's place in its family: its values, readable name and (random sweeps) sample number."""

    values: dict[str, Any] = field(default_factory=dict)
    name: str = ""


# ----------------------------------------------------------------------------------- parsing

_SWEEP_RULES = {
    "samples": Rule(int, low=1, high=MAX_TRIALS),
    "seed": Rule(int, low=0, high=2**32 - 1),
    "metric": Rule(str),
    "mode": Rule(str, choices=("min", "max")),
}
_SEARCH_RULES = {
    "trials": Rule(int, low=1, high=MAX_TRIALS),
    "sampler": Rule(str, choices=SAMPLERS),
    "pruner": Rule(str, choices=PRUNERS, optional=True),
    "seed": Rule(int, low=0, high=2**32 - 1),
    "metric": Rule(str),
    "mode": Rule(str, choices=("min", "max")),
    "startup_trials": Rule(int, low=0, high=MAX_TRIALS, optional=True),
    "min_steps": Rule(int, low=0, high=2**62),
    "min_trials": Rule(int, low=0, high=MAX_TRIALS, optional=True),
}


def parse_space(
    sweep: Any,
    search: Any,
    where: str,
    out_dir_key: Optional[str] = None,
    *,
    extra: Sequence[Param] = (),
    samples: Optional[int] = None,
    metric: Optional[str] = None,
    mode: Optional[str] = None,
) -> Space:
    """A family's ``sweep:`` (None: only ``extra``) and optional ``search:`` blocks; ``where``: where the
    family is written ('runs.yaml:12 (run lr_grid)'). ``extra``: ``--sweep`` overrides (they win over the
    block's), ``samples``: ``--samples``; ``metric``/``mode``: the run's own, the defaults of the block's."""
    if sweep is None:
        sweep = {}
    if not isinstance(sweep, Mapping):
        raise ConfigError(
            f"{where}: sweep must be a group of settings with params:, not {shown(sweep)}.",
            "write sweep: {params: {optim.lr: [0.001, 0.003]}}.",
        )
    _known(sweep, ("params", *_SWEEP_RULES), f"{where}: sweep")
    settings = {
        k: checked(f"{where}: sweep", k, v, _SWEEP_RULES[k], ConfigError)
        for k, v in sweep.items()
        if k != "params"
    }
    params = {
        p.key: p
        for p in (
            parse_params(sweep["params"], f"{where}: sweep.params", out_dir_key)
            if "params" in sweep
            else ()
        )
    }
    for param in extra:
        if out_dir_key and param.key == out_dir_key:
            raise ConfigError(
                f"--sweep {param.key}: the queue sets it (each trial's own folder).",
                "sweep another override.",
            )
        params[param.key] = param
    if not params:
        raise ConfigError(
            f"{where}: sweep has no params:.",
            "list what varies: params: {optim.lr: [0.001, 0.003]}.",
        )
    if samples is not None:
        settings["samples"] = checked(
            "--samples", "samples", samples, _SWEEP_RULES["samples"], ConfigError
        )
    settings.setdefault("metric", metric or "valid_loss")
    settings.setdefault("mode", mode or "min")
    if search is None:
        space = Space(tuple(params.values()), **settings)
        _check_count(space, where)
        return space
    if not isinstance(search, Mapping):
        raise ConfigError(
            f"{where}: search must be a group of settings, not {shown(search)}.",
            "write search: {sampler: tpe, trials: 32, metric: valid_loss, mode: min, pruner: asha}.",
        )
    _known(search, _SEARCH_RULES, f"{where}: search")
    chosen = {
        k: checked(f"{where}: search", k, v, _SEARCH_RULES[k], ConfigError)
        for k, v in search.items()
    }
    if "trials" not in chosen:
        raise ConfigError(
            f"{where}: search has no trials:.", "say how many trials to run, e.g. trials: 32."
        )
    if "samples" in settings:
        raise ConfigError(
            f"{where}: samples and the search's trials: both say how many trials to run.",
            "drop samples (and --samples): the search's trials: counts them.",
        )
    for key in ("metric", "mode"):
        if key in chosen and key in sweep and chosen[key] != sweep[key]:
            raise ConfigError(
                f"{where}: sweep.{key} {sweep[key]!r} and search.{key} {chosen[key]!r} differ.",
                f"give {key}: once.",
            )
        if key in chosen:
            settings[key] = chosen.pop(key)
    if chosen.get("pruner") is None:
        chosen["pruner"] = "none"
    return Space(tuple(params.values()), **settings, search=SearchSettings(**chosen))


def _known(block: Mapping[str, Any], names: Collection[str], owner: str) -> None:
    for key in block:
        if key not in names:
            close = difflib.get_close_matches(str(key), list(names), n=1)
            raise ConfigError(
                f"{owner} has no setting {shown(key)}.",
                f"did you mean {close[0]!r}?"
                if close
                else f"its settings are: {', '.join(names)}.",
            )


def parse_params(params: Any, where: str, out_dir_key: Optional[str] = None) -> tuple[Param, ...]:
    if not isinstance(params, Mapping) or not params:
        raise ConfigError(
            f"{where} must map overrides to values or distributions, not {shown(params)}.",
            "e.g. params: {optim.lr: [0.001, 0.003], model.hidden: {choice: [32, 64]}}.",
        )
    if len(params) > MAX_PARAMS:
        raise ConfigError(
            f"{where} sweeps {len(params)} overrides; at most {MAX_PARAMS}.", "sweep fewer at once."
        )
    return tuple(parse_param(key, value, where, out_dir_key) for key, value in params.items())


def parse_param(key: Any, spec: Any, where: str, out_dir_key: Optional[str] = None) -> Param:
    """``[a, b]`` (a grid axis), ``{choice: [a, b]}``, ``{uniform: [lo, hi]}``, ``{loguniform: [lo, hi]}``,
    ``{int: [lo, hi]}`` - or the same as text: ``loguniform(1e-4, 1e-1)``."""
    if not isinstance(key, str) or not key:
        raise ConfigError(
            f"{where}: override {shown(key)} is not a name.", "write a dotted key, e.g. optim.lr."
        )
    validate.plain_text(key, f"{where}: override", ConfigError, allow_space=False)
    if len(key) > MAX_VALUE_TEXT:
        raise ConfigError(
            f"{where}: override {shown(key)} is longer than {MAX_VALUE_TEXT} characters.",
            "write the override's dotted key, e.g. optim.lr.",
        )
    at = f"{where}.{key}"
    if out_dir_key and key == out_dir_key:
        raise ConfigError(
            f"{at}: the queue sets {key} (each trial's own folder).", "sweep another override."
        )
    if isinstance(spec, str):
        spec = written_values(spec, at)
    if isinstance(spec, (list, tuple)):
        return Param(key, "grid", checked_values(spec, at))
    if isinstance(spec, Mapping) and len(spec) == 1:
        ((kind, arguments),) = spec.items()
        if kind not in DISTRIBUTIONS:
            close = difflib.get_close_matches(str(kind), DISTRIBUTIONS, n=1)
            raise ConfigError(
                f"{at}: unknown distribution {shown(kind)}.",
                (f"did you mean {close[0]!r}? " if close else "")
                + f"use a list of values, or one of {', '.join(DISTRIBUTIONS)}.",
            )
        if kind == "choice":
            return Param(key, "choice", checked_values(arguments, at))
        return _range(key, kind, arguments, at)
    raise ConfigError(
        f"{at}: {shown(spec)} is neither a list of values nor one distribution.",
        "write [0.001, 0.003], or {loguniform: [1e-4, 1e-1]} (choice, uniform, loguniform, int).",
    )


def _range(key: str, kind: str, bounds: Any, at: str) -> Param:
    if not isinstance(bounds, (list, tuple)) or len(bounds) != 2:
        raise ConfigError(
            f"{at}: {kind} takes [low, high], not {shown(bounds)}.",
            f"write {{{kind}: [low, high]}}.",
        )
    low, high = (checked_value(b, at) for b in bounds)
    numbers = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high))
    if not numbers or (kind == "int" and not all(isinstance(b, int) for b in (low, high))):
        noun = "whole numbers" if kind == "int" else "numbers"
        raise ConfigError(
            f"{at}: {kind} bounds {shown(list(bounds))} are not {noun}.",
            f"write {{{kind}: [low, high]}}.",
        )
    if not low < high:
        raise ConfigError(
            f"{at}: the range {kind}({low}, {high}) is empty (low must be below high).",
            "give low < high; a single value is an override, not a sweep.",
        )
    if kind == "loguniform" and low <= 0:
        raise ConfigError(
            f"{at}: loguniform({low}, {high}) needs a low above 0.",
            "use uniform for ranges that reach 0.",
        )
    return Param(key, kind, low=low, high=high)


def parse_cli(items: Sequence[str], where: str = "--sweep") -> tuple[Param, ...]:
    """``--sweep KEY=VALUES`` items: ``optim.lr=1e-3,3e-3`` (a grid axis) or ``optim.lr=loguniform(1e-4,1e-1)``."""
    params: dict[str, Param] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"{where} {shown(item)} is not KEY=VALUES.",
                "write e.g. --sweep 'optim.lr=1e-3,3e-3,1e-2' or --sweep 'optim.lr=loguniform(1e-4,1e-1)'.",
            )
        key = key.strip()
        if key in params:
            raise ConfigError(f"{where} sweeps {key} twice.", "give each override one --sweep.")
        params[key] = parse_param(key, text, where)
    if len(params) > MAX_PARAMS:
        raise ConfigError(
            f"{where} sweeps {len(params)} overrides; at most {MAX_PARAMS}.", "sweep fewer at once."
        )
    return tuple(params.values())


def _check_count(space: Space, where: str) -> None:
    total = space.samples
    for param in space.params:
        if not param.drawn:
            total *= len(param.values)
            if total > MAX_TRIALS:
                break
    if total > MAX_TRIALS:
        axes = " x ".join(str(len(p.values)) for p in space.params if not p.drawn)
        raise ConfigError(
            f"{where}: the sweep has {axes}{f' x {space.samples} samples' if space.samples > 1 else ''}"
            f" = more than {MAX_TRIALS:,} trials.",
            "sample the space instead: give ranges ({uniform: [lo, hi]}, {choice: [...]}) and samples: N, "
            "or a search: block that explores it with a model (trials: N).",
        )
    if not any(p.drawn for p in space.params) and space.samples > 1:
        raise ConfigError(
            f"{where}: samples: {space.samples} but nothing is drawn (every override is a list).",
            "drop samples:, or give a distribution such as {loguniform: [1e-4, 1e-1]}.",
        )


# ----------------------------------------------------------------------------------- expansion


def points(family: str, space: Space) -> list[Point]:
    """Every trial of a grid/random sweep, in a stable order: the grid (first override slowest), and for
    each point ``samples`` draws."""
    grid = [p for p in space.params if not p.drawn]
    drawn = [p for p in space.params if p.drawn]
    labels = _labels(space.params)
    out = []
    for combo in itertools.product(*(p.values for p in grid)):
        fixed = dict(zip((p.key for p in grid), combo))
        for sample in range(space.samples):
            values = dict(fixed)
            if drawn:
                rng = random.Random(f"{space.seed}:{sample}:{stable_text(fixed)}")
                values.update((p.key, p.draw(rng)) for p in drawn)
            ordered = {p.key: values[p.key] for p in space.params}
            prefix = f"s{sample}" if drawn else ""
            out.append(
                Point(ordered, trial_name(family, ordered, labels, prefix, short=bool(drawn)))
            )
    return out


def _labels(params: Sequence[Param]) -> dict[str, str]:
    return labels_of([p.key for p in params])


def _round(value: float) -> float:
    return float(f"{value:.4g}")
