"""A queue trial's line to its sweep or search: report the metric after each evaluation, and hear
whether the search pruned the trial.

Why files in the trial's own folder (the job's ``trial_dir``, see :mod:`multigpu.distributed.job`):
the queue that reads them may be another process on another machine (a Slurm search), and the trial
must import nothing of the queue (the queue never imports the trainer, the trainer never imports the
queue). Rank 0 appends ``step,value`` to ``reports.csv``; when the search prunes, it waits (at most
``wait_s``) for the queue's answer in ``verdict.json``, so a decision is taken at the evaluation that
caused it, the same way on every run of the test suite. The answer is then agreed by every rank in
one all-reduce of a flag, so all ranks stop at the same evaluation - through the Trainer's
early-stop path, which keeps a checkpoint.

Outside a queue trial (no ``trial_dir`` in the job), :meth:`TrialChannel.report` does nothing and
answers False on every rank without any collective.
"""

from __future__ import annotations

import json
import math
import operator
import time
from typing import Any, Callable, Mapping, Optional

from multigpu.distributed.job import (
    JOB_VAR,
    TRIAL_REPORTS_FILE,
    TRIAL_SETTINGS_FILE,
    TRIAL_VERDICT_FILE,
)
from multigpu.errors import ConfigError, shown
from multigpu.fileio import Folder

#: Rows a trial writes at most (one per evaluation): beyond this it stops writing, with one warning.
MAX_REPORTS = 100_000
#: The longest the queue may make a trial wait for its answer to one report (trial.json's wait_s).
MAX_WAIT_S = 600.0
_LARGEST_STEP = 2**62


class TrialChannel:
    """``report(value, step)`` -> stop now? for one process of a trial (every rank calls it)."""

    def __init__(
        self,
        folder: Optional[str],
        is_main: bool,
        agree: Callable[[bool], bool],
        say: Callable[[str], None] = print,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.folder = Folder(folder) if folder else None
        self.is_main = is_main
        #: True on every rank when it is true on any (an all-reduce of the flag over the trial's ranks).
        self.agree = agree
        self.say = say
        #: A stop signal arrived (the queue is stopping): stop waiting for its answer.
        self.stopping = stopping
        self.pruned = False
        self.metric = ""
        self.wait_s = 0.0
        self._settings_read = False
        self._rows = 0

    @property
    def _folder(self) -> Folder:
        if self.folder is None:
            # report() returns before anything needs the folder
            raise RuntimeError("not a queue trial")
        return self.folder

    def report(self, value: Any, step: int) -> bool:
        """Report ``value`` (a number, or a mapping holding the search's metric) at optimizer ``step``;
        True on every rank once the search has pruned this trial: save and stop."""
        if self.folder is None:
            return False
        if self.pruned:
            return True
        self._read_settings()
        number, step = self._number(value), _step(step)
        pruned = self._report_on_main(number, step) if self.is_main else False
        self.pruned = self.agree(pruned)
        if self.pruned:
            self.say(
                f"multigpu: pruned by the queue's search at step {step} ({self.metric} {number:.6g}): "
                "stopping (the Trainer keeps a checkpoint)"
            )
        return self.pruned

    # ------------------------------------------------------------------ rank 0
    def _report_on_main(self, number: float, step: int) -> bool:
        if self._rows >= MAX_REPORTS:
            return False
        if self._rows == 0 and self._folder.kind(TRIAL_REPORTS_FILE) is None:
            self._append("step,value\n")
        self._rows += 1
        self._append(f"{step},{number!r}\n")
        if self._rows == MAX_REPORTS:
            self.say(
                f"multigpu: this trial reported {MAX_REPORTS:,} times; later reports are not written."
            )
        return self._verdict(step) if self.wait_s > 0 else False

    def _append(self, text: str) -> None:
        with self._folder.open_append(TRIAL_REPORTS_FILE) as handle:
            handle.write(text)

    def _verdict(self, step: int) -> bool:
        """Wait for the queue's answer to the report of ``step`` (polling its small file)."""
        deadline, pause = time.monotonic() + self.wait_s, 0.01
        while True:
            answer = self._read_verdict()
            if answer is not None and answer[0] >= step:
                return answer[1]
            if self.stopping():
                return False
            if time.monotonic() >= deadline:
                self.say(
                    f"multigpu: the queue did not answer this trial's report of step {step} within "
                    f"{self.wait_s:g} s; going on without waiting (no pruning from here on)."
                )
                self.wait_s = 0.0
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.2)

    def _read_verdict(self) -> Optional[tuple[int, bool]]:
        try:
            data = json.loads(self._folder.load_text(TRIAL_VERDICT_FILE, limit=4096))
        except (OSError, ValueError):
            return None  # not written yet (or being replaced): ask again
        step, prune = (
            (data.get("step"), data.get("prune")) if isinstance(data, dict) else (None, None)
        )
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(prune, bool):
            return step, prune
        return None

    # ------------------------------------------------------------------ every rank
    def _read_settings(self) -> None:
        """The metric to report and how long to wait for answers, from the queue's trial.json."""
        if self._settings_read:
            return
        where = f"the trial settings {self._folder / TRIAL_SETTINGS_FILE}"
        hint = f"start this run from its queue, or unset {JOB_VAR} to run it on its own."
        try:
            data = json.loads(self._folder.load_text(TRIAL_SETTINGS_FILE, limit=64 * 1024))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot read {where}: {getattr(exc, 'strerror', None) or exc}.", hint
            ) from None
        metric, wait_s = (
            (data.get("metric"), data.get("wait_s")) if isinstance(data, dict) else (None, None)
        )
        if (
            not isinstance(metric, str)
            or not 0 < len(metric) <= 200
            or isinstance(wait_s, bool)
            or not isinstance(wait_s, (int, float))
            or not 0 <= wait_s <= MAX_WAIT_S
        ):
            raise ConfigError(f"{where} are malformed.", hint)
        self.metric, self.wait_s, self._settings_read = metric, float(wait_s), True

    def _number(self, value: Any) -> float:
        """The reported number: ``value`` itself, or the search's metric in a mapping of metrics."""
        if isinstance(value, Mapping):
            if self.metric not in value:
                names = ", ".join(str(k) for k in list(value)[:20])
                raise ConfigError(
                    f"the search's metric {self.metric!r} is not among the metrics reported ({names}).",
                    "set metric: in the runs file's sweep: or search: block to one of them.",
                )
            value = value[self.metric]
        if isinstance(value, (bool, str, bytes)):
            raise ConfigError(
                f"run.report got {shown(value)}, not a number.",
                "report a float: run.report(loss, step).",
            )
        try:
            number = float(value)  # floats, ints, numpy scalars, one-element tensors
        except (TypeError, ValueError, RuntimeError):
            raise ConfigError(
                f"run.report got {shown(value)}, not a number.",
                "report a float (or a one-element tensor): run.report(loss, step).",
            ) from None
        return number if not math.isinf(number) else math.nan  # inf is as bad as NaN to a search


def _step(step: Any) -> int:
    try:
        if isinstance(step, bool):
            raise TypeError
        number = operator.index(step)
    except TypeError:
        raise ConfigError(
            f"run.report step {shown(step)} is not a whole number.",
            "pass the optimizer step: run.report(loss, step).",
        ) from None
    if not 0 <= number <= _LARGEST_STEP:
        raise ConfigError(
            f"run.report step {number} is outside 0..2**62.", "pass the optimizer step."
        )
    return number
