"""The runs file: keys are run names, ``larger_net < net`` inherits every setting of ``net``.

Each run names its recipe (a script or module, its arguments, ``key=value`` overrides) and how many
GPUs - or, on a CPU machine, process slots - it needs; a share below 1 (``gpus: 0.5``) packs small runs
onto one GPU, each held to its share of the GPU's memory::

    net:
      script: examples/digits/train.py
      args: [examples/digits/hparams.yaml]
      gpus: 1
      overrides: {model.hidden: 128, trainer.epochs: 10}
    larger_net < net:
      overrides: {model.hidden: 512}
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from multigpu import config, validate
from multigpu.config import yaml_file
from multigpu.errors import ConfigError, visible
from multigpu.launch import environment
from multigpu.queue import inheritance


@dataclass
class QueueEntry:
    name: str
    script: Optional[str] = None
    module: Optional[str] = None
    args: list[str] = field(default_factory=list)
    #: ``key=value`` settings handed to the recipe after its arguments (dotted keys for nested ones).
    overrides: dict[str, Any] = field(default_factory=dict)
    #: GPUs the run needs (on a CPU machine: process slots); below 1, its share of one (0.5: two runs per GPU).
    gpus: Union[int, float] = 1
    #: Processes inside the run (DDP within a run); default: one per GPU, or one per slot on a CPU.
    nproc: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)
    #: The override that tells the recipe where to write (set to the run's folder); null: none.
    out_dir_key: Optional[str] = "trainer.out_dir"
    #: The metrics.csv column shown in the status table (default: the first valid_* column) and by which the
    #: summary names the best run (default: valid_loss, else the recipe's final.json ``loss``).
    metric: Optional[str] = None
    #: Whether a lower (``min``) or higher (``max``) ``metric`` is better, as the Trainer's ``mode``.
    mode: str = "min"
    #: With ``multigpu queue --slurm``: submit this run as one task of an array job (as ``--array`` does
    #: for every run). Where a run trains, not what it computes: not part of the fingerprint.
    slurm_array: bool = False
    #: Runs of this file that must have finished (done) before this one starts, as ASDF's recipes start a
    #: tuning or evaluation config after its parent. A ``{run:NAME}`` in an override or argument is that
    #: run's folder, and waits for it too. When, not what: not part of the fingerprint.
    after: list[str] = field(default_factory=list)
    #: The fingerprints of the runs it waits for (set by the plan, never by a runs file): a parent that
    #: changed makes this run's fingerprint change, so it runs again instead of keeping stale results.
    upstream: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate.run_name(self.name, ConfigError)
        where = f"run {self.name!r}: "
        for name in [*self.after, *self.references()]:
            validate.run_name(name, ConfigError, f"{where}after: ")
            if name == self.name:
                raise ConfigError(
                    f"{where}waits for itself.",
                    "name another run of the file in after: (or {run:NAME}).",
                )
        for written in self._texts():
            if re.search(r"\{\s*run\s*:", RUN_REFERENCE.sub("", written), re.IGNORECASE):
                raise ConfigError(
                    f"{where}{visible(written)[:120]!r} holds a {{run:...}} that is not a run's name.",
                    "write {run:NAME} exactly, NAME a run of this file (letters, digits, _ . -).",
                )
        nested = [
            v
            for v in self.overrides.values()
            if not isinstance(v, str) and "{run:" in str(v).lower()
        ]
        if nested:
            raise ConfigError(
                f"{where}{{run:NAME}} inside a list or mapping value ({visible(str(nested[0]))[:80]}).",
                'give it a string value of its own: key: "{run:NAME}".',
            )
        if (self.script is None) == (self.module is None):
            raise ConfigError(
                f"{where}needs exactly one of script: or module:.",
                "e.g. script: examples/digits/train.py",
            )
        for what, text in (
            ("script", self.script),
            ("module", self.module),
            ("out_dir_key", self.out_dir_key),
            ("metric", self.metric),
            *(("args", a) for a in self.args),
        ):
            if text is not None:
                validate.plain_text(text, f"{where}{what}", ConfigError)
        if self.script is not None and (not self.script or self.script.startswith("-")):
            raise ConfigError(
                f"{where}script {self.script[:60]!r} starts with '-': it would be read as a launcher "
                "flag.",
                "write the path of the script, e.g. ./-odd-name.py.",
            )
        if self.module is not None and not re.fullmatch(r"[A-Za-z_][\w.]*", self.module):
            raise ConfigError(
                f"{where}module {self.module!r} is not a module name.",
                "write e.g. module: mypkg.train",
            )
        if self.mode not in ("min", "max"):
            raise ConfigError(
                f"{where}mode {str(self.mode)[:40]!r} is neither min nor max.",
                "mode: max when a higher metric is better (accuracy), min when lower is (a loss).",
            )
        self.gpus = whole_or_share(self.gpus, f"{where}gpus")
        if self.nproc is not None:
            validate.count(self.nproc, f"{where}nproc", ConfigError)
            if self.gpus < 1 and self.nproc > 1:
                raise ConfigError(
                    f"{where}gpus: {self.gpus} (a share of one GPU) with nproc: {self.nproc}.",
                    "a run on a share of a GPU runs one process: drop nproc:, or give it gpus: 1 or more.",
                )
        for name, value in self.env.items():
            environment.env_name(name, ConfigError, where)
            validate.plain_text(value, f"{where}env {name}", ConfigError)
        for key in self.overrides:
            validate.plain_text(key, f"{where}override key", ConfigError, allow_space=False)

    def processes(self, on_gpus: bool) -> int:
        return self.nproc or (max(1, int(self.gpus)) if on_gpus else 1)

    def share(self, runs_per_gpu: int = 1) -> Fraction:
        """How much of the pool it takes: its whole GPUs, or its share of one (``gpus: 1`` counts as
        ``1/runs_per_gpu`` under ``multigpu queue --runs-per-gpu``)."""
        if self.gpus < 1:
            # as written: 0.333 three times fits on one GPU, 0.97 stays 0.97
            return Fraction(str(self.gpus))
        return Fraction(1, runs_per_gpu) if self.gpus == 1 else Fraction(int(self.gpus))

    def references(self) -> list[str]:
        """The runs whose folders this one names with ``{run:NAME}`` (in its arguments or override values)."""
        return sorted({name for text in self._texts() for name in RUN_REFERENCE.findall(text)})

    def _texts(self) -> list[str]:
        """Where a ``{run:NAME}`` may stand: the arguments and the overrides' string values."""
        return [str(a) for a in self.args] + [
            v for v in self.overrides.values() if isinstance(v, str)
        ]

    def waits_for(self) -> list[str]:
        return sorted({*self.after, *self.references()})

    def recipe_args(self, folder: Path) -> list[str]:
        def placed(value: Any) -> Any:  # {run:NAME} -> that run's folder, a sibling of this one
            return (
                RUN_REFERENCE.sub(lambda m: str(folder.parent / m.group(1)), value)
                if isinstance(value, str)
                else value
            )

        out = [placed(str(a)) for a in self.args]
        out += [
            f"{key}={config.format_value(placed(value))}" for key, value in self.overrides.items()
        ]
        if self.out_dir_key:
            out.append(f"{self.out_dir_key}={folder}")
        return out

    def command(self, folder: Path, on_gpus: bool, python: str = sys.executable) -> list[str]:
        from multigpu.launch.flags import RunFlags

        # never read as launcher flags
        target = ["-m", self.module] if self.module else ["--", self.script]
        flags = RunFlags(
            nproc=self.processes(on_gpus), cpu=not on_gpus, log_dir=str(folder / "logs")
        )
        return flags.to_argv([*target, *self.recipe_args(folder)], python)

    def job_changes(self, folder: Path) -> dict[str, Any]:
        """What the queue asks of this run besides its folder (a sweep's trial: its channel; a
        :class:`multigpu.distributed.job.Job` field each)."""
        return {}

    def prepare(self, folder: Path) -> None:
        """Files the run needs in its folder before it starts (a sweep's trial: its channel's settings)."""

    def resolved(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}

    def fingerprint(self) -> str:
        """Changes when anything that affects the run's result changes (not its name)."""
        data = {
            k: v
            for k, v in self.resolved().items()
            if k not in ("name", "metric", "mode", "slurm_array", "after")
        }
        if not data.get("upstream"):  # a run that waits for none: the fingerprint it always had
            data.pop("upstream", None)
        data["gpus"] = math.ceil(self.gpus)  # a share of a GPU computes what a whole one does
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[
            :16
        ]


