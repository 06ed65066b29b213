"""One ``multigpu run`` command line, built in one place: :class:`RunFlags` and ``to_argv()``.

Why: the queue, ``check``, ``env --check``, ``doctor``, ``--simulate-nodes`` and Slurm scripts all start
``multigpu run`` as a child process. Each used to assemble its own argv; a flag renamed in the parser
then silently dropped out of one of them. Here every flag has one spelling, values are written only
when they differ from the launcher's default, and the target always comes last behind ``--`` (a
script named like a flag is never read as one) or as ``-m module``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from multigpu.launch.interpreter import python_module
from multigpu.launch.knobs import BY_NAME, KNOBS, LAUNCH_GROUPS

#: The knobs a ``multigpu run`` line carries, in the order they are written (switches last).
_HANDED_ON = tuple(k for k in KNOBS if k.handed_on and not k.switch) + tuple(
    k for k in KNOBS if k.handed_on and k.switch
)
#: The device and node flags that ``run`` and ``doctor`` share (``doctor`` hands them on to ``run``).
LAUNCH_FIELDS = tuple(k.name for k in KNOBS if k.group in LAUNCH_GROUPS)


class RunFlags:
    """The launcher's flags, by their knob names (:data:`multigpu.launch.knobs.KNOBS`); a flag left out,
    None, or at the launcher's default is not written.

    Values are kept as given: a Slurm script passes ``"$SLURM_JOB_NUM_NODES"`` for ``nnodes``, which
    the script's shell expands. Immutable: :meth:`replace` makes a changed copy.
    """

    __slots__ = ("_given",)

    def __init__(self, **given: Any) -> None:
        unknown = [name for name in given if name not in BY_NAME or not BY_NAME[name].handed_on]
        if unknown:
            raise TypeError(f"RunFlags has no launch flag {unknown[0]!r}")
        object.__setattr__(self, "_given", dict(given))

    def __getattr__(self, name: str) -> Any:
        if name in BY_NAME and BY_NAME[name].handed_on:
            return self._given.get(name)
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("RunFlags is immutable: use .replace()")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunFlags) and self._given == other._given

    def __repr__(self) -> str:
        return f"RunFlags({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"

    def replace(self, **changes: Any) -> "RunFlags":
        return RunFlags(**{**self._given, **changes})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RunFlags":
        """Every launch flag of a parsed ``multigpu run`` line: what a launch of launches (simulated
        nodes, replica groups) hands each child before setting its own."""
        return cls(**{knob.name: getattr(args, knob.name) for knob in _HANDED_ON})

    @classmethod
    def from_launch_args(cls, args: argparse.Namespace) -> "RunFlags":
        """The device and node flags (``commands.launching.add_launch_flags``) of a parsed command line."""
        return cls(**{name: getattr(args, name) for name in LAUNCH_FIELDS})

    def flags(self) -> list[str]:
        """Only the flags, in a fixed order."""
        out: list[str] = []
        for knob in _HANDED_ON:
            value = self._given.get(knob.name)
            if knob.switch:
                out += [knob.flags[0]] if value else []
            # "-x" as one word: never read as a flag
            elif value is not None and value != knob.default:
                text = str(value)
                out += (
                    [f"{knob.flags[0]}={text}"] if text.startswith("-") else [knob.flags[0], text]
                )
        return out

    def to_argv(self, target: Sequence[str], python: str = sys.executable) -> list[str]:
        """``python -P -m multigpu run FLAGS -- script args`` (or ``... -m module args``; ``-P``: see
        :mod:`.interpreter`).

        ``target``: ``[script, *args]``, ``["-m", module, *args]`` or ``["--", script, *args]``.
        """
        target = list(target)
        if target and target[0] not in ("-m", "--"):
            target = ["--", *target]
        return [*python_module("multigpu", python), "run", *self.flags(), *target]
