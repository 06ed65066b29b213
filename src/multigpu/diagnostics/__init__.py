"""Environment report, pre-flight checks, hang watchdog and cross-rank consistency checks."""
