"""The node's metrics directory and the per-run directory a rank shares with its node exporter.

Layout, under the node's metrics directory (``default_metrics_dir()``)::

    exporter.json               where the exporter serving this directory listens (it writes it)
    exporter.log                an auto-started exporter's log
    <run-slug>/                 one per training run
        counter_<pid>.db ...    prometheus_client multiprocess files, one set per rank process (mmap_layout)
        ranks/rank-<N>-<pid>.json  registration of one process of rank N: identity, pid,
                                   parent (the torchrun agent), finish time
        evidence/               stacks-rank-<N>-<pid>.txt: the rank's stacks, written on the
                                exporter's signal; rank-<N>-<pid>-<episode>.json: what the
                                exporter captured when the rank stopped making progress

The registration lets the exporter tell a live rank from a dead or finished
one (and a recycled pid from the original), and name ranks in series it
derives. It is written atomically (rename), so the exporter never reads half a
file. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rankscope.contract.mmap_layout import db_file_pid

RANKS_SUBDIR = "ranks"
EVIDENCE_SUBDIR = "evidence"
FLIGHT_RECORDER_SUBDIR = "flight-recorder"   # a rank's flight-recorder dumps, <name>_rank_<rank>
EXPORTER_FILE = "exporter.json"


def default_metrics_dir() -> Path:
    """Node-wide directory the ranks and the exporter share.

    /dev/shm keeps the mmap files in memory; it exists on Linux and in most
    containers (Kubernetes gives it 64 MiB by default, enough for ~100 ranks).
    """
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return base / f"rankscope-{os.getuid()}"


def save_exporter_address(directory: Path, addr: str, port: int) -> Path:
    """The exporter serving ``directory`` says where it listens (atomically): its port need not be
    the default one (another user's exporter may hold that)."""
    path = directory / EXPORTER_FILE
    tmp = path.with_name(f".{EXPORTER_FILE}.{os.getpid()}")
    tmp.write_text(json.dumps({"addr": addr, "port": port, "pid": os.getpid()}))
    os.replace(tmp, path)
    return path


def exporter_address(directory: Path) -> tuple[str, int] | None:
    """(addr, port) where the exporter of ``directory`` said it listens, if it did and still runs."""
    try:
        doc = json.loads((directory / EXPORTER_FILE).read_text())
        addr, port, pid = str(doc["addr"]), int(doc["port"]), int(doc["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return (addr, port) if process_start_ticks(pid) is not None else None


def forget_exporter_address(directory: Path) -> None:
    """At the exporter's exit: remove its address if it is still its own."""
    path = directory / EXPORTER_FILE
    try:
        if int(json.loads(path.read_text())["pid"]) == os.getpid():
            path.unlink()
    except (OSError, ValueError, KeyError, TypeError):
        pass


def run_slug(run: str) -> str:
    """A directory name for a run id: readable, and distinct for distinct ids."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:64]
    if safe == run and not run.startswith("."):
        return run
    return f"{safe.lstrip('.')}-{hashlib.sha1(run.encode()).hexdigest()[:8]}"


def process_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (None if it is gone).

    Together with the pid it identifies a process even after pid reuse.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # Field 22 counts from the command name, which may contain spaces and ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def process_state(pid: int) -> str | None:
    """One-letter process state from /proc (R, S, D, T stopped, Z zombie...), None if gone."""
    return stat_state(Path(f"/proc/{pid}/stat"))


def stat_state(stat: Path) -> str | None:
    """The state letter of a /proc ``stat`` file (a process's, or one of its threads'), None if gone."""
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass
class Registration:
    run: str
    rank: int
    local_rank: int
    node: str
    world_size: int
    local_world_size: int
    pid: int
    pid_start_ticks: int | None
    agent_pid: int
    agent_start_ticks: int | None
    started_at: float
    finished_at: float | None = None   # set only when the training loop completed
    failed_at: float | None = None     # set when the monitor ended on an exception
    exception: str = ""                # its type name, when known
    failure: str = ""                  # its traceback and message as Python prints them (bounded)
    info: dict[str, str] = field(default_factory=dict)
    # How the exporter gets the rank's stacks (rankscope.publishing.stacks): the signal to send,
    # the file the stacks are written to, and the training thread's id as the stacks name it.
    # {"unavailable": why} where it cannot (the job has its own handler on that signal); {}: off.
    stacks: dict = field(default_factory=dict)

    def end(self, at: float, exception: str, detail: str = "") -> None:
        """Record how the rank's monitor ended: cleanly (finished) or on ``exception`` (failed)."""
        if exception:
            self.failed_at, self.exception, self.failure = at, exception, detail
        else:
            self.finished_at = at

    @property
    def labels(self) -> dict[str, str]:
        return {"run": self.run, "rank": str(self.rank), "local_rank": str(self.local_rank), "node": self.node}

    def process_alive(self) -> bool:
        state = process_state(self.pid)
        return state is not None and state not in ("Z", "X") and process_start_ticks(self.pid) == self.pid_start_ticks

    def agent_alive(self) -> bool:
        ticks = process_start_ticks(self.agent_pid)
        return ticks is not None and ticks == self.agent_start_ticks

    @classmethod
    def load(cls, path: Path) -> "Registration":
        return cls(**json.loads(path.read_text()))

    def save(self, run_dir: Path) -> Path:
        ranks = run_dir / RANKS_SUBDIR
        ranks.mkdir(parents=True, exist_ok=True)
        path = ranks / reg_filename(self.rank, self.pid)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, path)
        return path


def load_registrations(run_dir: Path) -> list[Registration]:
    """Every readable registration of a run, one per rank process ever started
    (a torchelastic restart adds a new one). Unreadable files are skipped."""
    out = []
    for path in sorted((run_dir / RANKS_SUBDIR).glob("rank-*.json")):
        try:
            out.append(Registration.load(path))
        except (OSError, ValueError, TypeError):
            continue
    return out


def latest_per_rank(registrations: list[Registration]) -> dict[int, Registration]:
    """The newest process of each rank; older ones were superseded by a restart."""
    latest: dict[int, Registration] = {}
    for reg in registrations:
        if reg.rank not in latest or reg.started_at > latest[reg.rank].started_at:
            latest[reg.rank] = reg
    return latest


def remove_previous_launch(run_dir: Path, agent_pid: int, agent_start_ticks: int | None) -> list[Path]:
    """Delete files left by an earlier launch of the same run id on this node.

    A launch is one torchrun agent (the ranks' parent). Files of dead
    processes whose agent is gone belong to a finished or crashed launch:
    counting them again would double every counter. Files of the current
    agent's earlier processes (a torchelastic restart) are kept, so counters
    continue across restarts without a reset; so is anything still alive.
    """
    removed: list[Path] = []
    keep: set[int] = set()
    for reg in load_registrations(run_dir):
        same_agent = reg.agent_pid == agent_pid and reg.agent_start_ticks == agent_start_ticks
        if same_agent or reg.agent_alive() or reg.process_alive():
            keep.add(reg.pid)
        else:
            removed += _unlink(run_dir / RANKS_SUBDIR / reg_filename(reg.rank, reg.pid))
    for db in run_dir.glob("*.db"):
        pid = db_file_pid(db)
        if pid is not None and pid not in keep and process_start_ticks(pid) is None:
            removed += _unlink(db)
    return removed


def reg_filename(rank: int, pid: int) -> str:
    return f"rank-{rank}-{pid}.json"


def _unlink(path: Path) -> list[Path]:
    try:
        path.unlink()
        return [path]
    except FileNotFoundError:
        return []

