"""The node's registry: every collector the exporter runs, in one list, and its own health.

As node_exporter does: each collector is registered once below, by name, with
whether the configuration turns it on; the node collector runs the enabled
ones on every scrape, isolating failures (one broken run directory or GPU must
not blank the whole scrape), and reports each one's success and duration as
series of their own (``rankscope_exporter_collector_success{collector}``).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankscope.exporter import __version__
from rankscope.exporter.catalog import BY_NAME, RANK_STATES
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.evidence import EvidenceKeeper
from rankscope.exporter.network import NetworkCollector
from rankscope.exporter.nvml import NvmlCollector
from rankscope.exporter.ranks import RankCollector

log = logging.getLogger("rankscope.exporter")

# name -> the collector for a configuration, or None where the configuration turns it off.
COLLECTORS: dict[str, Callable[[ExporterConfig], Collector | None]] = {
    "ranks": RankCollector,
    "nvml": lambda cfg: NvmlCollector(cfg.node) if cfg.nvml else None,
    "evidence": lambda cfg: EvidenceKeeper(cfg) if cfg.evidence else None,
    "network": lambda cfg: NetworkCollector(cfg.node, cfg.network_excluded_devices) if cfg.network else None,
}


class NodeCollector(Collector):
    """Runs each enabled collector of ``COLLECTORS``; then the exporter's own series."""

    def __init__(self, cfg: ExporterConfig, nvml: NvmlCollector | None = None):
        self.cfg = cfg
        built = {name: (nvml if name == "nvml" and nvml is not None else make(cfg))
                 for name, make in COLLECTORS.items()}
        self.collectors: dict[str, Collector] = {name: c for name, c in built.items() if c is not None}
        self.ranks: RankCollector = self.collectors["ranks"]   # the exporter's reason to be: always on
        self.evidence: EvidenceKeeper | None = self.collectors.get("evidence")
        if self.evidence is not None:   # it reads the ranks' states and GPUs; its captures refine the states
            self.ranks.evidence, self.evidence.gpu = self.evidence, self.nvml
        self._logged: set[str] = set()

    @property
    def nvml(self) -> NvmlCollector | None:
        return self.collectors.get("nvml")

    def collect(self) -> Iterator[Metric]:
        success = GaugeMetricFamily("rankscope_exporter_collector_success",
                                    BY_NAME["rankscope_exporter_collector_success"].help, labels=["collector"])
        duration = GaugeMetricFamily("rankscope_exporter_collect_duration_seconds",
                                     BY_NAME["rankscope_exporter_collect_duration_seconds"].help,
                                     labels=["collector"])
        for name, collector in self.collectors.items():
            t0 = time.perf_counter()
            ok = True
            try:
                yield from list(collector.collect())
            except Exception:
                ok = False
                if name not in self._logged:
                    self._logged.add(name)
                    log.exception("collector %s failed (reported as rankscope_exporter_collector_success=0)", name)
            ok = ok and getattr(collector, "healthy", True)
            success.add_metric([name], 1.0 if ok else 0.0)
            duration.add_metric([name], time.perf_counter() - t0)
        yield success
        yield duration
        info = GaugeMetricFamily("rankscope_exporter_info", BY_NAME["rankscope_exporter_info"].help,
                                 labels=["node", "version", "directory"])
        info.add_metric([self.cfg.node, __version__, str(self.cfg.directory)], 1.0)
        yield info
        ranks = GaugeMetricFamily("rankscope_exporter_ranks", BY_NAME["rankscope_exporter_ranks"].help,
                                  labels=["state"])
        for state in RANK_STATES:
            ranks.add_metric([state], float(self.ranks.state_counts.get(state, 0)))
        yield ranks
