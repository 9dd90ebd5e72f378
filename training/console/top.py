"""``rankscope top``: every rank of a run and what it is doing, live, in a terminal.

Rendering is rich's (tables, colours, the alternate screen through
``rich.live.Live``); keys are read from the terminal in cbreak mode (no echo,
one key at a time, Ctrl-C still interrupts). Without a terminal, or with
``--once``, the same table is printed once as plain text.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import select
import sys
import termios
import time
import tty
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Iterator

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from rankscope.console import evidence
from rankscope.console.sources import Prometheus, Series, SourceError, scrape_exporter
from rankscope.console.view import RankRow, RunView, build_view, choose_run
from rankscope.contract.catalog import PHASES

STATE_STYLES = {
    "starting": "cyan",
    "progressing": "green",
    "busy": "bright_blue",
    "stuck_in_collective": "bold yellow",
    "stuck": "bold red",
    "frozen": "bold magenta",
    "dead": "bold white on red",
    "finished": "blue",
    "unknown": "dim",
}
PHASE_LETTERS = {"data": "d", "forward": "f", "backward": "b", "optimizer": "o", "comm_wait": "c", "other": "."}
PHASE_STYLES = {"data": "black on yellow", "forward": "black on blue", "backward": "black on magenta",
                "optimizer": "black on green", "comm_wait": "white on red", "other": "black on white"}
PHASE_BAR_WIDTH = 12
SUSPECT_MARK = "SUSPECT"
PLAIN_WIDTH = 200          # columns of the plain-text table when there is no terminal to ask

# key -> (sort name, how rows are ordered): slowest / furthest behind / most waiting first.
SORTS: dict[str, tuple[str, Callable[[RankRow], tuple]]] = {
    "t": ("step time", lambda r: (-(r.median_step_s or 0.0), r.rank)),
    "l": ("step lag", lambda r: (-(r.lag or 0.0), r.rank)),
    "c": ("comm wait", lambda r: (-r.comm_wait_fraction, r.rank)),
    "r": ("rank", lambda r: (r.rank,)),
}
SORT_BY_NAME = {"step_time": "t", "lag": "l", "comm_wait": "c", "rank": "r"}


class ExporterSource:
    """Rows from one or more node exporters; rates from this process's own earlier scrapes."""

    def __init__(self, urls: list[str], run: str | None, window_s: float, alerts: Prometheus | None = None):
        self.urls = urls
        self.requested_run = run
        self.run: str | None = None
        self.window_s = window_s
        self.alerts = alerts
        self.history: collections.deque[tuple[float, list[Series]]] = collections.deque()
        self.evidence = SuspectEvidence()

    @property
    def description(self) -> str:
        return ", ".join(self.urls)

    def fetch(self, strict: bool = False) -> RunView:
        """One picture. ``strict`` (the first fetch): any exporter that fails is an error. Later, a node
        whose exporter stops answering (the node in trouble) leaves the others on screen, and is named."""
        now = time.time()
        samples: list[Series] = []
        failures: list[str] = []
        for url in self.urls:
            try:
                samples += with_instance(scrape_exporter(url), url)
            except SourceError as e:
                if strict or len(self.urls) == 1:
                    raise
                failures.append(str(e))
        if len(failures) == len(self.urls):
            raise SourceError("; ".join(failures))
        if self.run is None or self.requested_run is None:
            # Without --run, follow the node's most recently active live run (a restart gets a new id).
            run = choose_run(samples, self.requested_run, self.description)
            if run != self.run:
                self.history.clear()   # the earlier run's scrapes are no baseline for this one
            self.run = run
        elif self.run not in {s.labels.get("run") for s in samples}:
            raise SourceError(f"run {self.run!r} is no longer served at {self.description}")
        while self.history and now - self.history[0][0] > self.window_s:
            self.history.popleft()
        baseline = self.history[0] if self.history and now - self.history[0][0] >= 1.0 else None
        self.history.append((now, samples))
        alerts = None
        if self.alerts is not None:
            alerts = self.alerts.firing_alerts(self.run)
        view = build_view(self.run, samples, source=self.description, taken_at=now, alerts=alerts,
                          baseline=baseline[1] if baseline else None,
                          window_s=(now - baseline[0]) if baseline else None)
        view.source_errors = failures
        view.evidence = self.evidence.of_suspects(view, samples)
        return view


