"""Evidence of a rank that stopped making progress, captured when the exporter sees it.

A page names a rank; the person on call then needs that rank's stacks, its
collectives, its process and device state, and, for a rank that raised, the
traceback. By the time a person reaches the node the job has often been torn
down (NCCL's watchdog: 10 minutes). So the exporter captures them itself, once
per **episode** (a rank's process entering a stalled state, until it makes
progress again or is gone), keeps them in the run directory (removed with it),
and serves them (``/evidence``, behind the same TLS and auth as ``/metrics``).

What starts an episode: ``stuck``, ``stuck_in_collective``, ``frozen``, a hang
suspect, or a rank that ended on an exception (``failed``). A capture holds:

* **stacks**: every thread's Python stack, written by the rank's own handler
  (``rankscope.publishing.stacks``) when the exporter sends it the signal its
  registration names: no ptrace privilege needed, and it answers while the rank
  holds the GIL. A stopped process (state ``T``) cannot answer: its state is
  reported instead, and nothing waits on it. Where ``py-spy`` is installed and
  permitted, also ``py-spy dump --native`` (C and CUDA frames);
* **where the training thread is**: in torch (a collective, backward) or in the
  job's own code; a rank counted in a collective whose training thread is in
  its own code is not waiting in it (the hang suspect rule reads this);
* **collectives**: those in flight, the last enqueued / completed sequence
  number per process group, the flight-recorder dumps written;
* **process**: state, wait channel, threads, and whether its CPU time advances;
* **device**: an NVML snapshot of its GPU;
* **failure**: the exception's traceback and message, and when it was raised.

Captures run on their own thread (``evidence``), never in a scrape, and never
touch the rank beyond the signal. Bounded: each text is cut to
``TEXT_MAX_BYTES``, at most ``cfg.evidence_max_episodes`` captures per run.
"""

from __future__ import annotations

import html
import json
import logging
import os
import queue
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from rankscope.contract.rundir import (EVIDENCE_SUBDIR, FLIGHT_RECORDER_SUBDIR, Registration, process_state,
                                      run_slug, stat_state)
from rankscope.exporter.catalog import BY_NAME

log = logging.getLogger("rankscope.exporter")

TRIGGERS = ("failed", "frozen", "suspect", "stuck_in_collective", "stuck")   # the first that applies names it
TEXT_MAX_BYTES = 256 * 1024        # each captured text (stacks, native stacks, traceback) is cut to this
STACK_WAIT_S = 3.0                 # how long a capture waits for the rank's handler to finish writing
CPU_SAMPLE_S = 0.5                 # the two reads of the process's CPU time are this far apart
PYSPY_TIMEOUT_S = 10.0
QUEUE_MAX = 64                     # captures waiting; more are skipped (logged once)
# Where a training thread counted in a collective (from its backward phase on) is not waiting in it.
OUTSIDE_COLLECTIVE = ("user code", "data loader")
_TICK = os.sysconf("SC_CLK_TCK")
_THREAD_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)")
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def evidence_path(run_dir_name: str, rank: int) -> str:
    """The path of a rank's evidence page, its run directory's name URL-quoted (a link must never
    depend on what a run id holds; the server accepts the quoted and the raw form, and the run id)."""
    return f"/evidence/{urllib.parse.quote(run_dir_name, safe='')}/{rank}"


def trigger_of(state: str, suspect: bool, reg: Registration) -> str | None:
    """The reason a rank's process is in an episode now, or None."""
    if state == "dead":
        return "failed" if reg.failed_at and reg.exception else None
    if state == "frozen":
        return "frozen"
    if suspect:
        return "suspect"
    if state in ("stuck_in_collective", "stuck"):
        return state
    return None


@dataclass
class Episode:
    trigger: str
    started: float
    number: int
    capture: dict | None = None        # once captured
    path: Path | None = None


