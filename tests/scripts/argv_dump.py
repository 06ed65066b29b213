"""Write this script's arguments (and where it ran) to the JSON file named by its first argument."""

import json
import os
import socket
import sys

import multigpu as mg

run = mg.init(timeout_s=60)
if run.is_main:
    with open(sys.argv[1], "w") as handle:
        json.dump(
            {
                "argv": sys.argv[2:],
                "world_size": run.world_size,
                "cwd": os.getcwd(),
                "host": socket.gethostname(),
                "source": run.world.source,
            },
            handle,
        )