def with_instance(samples: list[Series], url: str) -> list[Series]:
    """An exporter's evidence series, labelled with the exporter they came from (as Prometheus does)."""
    instance = urllib.parse.urlsplit(url).netloc
    return [Series(s.name, {**s.labels, "instance": instance}, s.value) if s.name == evidence.SERIES else s
            for s in samples]


class SuspectEvidence:
    """The evidence of the run's suspects (or stalled ranks), fetched once per capture."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, float], dict] = {}

    def of_suspects(self, view: RunView, samples: list[Series]) -> list[dict]:
        wanted = {r.rank for r in view.rows if r.suspect or r.state == "frozen"} \
            or {r.rank for r in view.rows if r.state in ("stuck", "dead") and r.evidence}
        out = []
        for c in evidence.captures(samples, view.run):
            if c["rank"] not in wanted:
                continue
            key = (c["url"], c["captured_at"])
            if key not in self._cache:
                self._cache[key] = evidence.summarize([c])[0]
            out.append(self._cache[key])
        return out


class PrometheusSource:
    """Rows from Prometheus's latest samples of the run; rates against the samples ``window_s`` earlier."""

    def __init__(self, prometheus: Prometheus, run: str | None, window_s: float):
        self.prometheus = prometheus
        self.requested_run = run
        self.run: str | None = None
        self.window_s = window_s
        self.evidence = SuspectEvidence()

    @property
    def description(self) -> str:
        return self.prometheus.url

    def fetch(self, strict: bool = False) -> RunView:
        self.prometheus.check()
        now = time.time()
        if self.run is None or self.requested_run is None:
            current = self.prometheus.query('{__name__=~"rankscope_rank_state|rankscope_last_step_timestamp_seconds'
                                            '|rankscope_rank_start_timestamp_seconds"}', now)
            if self.requested_run is not None and self.requested_run not in {s.labels.get("run") for s in current}:
                known = self.prometheus.label_values("run", "rankscope_rank_info")
                if self.requested_run in known:
                    raise SourceError(f"run {self.requested_run!r} has no current samples in {self.description} "
                                      f"(it ended; for its history: rankscope report --run {self.requested_run})")
            self.run = choose_run(current, self.requested_run, self.description)
        samples = self.prometheus.run_series(self.run, now)
        baseline = self.prometheus.run_series(self.run, now - self.window_s)
        alerts = self.prometheus.firing_alerts(self.run, now)
        view = build_view(self.run, samples, source=self.description, baseline=baseline,
                          window_s=self.window_s, alerts=alerts, taken_at=now)
        view.evidence = self.evidence.of_suspects(view, samples)
        return view


@dataclass
class Screen:
    """What the person chose: sort order and node filter."""

    sort_key: str = "r"
    node: str | None = None
    message: str = ""
    error: str = ""
    error_since: float | None = None

    def press(self, key: str, view: RunView | None) -> bool:
        """Apply a key; False to quit."""
        if key in ("q", "Q", "\x1b"):
            return False
        if key in SORTS:
            self.sort_key = key
        elif key == "n" and view is not None:
            nodes = [None, *view.nodes]
            self.node = nodes[(nodes.index(self.node) + 1) % len(nodes)] if self.node in nodes else None
        elif key == "a":
            self.node = None
        return True


def _seconds(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    if value < 1.0:
        return f"{value * 1000:.1f}ms"
    if value < 120:
        return f"{value:.2f}s" if value < 10 else f"{value:.1f}s"
    return f"{value / 60:.1f}m"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:.4g}"


def _bytes(value: float | None) -> str:
    if value is None or math.isnan(value):
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(value) < 1024 or unit == "T":
            return f"{value:.0f}{unit}" if unit in ("B", "K") else f"{value:.1f}{unit}"
        value /= 1024
    return "-"


def phase_bar(fractions: dict[str, float], color: bool, width: int = PHASE_BAR_WIDTH) -> Text:
    """``width`` cells split between the phases by their share (largest remainders), one letter per phase."""
    if not fractions:
        return Text("-")
    exact = {p: fractions.get(p, 0.0) * width for p in PHASES}
    cells = {p: int(v) for p, v in exact.items()}
    for p in sorted(PHASES, key=lambda p: exact[p] - cells[p], reverse=True)[:width - sum(cells.values())]:
        cells[p] += 1
    bar = Text()
    for p in PHASES:
        if cells[p]:
            bar.append(PHASE_LETTERS[p] * cells[p], style=PHASE_STYLES[p] if color else "")
    return bar


