"""Generate rankscope's Grafana dashboards from one Python source.

    python deploy/generate.py           # regenerate every generated file, these included
    python deploy/generate.py --check   # exit 1 if any is stale (python grafana/generate.py: the same)

Writes ``grafana/dashboards/<uid>.json`` with the official Grafana Foundation
SDK pinned to its Grafana 11.6 build (``grafana-foundation-sdk==1769699379!11.6.0``,
schemaVersion 41). The committed JSON is what Grafana's file provider loads;
``outputs()`` is what deploy/generate.py collects, and its ``--check`` (a fast
test) fails when the JSON drifts from this file.

Conventions (checked by the tests): every panel has a unit and a description,
every query targets the ``${datasource}`` variable and selects with
``run``/``node``/``rank`` variables, every ``rate``/``increase`` window is
``$__rate_interval``, and only catalog metrics (rankscope.contract.catalog,
rankscope.exporter.catalog), recording rules (prometheus/rules/) and Prometheus's own
``ALERTS`` series are used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from urllib.parse import quote

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models.dashboard import (
    Dashboard,
    DashboardCursorSync,
    DashboardLinkType,
    DataSourceRef,
    DataTransformerConfig,
    Threshold,
    ThresholdsMode,
    ValueMap,
    ValueMappingResult,
    VariableOption,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from prometheus.rules_spec import gpu_rank_map
from prometheus.generate import load_thresholds
from rankscope.contract.states import RANK_STATES
from rankscope.contract.thresholds import STRAGGLER_PHASES, STRAGGLER_RATIO

# What the panels' prose says of the rules, from the rules' own settings (thresholds.yaml).
_PARAMS = load_thresholds()["params"]
WINDOW = f"{_PARAMS['rate_window']} window"
COMPUTE = " + ".join(STRAGGLER_PHASES)   # forward + backward + optimizer

DASHBOARDS_DIR = Path(__file__).resolve().parent / "dashboards"

# Must match grafana/provisioning/datasources/rankscope.yaml.
PROMETHEUS_UID = "rankscope-prometheus"
TEMPO_UID = "rankscope-tempo"
TAG = "rankscope"
# Alert annotations and dashboards point at the same runbook.
RUNBOOK_URL = "https://github.com/rankscope/rankscope/blob/main/docs/runbook.md"

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")

# Every per-rank query is scoped by these; run is single-valued (one job at a
# time), node and rank are multi-valued with ".+" for All.
SEL = 'run="$run", node=~"$node", rank=~"$rank"'
RUN_SEL = 'run="$run"'
RATE = "$__rate_interval"


# --------------------------------------------------------------------------
# Reusable PromQL fragments

def mean_step_seconds(selector: str = SEL) -> str:
    """Mean step duration per rank over the rate window (exact, from _sum/_count)."""
    return (f"sum by (node, rank) (rate(rankscope_step_duration_seconds_sum{{{selector}}}[{RATE}]))"
            f" / sum by (node, rank) (rate(rankscope_step_duration_seconds_count{{{selector}}}[{RATE}]))")


def step_quantile(q: float) -> str:
    """Step-time quantile across all selected ranks."""
    return (f"histogram_quantile({q}, sum by (le) "
            f"(rate(rankscope_step_duration_seconds_bucket{{{SEL}}}[{RATE}])))")


def collective_quantile(q: float) -> str:
    return (f"histogram_quantile({q}, sum by (node, rank, op, le) "
            f"(rate(rankscope_collective_duration_seconds_bucket{{{SEL}}}[{RATE}])))")


def phase_rate(by: str, phase_matcher: str = "") -> str:
    extra = f", {phase_matcher}" if phase_matcher else ""
    return f"sum by ({by}) (rate(rankscope_phase_seconds_total{{{SEL}{extra}}}[{RATE}]))"


# GPU device metrics carry node/gpu/uuid; ranks carry their GPU's UUID in
# rankscope_rank_info{gpu_uuid}: the join is the rules' own (rules_spec.gpu_rank_map).
RANK_OF_GPU = gpu_rank_map(None, selector=f'{{{SEL}, gpu_uuid!=""}}').replace("\n", " ")


def per_rank_gpu(expr: str) -> str:
    """Attach the rank that uses each GPU to a per-GPU expression keeping node and uuid."""
    return f"({expr}) * on (node, uuid) group_left (rank) {RANK_OF_GPU}"


def gpu_metric(name: str, extra_labels: str = "") -> str:
    labels = "node, uuid, gpu" + (f", {extra_labels}" if extra_labels else "")
    return per_rank_gpu(f'max by ({labels}) ({name}{{node=~"$node"}})')


# --------------------------------------------------------------------------
# Panel helpers: each sets datasource, unit and description in one place.

def query(expr: str, legend: str = "", instant: bool = False,
          fmt: PromQueryFormat | None = None) -> prometheus.Dataquery:
    """A Prometheus query on the ${datasource} variable (refIds are assigned by the panel helpers)."""
    q = prometheus.Dataquery().expr(expr).datasource(DATASOURCE)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    else:
        q = q.range()
    if fmt is not None:
        q = q.format(fmt)
    return q


def _targets(panel, targets):
    """Add the queries with refIds A, B, C... in order."""
    for i, t in enumerate(targets):
        panel = panel.with_target(t.ref_id(chr(ord("A") + i)))
    return panel


def ts(title: str, description: str, unit: str, targets: list, *, w: int = 12, h: int = 8,
       stack: bool = False, bars: bool = False, soft_min: float | None = 0, no_value: str | None = None):
    """A time series panel; ``no_value`` is the text shown where the queries return nothing."""
    p = (timeseries.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(w).height(h).line_width(1).fill_opacity(10)
         .legend(common_builders.VizLegendOptions().show_legend(True)
                 .display_mode(common.LegendDisplayMode.TABLE).placement(common.LegendPlacement.RIGHT)
                 .calcs(["lastNotNull", "max"])))
    if soft_min is not None:
        p = p.axis_soft_min(soft_min)
    if stack:
        p = p.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(60)
    if bars:
        p = p.draw_style(common.GraphDrawStyle.BARS).fill_opacity(80)
    if no_value is not None:
        p = p.no_value(no_value)
    return _targets(p, targets)


def single_stat(title: str, description: str, unit: str, targets: list, *, w: int = 4, h: int = 4,
                thresholds: list[tuple[float | None, str]] | None = None):
    p = (stat.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(w).height(h).graph_mode(common.BigValueGraphMode.AREA)
         .color_mode(common.BigValueColorMode.BACKGROUND)
         .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))
    p = p.thresholds(_thresholds(thresholds or [(None, "green")]))
    return _targets(p, targets)


def _thresholds(steps: list[tuple[float | None, str]]):
    return (dash.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=v, color=c) for v, c in steps]))


def table_panel(title: str, description: str, unit: str, targets: list, *, w: int = 12, h: int = 8,
                hide: tuple[str, ...] = ("Time",)):
    p = (table.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(w).height(h)
         .with_transformation(DataTransformerConfig(
             id_val="organize", options={"excludeByName": {name: True for name in hide}})))
    return _targets(p, targets)


def state_timeline(title: str, description: str, unit: str, targets: list, mappings: list, *,
                   w: int = 24, h: int = 8):
    p = (statetimeline.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(w).height(h).mappings(mappings).show_value(common.VisibilityMode.NEVER)
         .merge_values(True).fill_opacity(80))
    return _targets(p, targets)


def heatmap_panel(title: str, description: str, unit: str, targets: list, *, y_unit: str,
                  w: int = 12, h: int = 8):
    """Pre-bucketed heatmap: each series is a row (a rank, or a histogram bucket); colour is the value.

    ``unit`` is the unit of the cells (the colour), ``y_unit`` that of the rows.
    """
    p = (heatmap.Panel().title(title).description(description).unit(unit).datasource(DATASOURCE)
         .span(w).height(h).calculate(False)
         .color(heatmap.HeatmapColorOptions().mode(heatmap_models.HeatmapColorMode.SCHEME)
                .scheme("Oranges").scale(heatmap_models.HeatmapColorScale.EXPONENTIAL).exponent(0.5))
         .y_axis(heatmap.YAxisConfig().unit(y_unit))
         .cell_values(heatmap.CellValues().unit(unit)))
    return _targets(p, targets)


def value_mappings(codes: dict[int, tuple[str, str]]) -> list:
    return [ValueMap(options={str(code): ValueMappingResult(text=text, color=color, index=code)
                              for code, (text, color) in codes.items()})]


# --------------------------------------------------------------------------
# Variables, links, dashboard skeleton

def variables() -> list:
    # Values come from rankscope_rank_up: the exporter emits it for every rank
    # it knows, from registration (before the first step) until the run's
    # files are removed, dead ranks included.
    def label_var(name: str, label: str, query_text: str, multi: bool) -> dash.QueryVariable:
        v = (dash.QueryVariable(name).label(label).datasource(DATASOURCE)
             .query({"query": query_text, "refId": f"{name}-variable", "qryType": 1})
             .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED).sort(VariableSort.NATURAL_ASC))
        if multi:
            v = v.multi(True).include_all(True).all_value(".+")
        return v

    return [
        dash.DatasourceVariable("datasource").label("Data source").type("prometheus").regex("")
        .current(VariableOption(selected=True, text="Prometheus", value=PROMETHEUS_UID)),
        label_var("run", "Run", "label_values(rankscope_rank_up, run)", multi=False),
        label_var("node", "Node", 'label_values(rankscope_rank_up{run="$run"}, node)', multi=True),
        label_var("rank", "Rank", 'label_values(rankscope_rank_up{run="$run", node=~"$node"}, rank)',
                  multi=True),
    ]


def traces_url() -> str:
    """Grafana Explore on the Tempo datasource with the spans of the selected run."""
    pane = {"datasource": TEMPO_UID,
            "queries": [{"refId": "A", "datasource": {"type": "tempo", "uid": TEMPO_UID},
                         "queryType": "traceql", "query": '{resource.rankscope.run="$run"}'}],
            "range": {"from": "$__from", "to": "$__to"}}
    # Keep $ and braces readable: Grafana interpolates variables in link URLs.
    return "/explore?schemaVersion=1&panes=" + quote(json.dumps({"traces": pane}, separators=(",", ":")),
                                                      safe="$_")


def links() -> list:
    return [
        dash.DashboardLink("rankscope dashboards").type(DashboardLinkType.DASHBOARDS).tags([TAG])
        .as_dropdown(False).include_vars(True).keep_time(True),
        dash.DashboardLink("Runbook").type(DashboardLinkType.LINK).url(RUNBOOK_URL).icon("doc")
        .target_blank(True).tooltip("What each alert means and what to do"),
        dash.DashboardLink("Traces of this run").type(DashboardLinkType.LINK).url(traces_url()).icon("bolt")
        .tooltip("Tempo: the OpenTelemetry spans of the selected run (one trace per sampled step)"),
    ]


def new_dashboard(uid: str, title: str, description: str) -> dash.Dashboard:
    d = (dash.Dashboard(title).uid(uid).description(description).tags([TAG])
         .time("now-30m", "now").refresh("30s").timezone("browser").readonly()
         .tooltip(DashboardCursorSync.CROSSHAIR).variables(variables()).links(links()))
    return d


# --------------------------------------------------------------------------
# The four dashboards

STATE_CODES = {i: s for i, s in enumerate(RANK_STATES)}
STATE_COLORS = {
    "starting": "blue", "progressing": "green", "busy": "dark-green", "stuck_in_collective": "orange", "stuck": "orange",
    "frozen": "purple", "dead": "red", "finished": "text",
}
# One number per rank: the index of its one-hot state, so a state timeline
# shows a single coloured band per rank.
RANK_STATE_CODE = "sum by (node, rank) (" + " or ".join(
    f'rankscope_rank_state{{{SEL}, state="{s}"}} * {i}' for i, s in STATE_CODES.items()) + ")"


def run_overview() -> dash.Dashboard:
    d = new_dashboard(
        "rankscope-run-overview", "rankscope / Run overview",
        "Open this first: is the run progressing, is the loss healthy, which ranks are down, what is firing.")
    d = d.with_row(dash.Row("Status"))
    d = d.with_panel(single_stat(
        "Ranks up", "Rank processes alive (exporter view).", "none",
        [query(f"sum(rankscope_rank_up{{{SEL}}})")], thresholds=[(None, "green")]))
    d = d.with_panel(single_stat(
        "Ranks down", "Rank processes that are gone without finishing. Anything above 0 pages.", "none",
        [query(f"sum(1 - rankscope_rank_up{{{SEL}}})")], thresholds=[(None, "green"), (1, "red")]))
    d = d.with_panel(single_stat(
        "Global step", "Highest step completed by any selected rank.", "none",
        [query(f"max(rankscope_step{{{SEL}}})")]))
    d = d.with_panel(single_stat(
        "Slowest rank stalled", "Longest time since any selected rank completed a step.", "s",
        [query(f"max(rankscope_step_stalled_seconds{{{SEL}}})")],
        thresholds=[(None, "green"), (60, "orange"), (300, "red")]))
    d = d.with_panel(single_stat(
        "Firing alerts", "Alerts firing for this run (Prometheus ALERTS series).", "none",
        [query(f'count(ALERTS{{alertstate="firing", run=~"$run|"}}) or vector(0)')],
        thresholds=[(None, "green"), (1, "red")]))
    d = d.with_panel(single_stat(
        "Divergence events", "Non-finite losses/gradients, loss spikes and grad-norm spikes so far in this run.",
        "none",
        [query(f"sum(rankscope_nonfinite_total{{{SEL}}}) + sum(rankscope_loss_spikes_total{{{SEL}}})"
               f" + sum(rankscope_grad_norm_spikes_total{{{SEL}}})")],
        thresholds=[(None, "green"), (1, "red")]))

    d = d.with_row(dash.Row("Training"))
    d = d.with_panel(ts(
        "Loss and its EMA", "Last known loss per rank and its exponential moving average.", "none",
        [query(f"rankscope_loss{{{SEL}}}", "loss rank {{rank}}"),
         query(f"rankscope_loss_ema{{{SEL}}}", "EMA rank {{rank}}")], soft_min=None))
    d = d.with_panel(ts(
        "Learning rate", "Learning rate of the last step, per rank.", "none",
        [query(f"rankscope_learning_rate{{{SEL}}}", "rank {{rank}}")]))
    d = d.with_panel(ts(
        "Throughput: samples per second", "Training samples per second, summed over the selected ranks.",
        "suffix: samples/s",
        [query(f"sum(rate(rankscope_samples_total{{{SEL}}}[{RATE}]))", "samples/s")]))
    d = d.with_panel(ts(
        "Throughput: tokens per second", "Training tokens per second, summed over the selected ranks.",
        "suffix: tokens/s",
        [query(f"sum(rate(rankscope_tokens_total{{{SEL}}}[{RATE}]))", "tokens/s")]))
    d = d.with_panel(ts(
        "Step time p50 / p99 across ranks", "Step-duration quantiles over all selected ranks (histogram).", "s",
        [query(step_quantile(0.5), "p50"), query(step_quantile(0.99), "p99")]))
    d = d.with_panel(ts(
        "Divergence events", "Per rank: non-finite loss or gradient (by what), loss spikes, grad-norm spikes.",
        "none",
        [query(f"sum by (rank, what) (increase(rankscope_nonfinite_total{{{SEL}}}[{RATE}])) > 0",
               "non-finite {{what}} rank {{rank}}"),
         query(f"sum by (rank) (increase(rankscope_loss_spikes_total{{{SEL}}}[{RATE}])) > 0",
               "loss spike rank {{rank}}"),
         query(f"sum by (rank) (increase(rankscope_grad_norm_spikes_total{{{SEL}}}[{RATE}])) > 0",
               "grad-norm spike rank {{rank}}")], bars=True))
    d = d.with_panel(ts(
        "Replicas in agreement",
        "Per process group of replicas (DDP's group; the replicate dimension of HSDP; a tensor-parallel group's "
        "replicated parameters): the share of its ranks holding the group's most common fingerprint of the "
        "replicated weights and reduced gradients, at the worse of its last two checks that every rank made "
        "(every RANKSCOPE_REPLICA_CHECK_EVERY steps). 100% while the replicas hold the same bits; a rank below it "
        "pages RankscopeReplicaDiverged. Empty for a job with nothing replicated (FSDP over one dimension).",
        "percentunit",
        [query(f"group:rankscope_replica_ranks:agreement_ratio{{{RUN_SEL}}}", "{{replicas}} group {{group}}")],
        no_value="No replicas compared: nothing replicated in the watched model, or the check is off"))

    # Goodput and MFU (docs/goodput.md): where the ranks' wall time goes, and how
    # much of the device's peak the model's FLOPs reach.
    d = d.with_row(dash.Row("Goodput and efficiency"))
    d = d.with_panel(ts(
        "Goodput",
        "Productive seconds per wall second (step time that trained), per rank, and the run's average over its "
        "ranks as the RankscopeGoodputLow alert sees it (5m window; it warns below 50% for 30m). A hung or idle "
        "rank reads 0. Productive + the badput categories (next panel) = wall time.",
        "percentunit",
        [query(f"run:rankscope_goodput:ratio{{{RUN_SEL}}}", "run (5m, alert basis)"),
         query(f'sum by (node, rank) (rate(rankscope_wall_seconds_total{{{SEL}, category="productive"}}[{RATE}]))',
               "rank {{rank}} ({{node}})")]))
    d = d.with_panel(ts(
        "Where the wall time goes",
        "Share of wall time per category, averaged over the selected ranks: productive (goodput), startup, "
        "data_wait, checkpoint_save, checkpoint_restore, evaluation, lost_progress (steps repeated after a "
        "relaunch), idle (gaps between steps, failed steps). The stack adds up to 100%, less the time of steps "
        "still under way: a step is attributed when it ends, so in a hang the stack shrinks towards 0.",
        "percentunit",
        [query(f"avg by (category) (rate(rankscope_wall_seconds_total{{{SEL}}}[{RATE}]))", "{{category}}")],
        stack=True))
    d = d.with_panel(ts(
        "Data wait tail",
        "The wait for each batch from the data loader: p99 per rank, and the longest wait of all selected ranks "
        "(the upper bound of the highest histogram bucket that holds one; a wait above 30 s reads 30 s). "
        "Multi-second loader stalls show here even when the mean data share is small.",
        "s",
        [query(f"histogram_quantile(0.99, sum by (node, rank, le) "
               f"(rate(rankscope_data_wait_seconds_bucket{{{SEL}}}[{RATE}])))", "p99 rank {{rank}} ({{node}})"),
         query(f"histogram_quantile(1, sum by (le) (rate(rankscope_data_wait_seconds_bucket{{{SEL}}}[{RATE}])))",
               "max, all ranks")]))
    d = d.with_panel(ts(
        "MFU (model FLOPs utilisation)",
        "Model FLOP/s over the device's dense peak FLOP/s for the configured dtype, per rank, and the run's "
        f"average ({WINDOW}). Needs a FLOPs figure (RANKSCOPE_FLOPS_PER_TOKEN, RANKSCOPE_FLOPS_PER_SAMPLE or "
        "RANKSCOPE_MODEL_PARAMS) and a GPU whose peak is known (or RANKSCOPE_PEAK_FLOPS): empty on CPU.",
        "percentunit",
        [query(f"sum by (node, rank) (rate(rankscope_model_flops_total{{{SEL}}}[{RATE}]))\n"
               f"/ sum by (node, rank) (rankscope_device_peak_flops{{{SEL}}} > 0)", "rank {{rank}} ({{node}})"),
         query(f"run:rankscope_mfu:ratio{{{RUN_SEL}}}", "run average (2m)")],
        no_value="No MFU: it needs a GPU with a known peak FLOP/s and a FLOPs figure (never on CPU; docs/goodput.md)"))

    d = d.with_row(dash.Row("Ranks and alerts"))
    d = d.with_panel(table_panel(
        "Active alerts", "Pending and firing alerts for this run: which alert, rank and node.", "none",
        [query(f'max by (alertname, alertstate, severity, node, rank) (ALERTS{{run=~"$run|"}})',
               instant=True, fmt=PromQueryFormat.TABLE)], hide=("Time", "Value")))
    d = d.with_panel(table_panel(
        "Ranks down", "Ranks whose process is gone (1 = down).", "none",
        [query(f"1 - rankscope_rank_up{{{SEL}}} > 0", instant=True, fmt=PromQueryFormat.TABLE)],
        hide=("Time", "__name__", "job", "instance", "Value")))
    return d


def ranks_and_stragglers() -> dash.Dashboard:
    d = new_dashboard(
        "rankscope-ranks", "rankscope / Ranks and stragglers",
        "Which rank is slow, stuck or dead: per-rank step time, phases, states and the hang suspect.")
    d = d.with_row(dash.Row("Step time per rank"))
    d = d.with_panel(ts(
        "Step time per rank", "Mean step duration per rank over the rate window.", "s",
        [query(mean_step_seconds(), "rank {{rank}} ({{node}})")]))
    d = d.with_panel(heatmap_panel(
        "Step time per rank (heatmap)", "One row per rank; colour is the mean step time. A straggler is a hot row.",
        "s", [query(f"max by (rank) ({mean_step_seconds()})", "{{rank}}")], y_unit="none"))
    # Synchronous training evens out step time across ranks; compute time per
    # step (forward + backward + optimizer) is what tells the straggler apart,
    # and the RankscopeStraggler alert compares it with the median of the rank's
    # peers (the run without its slowest rank): the same recording rule here.
    d = d.with_panel(ts(
        "Slowest ranks against their peers",
        f"Compute time per step ({COMPUTE}) of the 5 slowest selected ranks, divided by "
        f"the median of their peers (100% = the peers' median; the straggler alert fires above {STRAGGLER_RATIO:.0%}). "
        f"{WINDOW}.",
        "percentunit",
        [query(f"topk(5, rank:rankscope_phase_seconds:compute_per_step_peer_ratio{{{SEL}}})",
               "rank {{rank}} ({{node}})")]))
    d = d.with_panel(ts(
        "Compute time per step per rank",
        f"{COMPUTE.capitalize()} seconds per step, per rank, and the run median. {WINDOW}.", "s",
        [query(f"rank:rankscope_phase_seconds:compute_per_step{{{SEL}}}", "rank {{rank}} ({{node}})"),
         query(f"run:rankscope_phase_seconds:compute_per_step_median{{{RUN_SEL}}}", "run median")]))
    d = d.with_panel(heatmap_panel(
        "Step time distribution", "Steps per step-duration bucket (y axis) over time, all selected ranks.", "short",
        [query(f"sum by (le) (increase(rankscope_step_duration_seconds_bucket{{{SEL}}}[{RATE}]))",
               "{{le}}", fmt=PromQueryFormat.HEATMAP)], y_unit="s"))

    # Ranks of different pipeline stages do different work by design: the stage rules
    # (RankscopeStageImbalance, RankscopeLoadImbalance) and the straggler compare within a
    # stage; these panels read the same records. Empty for a job without stages (first two).
    d = d.with_row(dash.Row("Pipeline stages and load balance"))
    d = d.with_panel(ts(
        "Compute time per step per stage",
        f"Each pipeline stage's compute per step ({COMPUTE}): the median of its ranks "
        "without its slowest, so one straggler does not move it. Empty for a job without pipeline stages "
        f"(rankscope_rank_layout_info). {WINDOW}.", "s",
        [query(f"stage:rankscope_phase_seconds:compute_per_step{{{RUN_SEL}}}", "stage {{stage}}")]))
    d = d.with_panel(ts(
        "Stages against each other",
        "Each stage's compute per step over the median of the other stages (100% = balanced; "
        f"RankscopeStageImbalance warns above {_PARAMS['stage_imbalance_ratio']:.0%}: move layers out of that "
        f"stage). {WINDOW}.", "percentunit",
        [query(f"stage:rankscope_phase_seconds:compute_per_step_ratio{{{RUN_SEL}}}", "stage {{stage}}")]))
    d = d.with_panel(ts(
        "Slowest rank of the step over the median (load imbalance)",
        "The slowest rank's last step over its stage's median, each evaluation: the share of each step lost to "
        "the rank that is slowest at that moment (RankscopeLoadImbalance warns when its 10m median is above "
        "130% while no rank is persistently slower: uneven work, not a faulty rank).", "percentunit",
        [query(f"stage:rankscope_step_last_compute_seconds:max_over_median{{{RUN_SEL}}}", "stage {{stage}}")]))
    d = d.with_panel(table_panel(
        "Parallel layout", "Each rank's pipeline stage, tensor-parallel group and mesh coordinates "
        "(rankscope_rank_layout_info): learnt from watch() or stated with RANKSCOPE_LAYOUT; empty labels where "
        "the job has none.", "none",
        [query(f"rank:rankscope_rank_layout_info:current{{{SEL}}}", instant=True, fmt=PromQueryFormat.TABLE)],
        hide=("Time", "__name__", "job", "instance", "Value")))

    d = d.with_row(dash.Row("Where the step time goes"))
    d = d.with_panel(ts(
        "Phase breakdown per rank",
        "Share of wall time per phase (data, forward, backward, optimizer, comm_wait, other), per rank; "
        f"the input-bound and communication-bound alerts read the same series. {WINDOW}.",
        "percentunit",
        [query(f"rank_phase:rankscope_phase_seconds:fraction{{{SEL}}}", "rank {{rank}} {{phase}}")],
        w=24, h=9, stack=True))

    d = d.with_row(dash.Row("Liveness and hangs"))
    d = d.with_panel(state_timeline(
        "Rank states", "progressing / busy (its own checkpoint or evaluation) / stuck (in a collective or not) / frozen / dead / finished, per rank.",
        "none", [query(RANK_STATE_CODE, "rank {{rank}} ({{node}})")],
        value_mappings({i: (s, STATE_COLORS[s]) for i, s in STATE_CODES.items()})))
    d = d.with_panel(table_panel(
        "Hang suspect (likely culprit)",
        "Ranks outside any collective while their peers wait in one: the rank to look at first in a hang.",
        "none",
        [query(f"rankscope_hang_suspect{{{SEL}}} == 1", instant=True, fmt=PromQueryFormat.TABLE)],
        hide=("Time", "__name__", "job", "instance", "Value")))
    d = d.with_panel(ts(
        "Time since last step", "Seconds since each rank completed a step; rises on a hang or a stall.", "s",
        [query(f"rankscope_step_stalled_seconds{{{SEL}}}", "rank {{rank}}")]))
    d = d.with_panel(ts(
        "Heartbeat age", "Seconds since each rank's heartbeat thread last beat; rises when a rank is frozen.", "s",
        [query(f"rankscope_heartbeat_age_seconds{{{SEL}}}", "rank {{rank}}")], w=24))
    return d


def communication() -> dash.Dashboard:
    d = new_dashboard(
        "rankscope-communication", "rankscope / Communication",
        "Collectives per rank and op: latency, bandwidth, exposed communication and what is in flight now.")
    d = d.with_row(dash.Row("Latency"))
    d = d.with_panel(ts(
        "Collective latency p50 per rank and op", "Median collective duration (launch to completion).", "s",
        [query(collective_quantile(0.5), "{{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Collective latency p99 per rank and op", "99th percentile collective duration.", "s",
        [query(collective_quantile(0.99), "{{op}} rank {{rank}}")]))
    d = d.with_row(dash.Row("Bandwidth and exposure"))
    d = d.with_panel(ts(
        "Collective bandwidth per rank and op",
        "Bytes handed to collectives per second of time spent in them (algorithmic bandwidth).", "Bps",
        [query(f"sum by (rank, op) (rate(rankscope_collective_bytes_total{{{SEL}}}[{RATE}]))"
               f" / sum by (rank, op) (rate(rankscope_collective_duration_seconds_sum{{{SEL}}}[{RATE}]))",
               "{{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Bus bandwidth per rank and op",
        "Bus bandwidth as nccl-tests defines it (algorithm bandwidth times 2(n-1)/n for all_reduce, (n-1)/n for "
        "all_gather and reduce_scatter): the figure to hold against the fabric's own (all_reduce_perf). The run's "
        "median is what RankscopeFabricSlow compares with its level of the hour before.", "Bps",
        [query(f"sum by (rank, op) (rate(rankscope_collective_bus_bytes_total{{{SEL}}}[{RATE}]))"
               f" / sum by (rank, op) (rate(rankscope_collective_duration_seconds_sum{{{SEL}}}[{RATE}]))",
               "{{op}} rank {{rank}}"),
         query(f'run_op:rankscope_collective_bus_bandwidth_bytes:median{{{RUN_SEL}}}', "{{op}} run median (alert basis)")]))
    d = d.with_panel(ts(
        "Collective bytes per second", "Bytes handed to collectives per second of wall time.", "Bps",
        [query(f"sum by (rank, op) (rate(rankscope_collective_bytes_total{{{SEL}}}[{RATE}]))",
               "{{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Exposed communication fraction",
        "Share of wall time a rank waits on communication not hidden behind compute (phase comm_wait), per rank "
        "over the rate window, and per rank over 2m as the communication-bound alert sees it. "
        "A straggler's peers show it rising.", "percentunit",
        [query(phase_rate("node, rank", 'phase="comm_wait"') + " / " + phase_rate("node, rank"),
               "rank {{rank}}"),
         query(f'rank_phase:rankscope_phase_seconds:fraction{{{SEL}, phase="comm_wait"}}',
               "rank {{rank}} (2m, alert basis)")]))
    d = d.with_panel(ts(
        "Collectives per second", "Completed collectives per second, per rank and op.", "ops",
        [query(f"sum by (rank, op) (rate(rankscope_collective_duration_seconds_count{{{SEL}}}[{RATE}]))",
               "{{op}} rank {{rank}}")]))
    d = d.with_row(dash.Row("The fabric, on the run's nodes"))
    run_nodes = f"on (node) group_left () max by (node) (rankscope_rank_up{{{SEL}}})"   # the nodes of its ranks
    d = d.with_panel(ts(
        "Link throughput against its speed",
        "Bytes each network device of the run's nodes sends per second, and its nominal speed (sysfs; absent "
        "where the driver has none). A link near its speed, or one slower than the same device on the other "
        "nodes (a NIC trained low), is named by RankscopeFabricSlow.", "Bps",
        [query(f'sum by (node, device) (rate(rankscope_node_network_bytes_total{{direction="tx"}}[{RATE}])) * {run_nodes}',
               "{{node}} {{device}} sent"),
         query(f"max by (node, device) (rankscope_node_network_speed_bytes) * {run_nodes}", "{{node}} {{device}} speed")]))
    d = d.with_panel(ts(
        "Queues held back and credit waits",
        "What a slow link that drops nothing leaves on its node: its root queue held back over its limit (a shaper "
        "or policer: overlimits per second), and an InfiniBand port waiting for flow-control credit "
        "(port_xmit_wait ticks per second). Retransmits are on the network panels of a lossy link.", "ops",
        [query(f"sum by (node, device) (rate(rankscope_node_network_qdisc_overlimits_total[{RATE}])) * {run_nodes}",
               "{{node}} {{device}} queue overlimits"),
         query(f"sum by (node, device, port) (rate(rankscope_node_infiniband_xmit_wait_total[{RATE}])) * {run_nodes}",
               "{{node}} {{device}}/{{port}} credit wait")]))
    d = d.with_row(dash.Row("In flight"))
    d = d.with_panel(ts(
        "Collectives in flight", "1 while a rank is inside a collective of this op (as its node exporter "
        "judges: not where the rank's stacks showed it in its own code).", "none",
        [query(f"sum by (rank, op) (rankscope_collective_in_flight_seconds{{{SEL}}} > bool 0)",
               "{{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Collective in flight for", "How long the collective now in flight has been running, per rank and op. "
        "In a hang, every rank but the culprit shows a rising line.", "s",
        [query(f"max by (rank, op) (rankscope_collective_in_flight_seconds{{{SEL}}})", "{{op}} rank {{rank}}")]))
    d = d.with_row(dash.Row("Process groups (every collective, from torch's flight recorder)"))
    d = d.with_panel(ts(
        "Collectives per second per process group",
        "Every collective of every process group (DDP, FSDP, tensor parallel, pipeline, user sub-groups), per rank, "
        "group and op, as torch's flight recorder records them. group: default, a device-mesh dimension "
        "(dp_shard, tp, ...) or pg<name>. On gloo an FSDP reduce-scatter runs, and counts, as an all_reduce.", "ops",
        [query(f"sum by (rank, group, op) (rate(rankscope_process_group_collectives_total{{{SEL}}}[{RATE}]))",
               "{{group}} {{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Bytes per second per process group",
        "Message bytes per second per rank, group and op (all_gather: the gathered output; others: the input).",
        "Bps",
        [query(f"sum by (rank, group, op) (rate(rankscope_process_group_collective_bytes_total{{{SEL}}}[{RATE}]))",
               "{{group}} {{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Bus bandwidth per process group",
        "Per rank, group and op, where the backend times the collectives (NCCL with collective timing on; gloo "
        "gives no durations): bus bytes over the time spent in them.", "Bps",
        [query(f"sum by (rank, group, op) (rate(rankscope_process_group_collective_bus_bytes_total{{{SEL}}}[{RATE}]))"
               f" / sum by (rank, group, op) (rate(rankscope_process_group_collective_duration_seconds_sum{{{SEL}}}"
               f"[{RATE}]))", "{{group}} {{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Collectives behind the group's front",
        "Per rank and process group: the group's highest last-enqueued sequence number (over all its ranks, on "
        "every node) minus this rank's. 0 while healthy (a few at most, momentarily); in a hang the culprit "
        "stays behind while its peers wait (RankscopeCollectiveBehind).", "none",
        [query(f"group:rankscope_process_group_last_enqueued_seq:max{{{RUN_SEL}}}\n"
               f"- on (run, group, group_id) group_right ()\n"
               f"rankscope_process_group_last_enqueued_seq{{{SEL}}}", "{{group}} ({{group_id}}) rank {{rank}}")]))
    d = d.with_panel(ts(
        "Waiting in a collective, per process group",
        "How long each rank has waited in the oldest collective still in flight on each group, per op "
        "(from the collective's enqueue time).", "s",
        [query(f"max by (rank, group, op) (rank_group_op:rankscope_process_group_in_flight:seconds{{{SEL}}})",
               "{{group}} {{op}} rank {{rank}}")]))
    d = d.with_panel(ts(
        "Collective duration p50 per process group",
        "Median device duration per group and op, where the backend measures it: NCCL with collective timing "
        "on. gloo records none.", "s",
        [query(f"histogram_quantile(0.5, sum by (group, op, le) "
               f"(rate(rankscope_process_group_collective_duration_seconds_bucket{{{SEL}}}[{RATE}])))",
               "{{group}} {{op}}")], w=24))
    return d


def memory_and_devices() -> dash.Dashboard:
    d = new_dashboard(
        "rankscope-memory-devices", "rankscope / Memory and devices",
        "Allocator memory against device total per rank, OOMs, and each GPU's health joined to its rank.")
    d = d.with_row(dash.Row("Memory per rank"))
    d = d.with_panel(ts(
        "Device memory per rank",
        "CUDA caching allocator: allocated, peak allocated and reserved, against the device total.", "bytes",
        [query(f"rankscope_device_memory_allocated_bytes{{{SEL}}}", "allocated rank {{rank}}"),
         query(f"rankscope_device_memory_peak_allocated_bytes{{{SEL}}}", "peak rank {{rank}}"),
         query(f"rankscope_device_memory_reserved_bytes{{{SEL}}}", "reserved rank {{rank}}"),
         query(f"rankscope_device_memory_total_bytes{{{SEL}}}", "device total rank {{rank}}")]))
    d = d.with_panel(ts(
        "Memory headroom", "Free share of the device (1 - reserved/total) and, for CPU runs, of the host "
        "memory limit (1 - RSS/limit). Near 0 means an OOM is close.", "percentunit",
        [query(f"rank:rankscope_device_memory:headroom_ratio{{{SEL}}}", "device rank {{rank}}"),
         query(f"rank:rankscope_host_memory:headroom_ratio{{{SEL}}}", "host rank {{rank}}")]))
    d = d.with_panel(ts(
        "Host memory per rank", "Resident set size of each rank process against the cgroup or host limit.",
        "bytes",
        [query(f"rankscope_host_memory_rss_bytes{{{SEL}}}", "RSS rank {{rank}}"),
         query(f"max by (node) (rankscope_host_memory_limit_bytes{{{SEL}}})", "limit {{node}}")]))
    d = d.with_panel(ts(
        "Allocation retries", "Allocator retries after a failed cudaMalloc: fragmentation or memory pressure.",
        "none",
        [query(f"sum by (rank) (increase(rankscope_alloc_retries_total{{{SEL}}}[{RATE}]))", "rank {{rank}}")],
        bars=True))
    d = d.with_panel(ts(
        "OOM events", "Out-of-memory errors raised inside a monitored step (the rank usually dies next).", "none",
        [query(f"sum by (node, rank) (increase(rankscope_oom_total{{{SEL}}}[{RATE}])) > 0",
               "OOM rank {{rank}} ({{node}})")], bars=True))
    d = d.with_panel(table_panel(
        "Ranks that hit OOM", "Every rank with at least one OOM in this run.", "none",
        [query(f"max by (node, rank) (rankscope_oom_total{{{SEL}}}) > 0", instant=True,
               fmt=PromQueryFormat.TABLE)], hide=("Time",)))

    d = d.with_row(dash.Row("GPUs (joined to the rank that uses them)"))
    d = d.with_panel(ts(
        "GPU utilisation", "Fraction of time a kernel ran, per GPU, labelled with its rank.", "percentunit",
        [query(gpu_metric("rankscope_gpu_utilization_ratio"), "rank {{rank}} gpu {{gpu}}")]))
    d = d.with_panel(ts(
        "GPU memory used", "Device memory used by all processes against the GPU's total.", "bytes",
        [query(gpu_metric("rankscope_gpu_memory_used_bytes"), "used rank {{rank}} gpu {{gpu}}"),
         query(gpu_metric("rankscope_gpu_memory_total_bytes"), "total rank {{rank}} gpu {{gpu}}")]))
    d = d.with_panel(ts(
        "GPU power", "Power draw against the enforced limit.", "watt",
        [query(gpu_metric("rankscope_gpu_power_watts"), "draw rank {{rank}} gpu {{gpu}}"),
         query(gpu_metric("rankscope_gpu_power_limit_watts"), "limit rank {{rank}} gpu {{gpu}}")]))
    d = d.with_panel(ts(
        "GPU temperature", "GPU core temperature.", "celsius",
        [query(gpu_metric("rankscope_gpu_temperature_celsius"), "rank {{rank}} gpu {{gpu}}")]))
    d = d.with_panel(ts(
        "GPU SM clock", "Streaming-multiprocessor clock; drops with throttling.", "hertz",
        [query(gpu_metric("rankscope_gpu_sm_clock_hertz"), "rank {{rank}} gpu {{gpu}}")]))
    d = d.with_panel(ts(
        "GPU throttling", "Clock-reduction reasons active now, per GPU (1 = active).", "bool_yes_no",
        [query(gpu_metric("rankscope_gpu_throttled", "reason") + " > 0",
               "{{reason}} rank {{rank}} gpu {{gpu}}")], bars=True))
    d = d.with_panel(ts(
        "GPU errors", "ECC errors (by type) and critical XID events per GPU in the rate window.", "none",
        [query(per_rank_gpu(f'sum by (node, uuid, gpu, type) '
                            f'(increase(rankscope_gpu_ecc_errors_total{{node=~"$node"}}[{RATE}]))'),
               "ECC {{type}} rank {{rank}} gpu {{gpu}}"),
         query(per_rank_gpu(f'sum by (node, uuid, gpu) '
                            f'(increase(rankscope_gpu_xid_errors_total{{node=~"$node"}}[{RATE}]))'),
               "XID rank {{rank}} gpu {{gpu}}")], bars=True))
    d = d.with_panel(table_panel(
        "Last XID per GPU", "Code of the last critical XID error per GPU (0 = none seen).", "none",
        [query(gpu_metric("rankscope_gpu_last_xid"), instant=True, fmt=PromQueryFormat.TABLE)],
        hide=("Time",)))
    return d


DASHBOARDS = (run_overview, ranks_and_stragglers, communication, memory_and_devices)


def _number_panels(built) -> None:
    """Stable panel ids in layout order (Grafana would otherwise assign them on load)."""
    for i, panel in enumerate(built.panels or [], start=1):
        panel.id_val = i


def encode(model) -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(model) + "\n"


def load(text: str) -> Dashboard:
    """Parse dashboard JSON into the SDK's models (panel options and queries typed by plugin)."""
    register_default_plugins()
    return Dashboard.from_json(json.loads(text))


def render_all() -> dict[str, str]:
    """File name -> JSON text for every dashboard.

    The text is passed once through the SDK's decoder so that it is exactly
    what the models read back (they fill in plugin defaults the builders leave
    out); tests/unit/test_dashboards.py checks that fixed point.
    """
    out: dict[str, str] = {}
    for make in DASHBOARDS:
        built = make().build()
        _number_panels(built)
        out[f"{built.uid}.json"] = encode(load(encode(built)))
    return out


def outputs() -> dict[Path, str]:
    """The committed dashboards (path -> JSON text)."""
    return {DASHBOARDS_DIR / name: text for name, text in render_all().items()}


def main(argv: list[str] | None = None) -> int:
    """Same as deploy/generate.py (the Kubernetes ConfigMaps embed the dashboards)."""
    import subprocess

    return subprocess.call([sys.executable, str(Path(__file__).resolve().parents[1] / "deploy" / "generate.py"),
                            *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