@dataclass
class _Job:
    run_dir: Path
    reg: Registration
    episode: Episode
    state: str
    in_flight: dict[str, float]
    groups: list[dict] = field(default_factory=list)


class EvidenceKeeper:
    """The node's episodes and captures; a prometheus_client collector of their series."""

    def __init__(self, cfg: Any, gpu: Any = None):
        self.cfg = cfg
        self.gpu = gpu                                       # exporter.nvml.NvmlCollector, if on
        self.scheme = "https" if cfg.web_config is not None else "http"   # how its pages are reached
        self._episodes: dict[tuple[str, int, int], Episode] = {}   # (run dir, rank, pid) -> its episode
        self._per_run: dict[str, int] = {}                   # run dir -> episodes captured
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Job | None] = queue.Queue(QUEUE_MAX)
        self._logged: set[str] = set()
        self._thread = threading.Thread(target=self._work, name="evidence", daemon=True)
        self._thread.start()

    # -- what the ranks do (the janitor's thread, every few seconds) -----------------------
    def observe(self, run_dir: Path, views: Iterable[Any], groups: dict[str, list[dict]], now: float) -> None:
        """Start an episode (and queue its capture) for each rank that entered one; end the
        episodes of ranks that made progress again. ``groups``: rank -> its process groups'
        sequence numbers, from its merged files."""
        for v in views:
            key = (str(run_dir), v.reg.rank, v.reg.pid)
            trigger = trigger_of(v.state, v.suspect, v.reg)
            with self._lock:
                episode = self._episodes.get(key)
                if trigger is None:
                    if episode is not None and v.state in ("progressing", "busy", "starting", "finished"):
                        del self._episodes[key]
                    continue
                if episode is not None:
                    continue
                captured = self._per_run.get(str(run_dir), 0)
                if captured >= self.cfg.evidence_max_episodes:
                    self._log_once(f"cap:{run_dir}", "run %s: %d captures already, no more (--evidence-max-episodes)",
                                   run_dir.name, captured)
                    continue
                self._per_run[str(run_dir)] = captured + 1
                episode = self._episodes[key] = Episode(trigger, now, captured + 1)
            job = _Job(run_dir, v.reg, episode, v.state, dict(v.in_flight), groups.get(str(v.reg.rank), []))
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                self._log_once("queue", "evidence captures are behind: one skipped (logged once)")

    def outside_collective(self, run_dir: Path, reg: Registration) -> bool:
        """True when this process's current episode's capture found its training thread in
        the job's own code: counted in a collective, it is not waiting in one."""
        with self._lock:
            episode = self._episodes.get((str(run_dir), reg.rank, reg.pid))
        capture = episode.capture if episode is not None else None
        return bool(capture) and capture.get("stacks", {}).get("training_thread_in") in OUTSIDE_COLLECTIVE

    def forget(self, run_dirs: Iterable[Path]) -> None:
        """Drop what is kept about runs no longer in the directory."""
        keep = {str(p) for p in run_dirs}
        with self._lock:
            for key in [k for k in self._episodes if k[0] not in keep]:
                del self._episodes[key]
            for run in [r for r in self._per_run if r not in keep]:
                del self._per_run[run]

    # -- series ------------------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily("rankscope_evidence_captured_timestamp_seconds",
                                   BY_NAME["rankscope_evidence_captured_timestamp_seconds"].help,
                                   labels=BY_NAME["rankscope_evidence_captured_timestamp_seconds"].label_names)
        latest: dict[tuple[str, int], dict] = {}
        for capture in self.captures():
            key = (capture["run"], capture["rank"])
            if key not in latest or capture["captured_at"] > latest[key]["captured_at"]:
                latest[key] = capture
        for c in latest.values():
            family.add_metric([c["run"], str(c["rank"]), str(c["local_rank"]), c["node"], c["trigger"], self.scheme,
                               c["path"]], c["captured_at"])
        yield family

    def captures(self) -> list[dict]:
        """Every capture still kept (its run not removed), newest last."""
        out = []
        for run_dir in sorted(self.cfg.directory.glob(f"*/{EVIDENCE_SUBDIR}")):
            for path in sorted(run_dir.glob("rank-*.json")):
                try:
                    out.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    continue
        return sorted(out, key=lambda c: c.get("captured_at", 0))

    def dump(self, slug: str, rank: int, name: str) -> Path | None:
        """A flight-recorder dump of a rank of the run whose directory is ``slug``, by name."""
        run_dirs = {p.name: p for p in self.cfg.directory.iterdir() if p.is_dir()}
        if slug not in run_dirs:   # never a path of the client's making: only names listed here
            return None
        return next((p for p in flight_recorder_dumps(run_dirs[slug], rank) if p.name == name), None)

    def run_dir_name(self, segment: str) -> str | None:
        """The run directory a link's path segment names, or None: the directory's own name, or the
        run id (the directory is ``run_slug(run id)``: a run id such as ``10.0.0.1:29500``, the
        MASTER_ADDR:MASTER_PORT fallback, is not its directory's name), each as is or URL-quoted."""
        try:
            names = {p.name for p in self.cfg.directory.iterdir() if p.is_dir()}
        except OSError:
            return None
        for candidate in dict.fromkeys((segment, urllib.parse.unquote(segment))):
            if candidate in names:
                return candidate
            if candidate and run_slug(candidate) in names:
                return run_slug(candidate)
        return None

    def find(self, slug: str, rank: int, episode: int | None = None) -> dict | None:
        """The newest capture of a rank of the run whose directory is ``slug`` (or its ``episode``)."""
        found = [c for c in self.captures() if c.get("run_dir") == slug and c.get("rank") == rank
                 and (episode is None or c.get("episode") == episode)]
        return found[-1] if found else None

    # -- capturing (the evidence thread) ------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                capture = self.capture(job)
                path = job.run_dir / EVIDENCE_SUBDIR / f"rank-{job.reg.rank}-{job.reg.pid}-{job.episode.number}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(capture))
                os.replace(tmp, path)
                with self._lock:
                    job.episode.capture, job.episode.path = capture, path
                log.info("evidence of run %s rank %d (%s) captured: %s", job.reg.run, job.reg.rank,
                         job.episode.trigger, path)
            except Exception:
                self._log_once("capture", "an evidence capture failed (logged once)", exc_info=True)

    def capture(self, job: _Job) -> dict:
        began = time.monotonic()
        reg = job.reg
        state = process_state(reg.pid)
        alive = state not in (None, "Z") and reg.process_alive()   # a zombie has no stacks to give
        capture: dict[str, Any] = {
            "run": reg.run, "run_dir": job.run_dir.name, "rank": reg.rank, "local_rank": reg.local_rank,
            "node": reg.node, "pid": reg.pid, "episode": job.episode.number, "trigger": job.episode.trigger,
            "state": job.state, "captured_at": time.time(),
            "path": evidence_path(job.run_dir.name, reg.rank),
            "collectives": {"in_flight": job.in_flight, "groups": job.groups,
                            "flight_recorder": [p.name for p in flight_recorder_dumps(job.run_dir, reg.rank)]},
        }
        if reg.failed_at and reg.exception:
            capture["failure"] = {"exception": reg.exception, "failed_at": reg.failed_at,
                                  "traceback": _cut(reg.failure)}
        if alive:
            capture["stacks"] = self._stacks(reg, state)
            capture["process"] = _process(reg.pid)
            if capture["process"]["state"] is None:   # it exited while we read it
                capture["process"] = {"gone": True}
            native = self._native(reg.pid, state)
            if native is not None:
                capture["native"] = native
        else:
            capture["process"] = {"gone": True}
        gpu = self._gpu(reg)
        if gpu:
            capture["gpu"] = gpu
        capture["capture_s"] = round(time.monotonic() - began, 3)   # a stopped rank is never waited on
        return capture

    def _stacks(self, reg: Registration, state: str | None) -> dict:
        offer = reg.stacks or {}
        if state == "T":
            return {"source": "stopped", "note": "the process is stopped (state T): it cannot write its stacks "
                                                 "until it is continued (SIGCONT); nothing waited on it"}
        if not offer.get("signal") or not offer.get("file"):
            return {"source": "unavailable", "note": "the rank offers no stacks: "
                                                     + offer.get("unavailable", "turned off (stack_signal off)")}
        path = Path(offer["file"])
        try:
            os.truncate(path, 0)
            os.kill(reg.pid, int(offer["signal"]))
        except OSError as e:
            return {"source": "unavailable", "note": f"cannot ask the rank for its stacks: {e.strerror or e}"}
        text = _wait_for_stacks(path)
        threads = parse_stacks(text)
        training = [t for t in threads if t["id"] == int(offer.get("thread", 0))]
        return {"source": "signal", "text": _cut(text), "threads": threads,
                "training_thread": int(offer.get("thread", 0)),
                "training_thread_in": where(training[0]["frames"]) if training else None}

    def _native(self, pid: int, state: str | None) -> dict | None:
        py_spy = shutil.which("py-spy")
        if py_spy is None or state == "T":
            return None
        try:
            proc = subprocess.run([py_spy, "dump", "--pid", str(pid), "--native"], capture_output=True, text=True,
                                  timeout=PYSPY_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return {"source": "py-spy", "error": str(e)}
        if proc.returncode != 0:
            return {"source": "py-spy", "error": _cut(proc.stderr.strip() or f"exit {proc.returncode}")}
        return {"source": "py-spy", "text": _cut(proc.stdout)}

    def _gpu(self, reg: Registration) -> dict | None:
        uuid = (reg.info or {}).get("gpu_uuid", "")
        if not uuid or self.gpu is None or not getattr(self.gpu, "available", False):
            return None
        try:
            return self.gpu.snapshot(uuid)
        except Exception as e:   # a GPU in trouble may not answer: say so
            return {"uuid": uuid, "error": str(e)}

    def stop(self) -> None:
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass

    def _log_once(self, key: str, message: str, *args: Any, exc_info: bool = False) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(message, *args, exc_info=exc_info)


def _wait_for_stacks(path: Path) -> str:
    """The stacks the rank's handler writes: read once the file stops growing."""
    deadline = time.monotonic() + STACK_WAIT_S
    size = -1
    while time.monotonic() < deadline:
        time.sleep(0.05)
        try:
            now = path.stat().st_size
        except OSError:
            return ""
        if now > 0 and now == size:
            break
        size = now
    try:
        with open(path, "rb") as f:
            return f.read(TEXT_MAX_BYTES + 1).decode(errors="replace")
    except OSError:
        return ""


def flight_recorder_dumps(run_dir: Path, rank: int) -> list[Path]:
    """The flight-recorder dumps a rank wrote (rankscope.collectives.flight_recorder)."""
    return sorted(p for p in (run_dir / FLIGHT_RECORDER_SUBDIR).glob(f"*_rank_{rank}") if p.is_file())


def parse_stacks(text: str) -> list[dict]:
    """faulthandler's dump as threads: ``{"id", "current", "frames": [[file, line, function], ...]}``,
    innermost frame first (as it writes them)."""
    threads: list[dict] = []
    for line in text.splitlines():
        head = _THREAD_HEADER.match(line)
        if head:
            threads.append({"id": int(head.group(2), 16), "current": head.group(1) == "Current thread", "frames": []})
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1]["frames"].append([frame.group(1), int(frame.group(2)), frame.group(3)])
    return threads


