"""The run figures every reader shows, each defined once, with the alert rules' meaning
(prometheus/rules_spec.py): ``rankscope top``, ``rankscope report`` and rank 0's TensorBoard /
MLflow summary compute them here, from the increases of a window, or (the report, where the
shipped rules are loaded) read the series the rules recorded.

* compute per step: the seconds of ``COMPUTE_PHASES`` (the rules' ``straggler_phases``)
  per step (``rank:rankscope_phase_seconds:compute_per_step``);
* peer ratio: a rank's compute per step over the median of its pipeline stage's ranks
  WITHOUT the stage's slowest (``STAGE_PEER_MEDIAN``, the straggler's peers; a job without
  stages is one stage), ``rank:rankscope_phase_seconds:compute_per_step_peer_ratio``; the
  Straggler alert fires above ``STRAGGLER_RATIO``;
* phase shares: each phase's seconds over all phases' (which add up to the step time),
  ``rank_phase:rankscope_phase_seconds:fraction``; comm-bound and input-bound above
  ``COMM_BOUND_RATIO`` and ``INPUT_BOUND_RATIO``;
* goodput: productive wall seconds over all wall seconds (``rankscope_wall_seconds_total``);
* stalled: ranks in ``STALLED_STATES``.
"""

from __future__ import annotations

import math
import statistics
from typing import Hashable, Iterable, Mapping, TypeVar

from rankscope.contract.catalog import PHASES
from rankscope.contract.states import STALLED_STATES
from rankscope.contract.thresholds import COMM_BOUND_RATIO, INPUT_BOUND_RATIO, STRAGGLER_PHASES

K = TypeVar("K", bound=Hashable)

COMPUTE_PHASES = STRAGGLER_PHASES   # the readers' name for the rules' straggler_phases
# The series the rules record, for a reader with a Prometheus at hand.
PEER_RATIO_RECORD = "rank:rankscope_phase_seconds:compute_per_step_peer_ratio"


def finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def delta(now: float | None, before: float | None) -> float | None:
    """A counter's increase; a counter lower than before was reset (a new process): all of it is new."""
    if now is None or before is None:
        return None
    return now - before if now >= before else now


def deltas(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, float]:
    """Each labelled counter's increase (``delta``); one absent before counts from 0."""
    return {k: d for k, v in now.items() if (d := delta(v, before.get(k, 0.0))) is not None}


# ---- compute per step and the straggler's peer ratio ----
def compute_seconds(phases: Mapping[str, float]) -> float | None:
    """The compute seconds among ``phases`` (the rule sums those of COMPUTE_PHASES it has); None: none."""
    present = [phases[p] for p in COMPUTE_PHASES if p in phases]
    return sum(present) if present else None


def compute_per_step(phases: Mapping[str, float], steps: float | None) -> float | None:
    """Compute seconds per step over a window: the increases of the phases and of the steps."""
    compute = compute_seconds(phases)
    return compute / steps if compute is not None and steps else None


def peer_ratios(compute: Mapping[K, float], stages: Mapping[K, str] | None = None) -> dict[K, float]:
    """Each rank's compute per step over its stage's peer median: the median of the stage's ranks
    without the stage's slowest (a job without stages is one stage). The median of all ranks
    includes the straggler: in a 2-rank run it is the mean of the two, and a 1.5x rank reads
    only 1.2x it. A stage of one rank has no peers and no ratio; a rank without steps in the
    window (no value, NaN, negative) is left out, as the rule leaves it out."""
    stages = stages or {}
    by_stage: dict[str, list[K]] = {}
    for k in sorted(compute, key=_order):
        if finite(compute[k]) and compute[k] >= 0:
            by_stage.setdefault(stages.get(k, ""), []).append(k)
    out: dict[K, float] = {}
    for members in by_stage.values():
        if len(members) < 2:
            continue
        slowest = max(members, key=lambda k: compute[k])
        median = statistics.median(compute[k] for k in members if k != slowest)
        if median > 0:
            out.update({k: compute[k] / median for k in members})
    return out


def slowest(compute: Mapping[K, float], stages: Mapping[K, str] | None = None) -> tuple[K, float | None] | None:
    """The rank with the highest peer ratio, and that ratio; without peers (one rank a stage), the rank
    with the most compute per step, and None. None without compute."""
    ratios = peer_ratios(compute, stages)
    if ratios:
        k = max(sorted(ratios, key=_order), key=lambda k: ratios[k])
        return k, ratios[k]
    known = sorted((k for k in compute if finite(compute[k])), key=_order)
    return (max(known, key=lambda k: compute[k]), None) if known else None


