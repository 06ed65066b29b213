"""Run as a module: multigpu run -m pkg.hello ARG"""

import sys

import multigpu as mg

run = mg.init(timeout_s=30)
sys.stdout.write(
    f"module rank {run.rank} of {run.world_size} args {sys.argv[1:]} name {__name__}\n"
)
