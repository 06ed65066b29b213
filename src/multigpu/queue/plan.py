"""What a ``multigpu queue`` command runs: the runs file's plain runs, its sweeps expanded into trials,
and its searches (whose trials are asked while the queue runs), after ``--only`` and ``--sweep``.

Why a step of its own: every check that can fail - a space that is empty or too large, two trials with
one name, a trial named like a run, an ``--only`` that names nothing - fails here, before any folder
is written or any job submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from multigpu import validate
from multigpu.errors import ConfigError
from multigpu.queue.runs import Entry, QueueEntry, load_entries
from multigpu.queue.space import MAX_TRIALS, Param, Space, parse_space, points
from multigpu.queue.trial_names import check_names
from multigpu.queue.trials import Trial, make_trial


@dataclass
class Family:
    """A runs-file entry with a ``sweep:``: its own settings (never run) and how its trials vary."""

    entry: QueueEntry
    space: Space
    #: A grid/random sweep's trials to run now (a search asks its own while the queue runs: empty).
    trials: list[Trial] = field(default_factory=list)
    #: Every trial of a grid/random sweep, also those ``--only`` left out (the ranking shows them all).
    every: list[Trial] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.entry.name


@dataclass
class Plan:
    #: Plain runs and the trials of grid/random sweeps, in file order.
    runs: list[QueueEntry]
    families: list[Family]

    @property
    def searches(self) -> list[Family]:
        return [f for f in self.families if f.space.search is not None]


def load_plan(
    path: str | Path,
    only: Optional[Sequence[str]] = None,
    allow_env: Sequence[str] = (),
    sweep: Sequence[Param] = (),
    samples: Optional[int] = None,
) -> Plan:
    """The runs file's plan. ``sweep``: overrides to sweep in every chosen run (``--sweep``), added to a
    family's own (the command line wins for the same override); ``samples``: draws per grid point."""
    entries = load_entries(path, allow_env)
    chosen, single_trials = _chosen(entries, only, path)
    runs: list[QueueEntry] = []
    families: list[Family] = []
    taken = {e.spec.name.lower(): f"run {e.spec.name!r}" for e in entries}
    for entry in chosen:
        space = _space(entry, sweep, samples)
        if space is None:
            runs.append(entry.spec)
            continue
        family = Family(entry.spec, space)
        if space.search is None:
            family.trials = [
                make_trial(entry.spec, point.name, point.values, space)
                for point in points(entry.spec.name, space)
            ]
            check_names(
                [
                    (t.name, f"trial {t.name!r} of {entry.spec.name!r} ({_values(t.values)})")
                    for t in family.trials
                ],
                taken,
            )
            taken.update((t.name.lower(), f"trial {t.name!r}") for t in family.trials)
            family.every = list(family.trials)
            runs.extend(family.trials)
        families.append(family)
    if single_trials:  # --only names trials of sweeps: just those
        found = {t.name: t for f in families for t in f.trials}
        runs = [found[name] for name in single_trials if name in found]
        families = [f for f in families if any(t.name in single_trials for t in f.trials)]
        for family in families:
            family.trials = [t for t in family.trials if t.name in single_trials]
    for family in families:
        clash = next(
            (n for n in taken if family.space.search and _search_trial_name(family.name, n)), None
        )
        if clash is not None:
            raise ConfigError(
                f"{path}: {taken[clash]} is named like a trial of the search {family.name!r}.",
                "rename it: search trials are named <family>-t<number>-..., each in its own folder.",
            )
    _check_waits(entries, runs, families, path)
    total = sum(len(f.trials) for f in families) + sum(
        f.space.count() for f in families if f.space.search
    )
    if total > MAX_TRIALS:
        raise ConfigError(
            f"{path}: its sweeps have {total:,} trials together; at most {MAX_TRIALS:,}.",
            "run fewer families at once (--only), or sample them (samples: N, or a search: block).",
        )
    return Plan(runs, families)