def _memory(row: RankRow) -> str:
    if row.memory_used is None:
        return "-"
    limit = f"/{_bytes(row.memory_limit)}" if row.memory_limit else ""
    share = f" {100 * row.memory_used / row.memory_limit:.0f}%" if row.memory_limit else ""
    return f"{row.memory_kind} {_bytes(row.memory_used)}{limit}{share}"


def rows_shown(view: RunView, screen: Screen) -> list[RankRow]:
    rows = [r for r in view.rows if screen.node is None or r.node == screen.node]
    return sorted(rows, key=SORTS[screen.sort_key][1])


def render(view: RunView | None, screen: Screen, *, color: bool, live: bool) -> RenderableType:
    parts: list[RenderableType] = []
    if view is None:
        parts.append(Text(f"rankscope top: waiting for data... {screen.error}"))
        return Group(*parts)
    header = Text()
    header.append("rankscope top", style="bold" if color else "")
    header.append(f"  run {view.run}", style="bold cyan" if color else "")
    nodes = view.nodes
    header.append(f"  {len(view.rows)} ranks on {len(nodes)} node{'s' if len(nodes) != 1 else ''}")
    if view.leader_step is not None:
        header.append(f"  leader step {view.leader_step:.0f}")
    rate = "-" if view.steps_per_s is None else f"{view.steps_per_s:.2f}"
    window = f" over {view.window_s:.0f}s" if view.window_s else " (one sample so far)"
    header.append(f"  {rate} steps/s{window}")
    header.append(f"  at {time.strftime('%H:%M:%S', time.localtime(view.taken_at))}")
    parts.append(header)

    states = Text("ranks: ")
    for i, (state, count) in enumerate(view.state_counts().items()):
        if i:
            states.append(", ")
        states.append(f"{count} {state}", style=STATE_STYLES.get(state, "") if color else "")
    if view.suspects:
        states.append("   hang suspect: ")
        states.append(", ".join(f"rank {r}" for r in view.suspects), style="bold red" if color else "")
    parts.append(states)
    for group in view.replicas:
        line = Text("replicas: ")
        line.append(group.line(), style=("bold red" if group.differing else "green") if color else "")
        parts.append(line)

    alerts = Text("alerts firing: ")
    if view.alerts is None:
        alerts.append("(from Prometheus only: add --prometheus URL)", style="dim" if color else "")
    elif not view.alerts:
        alerts.append("none", style="green" if color else "")
    else:
        for i, a in enumerate(view.alerts):
            if i:
                alerts.append(", ")
            where = f" rank {a.rank}" if a.rank else ""
            alerts.append(f"{a.name} ({a.severity or '?'}{where})",
                          style=("bold red" if a.severity == "critical" else "yellow") if color else "")
    parts.append(alerts)
    others = [r for r in view.runs if r != view.run]
    if others:
        parts.append(Text(f"other runs at this source: {', '.join(others)} (--run RUN)"))

    table = Table(box=box.SIMPLE_HEAD if color else box.ASCII2, pad_edge=False, expand=False, collapse_padding=color,
                  header_style="bold" if color else "")
    staged = any(row.stage for row in view.rows)   # a pipeline job: each rank's stage beside its node
    for name, justify in (("rank", "right"), ("node", "left"), *([("stage", "right")] if staged else []),
                          ("state", "left"), ("step", "right"),
                          ("lag", "right"), ("last", "right"), ("median", "right"), ("phases", "left"),
                          ("loss", "right"), ("grad norm", "right"), ("memory", "right"),
                          ("collective", "left"), ("age", "right"), ("hang", "left"), ("evidence", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in rows_shown(view, screen):
        state = Text(row.state + (f" ({row.exception})" if row.exception else ""),
                     style=STATE_STYLES.get(row.state, "") if color else "")
        bar = phase_bar(row.phase_fractions, color)
        if row.since_start and row.phase_fractions:
            bar.append("*")
        lag = "-" if row.lag is None else f"{row.lag:.0f}"
        collective = Text(row.collective or "-", style="yellow" if (color and row.collective) else "")
        hang = Text(SUSPECT_MARK, style="bold white on red" if color else "") if row.suspect else Text("")
        table.add_row(str(row.rank), row.node, *([row.stage or "-"] if staged else []), state,
                      "-" if row.step is None else f"{row.step:.0f}", lag,
                      _seconds(row.last_step_s), _seconds(row.median_step_s), bar, _number(row.loss),
                      _number(row.grad_norm), _memory(row), collective,
                      _seconds(row.collective_age_s) if row.collective else "-", hang, row.evidence or "")
    parts.append(table)
    for c in view.evidence:
        line = Text(f"rank {c['rank']} ({c['trigger']}) ", style="bold" if color else "")
        line.append(evidence.one_line(c))
        line.append(f"   {c['url']}", style="dim" if color else "")
        parts.append(line)

    legend = Text("phases: ")
    for p in PHASES:
        legend.append(PHASE_LETTERS[p], style=PHASE_STYLES[p] if color else "")
        legend.append(f" {p}  ")
    legend.append("(* since start: no step in the window)")
    parts.append(legend)
    node = screen.node or "all"
    footer = f"sorted by {SORTS[screen.sort_key][0]}, node {node}"
    if live:
        footer = "keys: t step time  l step lag  c comm wait  r rank  n next node  a all nodes  q quit   " + footer
    parts.append(Text(footer, style="dim" if color else ""))
    for failure in view.source_errors:
        parts.append(Text(f"not answering, its ranks are left out: {failure}", style="bold red" if color else ""))
    if screen.error:
        since = time.strftime("%H:%M:%S", time.localtime(screen.error_since or time.time()))
        parts.append(Text(f"refresh failing since {since}: {screen.error} (showing the last good data)",
                          style="bold red" if color else ""))
    return Group(*parts)


def print_once(source, screen: Screen, out=None) -> None:
    """One plain-text picture (no colours, no cursor movement): for scripts, tickets and pipes."""
    view = source.fetch(strict=True)
    if screen.node is not None and screen.node not in view.nodes:
        raise SourceError(f"node {screen.node!r} has no ranks of run {view.run!r} (nodes: {', '.join(view.nodes)})")
    out = out or sys.stdout
    width = os.get_terminal_size(out.fileno()).columns if out.isatty() else PLAIN_WIDTH
    console = Console(file=out, width=max(width, 120), no_color=True, force_terminal=False, highlight=False,
                      emoji=False, color_system=None)
    console.print(render(view, screen, color=False, live=False))


@contextlib.contextmanager
def keys_from(stream) -> Iterator[Callable[[float], str]]:
    """A function that waits up to ``timeout`` s for one key on ``stream``; '' when none came.
    The terminal is in cbreak mode meanwhile (no echo, no line buffering; Ctrl-C still works)."""
    if not stream.isatty():
        yield lambda timeout: (time.sleep(timeout), "")[1]
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def read(timeout: float) -> str:
        ready, _, _ = select.select([fd], [], [], max(timeout, 0.0))
        return os.read(fd, 1).decode(errors="replace") if ready else ""

    try:
        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_live(source, screen: Screen, interval_s: float) -> None:
    view = source.fetch(strict=True)    # the first fetch fails loudly (bad URL, no such run): exit 2 before the screen
    if screen.node is not None and screen.node not in view.nodes:
        raise SourceError(f"node {screen.node!r} has no ranks of run {view.run!r} (nodes: {', '.join(view.nodes)})")
    console = Console()
    next_fetch = time.monotonic() + interval_s
    with keys_from(sys.stdin) as read_key, \
            Live(console=console, screen=True, auto_refresh=False, redirect_stdout=False,
                 redirect_stderr=False) as live:
        while True:
            live.update(render(view, screen, color=True, live=True), refresh=True)
            key = read_key(next_fetch - time.monotonic())
            if key and not screen.press(key, view):
                return
            if time.monotonic() >= next_fetch:
                try:
                    view = source.fetch()
                    screen.error, screen.error_since = "", None
                except SourceError as e:   # a node under stress answers late: keep the last picture, say so
                    screen.error = str(e)
                    screen.error_since = screen.error_since or time.time()
                next_fetch = time.monotonic() + interval_s
