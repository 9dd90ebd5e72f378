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

import copy
from typing import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.samples import Sample

from rankscope.exporter.catalog import node_histogram_help as node_help
from rankscope.exporter.catalog import node_histogram_name as node_name
from rankscope.exporter.config import RANK_HISTOGRAM_MODES
from rankscope.exporter.reader import MergedFamily

FULL, SUM_COUNT, NODE_BUCKETS = RANK_HISTOGRAM_MODES
RANK_ONLY_LABELS = frozenset(("rank", "local_rank"))


# Per merge plan (rankscope.exporter.reader): which of its series a reduced mode keeps, and how the node
# histograms add them up. Worked out once per file layout, as the plan itself.
_LAYOUTS: dict[int, tuple[object, list[bool] | None, list]] = {}
_LAYOUTS_MAX = 4096


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
        if isinstance(m, MergedFamily) and m._explicit is None and m._keep is None and m.order is None:
            # The merged family's own slots, served through the reader's cached rendering.
            keep, layout = _layout(m.plan, m.name, [(s.name, s.labels) for s in m.plan.series])
            if keep is None:
                out.append(m)
                continue
            reduced = copy.copy(m)
            reduced.type, reduced._keep = "summary", keep
            values = m.values
        else:
            samples = list(m.samples)
            keep, layout = _layout(None, m.name, [(s.name, tuple(s.labels.items())) for s in samples])
            if keep is None:
                out.append(m)
                continue
            reduced = Metric(m.name, m.documentation, "summary", m.unit)
            reduced.samples = [s for s, k in zip(samples, keep) if k]
            values = [s.value for s in samples]
        out.append(reduced)
        if mode == NODE_BUCKETS:
            node = Metric(node_name(m.name), node_help(m.documentation), "histogram", m.unit)
            for name, labels, indices in layout:
                total = 0.0
                for i in indices:
                    total += values[i]
                node.samples.append(Sample(name, labels, total))
            nodes.append(node)
    return out + nodes


def _layout(plan: object | None, family: str, series: list[tuple[str, tuple]]) -> tuple[list[bool] | None, list]:
    """For a histogram's series (sample name, labels as pairs): which to keep (everything but the buckets;
    None: the family is not per-rank, served as is), and the node histogram's series: (sample name, labels,
    indices of the series it adds up), the buckets of each label set (without rank, local_rank) in ``le``
    order, then its _count and _sum."""
    if plan is not None:
        hit = _LAYOUTS.get(id(plan))
        if hit is not None and hit[0] is plan:
            return hit[1], hit[2]
    bucket = family + "_bucket"
    if not series or not all(any(k == "rank" for k, _ in labels) for _, labels in series):
        keep, layout = None, []
    else:
        keep = [name != bucket for name, _ in series]
        groups: dict[tuple, dict[str, list[int]]] = {}   # labels without rank, local_rank, le -> {le or suffix: [i]}
        for i, (name, labels) in enumerate(series):
            key = tuple(lv for lv in labels if lv[0] not in RANK_ONLY_LABELS and lv[0] != "le")
            slot = dict(labels).get("le", "") if name == bucket else name[len(family):]
            groups.setdefault(key, {}).setdefault(slot, []).append(i)
        name = node_name(family)
        layout = []
        for key, slots in groups.items():
            labels = dict(key)
            for le in sorted((slot for slot in slots if slot not in ("_sum", "_count")), key=float):
                layout.append((name + "_bucket", {**labels, "le": le}, slots[le]))
            for suffix in ("_count", "_sum"):
                if suffix in slots:
                    layout.append((name + suffix, labels, slots[suffix]))
    if plan is not None:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.clear()
        _LAYOUTS[id(plan)] = (plan, keep, layout)
    return keep, layout
