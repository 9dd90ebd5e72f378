"""Spans built and exported by a child process, off the training process's GIL.

Building OpenTelemetry spans and encoding them to protobuf is Python: ~35 us per
span, in stretches of 0.3-4 ms per export request on the batch processor's
thread. A background thread that runs Python holds the GIL that the training
thread wants back after every CUDA launch and every collective, and the SDK's
queued spans lengthen the process's own full garbage collections
(docs/performance.md, "GIL holds"). So each rank starts one child process
(``python -m rankscope.tracing.span_process``) that runs the whole SDK pipeline of
``rankscope.tracing.otlp.OtlpTracing``; the rank only pickles each traced step's
small ``StepRecord`` onto a pipe::

    rank process                                      span process (one per rank)
    submit(record) ─► bounded queue ─► sender thread ═pipe═► OtlpTracing: build spans,
    (full: drop, count)                (pickle, write)         batch, export (counted)
    dropped() ◄───────────────────── reader thread ◄═pipe═ counts, every 0.2 s and at the end

Nothing is lost silently. The child reports the spans it received, delivered
and dropped; the rank adds the spans it could not hand over. If the child dies
(killed, crashed) every span sent to it and not reported delivered is counted
as dropped. The child exits when its input ends (the rank finished, or died:
the pipe closes either way) after at most its shutdown budget, and ignores
SIGINT, which a terminal sends to the whole process group: the rank decides
when tracing ends.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, Mapping

from rankscope.holds import LongestHold
from rankscope.identity import RankIdentity
from rankscope.tracing.records import StepRecord
from rankscope.tracing.api import QueuedTracing, TracingConfig, count_spans, resource_attributes
from rankscope.tracing.otlp import OtlpTracing

log = logging.getLogger("rankscope")

REPORT_EVERY_S = 0.2           # the child's counts reach the rank at most this late
DEFAULT_CHILD_SHUTDOWN_S = 2.0  # a child whose rank vanished without a shutdown message


class SpanProcessTracing(QueuedTracing):
    """The rank's side: hands records to the span process, never blocks, counts what it cannot hand over."""

    def __init__(self, identity: RankIdentity, config: TracingConfig, on_error: Callable[[], None],
                 env: Mapping[str, str]):
        super().__init__(config.every)   # self._dropped: spans never handed to the child (also: child gone)
        self._on_error = on_error
        self._sent = 0             # spans written whole to the child's pipe
        self._report: dict = {}    # the child's latest counts
        self._final = threading.Event()
        self._child_gone = False
        self.hold = LongestHold()  # the sender's longest stretch: pickling one record
        # The child inherits this process's environment (the OTLP exporter reads its own
        # OTEL_EXPORTER_OTLP_* variables there); rankscope's own settings travel in the
        # start message, with the resource attributes of this process (process.pid).
        self._errors_seen = 0
        # The child imports rankscope as this process does (an editable install, a
        # PYTHONPATH, or a path the launcher added).
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "rankscope.tracing.span_process"], env=child_env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        start = ("start", identity, config, dict(env), resource_attributes(identity, env))
        self._write(pickle.dumps(start, protocol=pickle.HIGHEST_PROTOCOL))
        self._sender = threading.Thread(target=self._send, name="rankscope-span-sender", daemon=True)
        self._reader = threading.Thread(target=self._read, name="rankscope-span-reader", daemon=True)
        self._sender.start()
        self._reader.start()

    def _accepting(self) -> bool:
        return not (self._closing or self._child_gone)

    def dropped(self) -> int:
        """Spans dropped or failed so far: those not handed over, plus the child's count.

        Once the child has gone without its final report, every span sent to it
        and not reported delivered counts as dropped."""
        report = self._report
        if self._child_gone and not self._final.is_set():
            # Spans delivered after the child's last report count too: over, never under.
            return self._dropped + self._sent - report.get("delivered", 0)
        # After the final report, spans the child never read (none, unless it was
        # killed mid-read) count too.
        unread = self._sent - report.get("received", 0) if self._final.is_set() else 0
        return self._dropped + report.get("dropped", 0) + unread

    def delivered(self) -> int:
        """Spans the child has reported exported (its reports come every REPORT_EVERY_S)."""
        return self._report.get("delivered", 0)

    def child_holds(self) -> dict[str, dict[str, float]]:
        """The span process's longest stretches (its own GIL, not the rank's), as last reported."""
        return dict(self._report.get("holds", {}))

    # -- sender: pickles and writes; a blocked write lets the GIL go ---------------------
    def _send(self) -> None:
        while True:
            record = self._records.get()
            if record is None:
                return
            if self._child_gone:
                self._dropped += count_spans(record)
                continue
            self.hold.start()
            data = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
            self.hold.stop()
            if self._write(data):
                self._sent += count_spans(record)
            else:
                self._dropped += count_spans(record)

    def _write(self, data: bytes) -> bool:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            self._child_gone = True
            return False

    # -- reader: the child's counts -------------------------------------------------------
    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                report = json.loads(line)
                if "error" in report:
                    log.warning("rankscope: the span process could not start tracing: %s", report["error"])
                    self._on_error()
                    continue
                self._report = report
                for _ in range(report.get("errors", 0) - self._errors_seen):
                    self._on_error()   # span-building errors in the child count as the rank's
                self._errors_seen = max(self._errors_seen, report.get("errors", 0))
                if report.get("final"):
                    self._final.set()
        except Exception:
            self._on_error()
        finally:
            self._child_gone = True

    # -- shutdown -----------------------------------------------------------------------
    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Ends the child within ``timeout_s``: it exports what it can in that time and reports.

        Whatever it could not deliver is counted as dropped."""
        if self._closing:
            return
        deadline = time.monotonic() + timeout_s
        self._close_queue()   # the sender is behind: what it has not sent by the deadline is dropped
        self._sender.join(timeout=max(0.0, (deadline - time.monotonic()) * 0.5))
        if self._sender.is_alive():
            # Records still queued will never be sent: count them now, once.
            self._child_gone = True
        else:
            # The child gets the rest of the budget, less a margin for its report and exit.
            budget = max(0.0, (deadline - time.monotonic()) * 0.8)
            self._write(pickle.dumps(("shutdown", budget), protocol=pickle.HIGHEST_PROTOCOL))
        try:
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self._final.wait(timeout=max(0.0, deadline - time.monotonic()))
        # After its final report the child only has to exit; past the deadline it is
        # killed either way (its counts are in, or everything sent counts as dropped).
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._child_gone = True
        self._drop_queued()


# -- the child ---------------------------------------------------------------------------

class _Reporter:
    """Writes the tracer's counts as one JSON line when they change, at most every REPORT_EVERY_S."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.tracing: OtlpTracing | None = None
        self.received = 0
        self.errors = 0
        self._last: dict = {}
        self._lock = threading.Lock()   # the periodic thread and the final report write one line at a time
        self._ended = False

    def counts(self) -> dict:
        t = self.tracing
        return {"received": self.received, "delivered": t.exporter.succeeded, "dropped": t.dropped(),
                "errors": self.errors,
                "holds": {"span worker": t.hold.as_dict(), "OTel batch export": t.exporter.hold.as_dict()}}

    def error(self) -> None:
        self.errors += 1

    def report(self, final: bool = False) -> None:
        with self._lock:
            if self._ended:
                return
            counts = self.counts()
            if final:
                counts["final"] = self._ended = True
            elif counts == self._last:
                return
            self._last = counts
            self.out.write(json.dumps(counts) + "\n")
            self.out.flush()

    def every(self, stop: threading.Event) -> None:
        while not stop.wait(REPORT_EVERY_S):
            self.report()


def main(stdin: IO[bytes] | None = None, stdout: IO[str] | None = None) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the rank ends tracing, not a terminal's Ctrl-C
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout
    try:
        kind, identity, config, env, resource = pickle.load(stdin)
        assert kind == "start", kind
        reporter = _Reporter(stdout)
        tracing = OtlpTracing(identity, config, reporter.error, env, resource=resource)
        reporter.tracing = tracing
    except Exception as e:   # reported to the rank, which logs it and counts what it sends as dropped
        stdout.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        stdout.flush()
        return 1
    stop = threading.Event()
    threading.Thread(target=reporter.every, args=(stop,), name="rankscope-span-report", daemon=True).start()
    shutdown_s = DEFAULT_CHILD_SHUTDOWN_S
    while True:
        try:
            message = pickle.load(stdin)
        except (EOFError, OSError, pickle.UnpicklingError):
            break   # the rank closed the pipe (finished, or died)
        if isinstance(message, StepRecord):
            reporter.received += count_spans(message)
            tracing.submit(message)
        elif isinstance(message, tuple) and message[0] == "shutdown":
            shutdown_s = float(message[1])
    tracing.shutdown(timeout_s=shutdown_s)
    stop.set()
    reporter.report(final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
