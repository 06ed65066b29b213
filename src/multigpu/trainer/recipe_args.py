"""A recipe's command-line arguments, checked by the launcher before any worker imports torch.

Why: a recipe reads its YAML file and ``KEY=VALUE`` overrides in its own ``main`` (``config.load``),
after ``import torch`` - so a typo (``trainer.epoch=1``), a Hydra habit (``+key=v``, ``~key``,
``--multirun``) or a broken YAML file cost 4-12 s of torch's import on every rank before the one line
came. What can be checked without the script's own classes is checked here, by the same code the
script runs, so the line is the same one it would print, in a tenth of a second:

- only for a script that calls multigpu's ``config.load`` (read from its source, never run), and only
  when its arguments are in the recipe's shape: an optional YAML file first, then ``KEY=VALUE`` items
  (a script with flags of its own is left to itself);
- the YAML file (syntax, duplicate keys, size), each override's form, and the section its recipe class
  declares as ``mg.TrainerSettings`` (``trainer:`` in every guide) with its overrides: unknown keys, types,
  bounds. The rest of the recipe (``model.hidden``) is the script's class, checked when the script runs.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Optional, Sequence

from multigpu.config import format_value, from_mapping, gather
from multigpu.config.yaml_file import read_text_file
from multigpu.errors import ConfigError
from multigpu.trainer.settings import TrainerSettings

#: A script larger than this is not read here (the worker still checks everything when it runs).
MAX_SCRIPT_BYTES = 2_000_000
_HYDRA_SWITCHES = ("--multirun", "-m")


def check_recipe_arguments(script: str, args: Sequence[str]) -> None:
    """Raise the :class:`ConfigError` the script's ``config.load`` would raise for these arguments, where
    it can be known without running the script; return quietly otherwise."""
    shape = _recipe_shape(args)
    if shape is None:
        return
    yaml_file, overrides = shape
    section = _settings_section(script)
    if section is False:
        return  # not a recipe of multigpu's config: its arguments are its own
    data, source, lines = gather(yaml_file, overrides)  # the file's and the overrides' own errors
    given = data.get(section) if isinstance(section, str) else None
    if isinstance(section, str) and isinstance(given, dict):
        from_mapping(TrainerSettings, given, source, lines, (section,))


def resume_override(section: str, fresh: bool, resume: Optional[str]) -> str:
    """``--fresh`` / ``--resume PATH`` as the recipe's own override, quoted to read back as the same text."""
    return f"{section}.fresh=true" if fresh else f"{section}.resume_from={format_value(resume)}"


def settings_section(script: str, args: Sequence[str]) -> Optional[str]:
    """The name of the recipe's TrainerSettings section (``trainer``) where its arguments are a recipe's
    and its source shows one; else None."""
    if _recipe_shape(args) is None:
        return None
    section = _settings_section(script)
    return section if isinstance(section, str) else None


def _recipe_shape(args: Sequence[str]) -> Optional[tuple[Optional[str], list[str]]]:
    """(YAML file, overrides) when ``args`` read as a recipe's, else None."""
    args = list(args)
    yaml_file = args.pop(0) if args and args[0].endswith((".yaml", ".yml")) else None
    for item in args:
        hydra = (
            item in _HYDRA_SWITCHES
            or item.startswith("~")
            or (item.startswith("+") and "=" in item)
        )
        if not hydra and ("=" not in item or item.startswith("-")):
            return None
    if yaml_file is not None and not Path(yaml_file).is_file():
        return None  # the script says what it makes of a missing file
    return yaml_file, args


def _settings_section(script: str) -> "str | bool | None":
    """False: the script does not call multigpu's ``config.load``. Else the name of the field its recipe
    class declares as ``TrainerSettings`` (None when there is none this reading can find)."""
    try:
        text = read_text_file(os.path.realpath(script), "script", limit=MAX_SCRIPT_BYTES)
        if "multigpu" not in text or "load" not in text:
            return False  # cheap: no recipe of ours, nothing to parse
        return _section_in(ast.parse(text, script))
    except (ConfigError, SyntaxError, ValueError, RecursionError, MemoryError):
        return False  # the script itself says what is wrong with it when it runs


