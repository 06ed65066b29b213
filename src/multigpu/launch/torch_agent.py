"""What this package changes in torch's elastic agent while a launch runs, and why.

torch's dynamic rendezvous names every event it records after the method that records it:
``get_method_name()`` in torch.distributed.elastic.rendezvous.dynamic_rendezvous calls ``inspect.stack()``
twice, which reads the source of every frame on the stack and, for a frame whose file is no module's
(``<frozen runpy>``: the ``python -m multigpu`` frames), walks the whole of ``sys.modules``. The name is an
argument, so it is computed even when no event handler is set and the event is dropped (torch's default).
In a launcher forked from a process that imported ``torch._dynamo`` (thousands of modules: the suite's
launch server, a launch started from a notebook), that was 0.6-0.8 s of the launcher's 0.7-0.9 s of CPU per
launch, measured here. :func:`cheap_method_names` gives the same name from the frame itself.

:func:`swapped` is how every such change is made (``ports.store_ports_held`` too): the function is replaced
while at least one launch of this process runs - launches in several threads may start and end in any
order - and torch's own comes back when the last one ends, unless something else replaced it meanwhile.
A torch without the function is left alone.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

_lock = threading.Lock()
#: (id(module), attribute) -> [blocks running, the original, the replacement installed, the module]
_swaps: dict[tuple[int, str], list[Any]] = {}


@contextlib.contextmanager
def swapped(
    module: ModuleType,
    name: str,
    replacement: Callable[..., Any],
    on_last_exit: Optional[Callable[[], None]] = None,
) -> Iterator[None]:
    """``module.name`` is ``replacement`` while any block of this kind for it runs in this process (the
    replacement of the first block that is still running is what the others get too). ``on_last_exit``
    runs when the last one ends (``ports.store_ports_held`` closes the ports it held then)."""
    key = (id(module), name)
    with _lock:
        entry = _swaps.get(key)
        if entry is None:
            original = getattr(module, name, None)
            if callable(original):
                setattr(module, name, replacement)
                entry = _swaps[key] = [0, original, replacement, module]
        if entry is not None:
            entry[0] += 1
    try:
        yield
    finally:
        if entry is not None:
            with _lock:
                entry[0] -= 1
                if entry[0] == 0:
                    del _swaps[key]
                    if getattr(module, name, None) is entry[2]:
                        setattr(module, name, entry[1])
                    if on_last_exit is not None:
                        on_last_exit()


def method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name(depth)`` returns - ``inspect.stack()[depth].function``, the name of the
    function ``depth`` frames above this one - without reading any source file or scanning any module."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


def cheap_method_names() -> contextlib.AbstractContextManager[None]:
    """Inside this block torch's rendezvous names its events with :func:`method_name`."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    return swapped(dynamic_rendezvous, "get_method_name", method_name)
