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
from pathlib import Path
from typing import Optional, Sequence

from multigpu.config import format_value, from_mapping, gather, read_text_file
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
        hydra = item in _HYDRA_SWITCHES or item.startswith("~") or (item.startswith("+") and "=" in item)
        if not hydra and ("=" not in item or item.startswith("-")):
            return None
    if yaml_file is not None and not Path(yaml_file).is_file():
        return None  # the script says what it makes of a missing file
    return yaml_file, args


def _settings_section(script: str) -> "str | bool | None":
    """False: the script does not call multigpu's ``config.load``. Else the name of the field its recipe
    class declares as ``TrainerSettings`` (None when there is none this reading can find)."""
    try:
        text = read_text_file(script, "script", limit=MAX_SCRIPT_BYTES)
        if "multigpu" not in text or "load" not in text:
            return False  # cheap: no recipe of ours, nothing to parse
        return _section_in(ast.parse(text, script))
    except (ConfigError, SyntaxError, ValueError, RecursionError, MemoryError):
        return False  # the script itself says what is wrong with it when it runs


def _section_in(tree: ast.Module) -> "str | bool | None":
    modules, loaders = _config_names(tree)
    recipe = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _is_load(node.func, modules, loaders):
            recipe = node.args[0].id if node.args and isinstance(node.args[0], ast.Name) else None
            break
    else:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == recipe:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and \
                        _names_settings(item.annotation):
                    return item.target.id
    return None


def _config_names(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Names bound to ``multigpu.config`` (or to ``multigpu``, as ``mg``) and to its ``load``."""
    modules, loaders = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "multigpu":
            modules |= {alias.asname or alias.name for alias in node.names if alias.name == "config"}
        elif isinstance(node, ast.ImportFrom) and node.module == "multigpu.config":
            loaders |= {alias.asname or alias.name for alias in node.names if alias.name == "load"}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in ("multigpu", "multigpu.config"):
                    modules.add(alias.asname or alias.name)
    return modules, loaders


def _is_load(func: ast.expr, modules: set[str], loaders: set[str]) -> bool:
    if isinstance(func, ast.Name):
        return func.id in loaders
    if not (isinstance(func, ast.Attribute) and func.attr == "load"):
        return False
    owner = ast.unparse(func.value)
    return owner in modules or owner.removesuffix(".config") in modules


def _names_settings(annotation: ast.expr) -> bool:
    text = ast.unparse(annotation).strip("'\"")
    return text == "TrainerSettings" or text.endswith(".TrainerSettings")
