"""``search:``: a model-based exploration of a sweep's space with Optuna, trials run on the queue's pool
(or as Slurm array tasks), bad trials pruned early.

    lr_search < net:
      sweep:
        params: {optim.lr: {loguniform: [1e-4, 1e-1]}, model.hidden: {choice: [32, 64, 128]}}
      search: {sampler: tpe, trials: 32, metric: valid_loss, mode: min, pruner: asha}

Why Optuna: a maintained library with the samplers (TPE) and pruners (ASHA, median) people use, whose
study lives in a database - here SQLite in ``OUT/.sweeps/<family>.db``, which only this queue process
opens (the trials never touch it), so it survives Ctrl-C and crashes and needs no server. It is an
optional extra (``pip install 'multigpu[sweep]'``), imported only when a runs file has a ``search:``.

How trials take part (nothing of the queue or Optuna runs inside them): the queue asks the study for a
trial when the pool has room, starts it as a run named from its values (``lr_search-t7-lr0.00312-hidden64``),
reads the ``reports.csv`` its rank 0 appends after each evaluation, reports each new step to the study,
asks the pruner, and answers in ``verdict.json`` (the trial waits for that answer, then every rank
agrees on it and stops through the Trainer's early-stop path). A finished trial is told with its last
reported value, a pruned one as pruned; a trial that failed or was interrupted stays "running" in the
study and is resumed, in its folder, by the next run of the queue. Trials asked while others run are
seen by TPE as pending (Optuna's constant liar), so parallel trials do not all land on one point.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, Sequence

from multigpu.distributed.job import TRIAL_REPORTS_FILE
from multigpu.errors import ConfigError, MultiGPUError, shown, visible
from multigpu.fileio import Folder
from multigpu.queue.lock import RunLock
from multigpu.queue.runs import QueueEntry
from multigpu.queue.space import Param, SearchSettings, Space, _labels
from multigpu.queue.study_file import check_study
from multigpu.queue.trial_names import trial_name
from multigpu.queue.trials import (
    SWEEPS_FOLDER,
    TRIAL_FOLDER,
    VERDICT_WAIT_S,
    Trial,
    make_trial,
    read_reports,
    read_verdict,
    result,
    write_verdict,
)

INSTALL_HINT = "pip install 'multigpu[sweep]' (or pip install 'optuna>=4')."


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise ConfigError("a search: needs Optuna, which is not installed.", INSTALL_HINT) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the queue prints its own lines
    return optuna


def distribution(param: Param) -> Any:
    """The Optuna distribution of one swept override (a list is a categorical choice)."""
    optuna = _optuna()
    if param.kind in ("grid", "choice"):
        return optuna.distributions.CategoricalDistribution(list(param.values))
    if param.kind == "int":
        return optuna.distributions.IntDistribution(int(param.low), int(param.high))
    return optuna.distributions.FloatDistribution(
        param.low, param.high, log=param.kind == "loguniform"
    )


def sampler(settings: SearchSettings) -> Any:
    optuna = _optuna()
    if settings.sampler == "random":
        return optuna.samplers.RandomSampler(seed=settings.seed)
    startup = (
        settings.startup_trials if settings.startup_trials is not None else min(10, settings.trials)
    )
    return optuna.samplers.TPESampler(
        seed=settings.seed, n_startup_trials=startup, constant_liar=True
    )


def pruner(settings: SearchSettings) -> Any:
    optuna = _optuna()
    if settings.pruner == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=5 if settings.min_trials is None else settings.min_trials,
            n_warmup_steps=settings.min_steps,
        )
    if settings.pruner == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=settings.min_steps or "auto", bootstrap_count=settings.min_trials or 0
        )
    return optuna.pruners.NopPruner()


def identity(entry: QueueEntry, space: Space) -> str:
    """What a study was started for - the family's settings, the space, the metric and its direction. A
    study is continued only with the same (the number of trials, sampler and pruner may change)."""
    data = {
        "settings": entry.fingerprint(),
        "params": [[p.key, p.record()] for p in space.params],
        "metric": space.metric,
        "mode": space.mode,
    }
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Search:
    """One family's study, driven by the queue: ``open`` (its earlier trials), ``wants_more``/``ask``,
    ``poll`` (reports -> verdicts), ``finished`` (tell), ``close``."""

    def __init__(self, entry: QueueEntry, space: Space, root: Path) -> None:
        if space.search is None:
            raise ValueError("not a search")
        self.entry, self.space = entry, space
        self.settings: SearchSettings = space.search
        self.root = Path(root)
        self.lock = RunLock(self.root, f".search-{entry.name}")
        self.wait_s = VERDICT_WAIT_S if self.settings.pruner != "none" else 0.0
        self.study: Any = None
        self._distributions = {p.key: distribution(p) for p in space.params}
        self._labels = _labels(space.params)
        self._trials: dict[str, Any] = {}  # run name -> optuna Trial (to report to)
        self._reported: dict[str, int] = {}  # run name -> last step reported to the study
        self._pruned: dict[str, bool] = {}
        self._sizes: dict[str, int] = {}  # run name -> size of its reports.csv when last read
        self._asked = 0
        #: Trials told in this queue (finished, pruned, failed) - for the summary's counts.
        self.told: dict[str, str] = {}

    @property
    def name(self) -> str:
        return self.entry.name

    # ------------------------------------------------------------------ opening
    def start(self) -> list[Trial]:
        """Take the study (one queue at a time), create or continue it; return its earlier trials as runs:
        the finished ones are skipped by their folders, the unfinished ones resume in theirs."""
        optuna = _optuna()
        if not self.lock.acquire():
            raise ConfigError(
                f"the search {self.name!r} is being run by another queue (pid {self.lock.holder()}).",
                "wait for it to end, or give this queue another --out.",
            )
        try:
            return self._open(optuna)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, optuna: Any) -> list[Trial]:
        folder = Folder(self.root).child(SWEEPS_FOLDER)
        database = f"{self.name}.db"
        if folder.kind(database) not in (None, "file"):
            raise ConfigError(
                f"{folder / database} is not a regular file.",
                "move it away: the study is kept there.",
            )
        path = str((folder / database).resolve())
        if any(char in path for char in "?#%"):
            raise ConfigError(
                f"the study's path {path[:200]!r} has ?, # or %, which a SQLite URL cannot hold.",
                "give the queue an --out without them.",
            )
        check_study(folder / database)  # a received study file: bounded, Optuna's own tables only
        try:
            return self._read(
                optuna, optuna.storages.RDBStorage(f"sqlite:///{path}"), folder / database
            )
        except MultiGPUError:
            raise
        # what Optuna raises on what it reads back (a JSON 200,000 deep, a bad enum)
        except Exception as exc:
            raise ConfigError(
                f"Optuna could not read the study file {visible(str(folder / database))} "
                f"({type(exc).__name__}: {shown(' '.join(str(exc).split()), 120)}).",
                "move it away to start the search afresh (its trials' run folders stay), or give "
                "the queue another --out.",
            ) from None

    def _read(self, optuna: Any, storage: Any, where: Path) -> list[Trial]:
        folder, database = Folder(where.parent), where.name
        direction = "maximize" if self.space.mode == "max" else "minimize"
        self.study = optuna.create_study(
            storage=storage,
            study_name=self.name,
            direction=direction,
            sampler=sampler(self.settings),
            pruner=pruner(self.settings),
            load_if_exists=True,
        )
        wanted = identity(self.entry, self.space)
        found = self.study.user_attrs.get("multigpu")
        if found is None:
            self.study.set_user_attr("multigpu", wanted)
        elif found != wanted:
            raise ConfigError(
                f"the settings, space or metric of the search {self.name!r} changed since its study in "
                f"{folder / database} was started.",
                "give this queue another --out, or move that file away to start the search afresh "
                "(trials:, sampler: and pruner: may change; the rest may not).",
            )
        earlier = []
        ours = [
            frozen
            for frozen in self.study.get_trials(deepcopy=False)
            if isinstance(frozen.user_attrs.get("run"), str)
            and set(self._distributions) <= set(frozen.params)
        ]
        # (not one of ours - a study someone else wrote into - is left alone; nor is a trial asked by a queue that
        # was killed before it named it (ask and set_user_attr are two writes): no run holds it, so it is not
        # counted - the trial it should have been is asked again)
        if len(ours) > self.settings.trials:
            raise ConfigError(
                f"the study of {visible(self.name)!r} in {visible(str(folder / database))} holds "
                f"{len(ours):,} trials, more than its trials: {self.settings.trials}.",
                f"raise trials: to {len(ours)} or more to continue it, or move the file away to start "
                "the search afresh.",
            )
        for frozen in ours:
            name = frozen.user_attrs["run"]
            spec = self._spec(name, frozen.params)  # its values checked against the space first
            values = {p.key: frozen.params[p.key] for p in self.space.params}
            if name != trial_name(
                self.name, values, self._labels, prefix=f"t{frozen.number}", short=True
            ):
                # only the name this search gives those values: another run's folder would be written over
                raise ConfigError(
                    f"the study of {visible(self.name)!r} holds a trial that names the run "
                    f"{visible(name)[:80]!r}, which is not the name its values get.",
                    "move the study file away to start the search afresh, or give the queue another "
                    "--out.",
                )
            if frozen.state == optuna.trial.TrialState.RUNNING:
                self._trials[name] = optuna.trial.Trial(self.study, frozen._trial_id)
                steps = list(frozen.intermediate_values)
                self._reported[name] = max(steps) if steps else -1
                verdict = read_verdict(self.root / name)
                self._pruned[name] = bool(verdict and verdict[1])
            earlier.append(spec)
        self._asked = len(earlier)
        return earlier

    def _spec(self, name: str, params: dict[str, Any]) -> Trial:
        values = {p.key: params[p.key] for p in self.space.params}
        # read back from the study file: it becomes an override of a run
        for param in self.space.params:
            if not param.holds(values[param.key]):
                raise ConfigError(
                    f"the study of {visible(self.name)!r} holds a trial {visible(name)[:80]!r} with "
                    f"{visible(param.key)}={shown(values[param.key])}, outside the search's "
                    f"{visible(param.describe())}.",
                    "move the study file away to start the search "
                    "afresh, or give the queue another --out.",
                )
        return make_trial(self.entry, name, values, self.space, self.wait_s)

    def settle_earlier(self, runs: Sequence[Any]) -> None:
        """Tell the study about earlier trials that finished after their queue stopped watching them
        (a crash, Ctrl-C, a Slurm job that ended while nobody watched): their folders say done."""
        for run in runs:
            if run.spec.name in self._trials and run.state == "skipped":
                self._tell(run)

    # ------------------------------------------------------------------ asking
    def wants_more(self) -> bool:
        return self.study is not None and self._asked < self.settings.trials

    def ask(self) -> Trial:
        trial = self.study.ask(self._distributions)
        values = {p.key: trial.params[p.key] for p in self.space.params}
        name = trial_name(self.name, values, self._labels, prefix=f"t{trial.number}", short=True)
        trial.set_user_attr("run", name)
        self._trials[name], self._reported[name], self._pruned[name] = trial, -1, False
        self._asked += 1
        return make_trial(self.entry, name, values, self.space, self.wait_s)

    # ------------------------------------------------------------------ while trials run
    def poll(self, runs: Sequence[Any]) -> None:
        """Report each running trial's new evaluations to the study and answer them (prune or go on)."""
        for run in runs:
            if run.state == "running" and run.spec.name in self._trials:
                self._take_reports(run.spec.name, run.folder)

    def _take_reports(self, name: str, folder: Path) -> None:
        try:
            size = Folder(folder).size(f"{TRIAL_FOLDER}/{TRIAL_REPORTS_FILE}")
        except OSError:
            # nothing reported yet (or not a regular file: read_reports would read nothing either)
            return
        if self._sizes.get(name) == size:
            return
        self._sizes[name] = size
        last = self._reported.get(name, -1)
        new = [(step, value) for step, value in read_reports(folder) if step > last]
        if not new:
            return
        trial, prune = self._trials[name], self._pruned.get(name, False)
        for step, value in new:
            trial.report(value, step)
            if not prune and self.settings.pruner != "none":
                prune = bool(trial.should_prune())
        self._reported[name], self._pruned[name] = new[-1][0], prune
        if self.wait_s:
            write_verdict(folder, new[-1][0], prune)

    def finished(self, run: Any) -> None:
        """A trial's run ended: tell the study (done or pruned). Failed and interrupted trials stay
        running in the study; the next queue resumes them in their folders."""
        if run.spec.name not in self._trials:
            return
        if run.state == "done":
            self._tell(run)
        else:
            run.note = (
                run.note + "; " if run.note else ""
            ) + "resumed by the next run of the queue"

    def _tell(self, run: Any) -> None:
        optuna = _optuna()
        name = run.spec.name
        self._take_reports(name, run.folder)
        found = result(run.folder, self.space.metric)
        trial = self._trials.pop(name)
        if self._pruned.get(name) or found.pruned:
            self.study.tell(
                trial.number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True
            )
            self.told[name] = "pruned"
            run.note = f"pruned at step {self._reported.get(name, '?')}"
        elif found.value is None or not math.isfinite(found.value):
            self.study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            self.told[name] = "failed"
            run.note = f"reported no {self.space.metric}: failed in the study"
        else:
            self.study.tell(trial.number, found.value, skip_if_finished=True)
            self.told[name] = "done"

    def close(self) -> None:
        self.lock.release()


def searches_of(families: Sequence[Any], root: Path) -> list[Search]:
    return [Search(f.entry, f.space, root) for f in families if f.space.search is not None]