# Where a thread is, by the file of its innermost Python frame: torch's own parts first.
_TORCH_PARTS = (("/torch/distributed/", "collective"), ("/torch/autograd/", "backward"),
                ("/torch/utils/data/", "data loader"), ("/torch/", "torch"))


def where(frames: list[list]) -> str:
    """Where a thread is, from its innermost frame: in torch ("collective", "backward", "data
    loader", "torch") or in "user code" (the job's own functions, the standard library, any
    other library). A native wait shows as the Python frame that called it."""
    if not frames:
        return "unknown"
    innermost = frames[0][0].replace("\\", "/")
    return next((part for marker, part in _TORCH_PARTS if marker in innermost), "user code")


def _process(pid: int) -> dict:
    """State, wait channel, threads and whether the CPU time advances (two reads CPU_SAMPLE_S apart)."""
    first = _cpu_seconds(pid)
    out: dict[str, Any] = {"state": process_state(pid)}
    try:
        out["wchan"] = Path(f"/proc/{pid}/wchan").read_text().strip() or "0"
    except OSError:
        pass
    states: dict[str, int] = {}
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            s = stat_state(task / "stat")
            if s:
                states[s] = states.get(s, 0) + 1
    except OSError:
        pass
    out["threads"] = sum(states.values())
    out["thread_states"] = states
    time.sleep(CPU_SAMPLE_S)
    second = _cpu_seconds(pid)
    if first is not None and second is not None:
        out["cpu_seconds"] = round(second, 3)
        out["cpu_advancing"] = second - first > 0.01
    return out