def compute_per_step_promql(sel: str, window: str) -> str:
    """PromQL of each rank's compute per step over ``window`` (the rule's, for one selector), with its stage."""
    per_step = (f'sum without (phase) (rate(rankscope_phase_seconds_total{{{sel},phase=~"{"|".join(COMPUTE_PHASES)}"}}'
                f"[{window}])) / rate(rankscope_steps_total{{{sel}}}[{window}])")
    layout = f"topk by (run, rank) (1, rankscope_rank_layout_info{{{sel}}} == 1)"
    return f"(({per_step}) * on (run, rank) group_left (stage) {layout} or on (run, rank) ({per_step}))"


def peer_ratio_promql(sel: str, window: str) -> str:
    """PromQL of ``PEER_RATIO_RECORD`` written out, for a Prometheus without the shipped rules."""
    c = compute_per_step_promql(sel, window)
    peers = f"quantile by (run, stage) (0.5, {c} >= 0 unless on (run, rank) topk by (run, stage) (1, {c} >= 0))"
    return f"{c} / on (run, stage) group_left () {peers}"


# ---- phase shares ----
def phase_shares(seconds: Mapping[str, float]) -> dict[str, float]:
    """Each phase's share of the phases' seconds (which add up to the step time); {} without any."""
    total = sum(seconds.get(p, 0.0) for p in PHASES)
    return {p: seconds.get(p, 0.0) / total for p in PHASES} if total > 0 else {}


def comm_share(seconds: Mapping[str, float]) -> float | None:
    """comm_wait's share of the phases' seconds (of one rank, or of several pooled); None without any."""
    shares = phase_shares(seconds)
    return shares["comm_wait"] if shares else None


def bound(seconds: Mapping[str, float]) -> str:
    """"input-bound" or "comm-bound" where the share of the data wait or of comm_wait is over the
    rules' bar (RankscopeInputBound, RankscopeCommunicationBound), else ""."""
    shares = phase_shares(seconds)
    if shares.get("data", 0.0) > INPUT_BOUND_RATIO:
        return "input-bound"
    if shares.get("comm_wait", 0.0) > COMM_BOUND_RATIO:
        return "comm-bound"
    return ""


def pooled(per_rank: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Labelled seconds of several ranks added up, label by label."""
    out: dict[str, float] = {}
    for values in per_rank:
        for k, v in values.items():
            out[k] = out.get(k, 0.0) + v
    return out


# ---- goodput ----
def goodput(wall: Mapping[str, float]) -> float | None:
    """Productive seconds over all wall seconds (its categories add up to wall time); None without any."""
    total = sum(wall.values())
    return wall.get("productive", 0.0) / total if total > 0 else None


def goodput_promql(sel: str, window: str) -> str:
    """PromQL of ``goodput`` over ``window``, the run's ranks pooled."""
    return (f'sum(increase(rankscope_wall_seconds_total{{{sel},category="productive"}}[{window}]))'
            f" / sum(increase(rankscope_wall_seconds_total{{{sel}}}[{window}]))")


# ---- rank states ----
def stalled(states: Mapping[K, str | None]) -> list[K]:
    """The ranks alive and not stepping (STALLED_STATES)."""
    return sorted((k for k, s in states.items() if s in STALLED_STATES), key=_order)


def _order(k) -> tuple:
    """Ranks in numeric order, whether they are ints or the label's strings."""
    try:
        return (0, int(k), "")
    except (TypeError, ValueError):
        return (1, 0, str(k))


# ---- step-time histograms ----
def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile on cumulative bucket counts {le: count}: linear within the bucket."""
    if not buckets:
        return None
    edges = sorted(buckets)
    total = buckets[edges[-1]]
    if not total or total <= 0 or not math.isinf(edges[-1]):
        return None
    target = q * total
    lower_edge, lower_count = 0.0, 0.0
    for le in edges:
        count = buckets[le]
        if count >= target:
            if math.isinf(le):
                return lower_edge   # in the open bucket: its lower bound, as Prometheus does
            if count == lower_count:
                return le
            return lower_edge + (le - lower_edge) * (target - lower_count) / (count - lower_count)
        lower_edge, lower_count = le, count
    return lower_edge
