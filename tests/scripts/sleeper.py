"""Joins the group, writes its pid, then sleeps until killed. Usage: sleeper.py OUT_DIR TOKEN"""

import os
import sys
import time

import multigpu as mg

run = mg.init(timeout_s=30)
with open(os.path.join(sys.argv[1], f"pid{run.rank}"), "w") as handle:
    handle.write(str(os.getpid()))
while True:
    time.sleep(0.2)
