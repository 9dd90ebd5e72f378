"""The node's registry: ranks, GPUs, and the exporter's own health."""

from __future__ import annotations

import logging
import time
from typing import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankscope.exporter import __version__
from rankscope.exporter.catalog import BY_NAME, RANK_STATES
from rankscope.exporter.config import ExporterConfig
from rankscope.exporter.nvml import NvmlCollector
from rankscope.exporter.ranks import RankCollector

log = logging.getLogger("rankscope.exporter")


class NodeCollector(Collector):
    """Runs each sub-collector, isolating failures: one broken run directory
    or GPU must not blank the whole scrape, and the failure is itself a series."""

    def __init__(self, cfg: ExporterConfig, nvml: NvmlCollector | None = None):
        self.cfg = cfg
        self.ranks = RankCollector(cfg)
        self.nvml = nvml if nvml is not None else (NvmlCollector(cfg.node) if cfg.nvml else None)
        self._logged: set[str] = set()

    def collect(self) -> Iterator[Metric]:
        success = GaugeMetricFamily("rankscope_exporter_collector_success",
                                    BY_NAME["rankscope_exporter_collector_success"].help, labels=["collector"])
        duration = GaugeMetricFamily("rankscope_exporter_collect_duration_seconds",
                                     BY_NAME["rankscope_exporter_collect_duration_seconds"].help,
                                     labels=["collector"])
        collectors = [("ranks", self.ranks)]
        if self.nvml is not None:
            collectors.append(("nvml", self.nvml))
        for name, collector in collectors:
            t0 = time.perf_counter()
            ok = True
            try:
                yield from list(collector.collect())
            except Exception:
                ok = False
                if name not in self._logged:
                    self._logged.add(name)
                    log.exception("collector %s failed (reported as rankscope_exporter_collector_success=0)", name)
            if name == "nvml" and self.nvml.error and not getattr(self.nvml, "no_driver", False):
                ok = False
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
