"""Errors a user can fix, each one line with a HINT naming the flag, variable or file to change.

Why a separate module: every layer (world, launch, config, checkpoint, ...) raises these, and the CLI
and the worker wrapper print them as one line instead of a traceback. Standard library only.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import override
# the marker is for the type checker: typing_extensions imports inspect, ~35 ms in every small process
else:

    def override(method):  # (a rank's boot and tee processes import this module)
        return method


# Exit statuses: the one table (docs/fault-tolerance.md, "Exit statuses") that the launcher, the
# workers, the queue and Slurm requeue follow; tests/test_faults.py checks the page against these.
#: Done.
EXIT_OK = 0
#: An error in the script, or a launcher that could not start the job (one line says which).
EXIT_FAILED = 1
#: ``multigpu`` refused its input: one line with a HINT; nothing was started.
EXIT_REFUSED = 2
#: Stopped on SIGTERM/SIGUSR1 after writing a checkpoint (sysexits' EX_TEMPFAIL, "try again later"):
#: run the same command again to resume; the queue and Slurm requeue read it that way.
EXIT_PREEMPTED = 75
#: The hang watchdog stopped the job (GNU timeout's status); the report names where each rank was.
EXIT_HANG = 124
#: Every rank's script finished, but a worker had not exited ``--exit-timeout`` seconds later: its Python
#: stacks are in the log folder and it was ended (launch/exit_watch.py). The script's own work is done; what
#: it left to its exit handlers may not be.
EXIT_STUCK_AT_EXIT = 125
#: Ctrl-C: every worker stopped at once, without a checkpoint.
EXIT_INTERRUPTED = 130


#: Characters that steer a terminal (C0 and C1 controls, DEL, bidirectional overrides, line separators).
_STEERING = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]"
)
#: An error line never grows beyond this (a 3 MB value echoed back is cut, not printed).
MAX_LINE = 2000


def visible(text: str, keep_newlines: bool = False) -> str:
    """``text`` that came from outside (a name, a file's contents), safe to print: everything that could
    steer a terminal (an escape sequence that retitles the window or rewrites the screen, a bidirectional
    override) is shown as ``\\xNN``/``\\uNNNN`` instead; tabs stay; newlines stay only when asked."""

    def escape(match: "re.Match[str]") -> str:
        char = match.group(0)
        return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"

    text = _STEERING.sub(escape, text)
    return text if keep_newlines else text.replace("\n", "\\n")


def shown(value: object, limit: int = 80) -> str:
    """A value echoed in an error line: its repr, made visible, cut to about ``limit`` characters."""
    text = visible(repr(value))
    return text if len(text) <= limit else f"{text[: limit - 15]}... ({len(text)} chars)"


_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def as_shown(line: str) -> str:
    """A log line as a terminal showed it: a progress bar's redraws (\\r) keep their last state, ANSI
    colour codes are dropped (anything else that steers a terminal is made visible by
    :func:`visible` where it is printed)."""
    line = _ANSI.sub("", line).rstrip("\r")
    return line.rsplit("\r", 1)[-1]


def last_shown(raw: "list[str]", lines: int) -> "list[str]":
    """The last ``lines`` non-blank lines of a log's tail as a terminal showed them, safe to print."""
    return [visible(text) for text in map(as_shown, raw) if text.strip()][-lines:]


class MultiGPUError(Exception):
    """A problem with the user's input or environment, with the fix in ``hint``."""

    def __init__(self, message: str, hint: str = "") -> None:
        self.message = message.strip()
        self.hint = hint.strip()
        super().__init__(str(self))

    @override
    def __str__(self) -> str:
        return f"{self.message} HINT: {self.hint}" if self.hint else self.message

    def one_line(self) -> str:
        """The form printed by the CLI: one line, nothing in it that steers a terminal, at most MAX_LINE."""
        message, hint = (visible(" ".join(part.split())) for part in (self.message, self.hint))
        room = MAX_LINE - min(len(hint), MAX_LINE // 4) - 40
        if len(message) > room:
            message = f"{message[:room]}... (cut: {len(message)} characters)"
        hint = hint if len(hint) <= MAX_LINE // 4 else hint[: MAX_LINE // 4] + "..."
        return f"multigpu: error: {message} HINT: {hint}" if hint else f"multigpu: error: {message}"


class WorldError(MultiGPUError):
    """The launcher's or scheduler's variables contradict each other."""


class LaunchError(MultiGPUError):
    """The requested processes, devices, nodes or ports cannot be started."""


class ConfigError(MultiGPUError):
    """A configuration file, override or runs file is invalid."""


class CheckpointError(MultiGPUError):
    """A checkpoint is missing, corrupt, or does not match the model."""


class DesyncError(MultiGPUError):
    """Ranks disagree about something they must agree on (config, model, data)."""
