"""The rank's stacks on request: a signal handler its node exporter can trigger.

When the exporter sees a rank stop making progress it captures evidence
(``rankscope.exporter.evidence``), and the first piece is every thread's Python
stack. Reading another process's stack needs ptrace privileges (py-spy), which a
node exporter often lacks; so at start-up the rank registers Python's
``faulthandler`` on one signal, writing every thread's stack into a file of its
run directory. The handler is C: it runs even while the rank's own code holds
the GIL (a spinning regular expression) or sleeps in C. It only writes file
names, line numbers and function names: no local variable, argument or
environment value.

Nothing runs on the hot path: the handler is registered once. The signal
(``stack_signal``, default ``SIGRTMIN+9``, a real-time signal nothing in
torch, torchrun, Slurm or Lightning uses) is never taken from the job: where
the job already handles it, rankscope does not register (said once), and where
the job installs its own handler later, rankscope stops asking for stacks on it
(the publisher checks at every publish), so the exporter never sends a signal
that would run the job's handler.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
from pathlib import Path
from typing import IO

from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import EVIDENCE_SUBDIR, Registration

log = logging.getLogger("rankscope")

DEFAULT_SIGNAL = "SIGRTMIN+9"
# Signals a job or its launcher uses for its own ends, or that faulthandler already handles:
# never chosen (docs/reliability.md, "The stack signal").
RESERVED = {"SIGKILL", "SIGSTOP", "SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGCHLD", "SIGPIPE", "SIGALRM",
            "SIGCONT", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGWINCH", "SIGSEGV", "SIGFPE", "SIGABRT", "SIGBUS",
            "SIGILL", "SIGTRAP", "SIGSYS", "SIGXCPU", "SIGXFSZ", "SIGPROF", "SIGVTALRM", "SIGURG", "SIGIO",
            "SIGPWR", "SIGSTKFLT"}


def parse_signal(text: str) -> int:
    """``SIGUSR2``, ``USR2``, ``SIGRTMIN+9``, ``43``, or ``off`` (0) as a signal number; ConfigError
    for a signal that cannot be caught or that a job or launcher already uses."""
    raw = text.strip()
    if raw.lower() in ("off", "0", "none", ""):
        return 0
    name = raw.upper() if raw.upper().startswith("SIG") else "SIG" + raw.upper()
    try:
        if raw.isdigit():
            number = int(raw)
        elif name.startswith(("SIGRTMIN", "SIGRTMAX")):
            base, sign, offset = name.partition("+") if "+" in name else name.partition("-")
            number = int(getattr(signal, base)) + (int(offset) if sign == "+" else -int(offset or 0))
        else:
            number = int(getattr(signal, name))
    except (AttributeError, ValueError):
        number = -1
    if number <= 0 or number not in signal.valid_signals():
        raise ConfigError(f"{text!r} is not a signal of this system", field="stack_signal")
    checked = _name(number)
    if checked in RESERVED:
        raise ConfigError(f"{text!r} ({checked}) is a signal jobs, launchers or Python itself use; choose SIGUSR1, "
                          f"SIGUSR2 or a real-time one (SIGRTMIN+N), or off", field="stack_signal")
    return number


class StackDumps:
    """Registers the handler at start and says so in the rank's registration; ``check`` (a
    publisher part) withdraws it there once the job takes the signal."""

    def __init__(self, run_dir: Path, registration: Registration, signum: int):
        self.signum = signum
        self.path = run_dir / EVIDENCE_SUBDIR / f"stacks-rank-{registration.rank}-{os.getpid()}.txt"
        self._run_dir = run_dir
        self._registration = registration
        self._file: IO[str] | None = None
        self._warned = False

    def start(self) -> None:
        """Register, and say so in the registration (saved)."""
        self._registration.stacks = self._register()
        self._registration.save(self._run_dir)

    def check(self) -> None:
        """Publisher thread: withdraw the offer once the job has taken the signal."""
        if self._registration.stacks.get("signal") and not self.still_ours():
            self._registration.stacks = {"unavailable": f"the job installed its own {_name(self.signum)} handler "
                                                        f"after rankscope's"}
            self._registration.save(self._run_dir)

    def _register(self) -> dict:
        """The registration's ``stacks`` entry: the signal, file and training thread, or why
        there are no stacks of this rank (``{"unavailable": why}``; {} when turned off)."""
        if not self.signum:
            return {}
        if not _unclaimed(self.signum):
            why = f"the job handles {_name(self.signum)} itself"
            log.warning("rankscope: %s: rankscope leaves it alone, and the exporter will capture no stacks of this "
                        "rank (set RANKSCOPE_STACK_SIGNAL to another signal)", why)
            return {"unavailable": why}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")   # kept open: the handler writes to its descriptor
            faulthandler.register(self.signum, file=self._file, all_threads=True, chain=False)
        except (OSError, RuntimeError, ValueError) as e:
            log.warning("rankscope: cannot register the stack handler on %s (%s): no stacks of this rank",
                        _name(self.signum), e)
            self._close_file()
            return {"unavailable": f"cannot register a handler on {_name(self.signum)}: {e}"}
        return {"signal": self.signum, "file": str(self.path), "thread": threading.get_ident()}

    def still_ours(self) -> bool:
        """False once the job has installed its own handler on the signal (after ours): the
        exporter must not send it any more. Said once."""
        if self._file is None or _unclaimed(self.signum):
            return self._file is not None
        if not self._warned:
            self._warned = True
            log.warning("rankscope: the job installed its own %s handler after rankscope's: the exporter stops "
                        "asking this rank for stacks (set RANKSCOPE_STACK_SIGNAL to another signal)",
                        _name(self.signum))
        return False

    def stop(self) -> None:
        if self._file is not None and _unclaimed(self.signum):
            faulthandler.unregister(self.signum)
        self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            finally:
                self._file = None


def _unclaimed(signum: int) -> bool:
    """No Python handler on the signal (faulthandler's own does not show here); None means a
    handler installed from C, which is not ours to replace either."""
    return signal.getsignal(signum) in (signal.SIG_DFL,)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
