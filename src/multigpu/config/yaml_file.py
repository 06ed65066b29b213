"""A YAML file read safely: bounded in bytes and nodes, duplicate keys refused, each key's line kept.

Why a module of its own: this is the door a settings or runs file comes through (PyYAML's safe
loader, never a constructor that runs code); what the values then become is the package's job.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from multigpu.errors import ConfigError, shown
from multigpu.fileio import read_regular

#: The line of each key in its file - or, for a key given on the command line, where it came from.
Lines = dict[tuple[str, ...], Union[int, str]]


#: Files larger than this are refused before parsing (a settings file is a few kilobytes).
MAX_YAML_BYTES = 4 << 20


#: Nodes a document may expand to once its aliases are followed: PyYAML shares aliased objects, but
#: anything that walks the result (merging, hashing, printing) expands them - a few hundred bytes of
#: nested aliases ("billion laughs") reach millions of nodes.
MAX_YAML_NODES = 100_000


_MERGE_TAG = "tag:yaml.org,2002:merge"


_INT_TAG = "tag:yaml.org,2002:int"


#: The one form of a whole number we read: YAML 1.1 also reads 1_000, 0x10, 0o7, 010 (octal) and 1:30
#: (sexagesimal, so an unquoted ``time: 20:00:00`` is 72000) as ints.
_BASE10 = re.compile(r"[-+]?(0|[1-9][0-9]*)")


def _check_tree(node: yaml.Node, source: str) -> Lines:
    """Refuse alias bombs, recursive aliases and duplicate keys; return the line of every key.

    One pass over the node graph with each node's expanded size memoised by identity, so an alias
    costs a lookup, not a re-walk. Lines are recorded on the first path that reaches a node.
    """
    sizes: dict[int, int] = {}
    lines: Lines = {}
    active: set[int] = set()

    def size(node: yaml.Node, path: Optional[tuple[str, ...]]) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(
                f"{source}:{node.start_mark.line + 1}: a YAML alias refers to itself.",
                "remove the recursive alias (*name inside the value it names).",
            )
        active.add(key)
        total = 1
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if key_node.tag == _MERGE_TAG:
                    total += size(value_node, None)
                    continue
                if isinstance(key_node, yaml.ScalarNode):
                    name = str(key_node.value)
                    if name in seen:
                        raise ConfigError(
                            f"{source}:{line}: key {name!r} is given twice (also at line {seen[name]}).",
                            "keep one of them: YAML would silently use the last.",
                        )
                    seen[name] = line
                child = (*path, str(key_node.value)) if path is not None else None
                if child is not None:
                    lines.setdefault(child, line)
                total += size(key_node, None) + size(value_node, child)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item, None)
        elif node.tag == _INT_TAG and not _BASE10.fullmatch(str(node.value)):
            raise ConfigError(
                f"{source}:{node.start_mark.line + 1}: {shown(str(node.value), 40)} is read by YAML as "
                "a number in another form (1_000, 0x10, 010 or 1:30 are 1000, 16, 8 and 90).",
                "write whole numbers with the digits 0-9 only, without a leading 0, or quote the value "
                "to keep it as text.",
            )
        active.discard(key)
        sizes[key] = total
        if total > MAX_YAML_NODES:
            raise ConfigError(
                f"{source}: the document expands to more than {MAX_YAML_NODES:,} values "
                "through its aliases.",
                "write the values out, or use fewer nested aliases (&name/*name).",
            )
        return total

    size(node, ())
    return lines


def parse_yaml(text: str, source: str = "<yaml>") -> tuple[Any, Lines]:
    """One YAML document from ``text`` with PyYAML's safe loader, bounded: (value, line of every key).

    Every problem is a :class:`ConfigError` naming ``source`` and the line: invalid syntax, a
    duplicate key, an alias that refers to itself or expands past :data:`MAX_YAML_NODES`, nesting
    too deep to parse. No tag constructs Python objects (safe loader).
    """
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # checks the characters already: inside the try
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines = _check_tree(node, source)
        return loader.construct_document(node), lines
    except yaml.YAMLError as exc:
        context, problem_mark = (
            getattr(exc, "context_mark", None),
            getattr(exc, "problem_mark", None),
        )
        mark = context or problem_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        if context is not None and problem_mark is not None and problem_mark.line != context.line:
            problem = (
                f"{getattr(exc, 'context', '')}: {problem} at line {problem_mark.line + 1}".strip(
                    ": "
                )
            )
        raise ConfigError(
            f"{where}: invalid YAML ({problem}).", "fix the syntax at that line."
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{source}: the YAML is nested too deeply to read.", "flatten the structure."
        ) from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a timestamp like 2020-13-45
        raise ConfigError(
            f"{source}: a value cannot be read ({' '.join(str(exc).split())[:200]}).",
            "quote it to keep it as text.",
        ) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text_file(path: Union[str, Path], what: str = "file", limit: int = MAX_YAML_BYTES) -> str:
    """A UTF-8 text file, with every failure (missing, a folder, too large, not UTF-8) a ConfigError."""
    path = Path(path)
    try:
        raw = read_regular(path, limit)
    except IsADirectoryError:
        raise ConfigError(
            f"{path} is a folder, not a {what}.", "give the path of the file."
        ) from None
    except OSError as exc:
        if exc.errno == 21:
            raise ConfigError(
                f"{path} is a folder, not a {what}.", "give the path of the file."
            ) from None
        raise ConfigError(
            f"cannot read {path}: {exc.strerror or exc}.", "check the path."
        ) from None
    if len(raw) > limit:
        raise ConfigError(
            f"{path} is larger than {limit >> 20} MiB: not a {what}.", "check the path."
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not valid UTF-8 (byte {raw[exc.start]:#04x}).",
            "save the file as UTF-8.",
        ) from None


def load_yaml(path: Union[str, Path]) -> tuple[dict[str, Any], Lines]:
    """The mapping in ``path`` and the line of every (nested) key."""
    data, lines = parse_yaml(read_text_file(path, "YAML file"), str(path))
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of keys to values.",
            "write `key: value` lines.",
        )
    return data, lines
