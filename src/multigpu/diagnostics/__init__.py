"""Environment report, pre-flight checks, hang watchdog and cross-rank consistency checks."""

#: The line prefix on which a doctor rank prints its verdict ({"faults": [...], "world": N} as JSON) for the
#: ``multigpu doctor`` command to read. Here, not in ``diagnostics.doctor`` (which imports torch): the command
#: checks its flags and starts the launch without importing torch.
DOCTOR_MARKER = "MULTIGPU_DOCTOR "
