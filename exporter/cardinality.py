"""How the per-rank histograms are served (``--rank-histograms``, docs/scaling.md, "Cardinality controls").

A rank's histograms are most of its series: the step duration alone is 17
buckets + ``+Inf`` + ``_sum`` + ``_count``, and the collective (per op), data
wait and process-group (per group and op) durations as many again. At
thousands of ranks that is most of a job's series. Three modes:

``full`` (default)
    Every bucket of every rank, as merged: today's page, byte for byte.
``sum-count``
    Each per-rank histogram as its ``_sum`` and ``_count`` only, with the
    values ``full`` serves. A family without buckets is not a valid
    OpenMetrics histogram (prometheus_client's OpenMetrics parser refuses it:
    "+Inf bucket missing"), so the family is typed ``summary`` (a summary
    without quantiles: ``_sum`` and ``_count``, valid in both text formats).
    Queries read ``_sum`` and ``_count`` the same either way. Every gauge and
    counter is unchanged.
``node-buckets``
    ``sum-count``, plus one histogram per node and run (and op, group...):
    ``rankscope_node_<name>`` (``rankscope_node_step_duration_seconds`` ...),
    the ranks' buckets, ``_count`` and ``_sum`` summed over the node's ranks
    of the run, labelled like the ranks' series without ``rank`` and
    ``local_rank``. A distinct name, not the ranks' own: under the same name,
    a sum over the family (``sum by (run) (rate(x_count[..]))``) would count
    every step twice, and one family could not be a histogram for some label
    sets and a summary for others.

A histogram family is per-rank when every one of its series has a ``rank``
label (all of rankscope's do); any other histogram is served as is.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from rankscope.exporter.catalog import node_histogram_help as node_help
from rankscope.exporter.catalog import node_histogram_name as node_name
from rankscope.exporter.config import RANK_HISTOGRAM_MODES
from rankscope.exporter.reader import MergedFamily

FULL, SUM_COUNT, NODE_BUCKETS = RANK_HISTOGRAM_MODES
RANK_ONLY_LABELS = frozenset(("rank", "local_rank"))


def _items(metric: Metric) -> Iterator[tuple[str, tuple, float]]:
    """(sample name, labels as pairs, value) of every sample served."""
    if isinstance(metric, MergedFamily) and metric._explicit is None:
        return metric.items()
    return ((s.name, tuple(s.labels.items()), s.value) for s in metric.samples)


def reduce_histograms(metrics: Iterable[Metric], mode: str) -> list[Metric]:
    """``metrics`` (one run's merged families) as ``mode`` serves them; ``full``: unchanged."""
    metrics = list(metrics)
    if mode == FULL:
        return metrics
    out: list[Metric] = []
    nodes: list[Metric] = []
    for m in metrics:
        if m.type != "histogram":
            out.append(m)
            continue
        items = list(_items(m))
        if not items or not all(any(k == "rank" for k, _ in labels) for _, labels, _ in items):
            out.append(m)
            continue
        bucket = m.name + "_bucket"
        reduced = Metric(m.name, m.documentation, "summary", m.unit)
        reduced.samples = [Sample(name, dict(labels), value) for name, labels, value in items if name != bucket]
        out.append(reduced)
        if mode == NODE_BUCKETS:
            nodes.append(_node_histogram(m, items))
    return out + nodes


def _node_histogram(m: Metric, items: list[tuple[str, tuple, float]]) -> Metric:
    """The ranks' buckets, counts and sums, added up per label set without rank and local_rank."""
    groups: dict[tuple, dict[str, float]] = {}   # labels without rank, local_rank, le -> {le or suffix: value}
    for name, labels, value in items:
        suffix = name[len(m.name):]
        key = tuple(lv for lv in labels if lv[0] not in RANK_ONLY_LABELS and lv[0] != "le")
        slot = dict(labels).get("le") if suffix == "_bucket" else suffix
        values = groups.setdefault(key, {})
        values[slot] = values.get(slot, 0.0) + value
    name = node_name(m.name)
    node = Metric(name, node_help(m.documentation), "histogram", m.unit)
    for key, values in groups.items():
        labels = dict(key)
        bounds = sorted((slot for slot in values if slot not in ("_sum", "_count")), key=float)
        for le in bounds:
            node.samples.append(Sample(name + "_bucket", {**labels, "le": le}, values[le]))
        for suffix in ("_count", "_sum"):
            if suffix in values:
                node.samples.append(Sample(name + suffix, labels, values[suffix]))
    return node


def count_series(directory, mode: str) -> dict[str, dict]:
    """Series a node's exporter would serve in ``mode`` for the runs in ``directory``, per run:
    ``per_rank`` {rank: series with that rank label}, ``node`` (the run's series without a rank label:
    node histograms). Key ``""``: the exporter's own series (its derived per-state counts, info, health), no NVML."""
    from pathlib import Path

    from rankscope.exporter.collector import NodeCollector
    from rankscope.exporter.config import ExporterConfig

    collector = NodeCollector(ExporterConfig(directory=Path(directory), nvml=False, rank_histograms=mode))
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
    """``python -m rankscope.exporter.cardinality [--dir D]``: series per rank and per node in each mode."""
    import argparse

    from rankscope.contract.rundir import default_metrics_dir

    p = argparse.ArgumentParser(prog="python -m rankscope.exporter.cardinality",
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