def _cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def _cut(text: str) -> str:
    data = (text or "").encode()
    if len(data) <= TEXT_MAX_BYTES:
        return text or ""
    return data[:TEXT_MAX_BYTES].decode(errors="ignore") + "\n... (cut)"


# -- pages ---------------------------------------------------------------------------------
def render_html(capture: dict) -> str:
    """One capture for a person: what it is, where the training thread is, then each part."""
    e = html.escape
    title = f"run {capture['run']} rank {capture['rank']} on {capture['node']}: {capture['trigger']}"
    parts = [f"<h1>{e(title)}</h1>",
             f"<p>pid {capture['pid']}, state {e(str(capture.get('state')))}, episode {capture['episode']}, captured "
             f"{e(time.strftime('%Y-%m-%d %H:%M:%S %Z', time.localtime(capture['captured_at'])))}. "
             f"<a href='?format=json'>JSON</a></p>"]
    failure = capture.get("failure")
    if failure:
        parts.append(f"<h2>It raised {e(failure['exception'])}</h2><pre>{e(failure.get('traceback', ''))}</pre>")
    stacks = capture.get("stacks")
    if stacks:
        if stacks.get("source") == "signal":
            parts.append(f"<h2>Stacks (the training thread is in {e(str(stacks.get('training_thread_in')))})</h2>"
                         f"<pre>{e(stacks.get('text', ''))}</pre>")
        else:
            parts.append(f"<h2>Stacks</h2><p>{e(stacks.get('note', ''))}</p>")
    native = capture.get("native")
    if native:
        parts.append(f"<h2>Native stacks (py-spy)</h2><pre>{e(native.get('text') or native.get('error', ''))}</pre>")
    collectives = capture.get("collectives", {})
    dumps = "".join(f" <a href='{capture['rank']}/flight-recorder/{e(name)}'>{e(name)}</a>"
                    for name in collectives.get("flight_recorder", []))
    parts.append(f"<h2>Collectives</h2><p>Flight-recorder dumps (pickles; torchfrtrace reads them):"
                 f"{dumps or ' none written yet'}</p><pre>{e(json.dumps(collectives, indent=1))}</pre>")
    parts.append(f"<h2>Process</h2><pre>{e(json.dumps(capture.get('process', {}), indent=1))}</pre>")
    if capture.get("gpu"):
        parts.append(f"<h2>GPU</h2><pre>{e(json.dumps(capture['gpu'], indent=1))}</pre>")
    return ("<!doctype html><html><head><meta charset='utf-8'><title>" + e(title) + "</title></head><body>"
            + "".join(parts) + "</body></html>")