#: ``{run:NAME}`` in an argument or an override value: the folder of the run NAME of the same queue.
RUN_REFERENCE = re.compile(r"\{run:([A-Za-z0-9][A-Za-z0-9_.-]*)\}")

#: The finest share of one GPU a run may take (``gpus: 0.0625``, ``--runs-per-gpu 16``).
MAX_RUNS_PER_GPU = validate.MAX_SHARERS_PER_GPU


def whole_or_share(value: Any, what: str) -> Union[int, float]:
    """A whole number of GPUs (1, 2, ...) or a share of one GPU above 1/16 (0.5, 0.25)."""
    hint = (
        "give a whole number of GPUs (1, 2, ...) or a share of one GPU (0.5, 0.25, down to 0.0625)."
    )
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, float):
        if not Fraction(1, MAX_RUNS_PER_GPU) <= value < 1:  # NaN fails too
            raise ConfigError(
                f"{what} {value!r} is neither a whole number nor a share of one GPU.", hint
            )
        return value
    return validate.count(value, what, ConfigError, hint=None if isinstance(value, int) else hint)


@dataclass(frozen=True)
class Entry:
    """One entry of a runs file: its settings, its ``sweep:``/``search:`` blocks as written (empty for a
    plain run; a family with them is not run itself - its trials are) and where it is written."""

    spec: QueueEntry
    blocks: dict[str, Any]
    where: str


#: Settings of a family that are not a run's: they say how its trials vary (queue/space.py).
SWEEP_KEYS = ("sweep", "search")


