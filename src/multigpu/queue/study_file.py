"""The door of a search's study file (``OUT/.sweeps/<family>.db``): checked before Optuna opens it.

Why: a run folder (and its ``.sweeps/``) can come from someone else - a colleague's results, an archive. Optuna
opens whatever SQLite database is there and runs the queries it likes on it: a 114 KB file holding a view
of ``zeroblob``s took a queue to 3.9 GB, a recursive view hung it with no word, garbage, an older schema or
a journal that is a link ended in tracebacks. SQLite itself is the reader here, held to bounds: the file
(and its journal, WAL and shared-memory companions) a regular file of this user, under a size bound, with
SQLite's header; opened read-only with a budget of steps for every statement; only the tables and columns
this Optuna writes, each made by the statement it makes them with (taken from a fresh database of its own:
another column, a CHECK, an expression index or a generated column is refused, and another Optuna's schema is
named as such), no view, no trigger; each table's rows and each value's length bounded. Whatever Optuna then
raises while it reads the study is one line too (:mod:`.search`). What Optuna then reads back - a trial's parameters - is checked
against the declared space by the search before it becomes a run's override (:mod:`.search`).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError, visible
from multigpu.fileio import Folder

#: A study of 10,000 trials with a few parameters and reports is a few MB; far more is not ours.
MAX_BYTES = 256 * 2**20
MAX_ROWS = 2_000_000
#: Trials a study may hold (a search's own limit is 10,000 trials), and the largest value of any column
#: (Optuna's JSON of a distribution or an attribute is a few hundred bytes).
MAX_TRIALS = 100_000
MAX_VALUE = 1 << 20
#: SQLite virtual-machine steps one statement of the check may take (the progress handler's budget).
MAX_STEPS = 50_000_000
_HEADER = b"SQLite format 3\x00"
_COMPANIONS = ("-journal", "-wal", "-shm")


def _refuse(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"the study file {visible(str(path))} {why}.",
        "move it away to start the search afresh (its trials' run folders stay), or give the "
        "queue another --out.",
    )


@functools.lru_cache(maxsize=1)
def optuna_schema() -> dict[tuple[str, str], str]:
    """(type, name) -> the statement that made it, of every table and index of the database this Optuna
    makes (an empty study in memory): a received file may hold these, each made by the same statement."""
    import optuna

    storage = optuna.storages.RDBStorage("sqlite:///:memory:")
    with storage.engine.connect() as connection:
        return _schema(connection.connection.driver_connection)


def _schema(connection: Any) -> dict[tuple[str, str], str]:
    return {
        (kind, name): " ".join(str(sql or "").split())
        for kind, name, sql in connection.execute("SELECT type, name, sql FROM sqlite_master")
    }


def _columns(connection: Any, table: str) -> list[tuple[str, tuple[str, ...]]]:
    """(column, the SQLite types its values may have) of a table, from its declared type: SQLite itself
    keeps ``'abc'`` in an INTEGER column, which Optuna then reads as a trial's number."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for row in connection.execute(f'PRAGMA table_xinfo("{table}")'):
        declared = str(row[2]).upper()
        kinds: tuple[str, ...] = (
            ("integer", "null")
            if "INT" in declared
            else ("real", "integer", "null")
            if any(word in declared for word in ("FLOAT", "REAL", "DOUBLE", "NUMERIC"))
            else ("text", "null")
            if any(word in declared for word in ("CHAR", "TEXT", "DATE", "TIME", "CLOB"))
            else ("text", "integer", "real", "blob", "null")
        )
        found.append((str(row[1]), kinds))
    return found


def _regular(path: Path, what: str) -> int:
    """The size of ``path`` (0: absent); a link, FIFO, device or another user's file is refused."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, f"{what} is a link, FIFO or device, not a regular file")
    if info.st_uid != os.getuid():
        raise _refuse(path, f"{what} belongs to another user (uid {info.st_uid})")
    if info.st_size > MAX_BYTES:
        raise _refuse(path, f"{what} is {info.st_size:,} bytes, more than {MAX_BYTES:,}")
    return info.st_size


def check_study(path: Path) -> None:
    """Refuse, with one line, a study file Optuna should not open (see the module's docstring); a missing
    file is a new study."""
    size = _regular(path, "")
    for suffix in _COMPANIONS:
        _regular(path.with_name(path.name + suffix), f"(its {suffix[1:]} file)")
    if size == 0:
        if path.exists():
            raise _refuse(path, "is empty")
        return
    try:
        header = Folder(path.parent).load_bytes(path.name, len(_HEADER))[: len(_HEADER)]
    except OSError as exc:
        raise _refuse(path, f"cannot be read ({exc.strerror or exc})") from None
    if header != _HEADER:
        raise _refuse(path, "is not a SQLite database")
    steps = [0]

    # called by SQLite every 1000 steps: a non-zero answer interrupts the statement
    def budget() -> int:
        steps[0] += 1000
        return 1 if steps[0] > MAX_STEPS else 0

    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error as exc:
        raise _refuse(path, f"cannot be opened ({exc})") from None
    try:
        connection.set_progress_handler(budget, 1000)
        connection.execute("PRAGMA trusted_schema = OFF")
        expected, found = optuna_schema(), _schema(connection)
        for (kind, name), sql in sorted(found.items()):
            if kind not in ("table", "index"):
                raise _refuse(
                    path,
                    f"holds a {visible(kind)[:20]} ({visible(name)[:60]}), which Optuna never writes",
                )
            if (kind, name) not in expected:
                raise _refuse(
                    path,
                    f"holds {'an' if kind == 'index' else 'a'} {kind} {visible(name)[:60]!r} that "
                    "Optuna does not write",
                )
            # another column, a CHECK, an expression index, a generated column
            if sql != expected[(kind, name)]:
                raise _refuse(
                    path, f"has the {kind} {name} as another Optuna version (or someone) made it"
                )
        for table in sorted(name for kind, name in found if kind == "table"):
            rows = connection.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
            if rows > (MAX_TRIALS if table == "trials" else MAX_ROWS):
                raise _refuse(path, f"has {rows:,} rows in {table}, more than a search makes")
            for column, kinds in _columns(connection, table):
                longest = connection.execute(
                    f'SELECT max(length("{column}")) FROM "{table}"'
                ).fetchone()[0]
                if longest is not None and longest > MAX_VALUE:
                    raise _refuse(
                        path,
                        f"holds a value of {longest:,} bytes in {table}.{column}, more than "
                        f"{MAX_VALUE:,}",
                    )
                listed = ", ".join(f"'{kind}'" for kind in kinds)
                odd = connection.execute(
                    f'SELECT typeof("{column}") FROM "{table}" WHERE typeof("{column}") NOT IN '
                    f"({listed}) LIMIT 1"
                ).fetchone()
                if odd is not None:
                    raise _refuse(
                        path,
                        f"holds a {odd[0]} in {table}.{column}, which Optuna keeps as {kinds[0]}",
                    )
        if connection.execute("PRAGMA quick_check(1)").fetchone()[0] != "ok":
            raise _refuse(path, "is damaged (SQLite's quick_check)")
    except sqlite3.OperationalError as exc:
        if steps[0] > MAX_STEPS:
            raise _refuse(path, "took more than SQLite's step budget to read") from None
        raise _refuse(path, f"cannot be read ({' '.join(str(exc).split())[:120]})") from None
    except sqlite3.DatabaseError as exc:
        raise _refuse(
            path, f"is not a database SQLite can read ({' '.join(str(exc).split())[:120]})"
        ) from None
    finally:
        connection.close()
