"""What the command that started this process asks of it, beside where it stands (:class:`World`).

Why one value: ``multigpu queue`` (the run's folder, its GPU memory share, a trial's channel), ``multigpu
check`` (where to record, for how many steps, at what batch scale) and ``multigpu run --profile`` each
asked their runs through variables of their own - seven of them, each parsed and checked as a field of
``World``, which is about ranks and topology. Here they are one typed value with a section per request,
handed on as one JSON variable (:data:`JOB_VAR`): the command that starts a launch sets its section with
:func:`job_env`, the launches inside it inherit the rest, and ``mg.init`` reads it once
(:func:`multigpu.distributed.world.read_job`). A value someone set by hand is checked like any outside
input: bounded, typed, unknown keys refused, one line with a HINT.

Standard library, ``errors`` and ``validate`` only: the launcher writes it without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from multigpu.errors import WorldError, shown
from multigpu.validate import Rule, checked, rules_of, setting

JOB_VAR = "MULTIGPU_JOB"
MAX_JOB_BYTES = 64 * 1024
#: A trial's channel (``Job.trial_dir``): the queue writes TRIAL_SETTINGS_FILE there (the metric to report,
#: how long to wait for a verdict); rank 0 appends ``step,value`` rows to TRIAL_REPORTS_FILE (``run.report``,
#: the Trainer after each evaluation) and reads the queue's pruning answer from TRIAL_VERDICT_FILE. Files,
#: not a socket: the queue may be another machine's process (Slurm), and the trial imports nothing of it.
TRIAL_SETTINGS_FILE = "trial.json"
TRIAL_REPORTS_FILE = "reports.csv"
TRIAL_VERDICT_FILE = "verdict.json"
_HINT = f"{JOB_VAR} is set by multigpu queue, check and run --profile; unset it when running by hand."


@dataclass(frozen=True)
class Check:
    """``multigpu check``'s request: the recorder's folder, after how many optimizer steps the run ends,
    by how much the one-process run's loaders scale their batch."""

    dir: str = setting(blank=False)
    steps: int = setting(5, low=1, high=10_000)
    scale: int = setting(1, low=1, high=4096)


@dataclass(frozen=True)
class Job:
    """Each command's request, one field or section each; a key this version does not know is refused."""

    #: The folder a queue run may write in (None: not started by ``multigpu queue``): a Trainer's out_dir or
    #: a checkpoint folder outside it (chosen by a runs file someone handed you) is refused.
    run_dir: Optional[str] = setting(None, blank=False)
    #: The share of its GPU's memory this process may take (a packed queue run); None: all of it.
    memory_fraction: Optional[float] = setting(None, low=0, high=1, positive=True)
    #: A queue trial's channel to its sweep or search (None: not a trial).
    trial_dir: Optional[str] = setting(None, blank=False)
    check: Optional[Check] = None
    #: ``multigpu run --profile``: the Trainer traces a few steps per rank.
    profile: bool = False


_RULES, _CHECK_RULES = rules_of(Job), rules_of(Check)  # from the declarations above


def parse_job(text: Optional[str]) -> Job:
    """The job a :data:`JOB_VAR` value describes (none set: a plain run, ``Job()``)."""
    if not text:
        return Job()
    if len(text) > MAX_JOB_BYTES:
        raise WorldError(f"{JOB_VAR} holds {len(text):,} characters (at most {MAX_JOB_BYTES:,}).", _HINT)
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise WorldError(f"{JOB_VAR}={shown(text, 60)} is not a JSON object.", _HINT) from None
    if not isinstance(data, dict):
        raise WorldError(f"{JOB_VAR}={shown(text, 60)} is not a JSON object.", _HINT)
    check = data.pop("check", None)
    values = _typed(data, _RULES, JOB_VAR)
    if check is not None:
        if not isinstance(check, dict):
            raise WorldError(f"{JOB_VAR}: check={shown(check, 60)} is not an object.", _HINT)
        if "dir" not in check:
            raise WorldError(f"{JOB_VAR}: check={shown(check, 60)} is missing its dir.", _HINT)
        values["check"] = Check(**_typed(check, _CHECK_RULES, f"{JOB_VAR} check"))
    return Job(**values)


def _typed(data: Mapping[str, Any], rules: Mapping[str, Rule], owner: str) -> dict[str, Any]:
    unknown = [str(key) for key in data if key not in rules]
    if unknown:
        raise WorldError(f"{owner} has an unknown key {shown(unknown[0], 40)}.", _HINT)
    values = {name: checked(owner, name, value, rules[name], WorldError) for name, value in data.items()}
    if isinstance(values.get("memory_fraction"), int):
        values["memory_fraction"] = float(values["memory_fraction"])
    return values


def job_text(job: Job) -> str:
    """``job`` as the value of :data:`JOB_VAR` (what is at its default is left out)."""
    defaults = Job()
    out: dict[str, Any] = {}
    for item in dataclasses.fields(Job):
        value = getattr(job, item.name)
        if value != getattr(defaults, item.name):
            out[item.name] = dataclasses.asdict(value) if isinstance(value, Check) else value
    return json.dumps(out, sort_keys=True)


def job_env(inherited: Optional[str], **changes: Any) -> dict[str, str]:
    """The :data:`JOB_VAR` entry of a child's environment: the job this process was given (``inherited``,
    its own variable's value), with ``changes`` (a section set to None is cleared)."""
    return {JOB_VAR: job_text(dataclasses.replace(parse_job(inherited), **changes))}
