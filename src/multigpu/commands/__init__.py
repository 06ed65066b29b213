"""One module per group of ``multigpu`` commands: each adds its parsers and runs its command."""
