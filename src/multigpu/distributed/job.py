"""What the command that started this process asks of it, beside where it stands (:class:`World`).

Why one value: ``multigpu queue`` (the run's folder, its GPU memory share, a trial's channel), ``multigpu
check`` (where to record, for how many steps, at what batch scale), ``multigpu run --profile`` and the
launcher itself (its workers' devices, log folder, output prefix) each spoke to their runs through
variables of their own - fourteen of them, half parsed and checked as fields of ``World``, which is
about ranks and topology. Here they are one typed value with a section per request,
handed on as one JSON variable (:data:`JOB_VAR`): the command that starts a launch sets its section with
:func:`job_env`, the launches inside it inherit the rest, and ``mg.init`` reads it once
(:func:`multigpu.distributed.world.read_job`). A value someone set by hand is checked like any outside
input: bounded, typed, unknown keys refused, one line with a HINT.

Standard library, ``errors`` and ``validate`` only: the launcher writes it without importing torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
_HINT = f"{JOB_VAR} is set by multigpu run, queue and check; unset it when running by hand."


@dataclass(frozen=True)
class Check:
    """``multigpu check``'s request: the recorder's folder, after how many optimizer steps the run ends,
    by how much the one-process run's loaders scale their batch."""

    dir: str = setting(blank=False)
    steps: int = setting(5, low=1, high=10_000)
    scale: int = setting(1, low=1, high=4096)


@dataclass(frozen=True)
class Workers:
    """What a launcher tells its own workers: each launcher writes its own section, so the workers of a
    launch started inside a worker never read their parent's."""

    #: The agent that started them (the worker dies with it; 0: none).
    agent_pid: int = setting(0, low=0, high=2**31)
    #: ``--gpus-per-proc K`` and ``--procs-per-gpu K``: devices each process owns, processes per device.
    devices_per_process: int = setting(1, low=1, high=4096)
    processes_per_device: int = setting(1, low=1, high=4096)
    #: Where each rank's stderr (and with ``keep_stdout``, stdout) is copied; ``tee_prefix``: [rankN] lines.
    log_dir: Optional[str] = setting(None, blank=False)
    keep_stdout: bool = False
    tee_prefix: bool = False
    #: A c10d rendezvous of several nodes: the first worker of each node says its node number.
    announce_node: bool = False


@dataclass(frozen=True)
class Job:
    """Each command's request, one field or section each; a key this version does not know is refused."""

    #: The folder a queue run may write in (None: not started by ``multigpu queue``): a Trainer's out_dir or
    #: a checkpoint folder outside it (chosen by a runs file someone handed you) is refused.
    run_dir: Optional[str] = setting(None, blank=False)
    #: The share of its GPU's memory this process may take (a packed queue run); None: all of it.
    memory_fraction: Optional[float] = setting(None, low=0.001, high=1)
    #: A queue trial's channel to its sweep or search (None: not a trial).
    trial_dir: Optional[str] = setting(None, blank=False)
    check: Optional[Check] = None
    #: ``multigpu run --profile``: the Trainer traces a few steps per rank.
    profile: bool = False
    workers: Optional[Workers] = None
    #: Launcher to launcher: a node's launcher started by ``--simulate-nodes`` (the other nodes start in
    #: this command too), and the replica launcher a group's agent dies with (its pid; 0: none). Each
    #: launcher clears both for its workers: a launch inside a worker is not one of these.
    simulated_node: bool = False
    replica_launcher_pid: int = setting(0, low=0, high=2**31)


_RULES = rules_of(Job)  # from the declarations above
_SECTIONS: dict[str, tuple[type, dict[str, Rule]]] = {
    "check": (Check, rules_of(Check)),
    "workers": (Workers, rules_of(Workers)),
}


def parse_job(text: Optional[str]) -> Job:
    """The job a :data:`JOB_VAR` value describes (none set: a plain run, ``Job()``)."""
    if not text:
        return Job()
    size = len(text.encode("utf-8", "surrogateescape"))
    if size > MAX_JOB_BYTES:
        raise WorldError(f"{JOB_VAR} holds {size:,} bytes (at most {MAX_JOB_BYTES:,}).", _HINT)
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as exc:
        raise WorldError(f"{JOB_VAR} gives {shown(str(exc), 40)} twice.", _HINT) from None
    except (ValueError, RecursionError) as exc:
        raise WorldError(
            f"{JOB_VAR}={shown(text, 60)} is not a JSON object ({shown(str(exc), 60)}).", _HINT
        ) from None
    if not isinstance(data, dict):
        raise WorldError(f"{JOB_VAR}={shown(text, 60)} is not a JSON object.", _HINT)
    sections = {name: data.pop(name) for name in _SECTIONS if name in data}
    values = _typed(data, _RULES, JOB_VAR)
    for name, section in sections.items():
        cls, rules = _SECTIONS[name]
        if section is None:
            continue
        if not isinstance(section, dict):
            raise WorldError(f"{JOB_VAR}: {name}={shown(section, 60)} is not an object.", _HINT)
        missing = [
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.name not in section
        ]
        if missing:
            raise WorldError(
                f"{JOB_VAR}: {name}={shown(section, 60)} is missing its {missing[0]}.", _HINT
            )
        values[name] = cls(**_typed(section, rules, f"{JOB_VAR} {name}"))
    job = Job(**values)
    for where, path in _paths(job):
        # a fence that moves with the script's current folder is no fence
        if not os.path.isabs(path):
            raise WorldError(
                f"{JOB_VAR}: {where}={shown(path, 60)} is not an absolute path.", _HINT
            )
    return job


class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key)
        out[key] = value
    return out


def _paths(job: Job) -> list[tuple[str, str]]:
    """The job's folders, by where they are: each must be absolute."""
    found = [
        ("run_dir", job.run_dir),
        ("trial_dir", job.trial_dir),
        ("check.dir", job.check.dir if job.check else None),
        ("workers.log_dir", job.workers.log_dir if job.workers else None),
    ]
    return [(where, path) for where, path in found if path is not None]


def _typed(data: Mapping[str, Any], rules: Mapping[str, Rule], owner: str) -> dict[str, Any]:
    unknown = [str(key) for key in data if key not in rules]
    if unknown:
        raise WorldError(f"{owner} has an unknown key {shown(unknown[0], 40)}.", _HINT)
    values = {
        name: checked(owner, name, value, rules[name], WorldError) for name, value in data.items()
    }
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
            out[item.name] = (
                dataclasses.asdict(value) if isinstance(value, (Check, Workers)) else value
            )
    return json.dumps(out, sort_keys=True)


def job_env(inherited: Optional[str], **changes: Any) -> dict[str, str]:
    """The :data:`JOB_VAR` entry of a child's environment: the job this process was given (``inherited``,
    its own variable's value), with ``changes`` (a section set to None is cleared)."""
    # made absolute here, once: the run's folder stays where it was
    for name in ("run_dir", "trial_dir"):
        if isinstance(changes.get(name), str):
            changes[name] = os.path.abspath(changes[name])
    for name, folder in (("check", "dir"), ("workers", "log_dir")):
        if changes.get(name) is not None and getattr(changes[name], folder) is not None:
            changes[name] = dataclasses.replace(
                changes[name], **{folder: os.path.abspath(getattr(changes[name], folder))}
            )
    text = job_text(dataclasses.replace(parse_job(inherited), **changes))
    try:
        # what the runs will read: a value they would refuse is refused here, by its writer
        parse_job(text)
    except WorldError as exc:
        raise WorldError(
            exc.message,
            "give the run's folders names of plain text (valid UTF-8, no control characters).",
        ) from None
    return {JOB_VAR: text}
