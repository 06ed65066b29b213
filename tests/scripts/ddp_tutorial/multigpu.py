"""The PyTorch DDP tutorial series keeps a ``multigpu.py`` (its mp.spawn version) beside its torchrun script.
Imported, this one says so and fails: a launch from this folder must never import it."""

raise SystemExit("PLANTED multigpu.py was imported")
