"""How a rank's monitor ends: ``finished`` only when the training loop completed.

A rank is reported ``finished`` (and so never paged for) only if its monitor
is closed with no exception on the way. It is ``failed`` when:

* the interpreter exits on an uncaught exception (an OOM, a gloo or NCCL
  error after a peer died, a data error): the exception hook below records
  its type before the exit hooks run ``close()``;
* ``close()`` runs while an exception propagates (a ``finally:`` block) or
  ``with Monitor()`` exits on one.

A rank killed by a signal (SIGKILL, or the launcher's SIGTERM after a peer
failed) runs no exit hook at all, and the exporter reports it ``dead``.
Either way it pages; ``finished`` is reserved for a loop that completed.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

_lock = threading.Lock()
_installed = False
_uncaught: list[str] = []   # type names of exceptions that reached the top of the main thread


def install() -> None:
    """Chain an exception hook (once per process) that remembers an uncaught exception's type."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.excepthook

        def remember(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            _uncaught.append(exc_type.__name__)
            previous(exc_type, exc, tb)

        sys.excepthook = remember


def failure(exc: BaseException | None = None) -> str:
    """The type name of the exception that ends the monitor, or "" for a clean end.

    ``exc`` is the exception the caller knows of (``__exit__``); otherwise one
    being handled right now, or one that reached the top of the main thread."""
    if exc is None:
        exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return ""   # sys.exit() after the loop: a clean end
    if exc is not None:
        return type(exc).__name__
    return _uncaught[-1] if _uncaught else ""
