"""``python -m multigpu`` is the ``multigpu`` command."""

import sys

from multigpu.cli import main

sys.exit(main())
