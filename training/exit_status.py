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

A failed rank also leaves the exception's message and traceback
(``failure_detail``, bounded): the evidence a person reads from the page. A
traceback holds file names, line numbers, function names and source lines,
never local variables or arguments.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import Any

DETAIL_MAX_CHARS = 16_000   # the end of a longer traceback is kept: the innermost frames and the message

_lock = threading.Lock()
_installed = False
_uncaught: list[BaseException] = []   # exceptions that reached the top of the main thread


def install() -> None:
    """Chain an exception hook (once per process) that remembers an uncaught exception's type."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        previous = sys.excepthook

        def remember(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
            if isinstance(exc, BaseException):
                _uncaught.append(exc.with_traceback(tb) if tb is not None and exc.__traceback__ is None else exc)
            previous(exc_type, exc, tb)

        sys.excepthook = remember


def ending_exception(exc: BaseException | None = None) -> BaseException | None:
    """The exception that ends the monitor, or None for a clean end.

    ``exc`` is the exception the caller knows of (``__exit__``); otherwise one
    being handled right now, or one that reached the top of the main thread."""
    if exc is None:
        exc = sys.exc_info()[1]
    if exc is None and _uncaught:
        exc = _uncaught[-1]
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return None   # sys.exit() after the loop: a clean end
    return exc


def failure(exc: BaseException | None = None) -> str:
    """The type name of the exception that ends the monitor, or "" for a clean end."""
    ending = ending_exception(exc)
    return type(ending).__name__ if ending is not None else ""


def failure_detail(exc: BaseException | None) -> str:
    """The exception's traceback and message as Python prints them (its end, when long)."""
    if exc is None:
        return ""
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except Exception:   # a message whose __str__ raises: the type still says what happened
        text = f"{type(exc).__name__} (its message could not be formatted)"
    return text if len(text) <= DETAIL_MAX_CHARS else "...\n" + text[-DETAIL_MAX_CHARS:]
