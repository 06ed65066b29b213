"""Errors a user can fix, each one line with a HINT naming the flag, variable or file to change.

Why a separate module: every layer (world, launch, config, checkpoint, ...) raises these, and the CLI
and the worker wrapper print them as one line instead of a traceback. Standard library only.
"""

from __future__ import annotations

from typing_extensions import override

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
#: Ctrl-C: every worker stopped at once, without a checkpoint.
EXIT_INTERRUPTED = 130


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
        """The form printed by the CLI: never more than one line."""
        return "multigpu: error: " + " ".join(str(self).split())


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
