"""How many series a node's exporter serves for the runs in a metrics directory, in each
``--rank-histograms`` mode (docs/scaling.md, "Series budget"): a sizing tool, run by hand on
a live job, never on the scrape path.

    python -m rankscope.exporter.sizing [--dir DIR] [--ranks-per-node 8]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rankscope.contract.rundir import default_metrics_dir
from rankscope.exporter.collector import NodeCollector
from rankscope.exporter.config import RANK_HISTOGRAM_MODES, ExporterConfig


def count_series(directory, mode: str) -> dict[str, dict]:
    """Series a node's exporter would serve in ``mode`` for the runs in ``directory``, per run:
    ``per_rank`` {rank: series with that rank label}, ``node`` (the run's series without a rank label:
    node histograms). Key ``""``: the exporter's own series (its derived per-state counts, info, health), no NVML
    and no network (their series depend on the node's GPUs and NICs: docs/scaling.md counts them apart)."""
    collector = NodeCollector(ExporterConfig(directory=Path(directory), nvml=False, network=False, rank_histograms=mode))
    out: dict[str, dict] = {"": {"per_rank": {}, "node": 0}}
    for metric in collector.collect():
        for s in metric.samples:
            run = s.labels.get("run", "") if metric.name.startswith("rankscope_") else ""
            counts = out.setdefault(run, {"per_rank": {}, "node": 0})
            if "rank" in s.labels:
                counts["per_rank"][s.labels["rank"]] = counts["per_rank"].get(s.labels["rank"], 0) + 1
            else:
                counts["node"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m rankscope.exporter.sizing [--dir D]``: series per rank and per node in each mode."""
    p = argparse.ArgumentParser(prog="python -m rankscope.exporter.sizing",
                                description="Series per rank and per node in each --rank-histograms mode, for the "
                                            "runs in the metrics directory (read like the exporter reads it).")
    p.add_argument("--dir", default=None, help="metrics directory (default: RANKSCOPE_METRICS_DIR or "
                                               "/dev/shm/rankscope-UID)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks per node for the per-node estimate (8)")
    args = p.parse_args(argv)
    directory = args.dir or default_metrics_dir()
    print("| run | mode | ranks | series per rank | node histograms | exporter's own "
          f"| per node of {args.ranks_per_node} ranks, NVML aside |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for mode in RANK_HISTOGRAM_MODES:
        counts = count_series(directory, mode)
        own = counts.pop("")["node"]
        for run, c in sorted(counts.items()):
            per_rank = sorted(c["per_rank"].values())
            if not per_rank:
                continue
            spread = f"{per_rank[0]}" if per_rank[0] == per_rank[-1] else f"{per_rank[0]}-{per_rank[-1]}"
            node = args.ranks_per_node * per_rank[-1] + c["node"] + own
            print(f"| {run} | {mode} | {len(per_rank)} | {spread} | {c['node']} | {own} | {node} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
