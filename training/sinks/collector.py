"""The sink's collector: every ``interval_s``, the exporters' pages read, summarised, and the
record handed to every backend's writer (thread ``rankscope-sink``)."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Iterable

from rankscope import pages
from rankscope.contract.environment import ConfigError
from rankscope.pages.record import RankRecord
from rankscope.sinks.backend import QUEUE_MIN_RECORDS, QUEUE_SECONDS, Backend, Writer
from rankscope.sinks.summary import Summarizer, parse_page

log = logging.getLogger("rankscope")

SCRAPE_TIMEOUT_S = 5.0


def exporter_urls(text: str | None) -> list[str]:
    """``host:port,host:port`` (or ``http(s)://host:port[/metrics]``) as metrics URLs; ConfigError if malformed."""
    urls = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        try:
            urls.append(pages.page_url(item, port_required=True))
        except ValueError:
            raise ConfigError(f"{item!r} is not host:port or an http(s)://host:port URL",
                              field="sink_exporters") from None
    return urls


class Sink:
    """Scrapes ``urls`` every ``interval_s`` and hands each record to every backend's writer."""

    def __init__(self, urls: Iterable[str], run: str, interval_s: float, backends: Iterable[Backend],
                 drop: Callable[..., None]):
        self.urls = list(urls)
        self.run = run
        self.interval_s = interval_s
        self.drop = drop
        records = max(QUEUE_MIN_RECORDS, math.ceil(QUEUE_SECONDS / interval_s))
        self.writers = [Writer(b, drop, records) for b in backends]
        self.summarizer = Summarizer()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rankscope-sink", daemon=True)
        self.records = 0

    @property
    def backends(self) -> list[Backend]:
        return [w.backend for w in self.writers]

    def local_exporter(self, url: str) -> None:
        """The node's own exporter answers at ``url``, found at start-up (another user's exporter
        may hold the configured port)."""
        self.urls[0] = url

    def start(self) -> None:
        for w in self.writers:
            w.thread.start()
        self._thread.start()

    def _run(self) -> None:
        self.collect()   # the baseline the first interval is measured from
        while not self._stop.wait(self.interval_s):
            self.collect()
        self.collect()   # the last interval, up to close()

    def collect(self) -> None:
        try:
            ranks: dict[int, RankRecord] = {}
            answered = 0
            for url in self.urls:
                try:
                    text = pages.fetch(url, min(SCRAPE_TIMEOUT_S, max(self.interval_s, 1.0)))
                except pages.FetchError as e:
                    log.debug("rankscope sink: %s", e)
                    continue
                answered += 1
                for rank, values in parse_page(text, self.run).items():
                    ranks.setdefault(rank, values)   # a rank listed by two exporters: the first
            if not answered:
                self.drop("sink", f"no exporter answered ({', '.join(self.urls)})")
                return
            record = self.summarizer.update(ranks)
        except Exception as e:   # noqa: BLE001 - never let the thread die
            self.drop("sink", f"summary failed: {type(e).__name__}: {e}")
            return
        if record is None:
            return
        self.records += 1
        for w in self.writers:
            w.offer(record)

    def stop(self, timeout_s: float = 3.0) -> None:
        """One last record, then the writers finish; gives up (daemon threads) after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))
        for w in self.writers:
            w.closing.set()
        for w in self.writers:
            if w.thread.is_alive():
                w.thread.join(max(0.0, deadline - time.monotonic()))
            left = w.queue.qsize() if w.thread.is_alive() else 0
            if left:
                self.drop("sink", f"{w.backend.name}: still writing at close", n=left)