def _check_waits(
    entries: list[Entry], runs: list[QueueEntry], families: list[Family], path: str | Path
) -> None:
    """What runs wait for, once sweeps are expanded (a sweep's values, ``--sweep``): plain runs of the file
    only - never a family (many runs), a trial or a name that is none - and no search waits (its trials
    are asked while the queue runs, not ordered)."""
    swept = {f.name for f in families} | {e.spec.name for e in entries if e.blocks}
    plain = {e.spec.name: e.spec for e in entries if e.spec.name not in swept}
    for family in families:
        if family.space.search is not None and family.entry.waits_for():
            raise ConfigError(
                f"{path}: the search {family.name!r} waits for {', '.join(family.entry.waits_for())}, "
                "which searches do not do yet.",
                "run it in a second queue once those are done.",
            )
    for spec in runs:
        for name in spec.waits_for():
            if name in swept:
                raise ConfigError(
                    f"{path}: run {spec.name!r} waits for {name!r}, which is swept here: its trials "
                    "are many runs.",
                    "name one plain run (or wait for the family in a second queue).",
                )
            if name not in plain:
                raise ConfigError(
                    f"{path}: run {spec.name!r} waits for {name!r}, which is not a run of this file.",
                    f"runs: {', '.join(sorted(plain))[:300]}.",
                )
        spec.upstream = {name: plain[name].fingerprint() for name in spec.waits_for()}


def _chosen(
    entries: list[Entry], only: Optional[Sequence[str]], path: str | Path
) -> tuple[list[Entry], list[str]]:
    """The entries ``--only`` chooses (all without it), and the trial names it gives."""
    if only is None:
        return entries, []
    if not only:
        raise ConfigError(
            "--only names no run.",
            "give comma-separated run names, or leave --only out for every run.",
        )
    names = [e.spec.name for e in entries]
    picked = [next(e for e in entries if e.spec.name == n) for n in only if n in names]
    others = [n for n in only if n not in names]
    if not others:
        return picked, []
    if picked:
        raise ConfigError(
            f"--only mixes runs ({picked[0].spec.name!r}) and other names ({others[0]!r}).",
            "give runs and families, or trials of sweeps, not both.",
        )
    # Trials of grid/random sweeps: expand every family to find them (cheap: no folder is touched).
    families = [e for e in entries if e.blocks]
    trial_names: set[str] = set()
    for entry in families:
        space = _space(entry, (), None)
        if space is not None and space.search is None:
            trial_names.update(p.name for p in points(entry.spec.name, space))
    unknown = [n for n in others if n not in trial_names]
    if unknown:
        raise ConfigError(
            f"--only names {unknown[0]!r}, which {path} does not define.",
            f"runs: {', '.join(names)[:300]} (or a trial of one of their sweeps).",
        )
    return families, list(others)


def _space(entry: Entry, sweep: Sequence[Param], samples: Optional[int]) -> Optional[Space]:
    """The entry's space (its blocks, then the command line's --sweep and --samples), or None: a plain run."""
    if not entry.blocks and not sweep:
        if samples is not None:
            raise ConfigError(
                f"--samples {samples} but run {entry.spec.name!r} sweeps nothing.",
                "add --sweep KEY=DISTRIBUTION, or a sweep: block to the run.",
            )
        return None
    if "search" in entry.blocks and "sweep" not in entry.blocks:
        raise ConfigError(
            f"{entry.where}: search: without a sweep: to search in.",
            "add sweep: {params: {optim.lr: {loguniform: [1e-4, 1e-1]}}} next to it.",
        )
    return parse_space(
        entry.blocks.get("sweep"),
        entry.blocks.get("search"),
        entry.where,
        entry.spec.out_dir_key,
        extra=sweep,
        samples=samples,
        metric=entry.spec.metric,
        mode=getattr(entry.spec, "mode", None),
    )


def _search_trial_name(family: str, name: str) -> bool:
    """Could ``name`` (lowercased) be a trial of the search ``family`` (``<family>-t<number>...``)?"""
    prefix = f"{family.lower()}-t"
    return name.startswith(prefix) and validate.is_digits(name[len(prefix) :][:1])


def _values(values: dict[str, Any]) -> str:
    from multigpu.queue.trials import shown_values

    return shown_values(values)
