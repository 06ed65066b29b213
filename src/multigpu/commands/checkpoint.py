"""``multigpu checkpoint list|verify|consolidate``."""

from __future__ import annotations

import argparse
from typing import Any


def add_checkpoint_parser(sub: argparse._SubParsersAction[Any]) -> None:
    p = sub.add_parser(
        "checkpoint",
        help="list, verify or consolidate checkpoints",
        description="Inspect checkpoint folders written by multigpu (replicated or sharded).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser(
        "list", help="the checkpoints in a folder, newest first, with their state"
    )
    listing.add_argument("directory")
    verify = actions.add_parser(
        "verify", help="check every file of a checkpoint against its manifest"
    )
    verify.add_argument("path")
    consolidate = actions.add_parser(
        "consolidate", help="one plain state.pt from a sharded (fsdp) checkpoint"
    )
    consolidate.add_argument(
        "path", help="a sharded checkpoint folder (step-N) or a folder of them (the newest)"
    )
    consolidate.add_argument(
        "--out", help="folder for the consolidated checkpoint (default: <parent>/consolidated)"
    )
    p.set_defaults(handler=_cmd_checkpoint)


def _cmd_checkpoint(args: argparse.Namespace) -> int:
    """Every action only reads its input: a crashed save's leftovers are reported, never fixed here
    (a resume fixes them), and a consolidated copy is written to a new folder."""
    from pathlib import Path

    from multigpu import checkpoint
    from multigpu.checkpoint import sharded
    from multigpu.errors import CheckpointError, visible

    if args.action == "list":
        if not Path(args.directory).is_dir():
            raise CheckpointError(
                f"{visible(args.directory)} is not a folder.",
                "give the folder holding step-N checkpoints.",
            )
        found = checkpoint.list_checkpoints(args.directory)
        if not found:
            print(f"no checkpoints in {visible(args.directory)}")
            return 1
        for info in found:
            try:
                manifest = checkpoint.verify(info.path)
                kind = "sharded" if manifest.get("sharded") else "replicated"
                print(
                    f"{visible(str(info.path))}  step {info.step}  epoch {manifest.get('epoch', '?')}  "
                    f"{kind}, world size {manifest.get('world_size', '?')}  ok"
                )
            except CheckpointError as exc:
                print(
                    f"{visible(str(info.path))}  step {info.step}  CORRUPT: {visible(exc.message)}"
                )
        return 0
    if args.action == "verify":
        manifest = checkpoint.verify(args.path)
        print(f"{visible(args.path)}: ok ({len(manifest['files'])} file(s) match the manifest)")
        return 0
    path = Path(args.path)
    if not checkpoint.files.is_checkpoint(path):
        newest = checkpoint.latest(path, report=lambda line: print(line))
        if newest is None:
            raise CheckpointError(
                f"no checkpoint at {visible(str(path))}.",
                "give a step-N folder or the folder holding them.",
            )
        path = newest.path
    out = sharded.consolidate(path, Path(args.out) if args.out else None)
    print(
        f"consolidated {visible(str(path))} -> {visible(str(out / 'state.pt'))} "
        "(load with torch.load(..., weights_only=True)['model'])"
    )
    return 0