def load_entries(path: str | Path, allow_env: Sequence[str] = ()) -> list[Entry]:
    """Every entry of the file, inheritance resolved (a ``sweep:`` is inherited like any setting; a
    child sets ``sweep: null`` to be a plain run again), in file order.

    ``allow_env``: variables the person starting the queue allows beyond the library knobs
    (:data:`multigpu.environment.ENV_ALLOWED`)."""
    data, lines = yaml_file.load_yaml(path)
    if not data:
        raise ConfigError(
            f"{path} defines no runs.", "add `name:` entries with script:, args:, overrides:."
        )
    folded: dict[str, str] = {}
    for key in data:
        name, parent = inheritance.split_run_key(key)
        at = f"{config.where(str(path), lines, (str(key),))}: "
        validate.run_name(name, ConfigError, at)
        if name.lower() in folded and folded[name.lower()] != name:
            raise ConfigError(
                f"{at}run names {folded[name.lower()]!r} and {name!r} differ only in case.",
                "they would share one folder on some file systems; rename one.",
            )
        folded[name.lower()] = name
    resolved = inheritance.resolve_inheritance(data, str(path), lines)
    raw_keys = {inheritance.split_run_key(key)[0]: key for key in data}
    entries = []
    for name, settings in resolved.items():
        run_lines = {
            path_[1:]: line for path_, line in lines.items() if path_ and path_[0] == raw_keys[name]
        }
        if "name" in settings:
            raise ConfigError(
                f"{config.where(str(path), lines, (raw_keys[name], 'name'))}: run {name!r} sets name:, "
                "which is the run's key.",
                "remove name: (rename the entry instead).",
            )
        if "upstream" in settings:
            raise ConfigError(
                f"{config.where(str(path), lines, (raw_keys[name], 'upstream'))}: upstream: is the "
                "queue's own record of the runs a run waits for.",
                "remove it; name them in after:.",
            )
        blocks = {key: settings[key] for key in SWEEP_KEYS if settings.get(key) is not None}
        settings = {key: value for key, value in settings.items() if key not in SWEEP_KEYS}
        spec = config.from_mapping(
            QueueEntry, {**settings, "name": name}, f"{path} (run {name!r})", run_lines
        )
        at = config.where(
            str(path), lines, (raw_keys[name], *(["sweep"] if "sweep" in blocks else []))
        )
        entries.append(Entry(spec, blocks, f"{at} (run {name!r})"))
    for entry in entries:
        for name, value in entry.spec.env.items():
            environment.env_allowed(name, allow_env, ConfigError, f"run {entry.spec.name!r}: ")
            environment.env_value(name, value, ConfigError, f"run {entry.spec.name!r}: ")
    check_order(entries)
    return entries


def check_order(entries: Sequence[Entry]) -> None:
    """Every run named by ``after:`` or ``{run:NAME}`` is a plain run of the file, and no run waits for
    itself through others (a cycle would wait forever)."""
    families = {e.spec.name for e in entries if e.blocks}
    plain = {e.spec.name for e in entries if not e.blocks}
    for entry in entries:
        for name in entry.spec.waits_for():
            if name in families:
                raise ConfigError(
                    f"{entry.where}: waits for {name!r}, a sweep or search: its trials are many runs.",
                    "name one plain run of the file (or wait for the family in a second queue).",
                )
            if name not in plain:
                raise ConfigError(
                    f"{entry.where}: waits for {name!r}, which is not a run of this file.",
                    f"runs: {', '.join(sorted(plain))[:300]}.",
                )
    waits = {e.spec.name: e.spec.waits_for() for e in entries}
    for start in waits:
        path, todo = [start], list(waits[start])
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name == start:
                raise ConfigError(
                    f"runs {start!r} and {', '.join(repr(n) for n in path[1:]) or 'itself'} wait for "
                    "each other: none would start.",
                    "remove one of the after: (or {run:NAME}) links.",
                )
            if name not in seen:
                seen.add(name)
                path.append(name)
                todo += waits.get(name, [])
    specs = {e.spec.name: e.spec for e in entries}
    done: set[str] = set()
    while len(done) < len(waits):  # parents first (no cycle: each pass settles one more at least)
        for name, parents in waits.items():
            if name not in done and all(p in done for p in parents):
                # a parent's holds its own
                specs[name].upstream = {p: specs[p].fingerprint() for p in parents}
                done.add(name)


def load_runs(
    path: str | Path, only: Optional[Sequence[str]] = None, allow_env: Sequence[str] = ()
) -> list[QueueEntry]:
    """Every run of the file, inheritance resolved, sweeps expanded into their trials, in file order
    (``only``: just these, in that order). A file with a ``search:`` needs :func:`multigpu.queue.plan.load_plan`."""
    from multigpu.queue.plan import load_plan

    plan = load_plan(path, only, allow_env)
    if plan.searches:
        raise ConfigError(
            f"{path}: run {plan.searches[0].entry.name!r} is a search, whose trials are asked while "
            "the queue runs.",
            "start it with `multigpu queue`.",
        )
    return plan.runs
