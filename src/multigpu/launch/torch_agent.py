"""What this package changes in torch's elastic agent while a launch runs, and why.

torch's dynamic rendezvous names every event it records after the method that records it:
``get_method_name()`` in torch.distributed.elastic.rendezvous.dynamic_rendezvous calls ``inspect.stack()``
twice, which reads the source of every frame on the stack and, for a frame whose file is no module's
(``<frozen runpy>``: the ``python -m multigpu`` frames), walks the whole of ``sys.modules``. The name is an
argument, so it is computed even when no event handler is set and the event is dropped (torch's default).
In a launcher forked from a process that imported ``torch._dynamo`` (thousands of modules: the suite's
launch server, a launch started from a notebook), that was 0.6-0.8 s of the launcher's 0.7-0.9 s of CPU per
launch, measured here (``tests/test_launch_plan.py`` checks the name is the same).

:func:`cheap_method_names` gives the same name from the frame itself, and puts torch's function back when
the launch is over. A torch without that function is left alone.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator


def method_name(depth: int = 2) -> str:
    """What torch's ``get_method_name(depth)`` returns - ``inspect.stack()[depth].function``, the name of the
    function ``depth`` frames above this one - without reading any source file or scanning any module."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # the stack is not that deep
        return "no_method_name"


@contextlib.contextmanager
def cheap_method_names() -> Iterator[None]:
    """Inside this block torch's rendezvous names its events with :func:`method_name`."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    original = getattr(dynamic_rendezvous, "get_method_name", None)
    try:
        if callable(original):
            dynamic_rendezvous.get_method_name = method_name
        yield
    finally:
        if callable(original):
            dynamic_rendezvous.get_method_name = original
