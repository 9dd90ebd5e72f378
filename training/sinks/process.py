"""Rank 0's sink in a process of its own, so that it never takes the training thread's GIL.

In a thread of rank 0's process the sink competed with the training loop for the
interpreter: MLflow's import and a new sqlite store's schema (~2.5 s of CPU, over 8 s
on a node whose cores the ranks keep busy) and every interval's scrape and parse ran
between rank 0's own Python, and rank 0's forward and optimizer read up to 10x their
usual seconds while it did (a test run named the unslowed rank 0 the slowest rank for
its first four records). A child process has its own interpreter: rank 0 pays one
``posix_spawn`` at start-up and a blocked read on a pipe.

The parent (``SinkProcess``, what ``rankscope.sinks.build`` returns) hands the child the
``Sink``'s arguments, pickled, on its stdin and keeps that pipe open as the child's
lifeline: ``stop`` is one line on it, and its end (rank 0 gone) stops the child too.
The child reports each drop on a pipe of its own (not its stdout, which MLflow's and
TensorBoard's prints share), and the parent counts it as the in-process sink did, in
``rankscope_telemetry_dropped_total{what="sink"}`` on rank 0.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import subprocess
import sys
import threading
from typing import IO, Callable, Iterable

from rankscope.sinks.backend import Backend

LIFELINE_CLOSED_STOP_S = 3.0   # rank 0 went away without stop: the last record and the writers' close, bounded
STOP_MARGIN_S = 2.0            # beyond the child's own bound, before it is killed and its records counted lost


class SinkProcess:
    """The parent's handle on the sink's child process: what ``Sink`` offers the ``Monitor``."""

    def __init__(self, urls: Iterable[str], run: str, interval_s: float, backends: Iterable[Backend],
                 drop: Callable[..., None]):
        self.urls = list(urls)
        self.run = run
        self.interval_s = interval_s
        self.backends = list(backends)
        self.drop = drop
        self.child: subprocess.Popen[bytes] | None = None
        self._reports: threading.Thread | None = None

    def local_exporter(self, url: str) -> None:
        """The node's own exporter answers at ``url``, found at start-up (another user's exporter
        may hold the configured port)."""
        self.urls[0] = url

    def start(self) -> None:
        read_end, write_end = os.pipe()
        try:
            spec = pickle.dumps((self.urls, self.run, self.interval_s, self.backends))
            self.child = subprocess.Popen([sys.executable, "-m", "rankscope.sinks.process", str(write_end)],
                                          stdin=subprocess.PIPE, pass_fds=(write_end,), close_fds=True)
            self.child.stdin.write(base64.b64encode(spec) + b"\n")
            self.child.stdin.flush()
        except (OSError, pickle.PicklingError) as e:   # no process to be had: the records are lost, training goes on
            os.close(read_end)
            self.drop("sink", f"the sink's process did not start: {e}")
            self.child = None
            return
        finally:
            os.close(write_end)
        reports = os.fdopen(read_end, "rb")
        self._reports = threading.Thread(target=self._count_reports, args=(self.child, reports),
                                         name="rankscope-sink-reports", daemon=True)
        self._reports.start()

    def _count_reports(self, child: subprocess.Popen[bytes], reports: IO[bytes]) -> None:
        with reports:
            for line in reports:
                try:
                    report = json.loads(line)
                    self.drop("sink", str(report["reason"]), n=int(report["n"]))
                except (ValueError, KeyError, TypeError):
                    self.drop("sink", f"the sink's process reported {line[:200]!r}")
        # The pipe ends with the child: said at once if it failed (it could not import rankscope,
        # or died), not only at close. Killed at close (-9): counted there.
        returncode = child.wait()
        if returncode not in (0, -9):
            self.drop("sink", f"the sink's process ended with {returncode} (its errors are in this job's log)")

    def stop(self, timeout_s: float = 3.0) -> None:
        """One last record, then the writers finish, in the child within ``timeout_s``; a child
        still running after that and a margin is killed, and its records counted lost (one)."""
        child = self.child
        if child is None:
            return
        try:
            child.stdin.write(f"stop {timeout_s}\n".encode())
            child.stdin.close()
        except OSError:   # the child already ended
            pass
        try:
            child.wait(timeout_s + STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            self.drop("sink", f"the sink's process was still writing {timeout_s + STOP_MARGIN_S:.0f} s after close")
        if self._reports is not None:
            self._reports.join(1.0)


def _report_drops(out: IO[bytes]) -> Callable[..., None]:
    lock = threading.Lock()

    def drop(what: str, reason: str = "", n: int = 1) -> None:
        line = json.dumps({"reason": reason, "n": n}).encode() + b"\n"
        with lock:
            try:
                out.write(line)
                out.flush()
            except (OSError, ValueError):   # the parent is gone: nobody to count it
                pass

    return drop


def main(argv: list[str]) -> int:
    from rankscope.sinks.collector import Sink

    logging.basicConfig(format=f"rankscope sink (pid {os.getpid()}): %(message)s", level=logging.WARNING)
    reports = os.fdopen(int(argv[0]), "wb")
    drop = _report_drops(reports)
    urls, run, interval_s, backends = pickle.loads(base64.b64decode(sys.stdin.buffer.readline()))
    sink = Sink(urls, run, interval_s, backends, drop)
    sink.start()
    line = sys.stdin.buffer.readline()   # blocks until stop, or until rank 0's end closes the pipe
    words = line.split()
    timeout_s = float(words[1]) if len(words) == 2 and words[0] == b"stop" else LIFELINE_CLOSED_STOP_S
    sink.stop(timeout_s)
    reports.close()
    if any(w.thread.is_alive() for w in sink.writers):
        os._exit(0)   # a writer still stuck (counted): MLflow's exit hooks would join it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
