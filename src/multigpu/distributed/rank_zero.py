"""Small DDP-safe helpers: ``run_on_main``, ``is_main``, rank-zero printing and logging.

Why: a script run N times at once must prepare data once, print once and log once. These helpers ask
``torch.distributed`` where they stand (and the launcher's variables before ``mg.init()``), so they
need no object passed around and keep no state of their own beyond a per-group call counter.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import weakref
from typing import Any, Callable, Optional, TypeVar, cast

import torch.distributed as dist
from typing_extensions import override

from multigpu.distributed.world import detect_world
from multigpu.errors import MultiGPUError

T = TypeVar("T")

# One counter per process group, so the n-th run_on_main call on every rank uses the same store key
# and several runs in one process (each with its own group) never share keys.
_CALLS: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """Global rank: from the process group once started, from the launcher's variables before."""
    return dist.get_rank() if _group_ready() else detect_world().rank


def is_main() -> bool:
    """True in exactly one process of the job (global rank 0)."""
    return rank() == 0


def rank_zero_only(fn: Callable[..., T]) -> Callable[..., Optional[T]]:
    """Decorator: run ``fn`` on global rank 0 only; other ranks get None and do not wait."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Optional[T]:
        return fn(*args, **kwargs) if is_main() else None

    return wrapper


def rank_zero_print(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (flushed, so it interleaves correctly with the launcher's lines)."""
    print_on_main(is_main(), *args, **kwargs)


def print_on_main(main: bool, *args: Any, **kwargs: Any) -> None:
    """``print`` if ``main``, flushed: the one place rank-0 printing happens."""
    if main:
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


class RankZeroFilter(logging.Filter):
    """Lets everything through on rank 0; on other ranks only warnings and errors, tagged with the rank."""

    @override
    def filter(self, record: logging.LogRecord) -> bool:
        r = rank()
        if r == 0:
            return True
        if record.levelno >= logging.WARNING:
            record.msg = f"[rank {r}] {record.msg}"
            return True
        return False


