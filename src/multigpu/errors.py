"""Errors a user can fix, each one line with a HINT naming the flag, variable or file to change.

Why a separate module: every layer (world, launch, config, checkpoint, ...) raises these, and the CLI
and the worker wrapper print them as one line instead of a traceback. Standard library only.
"""

from __future__ import annotations

from typing_extensions import override


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
