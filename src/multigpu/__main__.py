"""``python -m multigpu`` is the ``multigpu`` command."""

from multigpu.cli import entry

entry()
