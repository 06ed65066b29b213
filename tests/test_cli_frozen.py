"""The command-line interface is frozen: every sub-command's flags, their spellings, defaults, choices and
how many values they take, compared with tests/data/cli.json (as torchtitan's test_no_new_cli_options
does). A flag cannot disappear or change its meaning unnoticed; a deliberate change updates the file:

    python tests/test_cli_frozen.py > tests/data/cli.json

and the diff is reviewed like code (and the docs that show the flag are updated with it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

FROZEN = Path(__file__).parent / "data" / "cli.json"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found.update(action.choices)
    return found


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return repr(value)


def describe(parser: argparse.ArgumentParser, prefix: str = "multigpu") -> dict[str, Any]:
    """Every command path -> its arguments (spellings, destination, values taken, default, choices)."""
    commands: dict[str, Any] = {}
    args = []
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        args.append(
            {
                "flags": list(action.option_strings) or [action.dest],
                "dest": action.dest,
                "nargs": _plain(action.nargs),
                "default": _plain(action.default),
                "choices": _plain(sorted(action.choices) if action.choices else None),
                "kind": type(action).__name__,
            }
        )
    commands[prefix] = sorted(args, key=lambda a: a["flags"])
    for name, sub in sorted(_subparsers(parser).items()):
        commands.update(describe(sub, f"{prefix} {name}"))
    return commands


def current() -> dict[str, Any]:
    from multigpu.cli import build_parser

    return describe(build_parser())


def test_the_command_line_is_what_was_frozen():
    frozen = json.loads(FROZEN.read_text())
    now = current()
    gone = sorted(set(frozen) - set(now))
    added = sorted(set(now) - set(frozen))
    assert not gone and not added, (
        f"commands removed: {gone}; added: {added} (see this file's docstring)"
    )
    changed = [name for name in frozen if frozen[name] != now[name]]
    details = []
    for name in changed:
        before = {tuple(a["flags"]): a for a in frozen[name]}
        after = {tuple(a["flags"]): a for a in now[name]}
        details += [f"{name}: {' '.join(f)} removed" for f in before if f not in after]
        details += [f"{name}: {' '.join(f)} added" for f in after if f not in before]
        details += [
            f"{name}: {' '.join(f)} {before[f]} -> {after[f]}"
            for f in before
            if f in after and before[f] != after[f]
        ]
    assert not changed, "the command line changed (see this file's docstring):\n" + "\n".join(
        details
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    print(json.dumps(current(), indent=1, sort_keys=True))