def _section_in(tree: ast.Module) -> "str | bool | None":
    """The recipe class's ``TrainerSettings`` field, read only where the reading is unambiguous: one
    recipe class handed to every ``config.load`` call, defined once, with a field annotated by a name
    bound to multigpu's own class (a user's class of the same name is the user's)."""
    names = _multigpu_names(tree)
    recipes = {
        _first_name(node)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _is_load(node.func, names)
    }
    if not recipes:
        return False
    classes = [
        node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name in recipes
    ]
    if len(recipes) != 1 or None in recipes or len(classes) != 1:
        return None  # several recipes, or one this reading cannot name: the script checks its own
    fields = [
        item.target.id
        for item in classes[0].body
        if isinstance(item, ast.AnnAssign)
        and isinstance(item.target, ast.Name)
        and _names_settings(item.annotation, names)
    ]
    return fields[0] if len(fields) == 1 else None


def _first_name(call: ast.Call) -> Optional[str]:
    return call.args[0].id if call.args and isinstance(call.args[0], ast.Name) else None


class _Names:
    """What the script's imports bind: names for the ``multigpu`` package (``mg``), for
    ``multigpu.config``, for its ``load``, and for multigpu's ``TrainerSettings``."""

    def __init__(self) -> None:
        self.package: set[str] = set()
        self.config: set[str] = set()
        self.load: set[str] = set()
        self.settings: set[str] = set()
        #: Names the script binds to something else too (a class of its own, an assignment, another
        #: library's import): which one a line means is the script's to say.
        self.shadowed: set[str] = set()


_SETTINGS_HOMES = ("multigpu", "multigpu.trainer", "multigpu.trainer.settings")


def _multigpu_names(tree: ast.Module) -> _Names:
    names = _Names()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                bound = alias.asname or alias.name
                if node.level == 0 and node.module == "multigpu" and alias.name == "config":
                    names.config.add(bound)
                elif node.level == 0 and node.module == "multigpu.config" and alias.name == "load":
                    names.load.add(bound)
                elif (
                    node.level == 0
                    and node.module in _SETTINGS_HOMES
                    and alias.name == "TrainerSettings"
                ):
                    names.settings.add(bound)
                elif node.level or node.module not in ("multigpu", *_SETTINGS_HOMES):
                    names.shadowed.add(bound)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "multigpu":
                    names.package.add(alias.asname or alias.name)
                elif alias.name == "multigpu.config":
                    (names.config if alias.asname else names.package).add(
                        alias.asname or "multigpu"
                    )
                elif not alias.name.startswith("multigpu."):
                    names.shadowed.add(alias.asname or alias.name.partition(".")[0])
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.shadowed.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.shadowed.add(node.id)
        elif isinstance(node, ast.arg):
            names.shadowed.add(node.arg)
    for group in (names.package, names.config, names.load, names.settings):
        group -= names.shadowed
    return names


def _is_load(func: ast.expr, names: _Names) -> bool:
    if isinstance(func, ast.Name):
        return func.id in names.load
    if not (isinstance(func, ast.Attribute) and func.attr == "load"):
        return False
    owner = ast.unparse(func.value)
    return owner in names.config or owner in {f"{p}.config" for p in names.package}


def _names_settings(annotation: ast.expr, names: _Names) -> bool:
    """``mg.TrainerSettings``, ``multigpu.trainer.TrainerSettings`` or a name imported from multigpu."""
    text = ast.unparse(annotation).strip("'\"")
    if text in names.settings:
        return True
    owner, _, name = text.rpartition(".")
    return name == "TrainerSettings" and any(
        owner == package or owner == f"{package}.trainer" for package in names.package
    )