def get_logger(name: str = "multigpu") -> logging.Logger:
    """A logger that does not repeat every line N times (``logging.getLogger`` plus RankZeroFilter)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RankZeroFilter) for f in logger.filters):
        logger.addFilter(RankZeroFilter())
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        )
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    return logger


def run_on_main(
    fn: Callable[..., T], *args: Any, notice_every_s: float = 300.0, **kwargs: Any
) -> T:
    """Run ``fn(*args, **kwargs)`` once, on global rank 0, while the other ranks wait; return its result
    on every rank.

    The others wait by polling the rendezvous store, not inside a collective, so an hour of data
    preparation never trips the collective timeout; they print a line every ``notice_every_s`` so the
    wait is never silent. If ``fn`` raises on rank 0, every rank raises.

    Call it on every rank, unconditionally: make ``fn`` skip work already done (as SpeechBrain's recipes
    skip a finished data preparation). Under ``if not os.path.exists(made_by_fn):`` a rank that comes late
    sees the file rank 0 has just made and skips the call, and rank 0 would pair the broadcast of its
    result with that rank's next collective (a hang, or garbage). Rank 0 first waits, in the store, for
    every rank to arrive, naming those that have not after 10 s: the mistake is named, not a silent hang.
    """
    if not _group_ready():
        world = detect_world()
        if world.world_size > 1:
            raise MultiGPUError(
                f"run_on_main({_name(fn)}) was called in a {world.world_size}-process job before mg.init().",
                "call `run = mg.init()` at the top of the script, before run_on_main.",
            )
        return fn(*args, **kwargs)
    if dist.get_world_size() == 1:
        return fn(*args, **kwargs)

    group = dist.group.WORLD
    index = _CALLS.get(group, 0)
    _CALLS[group] = index + 1
    key = f"multigpu/run_on_main/{index}"
    # the rendezvous store every rank already shares
    store = dist.distributed_c10d._get_default_store()
    me = dist.get_rank()
    box: list[Any] = [None]  # rank 0's result, sent to the others
    others = dist.get_world_size() - 1
    if me == 0:
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            store.set(key, f"error:{type(exc).__name__}: {exc}"[:2000])
            raise
        store.set(key, "ok:none" if result is None else "ok:value")
        if result is None:
            return result
        box[0] = result
        try:
            _poll(
                lambda: store.add(f"{key}/arrived", 0) >= others,
                lambda waited: _not_arrived(store, key, fn, others, waited),
                notice_every_s,
                FIRST_NOTICE_S,
            )
        # the store (hosted by the launcher) went away: the job is stopping
        except RuntimeError as exc:
            raise MultiGPUError(
                f"run_on_main({_name(fn)}) lost the store while waiting for the other ranks "
                f"({' '.join(str(exc).split())[:120]}).",
                "a rank failed or was stopped; its own error is above.",
            ) from None
    else:
        status = _wait_for(store, key, fn, me, notice_every_s, others)
        if status.startswith("error:"):
            raise MultiGPUError(
                f"run_on_main({_name(fn)}) failed on rank 0 ({status[6:200]}).",
                "see rank 0's traceback above; the other ranks stopped with it.",
            )
        if status == "ok:none":
            return cast(T, None)  # rank 0's fn returned None, so None is a T
    dist.broadcast_object_list(box, src=0)
    return cast(T, box[0])  # rank 0's result


#: The first "still waiting" line comes after this long; later ones at twice the interval (``_poll``).
FIRST_NOTICE_S = 10.0


def _wait_for(
    store: Any,
    key: str,
    fn: Callable[..., Any],
    me: int,
    notice_every_s: float,
    others: int,
    first_notice_s: float = FIRST_NOTICE_S,
) -> str:
    """Rank ``me``'s wait for rank 0's status of ``fn`` under ``key``; rank 1 speaks for the waiting ranks."""
    who = "rank 1" if others == 1 else f"ranks 1-{others}"
    try:
        # here (rank 0 waits for every rank before it broadcasts)
        store.set(f"{key}/arrived/{me}", "1")
        store.add(f"{key}/arrived", 1)
        _poll(
            lambda: store.check([key]),
            lambda waited: (
                f"multigpu: {who} wait for rank 0 to finish {_name(fn)} ({waited:.0f} s so far)"
                if me == 1
                else None
            ),
            notice_every_s,
            first_notice_s,
        )
        status: str = store.get(key).decode()
        return status
    except RuntimeError as exc:  # the store (hosted by rank 0 or its launcher) went away
        raise MultiGPUError(
            f"run_on_main({_name(fn)}) lost rank 0 while waiting for it ({' '.join(str(exc).split())[:120]}).",
            "rank 0 failed or was stopped; its own error is above.",
        ) from None


def _poll(
    ready: Callable[[], bool],
    notice: Callable[[float], Optional[str]],
    notice_every_s: float,
    first_notice_s: float,
) -> None:
    """Wait until ``ready()``, polling ever less often (up to 0.5 s); ``notice(seconds waited)``'s line (None:
    none) after ``first_notice_s``, then at doubling intervals up to ``notice_every_s``: a wait is never
    silent for long, and an hour-long one is not a wall of lines."""
    started = time.monotonic()
    interval = min(first_notice_s, notice_every_s)
    next_notice = started + interval
    delay = 0.01
    while not ready():  # (a notice only right after a poll that found it not ready)
        now = time.monotonic()
        if now >= next_notice:
            interval = min(interval * 2, notice_every_s)
            next_notice = now + interval
            line = notice(now - started)
            if line is not None:
                print(line, file=sys.stderr, flush=True)
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def _not_arrived(
    store: Any, key: str, fn: Callable[..., Any], others: int, waited: float
) -> Optional[str]:
    """Rank 0's line for the ranks that have not called run_on_main ``key`` yet (asked only when a line is
    due: one store request per rank), or None once they all have."""
    missing = [r for r in range(1, others + 1) if not store.check([f"{key}/arrived/{r}"])]
    if not missing:
        return None
    shown = ", ".join(map(str, missing[:8])) + (
        f" and {len(missing) - 8} more" if len(missing) > 8 else ""
    )
    return (
        f"multigpu: rank 0 waits for rank(s) {shown} to call run_on_main({_name(fn)}) too ({waited:.0f} s "
        "so far). HINT: if a rank skips the call (under a condition it can see differently, such as a file "
        "rank 0 has just made), call it on every rank and let the function skip work already done."
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
