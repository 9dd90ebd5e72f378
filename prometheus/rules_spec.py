"""The rankscope recording and alerting rules, written once against named thresholds.

Expressions and annotations use two placeholders that prometheus/generate.py
fills from prometheus/thresholds.yaml:

- ``<<name>>`` is a threshold from ``params`` (``<<name:seconds>>`` converts a
  Prometheus duration such as ``1h`` to seconds);
- ``{SEL}`` / ``{SEL,label="v"}`` is a metric's matcher list with the
  configured ``selector`` (e.g. ``job="rankscope"``) put in front.

Only metric names from rankscope.contract.catalog and rankscope.exporter.catalog (plus Prometheus's
own ``up``) may appear; tests/unit/test_rules.py checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Record:
    record: str
    expr: str
    labels: tuple[tuple[str, str], ...] = ()   # static labels the rule adds (e.g. cause="straggler")


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    severity: str  # critical (pages) | warning (chat) | info
    summary: str
    description: str


# Where the exporter keeps what it captured of the alert's rank when it stopped making progress
# (its stacks, collectives, process and device state, traceback: rankscope.exporter.evidence),
# as a link a person opens from the page; nothing where nothing was captured.
EVIDENCE = ("{{ with printf `rankscope_evidence_captured_timestamp_seconds{SEL,run=\"%s\",rank=\"%s\"}` "
            "$labels.run $labels.rank | query }}{{ range . }} Evidence of this rank (its stacks, collectives, process "
            "and device state): {{ .Labels.scheme }}://{{ .Labels.instance }}{{ .Labels.path }}{{ end }}{{ end }}")
# The same for the other ranks of the run, where the alert's own node is gone.
RUN_EVIDENCE = ("{{ with printf `topk(4, rankscope_evidence_captured_timestamp_seconds{SEL,run=\"%s\"})` "
                "$labels.run | query }} Evidence captured on the surviving nodes:{{ range . }} rank "
                "{{ .Labels.rank }} ({{ .Labels.trigger }}): {{ .Labels.scheme }}://{{ .Labels.instance }}"
                "{{ .Labels.path }}{{ end }}{{ end }}")
# Which rank of the run raised first: the cause; the others are torn down by it.
FIRST_FAILURE = ("{{ with printf `bottomk(1, rankscope_rank_failed_timestamp_seconds{SEL,run=\"%s\"})` "
                 "$labels.run | query }}{{ range . }}{{ if eq .Labels.rank $labels.rank }} It is the run's first "
                 "failure: the cause.{{ else }} It failed after rank {{ .Labels.rank }} on node {{ .Labels.node }} "
                 "raised {{ .Labels.exception }}, the run's first failure: a consequence of it.{{ end }}{{ end }}"
                 "{{ end }}")


def new_events(metric: str, window: str, at_least: str = "1") -> str:
    """Events a counter gained in the window, exactly (no rate() extrapolation).

    The second branch covers a series born less than a window ago already
    above zero (the first event of a new rank): ``offset`` finds nothing then.
    """
    return (f"({metric} - {metric} offset {window}) >= {at_least}\n"
            f"or ({metric} >= {at_least} unless {metric} offset {window})")


# The rank using each GPU (joined on its UUID via rankscope_rank_info), recorded once
# per evaluation in the group of the GPU alerts that join it, before them: they see
# it in the same evaluation. Re-derived inside each alert (label_replace over every
# rank's info series, a join with the rank filter and a topk per UUID), it was the
# costliest part of three alerts at 1,024 nodes (docs/scaling.md).
GPU_RANK_LIVE = "uuid:rankscope_rank_info:live"                # a live rank (rankscope_rank_up 1)
GPU_RANK_PROGRESSING = "uuid:rankscope_rank_info:progressing"  # a rank that trains (state progressing)
# What the GPU alerts report, recorded once in the same group before them: each alert
# reads its expression twice (joined to the rank map, and alone for a GPU no rank
# uses), and the raw expressions read every GPU's counters or throttle reasons.
GPU_ERRORS_NEW = "uuid_error:rankscope_gpu_errors:new"                  # new XID / uncorrected ECC errors
GPU_THROTTLED_NOW = "uuid_reason:rankscope_gpu_throttled:active"        # throttled for a paging reason


def gpu_rank_map(rank_filter: str | None, selector: str = "{SEL}") -> str:
    """The join from a GPU to its rank, defined once for the rules and the dashboards
    (grafana/generate.py): one rank_info series per GPU UUID (label ``uuid``, which the
    exporter's GPU series carry), of a rank that passes ``rank_filter`` (None: any rank).
    One per UUID, so a join never fails where two ranks share a GPU."""
    joined = f"\n  and on (run, rank) ({rank_filter})" if rank_filter is not None else ""
    return ("topk by (uuid) (1,\n"
            f"  label_replace(rankscope_rank_info{selector}, \"uuid\", \"$1\", \"gpu_uuid\", \"(.+)\")"
            f"{joined}\n)")


def with_rank_of_gpu(expr: str, *, required: bool = False, ranks: str = GPU_RANK_LIVE) -> str:
    """Adds run/rank/local_rank of the rank using a GPU, from the recorded map ``ranks``.

    A GPU no such rank uses keeps its alert unless ``required`` (``or on (uuid)``).
    """
    joined = f"({expr})\n* on (uuid) group_left (run, rank, local_rank)\n{ranks}"
    return joined if required else f"{joined}\nor on (uuid) ({expr})"


def _indent(text: str, by: str = "  ") -> str:
    return text.replace("\n", "\n" + by)


def hysteresis(alert: str, judge: Callable[[str], str], fire: str, hold: str, on: str = "run, rank") -> str:
    """A threshold with hysteresis: ``judge(fire)`` starts the alert; once it is pending or
    firing (its own ``ALERTS`` series exists), ``judge(hold)``, a bar on the safe side of
    ``fire``, keeps it. A value wavering around ``fire`` then goes pending once, fires once
    ``for:`` later and stays firing, instead of resetting ``for:`` (or resolving) at every
    dip below the bar: that is how the straggler alert flapped and never paged.
    ``keep_firing_for`` (thresholds.yaml) adds the same in time, for gaps in the data.
    """
    return (f"(\n  {_indent(judge(fire))}\n)\n"
            f"or (\n  {_indent(judge(hold))}\n  and on ({on}) ALERTS{{alertname=\"{alert}\"}}\n)")


# Where (run, rank, node) go in every per-rank description.
WHO = "run {{ $labels.run }}, rank {{ $labels.rank }} on node {{ $labels.node }}"
# For GPU alerts, whose rank labels are joined in when a live rank uses the GPU.
GPU_WHO = ("GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on node {{ $labels.node }}"
           "{{ if $labels.rank }}, used by run {{ $labels.run }}, rank {{ $labels.rank }}"
           "{{ else }}, used by no live rank{{ end }}")


def stalled_past(bar: str, steps: str) -> str:
    """No step for ``bar`` seconds, nor for ``steps`` times the rank's last step's duration where
    it is known: a job whose steps take minutes is not stalled between two of them (long steps
    are not hangs)."""
    return (f"rankscope_step_stalled_seconds{{SEL}} > {bar}\n"
            f"unless on (run, rank) (rankscope_step_stalled_seconds{{SEL}}"
            f" <= on (run, rank) group_left () ({steps} * rankscope_step_last_duration_seconds{{SEL}}))")


# ---- conditions, each written once: the alert that pages on it and the run's
# ---- "cause present" record that keeps its victims quiet use the same text ----

# The process of a rank is gone and its monitor was not closed after the loop.
RANK_DOWN = ("rankscope_rank_up{SEL} == 0\n"
             "unless on (run, rank) (rankscope_rank_state{SEL,state=\"finished\"} == 1)")

# A rank in a checkpoint or evaluation block it declared (monitor.checkpoint(),
# monitor.evaluation()), for less than block_stall_seconds: busy with its own work,
# not hung, and its peers may wait for it in a collective meanwhile (rank 0 saves, the
# others wait in a barrier). Its run is judged by no hang, behind or stall rule
# meanwhile; a block older than the bar is a pause like any other (HangSuspect names
# the rank, or RunStalled pages). Recorded first in the hang group, which reads it.
BLOCK_RECORD = "run:rankscope_ranks:in_block"
BLOCK = ("count by (run) (\n"
         "  (timestamp(rankscope_block_started_timestamp_seconds{SEL}) - rankscope_block_started_timestamp_seconds{SEL})"
         " < <<block_stall_seconds>>\n"
         "  and rankscope_block_started_timestamp_seconds{SEL} > 0\n"
         "  and on (run, rank) (rankscope_rank_up{SEL} == 1)\n"
         ")")
NOT_IN_BLOCK = "unless on (run) " + BLOCK_RECORD
# What RankDown adds for a rank that failed before its first step: the start-up phase it was in.
IN_START_UP = ("{{ with printf `rankscope_startup_phase{SEL,run=\"%s\",rank=\"%s\",phase!=\"training\"} == 1` "
               "$labels.run $labels.rank | query }}{{ range . }} It failed in its start-up, in phase "
               "{{ .Labels.phase }}{{ if eq .Labels.phase \"rendezvous\" }} (inside init_process_group){{ end }}"
               ".{{ end }}{{ end }}")
# What a hang or stall page adds when the rank is in a block past the bar: the block itself hangs.
BLOCK_OVERDUE = ("{{ with printf `rankscope_block_started_timestamp_seconds{SEL,run=\"%s\",rank=\"%s\"} > 0` "
                 "$labels.run $labels.rank | query }}{{ range . }} It has been in its {{ .Labels.block }} block "
                 "(monitor.checkpoint() or evaluation()) for over <<block_stall_seconds>>s: the block itself "
                 "hangs (a stuck write, a collective inside it).{{ end }}{{ end }}")


def before_first_step(longest_wait: str) -> str:
    """A rank that has not completed its first step, unless the run's longest wait is past
    first_step_wait_seconds: a first compile or checkpoint load may take one rank far longer
    than its peers, who wait for it in the first collective meanwhile."""
    return (f"unless on (run, rank) (\n  rankscope_steps_total{{SEL}} == 0\n"
            f"  unless on (run) (max by (run) ({longest_wait}) > <<first_step_wait_seconds>>)\n)")


# A live rank outside any collective while its peers wait in one. The exporter
# marks it when the peers are on its node; the second branch finds the same
# across nodes. A frozen rank is excluded: RankscopeRankFrozen says more (the
# interpreter itself stopped) and pages for it.
HANG_SUSPECT = (
    "rankscope_step_stalled_seconds{SEL}\n"
    "and on (run, rank) (\n"
    "  rankscope_hang_suspect{SEL} == 1\n"
    "  or on (run, rank) (\n"
    "    max by (run, rank) (rankscope_collective_in_flight_seconds{SEL}) == 0\n"
    "    and on (run) (max by (run) (rankscope_collective_in_flight_seconds{SEL}) > <<hang_peer_wait_seconds>>)\n"
    "    and on (run, rank) (\n      "
    + _indent(stalled_past("<<hang_peer_wait_seconds>>", "<<hang_after_steps>>"), "      ") + "\n    )\n"
    "    " + _indent(before_first_step("rankscope_collective_in_flight_seconds{SEL}"), "    ") + "\n"
    "  )\n"
    ")\n"
    "unless on (run, rank) (rankscope_rank_state{SEL,state=\"frozen\"} == 1)\n" + NOT_IN_BLOCK)

RANK_FROZEN = ("rankscope_heartbeat_age_seconds{SEL}\n"
               "and on (run, rank) (rankscope_rank_state{SEL,state=\"frozen\"} == 1)")

# RANK_DOWN and RANK_FROZEN, each recorded once per evaluation in the group of their
# causes (rankscope.recording.liveness), with the lost node's records and cause: the
# cause reads it in the same evaluation, the alert (RankDown, RankFrozen) as of that
# group's last evaluation, together with the node_lost cause RankDown defers to.
RANK_DOWN_RECORD = "rank:rankscope_rank_up:down"
RANK_FROZEN_RECORD = "rank:rankscope_heartbeat_age_seconds:frozen"

# No step for stall_seconds; a rank that has not completed its first step yet
# (loading a checkpoint, compiling) gets startup_stall_seconds; and in both, no
# step for stall_after_steps of the rank's own last step (long steps are not
# stalls). Either way a rank whose step counter still grows is not stalled, whatever its last-step
# clock says (a rank-side bug once froze that clock while steps were counted).
STALLED = (
    "(\n"
    "  (\n"
    "    " + _indent(stalled_past("<<stall_seconds>>", "<<stall_after_steps>>"), "    ") + "\n"
    "    unless on (run, rank) (rankscope_steps_total{SEL} == 0)\n"
    "  )\n"
    "  or (\n    " + _indent(stalled_past("<<startup_stall_seconds>>", "<<stall_after_steps>>"), "    ") + "\n  )\n"
    ")\n"
    "unless on (run, rank) (increase(rankscope_steps_total{SEL}[<<progress_window>>]) > 0)\n" + NOT_IN_BLOCK)

# HANG_SUSPECT and STALLED, each recorded once per evaluation in the group of the
# alert that pages on it, before the alert and the cause that read it (the same
# evaluation's value). CollectiveBehind, in the same group as HangSuspect, reads
# the hang_suspect cause recorded before it: on Prometheus as of its own
# evaluation; on vmalert, which reads a record of its own group one evaluation
# late, as of the same evaluation as the sequence numbers it judges (recorded in
# that group too), so the two never disagree about which hang came first.
HANG_SUSPECT_RECORD = "rank:rankscope_step_stalled_seconds:hang_suspect"
STALLED_RECORD = "rank:rankscope_step_stalled_seconds:stalled"

# Rate-window judgements (straggler, input, communication, throughput) wait
# until the window no longer reaches back before the launch's first step: until
# then it measures start-up (the first batch's loader start, compilation, a
# restart's gap), not training. rank:rankscope_steps:warming_up marks those ranks.
WARM = "\nunless on (run, rank) rank:rankscope_steps:warming_up"

# Where each rank sits in its job's layout (rankscope.layout): its pipeline stage and
# tensor-parallel group, one series per rank (the one it has now, of any it had).
LAYOUT_RECORD = "rank:rankscope_rank_layout_info:current"
# Ranks in a tensor-parallel group: they compute equally long by construction, so a slow GPU
# slows the whole group and no metric picks one rank; the group is paged once.
TP_RANKS = LAYOUT_RECORD + "{tp_group!=\"\"}"


def _straggler_ranks(held_on: str) -> str:
    """Compute per step against the median of the rank's peers in its stage, with a negligible
    absolute floor (only sub-millisecond toy loops are below it), held while an alert with the
    labels ``held_on`` fires; at most half of the stage's ranks (more is the run's pace, not
    ranks), and no rank newly named while its peers' own compute rose (RUN_COMPUTE_ROSE)."""
    return ("(\n  "
            + _indent(hysteresis("RankscopeStraggler",
                                 lambda bar: f"rank:rankscope_phase_seconds:compute_per_step_peer_ratio > {bar}",
                                 "<<straggler_ratio>>", "<<straggler_hold_ratio>>", on=held_on))
            + "\n)\n"
            "and on (run, rank) (\n"
            "  rank:rankscope_phase_seconds:compute_per_step\n"
            "  - on (run, stage) group_left () " + STAGE_PEER_MEDIAN + "\n"
            "  > <<straggler_min_excess_seconds>>\n"
            ")\n"
            "unless on (run, stage) " + SLOW_MAJORITY_RECORD + "\n"
            "unless on (run, rank) (\n"
            "  rank:rankscope_phase_seconds:compute_per_step_peer_ratio * 0\n"
            "  + on (run, stage) group_left () " + RUN_COMPUTE_ROSE_RECORD + "\n"
            "  unless on (" + held_on + ") ALERTS{alertname=\"RankscopeStraggler\"}\n"
            ")" + WARM)


STAGE_PEER_MEDIAN = "stage:rankscope_phase_seconds:compute_per_step_peer_median"
# A straggler is slower than its peers: no more than half of a stage's ranks can be. 1 for a stage
# where more than half compute over straggler_hold_ratio x its fastest quarter's level (the 0.25
# quantile: the fast ranks' level even when most are slow, which the peer median is not): the
# stage's pace, not ranks (a slow fabric booked as compute, a slower model step, the node's load).
SLOW_MAJORITY_RECORD = "stage:rankscope_phase_seconds:compute_per_step_slow_majority"
SLOW_MAJORITY = (
    "count by (run, stage) (\n"
    "  rank:rankscope_phase_seconds:compute_per_step\n"
    "  > on (run, stage) group_left () <<straggler_hold_ratio>>"
    " * quantile by (run, stage) (0.25, rank:rankscope_phase_seconds:compute_per_step >= 0)\n"
    ") * 2\n"
    "> count by (run, stage) (rank:rankscope_phase_seconds:compute_per_step >= 0)")
# 1 for a stage whose peers' median compute per step rose above straggler_peer_rise_ratio x its own
# level over the throughput baseline window: the whole stage got slower (a wait booked as compute,
# the node's or the fabric's contention). A rank crossing the straggler bar then is not named: its
# ratio is the run's change, not its own. A rank already named stays named.
RUN_COMPUTE_ROSE_RECORD = "stage:rankscope_phase_seconds:compute_per_step_peer_median_rose"
RUN_COMPUTE_ROSE = (
    STAGE_PEER_MEDIAN + "\n"
    "> <<straggler_peer_rise_ratio>> * avg_over_time(" + STAGE_PEER_MEDIAN + "[<<throughput_baseline_window>>]"
    " offset <<throughput_baseline_offset>>)")
# A straggler, compared only with the ranks of its own stage (a job without a pipeline is one
# stage): a rank, or a whole tensor-parallel group, once, on its node.
STRAGGLER = (
    "(\n  " + _indent(_straggler_ranks("run, rank")) + "\n)\n"
    "unless on (run, rank) " + TP_RANKS + "\n"
    "or max by (job, instance, node, run, stage, tp_group) (\n"
    "  (\n    " + _indent(_straggler_ranks("run, tp_group"), "    ") + "\n  )\n"
    "  and on (run, rank) " + TP_RANKS + "\n"
    ")")

# A whole pipeline stage computing more per step than the job's other stages: its layers'
# partition, not a rank, is at fault. Its ranks are not stragglers (compared within the stage)
# and the other stages' wait for it is not the network's (a cause: CommunicationBound is quiet).
STAGE_IMBALANCE = "(\n  " + _indent(hysteresis(
    "RankscopeStageImbalance",
    lambda bar: f"stage:rankscope_phase_seconds:compute_per_step_ratio > {bar}",
    "<<stage_imbalance_ratio>>", "<<stage_imbalance_hold_ratio>>", on="run, stage")) + "\n)" \
    "\nunless on (run) rank:rankscope_steps:warming_up"

# Uneven work per step with no persistent culprit: the slowest rank of a stage, scrape by scrape,
# computes well above its stage's median while no rank's mean compute stands out (the slowest
# changes from step to step: sequence lengths, MoE routing; and the stage's ranks are measured: a
# rank whose compute per step is not measured yet may be the culprit). Judged on the median over the
# window, so that it holds in most steps: a few steps slowed by a burst of the node's or the
# network's noise (a descheduled rank, a retransmit inside an estimated comm wait) do not count.
# Not while a straggler is paged.
LOAD_IMBALANCE = "(\n  " + _indent(hysteresis(
    "RankscopeLoadImbalance",
    lambda bar: ("quantile_over_time(0.5, stage:rankscope_step_last_compute_seconds:max_over_median"
                 f"[<<load_imbalance_window>>]) > {bar}"),
    "<<load_imbalance_ratio>>", "<<load_imbalance_hold_ratio>>", on="run, stage")) + "\n)\n" \
    "and on (run, stage) (\n" \
    "  max by (run, stage) (rank:rankscope_phase_seconds:compute_per_step_peer_ratio)" \
    " <= <<load_imbalance_max_rank_ratio>>\n)" \
    "\nunless on (run) rank:rankscope_steps:warming_up"

INPUT_BOUND = "(\n  " + _indent(hysteresis(
    "RankscopeInputBound",
    lambda bar: f"rank_phase:rankscope_phase_seconds:fraction{{phase=\"data\"}} > {bar}",
    "<<input_bound_ratio>>", "<<input_bound_hold_ratio>>")) + "\n)" + WARM

COMM_BOUND = "(\n  " + _indent(hysteresis(
    "RankscopeCommunicationBound",
    lambda bar: f"rank_phase:rankscope_phase_seconds:fraction{{phase=\"comm_wait\"}} > {bar}",
    "<<comm_bound_ratio>>", "<<comm_bound_hold_ratio>>")) + "\n)" + WARM

def _pace_drop(alert: str) -> str:
    """The run's step rate below throughput_drop_ratio x its own level (held while ``alert`` is
    pending or firing). Not for a run whose rate window holds only a few steps (steps of a minute
    or more): its rate moves by a whole step at a time, and a stop shows as a stall or a hang instead."""
    return "(\n  " + _indent(hysteresis(
        alert,
        lambda bar: ("run:rankscope_steps:rate\n"
                     f"< {bar} * avg_over_time(run:rankscope_steps:rate[<<throughput_baseline_window>>]"
                     " offset <<throughput_baseline_offset>>)"),
        "<<throughput_drop_ratio>>", "<<throughput_drop_hold_ratio>>", on="run")) + "\n)" \
        "\nunless on (run) rank:rankscope_steps:warming_up" \
        "\nand on (run) (run:rankscope_steps:rate offset <<throughput_baseline_offset>>" \
        " * <<rate_window:seconds>> >= <<throughput_min_steps_per_window>>)"


THROUGHPUT_DROP = _pace_drop("RankscopeThroughputDrop")

# The causes a run can train under for hours, slower than it could: its pace is theirs, so
# ThroughputDrop is quiet while one stands. A run under one since a baseline offset ago that then
# loses a large part of its remaining pace is news (RankscopeRunSlowedFurther): the cause's own
# alerts keep their labels and Alertmanager does not re-send them.
PACE_CAUSES = "straggler|stage_imbalance|load_imbalance|input_bound|network_degraded|fabric_slow"
RUN_SLOWED_FURTHER = (
    _pace_drop("RankscopeRunSlowedFurther")
    + f"\nand on (run) run:rankscope_cause:present{{cause=~\"{PACE_CAUSES}\"}}"
    + f"\nand on (run) run:rankscope_cause:present{{cause=~\"{PACE_CAUSES}\"}} offset <<throughput_baseline_offset>>")

# Goodput: the share of the run's wall time that trained, averaged over its ranks
# (a hung, idle or frozen rank counts its 0). Judged once the window lies after
# the run's first productive step: before it the run is starting (RunStalled's
# start-up bar watches that), and a window reaching back before the counters
# began reads low (rate() divides by the whole window) and would start the
# hysteresis hold for a run that is above the bar. A relaunch is judged: its
# start-up, restore and lost progress are the restart's real cost.
GOODPUT_LOW = "(\n  " + _indent(hysteresis(
    "RankscopeGoodputLow",
    lambda bar: f"run:rankscope_goodput:ratio < {bar}",
    "<<goodput_min_ratio>>", "<<goodput_hold_ratio>>", on="run")) + "\n)" \
    "\nand on (run) (max by (run) (rankscope_wall_seconds_total{SEL,category=\"productive\"}" \
    " offset <<goodput_window>>) > 0)"

# A lost node: ranks that vanished with their exporter (rank:rankscope_rank_up:lost)
# while the run's other ranks stopped. Torn down by the launcher (every visible
# rank dead) is proof at once; stuck (blocked in a collective with the lost
# ranks) needs the exporter unreachable for node_lost_unreachable_for, so one
# failed scrape during a hang is not a lost node.
NODE_LOST = (
    "(\n"
    "  rank:rankscope_rank_up:lost\n"
    "  and on (run) run:rankscope_ranks:torn_down\n"
    ")\n"
    "or (\n"
    "  rank:rankscope_rank_up:lost\n"
    "  unless on (job, instance) (max_over_time(up{SEL}[<<node_lost_unreachable_for>>]) == 1)\n"
    "  and on (run) run:rankscope_ranks:stopped\n"
    ")")


# The wavefront of a hang, across nodes, from the flight recorder's sequence
# numbers (rankscope.collectives.group_reader): a rank whose last enqueued collective on a
# process group is behind the group's front while a peer of that group has
# waited in a collective for collective_behind_wait_seconds, and which waits in
# no collective itself (a rank blocked elsewhere, by the culprit, is a victim),
# has stepped no more for as long, and is not frozen (RankFrozen says more).
# Computed from the raw series, and recorded in the alert's own group just before it
# (rankscope.alerts.hangs), so that the alert needs no other group's evaluation
# first: it can go pending one scrape and one evaluation after the peers' wait crosses
# the bar.
# The wait as of the scrape (the sample's timestamp), as the exporter computes
# rankscope_collective_in_flight_seconds: measured on one clock, the same hang
# never crosses this bar before HangSuspect's, which then keeps this alert quiet.
IN_FLIGHT_SECONDS = ("((timestamp(rankscope_process_group_in_flight_started_timestamp_seconds{SEL})"
                     " - rankscope_process_group_in_flight_started_timestamp_seconds{SEL})"
                     " and (rankscope_process_group_in_flight_started_timestamp_seconds{SEL} > 0))")
# The waits past the bar, recorded first in the same group: the rule below reads them
# twice, and the timestamp series three times each (at 1,024 x 8 ranks this rule was
# the group's cost, docs/scaling.md). Usually empty: nothing waits that long.
LONG_WAITS_RECORD = "rank_group_op:rankscope_process_group_in_flight:long_wait_seconds"
LONG_WAITS = IN_FLIGHT_SECONDS + " > <<collective_behind_wait_seconds>>"
SEQ_BEHIND = (
    "(\n"
    "  max by (run, group, group_id) (rankscope_process_group_last_enqueued_seq{SEL})\n"
    "  - on (run, group, group_id) group_right ()\n"
    "  rankscope_process_group_last_enqueued_seq{SEL}\n"
    ") > 0\n"
    f"and on (run, group_id) (max by (run, group, group_id) ({LONG_WAITS_RECORD}))\n"
    # A victim: it waits in a group where it is ahead of a peer (blocked by someone else).
    # Only there: gloo's last-completed number can stay one short after a burst of
    # concurrent collectives, so a culprit may look "in flight" in a group where it is
    # level with or behind its peers.
    "unless on (run, rank) (\n"
    "  (\n"
    "    rankscope_process_group_last_enqueued_seq{SEL}\n"
    "    > on (run, group, group_id) group_left ()\n"
    "    min by (run, group, group_id) (rankscope_process_group_last_enqueued_seq{SEL})\n"
    "  )\n"
    f"  and on (run, rank, group_id) {LONG_WAITS_RECORD}\n"
    ")")
# ... and that has stepped no more for as long, and is not frozen: CollectiveBehind's
# whole condition, recorded once (rank_group:rankscope_process_group_seq:behind) for
# the cause and the alert evaluated after it in its group: the same evaluation's value.
COLLECTIVE_BEHIND = (
    SEQ_BEHIND + "\n"
    "and on (run, rank) (\n  " + _indent(stalled_past("<<collective_behind_wait_seconds>>", "<<hang_after_steps>>"))
    + "\n)\n"
    "unless on (run, rank) (rankscope_rank_state{SEL,state=~\"frozen|stuck_in_collective\"} == 1)\n"
    + before_first_step(LONG_WAITS_RECORD) + "\n" + NOT_IN_BLOCK)
SEQ_BEHIND_RECORD = "rank_group:rankscope_process_group_seq:behind"
# A rank that issued every collective its peers did, but whose collectives stopped completing
# (its device stopped running its kernels: an assert in a kernel, an Xid, a hung kernel), more
# than completion_behind_min behind the group's newest completion (gloo's completed number can
# stay one short), while a peer has waited past the bar and it has stepped no more for as long.
# CollectiveBehind compares what was issued and cannot see it. The value: completions behind.
COMPLETION_BEHIND = (
    "(\n"
    "  max by (run, group, group_id) (rankscope_process_group_last_completed_seq{SEL})\n"
    "  - on (run, group, group_id) group_right ()\n"
    "  rankscope_process_group_last_completed_seq{SEL}\n"
    ") > <<completion_behind_min>>\n"
    "unless on (run, rank, group_id) (\n"
    "  rankscope_process_group_last_enqueued_seq{SEL}\n"
    "  < on (run, group, group_id) group_left ()\n"
    "  max by (run, group, group_id) (rankscope_process_group_last_enqueued_seq{SEL})\n"
    ")\n"
    f"and on (run, group_id) (max by (run, group, group_id) ({LONG_WAITS_RECORD}))\n"
    "and on (run, rank) (\n  " + _indent(stalled_past("<<collective_behind_wait_seconds>>", "<<hang_after_steps>>"))
    + "\n)\n"
    "unless on (run, rank) (rankscope_rank_state{SEL,state=\"frozen\"} == 1)\n"
    + before_first_step(LONG_WAITS_RECORD) + "\n" + NOT_IN_BLOCK)
COMPLETION_BEHIND_RECORD = "rank_group:rankscope_process_group_completions:behind"
# (Its exporter says a rank behind is waiting inside a collective itself: it issued it, and
# is blocked like its peers. When a link between nodes goes down, gloo leaves the ranks on
# one side a collective or two behind the other side's, all of them waiting: no culprit.)

# Every live rank of the run has waited inside a collective past the peers' wait bar, and
# none is outside one: no rank is the culprit. What is left is between them: the network (a
# link, a NIC, a switch port) or the communication library. Read from the waits themselves
# (the exporter's rank states add --stuck-after, 30 s, before they say stuck_in_collective).
# Not while a rank of the run is down or frozen (a cause with its own page), nor where one has
# vanished with its exporter (a lost node, an exporter down: the culprit may be there), nor in
# a one-node run.
NETWORK_STALL = (
    "count by (run) (\n"
    "  max by (run, rank) (rankscope_collective_in_flight_seconds{SEL}) > <<hang_peer_wait_seconds>>\n"
    ") > 1\n"
    "unless on (run) (\n"
    "  rankscope_rank_up{SEL} == 1\n"
    "  unless on (run, rank) (max by (run, rank) (rankscope_collective_in_flight_seconds{SEL})"
    " > <<hang_peer_wait_seconds>>)\n"
    ")\n"
    "unless on (run) (rankscope_rank_up{SEL} == 0 or rankscope_rank_state{SEL,state=\"frozen\"} == 1)\n"
    # A rank whose collectives stopped completing blocks the others inside theirs: not the network.
    "unless on (run) " + COMPLETION_BEHIND_RECORD + "\n"
    "unless on (run) (\n"
    "  max_over_time(rankscope_rank_up{SEL}[<<node_lost_window>>])\n"
    "  unless on (run, rank) rankscope_rank_up{SEL}\n"
    ")\n"
    # Across nodes only: on one node nothing crosses a network (RunStalled pages that stall).
    "and on (run) (count by (run) (count by (run, node) (rankscope_rank_up{SEL})) > 1)\n" + NOT_IN_BLOCK)
NETWORK_STALL_RECORD = "run:rankscope_ranks:blocked_in_collectives"

# A node retransmitting a share of its TCP segments (gloo, NCCL over sockets) while the
# ranks on it of a run across nodes spend most of their step waiting in communication: its
# link or NIC is degraded, and every rank of the run slows with it (their compute is not to
# blame).
RETRANSMIT_RATIO_RECORD = "node:rankscope_tcp_segments:retransmit_ratio"
RETRANSMIT_RATIO = (
    "rate(rankscope_node_tcp_segments_retransmitted_total{SEL}[<<rate_window>>])\n"
    "/ (rate(rankscope_node_tcp_segments_sent_total{SEL}[<<rate_window>>]) > 0)\n"
    "and on (node) (rate(rankscope_node_tcp_segments_retransmitted_total{SEL}[<<rate_window>>])"
    " > <<tcp_retransmit_min_per_second>>)")
NETWORK_DEGRADED = (
    "max by (run, node) (rank_phase:rankscope_phase_seconds:fraction{phase=\"comm_wait\"})"
    " > <<comm_bound_ratio>>\n"
    "and on (node) (" + RETRANSMIT_RATIO_RECORD + " > <<tcp_retransmit_ratio>>)\n"
    # Only a run across nodes: a one-node run's collectives never cross the node's NIC (loopback,
    # shared memory, NVLink), and its peers' wait for a straggler is not the network's.
    "and on (run) (count by (run) (count by (run, node) (rankscope_rank_up{SEL})) > 1)")


# ---- a slow fabric (docs/alerting.md, "A slow fabric") -------------------------------------------
# Bus bandwidth (nccl-tests' definition: message bytes over the collective's duration, times the
# op's factor for its group size; rankscope.collectives.tracker.bus_factor) per rank and op, from
# the collectives rankscope times (DDP's buckets or timers, explicit collectives), and per rank,
# process group and op where the backend measures durations (NCCL with collective timing on).
BUS_BANDWIDTH = "rank_op:rankscope_collective_bus_bandwidth_bytes:rate"
ALGORITHM_BANDWIDTH = "rank_op:rankscope_collective_algorithm_bandwidth_bytes:rate"
GROUP_BUS_BANDWIDTH = "rank_group_op:rankscope_process_group_bus_bandwidth_bytes:rate"
RUN_BUS_BANDWIDTH = "run_op:rankscope_collective_bus_bandwidth_bytes:median"
RUN_GROUP_BUS_BANDWIDTH = "run_group_op:rankscope_process_group_bus_bandwidth_bytes:median"
# The run's level counts only ranks whose bandwidth window lies within their launch: one that reaches
# back before it (the first minutes, a restart) holds start-up's collectives (peers arriving seconds
# apart, the first buckets, the backend's connections), several times slower or faster than the
# fabric carries a step's, and for a whole window. Read by FabricSlow now and in its baseline.
BANDWIDTH_SETTLED = (
    "\nand on (run, rank) (rankscope_steps_total{SEL} offset <<bandwidth_window>> > 0)"
    "\nunless on (run, rank) (resets(rankscope_steps_total{SEL}[<<bandwidth_window>>]) > 0)")
# Node data that show a constrained link (one series per node, device and kind of evidence): a queue
# held back over its shaper's or policer's limit, an InfiniBand port waiting for credit, a link whose
# speed is below the same device's on the fleet's other nodes, a link near its speed.
FABRIC_NODE_EVIDENCE = "node_device:rankscope_node_network_constrained:evidence"
FABRIC_NODE_EVIDENCE_EXPR = (
    "label_replace(rate(rankscope_node_network_qdisc_overlimits_total{SEL}[<<rate_window>>])"
    " > <<fabric_queue_overlimits_per_second>>, \"evidence\", \"its queue is held back over its limit\", \"\", \"\")\n"
    "or label_replace(rate(rankscope_node_infiniband_xmit_wait_total{SEL}[<<rate_window>>])"
    " > <<fabric_xmit_wait_per_second>>, \"evidence\", \"its InfiniBand port waits for flow-control credit\", "
    "\"\", \"\")\n"
    "or label_replace(rankscope_node_network_speed_bytes{SEL}\n"
    "  < on (device) group_left () quantile by (device) (0.5, rankscope_node_network_speed_bytes{SEL}),"
    " \"evidence\", \"its link runs below the speed of the same device on the other nodes\", \"\", \"\")\n"
    "or label_replace(rankscope_node_infiniband_rate_bytes{SEL}\n"
    "  < on (device) group_left () quantile by (device) (0.5, rankscope_node_infiniband_rate_bytes{SEL}),"
    " \"evidence\", \"its InfiniBand port is trained below the rate of the same port on the other nodes\", \"\", \"\")\n"
    "or label_replace(rate(rankscope_node_network_bytes_total{SEL,direction=\"tx\"}[<<rate_window>>])\n"
    "  / ignoring (direction) (rankscope_node_network_speed_bytes{SEL} > 0) > <<fabric_saturated_ratio>>,"
    " \"evidence\", \"its link sends near its speed\", \"\", \"\")")
# The run's collectives slower than its own level, while compute per rank is balanced (no rank over
# the straggler bar) and unchanged (the peers' median did not rise), and no rank is outside a
# collective (a stall cause): the fabric carrying them is slow, not the ranks. A lossy link is
# NetworkDegraded's (its node retransmits: more specific).
FABRIC_SLOW = (
    "(\n  " + _indent(hysteresis(
        "RankscopeFabricSlow",
        lambda bar: (RUN_BUS_BANDWIDTH + f"\n< {bar} * avg_over_time(" + RUN_BUS_BANDWIDTH
                     + "[<<throughput_baseline_window>>] offset <<throughput_baseline_offset>>)\n"
                     "or " + RUN_GROUP_BUS_BANDWIDTH + f"\n< {bar} * avg_over_time(" + RUN_GROUP_BUS_BANDWIDTH
                     + "[<<throughput_baseline_window>>] offset <<throughput_baseline_offset>>)"),
        "<<fabric_slow_ratio>>", "<<fabric_slow_hold_ratio>>", on="run, op")) + "\n)\n"
    "and on (run) (max by (run) (rank:rankscope_phase_seconds:compute_per_step_peer_ratio) <= <<straggler_ratio>>)\n"
    "unless on (run) " + RUN_COMPUTE_ROSE_RECORD + "\n"
    "unless on (run) rank:rankscope_steps:warming_up")


def _bandwidth_before(record: str, group: bool) -> str:
    """The run's bus bandwidth level before (the alert's baseline), as template text."""
    group_matcher = ',group="%s"' if group else ""
    group_arg = " $labels.group" if group else ""
    return ("{{ with printf `avg_over_time(" + record + '{run="%s",op="%s"' + group_matcher
            + "}[<<throughput_baseline_window>>] offset <<throughput_baseline_offset>>)` $labels.run $labels.op"
            + group_arg + " | query }}{{ . | first | value | humanize1024 }}B/s{{ else }}its level{{ end }}")


def cause(name: str, alert: str, condition: str) -> Record:
    """run:rankscope_cause:present{cause=NAME}: 1 while ALERT's condition holds in the run
    or the alert is pending or firing (keep_firing_for included). The victims' alerts of
    the run (CommunicationBound, ThroughputDrop, RunStalled, ...) are not judged then."""
    return Record("run:rankscope_cause:present",
                  f"group by (run) (\n  (\n    {_indent(condition, '    ')}\n  )\n  or ALERTS{{alertname=\"{alert}\"}}\n)",
                  labels=(("cause", name),))


# A rank's compute seconds per step over the rate window.
COMPUTE_PER_STEP = (
    "sum without (phase) (rate(rankscope_phase_seconds_total{SEL,phase=~\"<<straggler_phases>>\"}[<<rate_window>>]))\n"
    "/ rate(rankscope_steps_total{SEL}[<<rate_window>>])")
# The compute of each training rank's last step (> 0), with its stage.
LAST_COMPUTE = (
    "(\n  rankscope_step_last_compute_seconds{SEL} > 0\n"
    "  and on (run, rank) (rankscope_rank_state{SEL,state=\"progressing\"} == 1)\n"
    ")\n* on (run, rank) group_left (stage) " + LAYOUT_RECORD + "\n"
    "or on (run, rank) (\n  rankscope_step_last_compute_seconds{SEL} > 0\n"
    "  and on (run, rank) (rankscope_rank_state{SEL,state=\"progressing\"} == 1)\n)")


# ---- start-up: from launch to the first step (rankscope.publishing.startup_phases) ----
# The live ranks of a run that wait in the rendezvous (inside init_process_group), and for how long.
STARTUP_WAIT_RECORD = "rank:rankscope_startup_rendezvous:wait_seconds"
STARTUP_WAIT = ("(time() - rankscope_startup_phase_since_timestamp_seconds{SEL})\n"
                "and on (run, rank) (rankscope_startup_phase{SEL,phase=\"rendezvous\"} == 1)\n"
                "and on (run, rank) (rankscope_rank_up{SEL} == 1)")
# A live rank still in its own start-up (before init_process_group) while a peer has waited for it
# in the rendezvous past the bar: it holds up the start. The value: how long it has been starting.
# A slow but healthy start-up (every rank busy compiling or loading, none waiting) names no one.
STARTUP_BLOCKED_RECORD = "rank:rankscope_startup_launch:blocking_seconds"
STARTUP_BLOCKED = ("(time() - rankscope_startup_phase_since_timestamp_seconds{SEL})\n"
                   "and on (run, rank) (rankscope_startup_phase{SEL,phase=\"launch\"} == 1)\n"
                   "and on (run, rank) (rankscope_rank_up{SEL} == 1)\n"
                   "and on (run) (max by (run) (" + STARTUP_WAIT_RECORD + ") > <<startup_wait_seconds>>)")
# Ranks the launcher started (its WORLD_SIZE) that no exporter serves, while the ranks that did
# report wait in the rendezvous past the bar: their node's launcher never started, or their node
# cannot be reached. The value: how many are missing.
STARTUP_MISSING_RECORD = "run:rankscope_startup_ranks:missing"
STARTUP_MISSING = ("(\n"
                   "  max by (run) (rankscope_launch_world_size{SEL})\n"
                   "  - count by (run) (rankscope_launch_world_size{SEL})\n"
                   ") > 0\n"
                   "and on (run) (max by (run) (" + STARTUP_WAIT_RECORD + ") > <<startup_wait_seconds>>)")

# Causes whose peers stall: a dead, lost, hung or frozen rank blocks the others, and so does a
# rank that never reaches the rendezvous, or never starts.
STALL_CAUSES = ("rank_down|node_lost|hang_suspect|frozen|collective_behind|completion_behind|network_stall"
                "|startup_blocked|startup_missing")
# Causes that explain a low goodput and page or warn for it themselves: a dead,
# lost, hung or frozen rank, a stall (the ranks' time goes to idle), an
# input-bound rank (its time goes to data_wait). A straggler does not lower
# goodput: its peers' wait is inside their steps.
GOODPUT_CAUSES = STALL_CAUSES + "|stalled|input_bound"


# ---- replicas (rankscope.replicas; docs/alerting.md, "Divergence between replicas") ----------
# Each rank publishes, per replica set, a fingerprint of its replicated weights (and reduced
# gradients) every K steps: one float holding the check's step and the fingerprint, in two
# slots (its last two checks). Two ranks agree on a check exactly when their values are equal.
# The ranks of one process group (``group``: its name, the same on each member) that checked
# the same step are compared: the fingerprint most of them hold is the group's; a rank holding
# another is the minority, named; where the largest camps tie (two replicas, or 2 against 2)
# every rank of a tied camp is named, and the page says the majority cannot tell. Ranks a
# check apart compare at the check they share; a rank alone at its step is compared with
# nobody. Every series the comparison reads comes from one scrape of one rank's file: a
# rank's step and fingerprint cannot be torn apart, so it pages at `for: 0s`. The join of a rank's
# step to its fingerprint matches on every identity label: a rank claimed twice (two nodes; see
# DuplicateRank) must not break the rule for every run (a many-to-many match is an error).
REPLICA_STEP_UNIT = str(1 << 26)   # rankscope.contract.replicas.STEP_UNIT: value = step x 2^26 + fingerprint
REPLICA_TOTALS = "rankscope_replica_fingerprint{SEL,part=\"all\"}"
REPLICA_CHECKS_RECORD = "rank_check:rankscope_replica_fingerprint:labelled"
REPLICA_CHECKS = ("count_values without () (\"fingerprint\", " + REPLICA_TOTALS + ")\n"
                  "* on (job, instance, run, rank, node, replicas, group, of, slot) group_left (check_step)\n"
                  "count_values without () (\"check_step\", floor(" + REPLICA_TOTALS + " / " + REPLICA_STEP_UNIT
                  + "))")
REPLICA_CHECK = "run, replicas, group, of, check_step"   # one check of one group
REPLICA_GROUP_SIZE = ("on (run, replicas, group) group_left () "
                      "max by (run, replicas, group) (rankscope_replica_group_size{SEL})")
REPLICA_AGREEING = "group_check:rankscope_replica_ranks:agreeing"            # ranks per fingerprint
REPLICA_CHECKED = "group_check:rankscope_replica_ranks:checked"              # ranks that checked the step
REPLICA_LARGEST = "group_check:rankscope_replica_ranks:largest_agreement"    # the largest camp
REPLICA_OWN_CAMP = (REPLICA_CHECKS_RECORD + "\n* on (" + REPLICA_CHECK + ", fingerprint) group_left () "
                    + REPLICA_AGREEING)
# Judged only on what no later publish can overturn: a minority once a strict majority of the
# group's ranks holds another fingerprint; a tie once every rank of the group has checked (ranks
# publish a check up to a publish interval apart: half a group seen early must not name anyone).
REPLICA_MINORITY = (REPLICA_OWN_CAMP + "\n< on (" + REPLICA_CHECK + ") group_left () (\n  " + REPLICA_LARGEST
                    + "\n  and on (" + REPLICA_CHECK + ") " + REPLICA_LARGEST + " * 2 > " + REPLICA_GROUP_SIZE + "\n)")
REPLICA_TIE = ("(\n  " + _indent(REPLICA_OWN_CAMP) + "\n  == on (" + REPLICA_CHECK + ") group_left () "
               + REPLICA_LARGEST + "\n)\nand on (" + REPLICA_CHECK + ") (\n"
               "  count by (" + REPLICA_CHECK + ") (\n"
               "    " + REPLICA_AGREEING + " == on (" + REPLICA_CHECK + ") group_left () " + REPLICA_LARGEST + "\n"
               "  ) > 1\n)\nand on (" + REPLICA_CHECK + ") " + REPLICA_CHECKED + " == " + REPLICA_GROUP_SIZE)
REPLICA_STEP = "floor(" + REPLICA_TOTALS + " / " + REPLICA_STEP_UNIT + ")"
REPLICA_DIFFERS_RECORD = "rank_check:rankscope_replica_fingerprint:differs_at_step"
REPLICA_DIFFERS = ("label_replace(\n  " + REPLICA_STEP + "\n  and on (run, rank, replicas, group, of, slot) (\n    "
                   + _indent(REPLICA_MINORITY, "    ") + "\n  ),\n  \"verdict\", \"minority\", \"\", \"\"\n)\n"
                   "or label_replace(\n  " + REPLICA_STEP + "\n  and on (run, rank, replicas, group, of, slot) (\n    "
                   + _indent(REPLICA_TIE, "    ") + "\n  ),\n  \"verdict\", \"tie\", \"\", \"\"\n)")
REPLICA_AGREEMENT_RECORD = "group:rankscope_replica_ranks:agreement_ratio"
# The first part of the rank's weights (consecutive parameters, named by the first) whose
# fingerprint at the alert's step no other rank of its group shares.
REPLICA_FIRST_PART = (
    "{{ with printf `count_values without () (\"v\", rankscope_replica_fingerprint{SEL,run=\"%s\",rank=\"%s\","
    "group=\"%s\",of=\"weights\",part!=\"all\"} and on (slot) (floor(rankscope_replica_fingerprint{SEL,"
    "run=\"%s\",rank=\"%s\",group=\"%s\",of=\"weights\",part=\"all\"} / " + REPLICA_STEP_UNIT + ") == %.0f)) "
    "unless on (part, v) count_values without () (\"v\", rankscope_replica_fingerprint{SEL,run=\"%s\","
    "rank!=\"%s\",group=\"%s\",of=\"weights\",part!=\"all\"})` $labels.run $labels.rank $labels.group "
    "$labels.run $labels.rank $labels.group $value $labels.run $labels.rank $labels.group | query "
    "| sortByLabel \"part\" }}{{ range $i, $p := . }}{{ if eq $i 0 }} The first of its weights that differ: "
    "the part that begins at parameter {{ $p.Labels.param }} (part {{ $p.Labels.part }} of the model's "
    "parameters in order).{{ end }}{{ end }}{{ end }}")
REPLICA_VERDICT = (
    "{{ with printf `" + REPLICA_DIFFERS_RECORD + "{run=\"%s\",rank=\"%s\",group=\"%s\",verdict=\"tie\"}` "
    "$labels.run $labels.rank $labels.group | query }} Its group's replicas split into camps of equal size "
    "(with two replicas, any difference does): the majority cannot tell which is right, and every rank of a "
    "tied camp is named{{ with printf `max by (rank) (" + REPLICA_DIFFERS_RECORD + "{run=\"%s\",rank!=\"%s\","
    "group=\"%s\",verdict=\"tie\"})` $labels.run $labels.rank $labels.group | query }} (also:{{ range . }} rank "
    "{{ .Labels.rank }}{{ end }}){{ end }}.{{ else }}{{ with printf `" + REPLICA_LARGEST + "{run=\"%s\",group=\"%s\","
    "of=\"weights\",check_step=\"%.0f\"}` $labels.run $labels.group $value | query }}{{ range . }} "
    "{{ .Value }}{{ end }}{{ end }}{{ with printf `" + REPLICA_CHECKED + "{run=\"%s\",group=\"%s\",of=\"weights\","
    "check_step=\"%.0f\"}` $labels.run $labels.group $value | query }}{{ range . }} of the {{ .Value }} ranks of "
    "its group that checked this step{{ end }}{{ end }} agree with each other: this rank is the odd one out."
    "{{ end }}")
REPLICA_SINCE = (
    "{{ with printf `min(min_over_time(" + REPLICA_DIFFERS_RECORD + "{run=\"%s\",rank=\"%s\",group=\"%s\"}"
    "[<<replica_history>>]))` $labels.run $labels.rank $labels.group | query }}{{ range . }} Its first "
    "check that differed (within <<replica_history>>): step {{ .Value | printf \"%.0f\" }}.{{ end }}{{ end }}")
REPLICA_GRADS = (
    "{{ with printf `" + REPLICA_DIFFERS_RECORD + "{run=\"%s\",rank=\"%s\",group=\"%s\",of=\"grads\"}` "
    "$labels.run $labels.rank $labels.group | query }} Its reduced gradients differ too: it skipped or left "
    "the gradient all-reduce (no_sync(), require_backward_grad_sync), or changed its gradients after it "
    "(a rank-local clip or scaler).{{ else }} Its reduced gradients agree with its replicas' (or are not "
    "checked): the weights changed apart in or after the optimizer step (a silently corrupting GPU, an "
    "optimizer state of its own, a resume from another checkpoint).{{ end }}")


RECORDING_RULES: tuple[Record, ...] = (
    # Step time per rank: exact mean over the window from the histogram.
    Record("rank:rankscope_step_duration_seconds:mean",
           "rate(rankscope_step_duration_seconds_sum{SEL}[<<rate_window>>])\n"
           "/ rate(rankscope_step_duration_seconds_count{SEL}[<<rate_window>>])"),
    Record("run:rankscope_step_duration_seconds:median",
           "quantile by (run) (0.5, rank:rankscope_step_duration_seconds:mean)"),
    # (slowest - fastest) / median: 0 for a balanced run.
    Record("run:rankscope_step_duration_seconds:spread_ratio",
           "(max by (run) (rank:rankscope_step_duration_seconds:mean)"
           " - min by (run) (rank:rankscope_step_duration_seconds:mean))\n"
           "/ run:rankscope_step_duration_seconds:median"),
    Record("run:rankscope_step_duration_seconds:p90",
           "histogram_quantile(0.9, sum by (run, le) (rate(rankscope_step_duration_seconds_bucket{SEL}[<<rate_window>>])))"),
    # Fraction of a rank's step time in each phase (data, forward, ..., comm_wait, other).
    Record("rank_phase:rankscope_phase_seconds:fraction",
           "rate(rankscope_phase_seconds_total{SEL}[<<rate_window>>])\n"
           "/ ignoring (phase) group_left ()\n"
           "sum without (phase) (rate(rankscope_phase_seconds_total{SEL}[<<rate_window>>]))"),
    Record("run_phase:rankscope_phase_seconds:fraction_avg",
           "avg by (run, phase) (rank_phase:rankscope_phase_seconds:fraction)"),
    # The rank's layout (stage, tensor-parallel group): the one it has now, one per rank.
    Record(LAYOUT_RECORD, "topk by (run, rank) (1, rankscope_rank_layout_info{SEL} == 1)"),
    # Compute seconds per step (the straggler signal: its peers' time goes to comm_wait instead),
    # with the rank's stage and tensor-parallel group where it has them.
    Record("rank:rankscope_phase_seconds:compute_per_step",
           _indent(COMPUTE_PER_STEP) + "\n* on (run, rank) group_left (stage, tp_group) " + LAYOUT_RECORD + "\n"
           "or on (run, rank)\n" + _indent(COMPUTE_PER_STEP)),
    Record("run:rankscope_phase_seconds:compute_per_step_median",
           "quantile by (run) (0.5, rank:rankscope_phase_seconds:compute_per_step)"),
    # The straggler's baseline: the median of its stage WITHOUT the stage's slowest rank,
    # i.e. the slowest rank's peers (a job without pipeline stages is one stage). The median
    # of all ranks includes the straggler: in a 2-rank run it is the mean of the two, and a
    # 1.5x rank reads only 1.2x it. No peers (1 rank): no baseline. Ranks without steps in
    # the window (NaN) are left out.
    Record(STAGE_PEER_MEDIAN,
           "quantile by (run, stage) (0.5,\n"
           "  rank:rankscope_phase_seconds:compute_per_step >= 0\n"
           "  unless on (run, rank) topk by (run, stage) (1, rank:rankscope_phase_seconds:compute_per_step >= 0)\n"
           ")"),
    Record("rank:rankscope_phase_seconds:compute_per_step_peer_ratio",
           "rank:rankscope_phase_seconds:compute_per_step\n"
           "/ on (run, stage) group_left () " + STAGE_PEER_MEDIAN),
    Record(RUN_COMPUTE_ROSE_RECORD, RUN_COMPUTE_ROSE + " > bool 0"),
    Record(SLOW_MAJORITY_RECORD, "(\n  " + _indent(SLOW_MAJORITY) + "\n) > bool 0"),
    # A pipeline stage's compute per step: its peer median (a straggler in it does not move
    # it), or its only rank's. Against the median of the other stages (the job without its
    # slowest stage): a stage's ratio. Only for jobs with stages.
    Record("stage:rankscope_phase_seconds:compute_per_step",
           STAGE_PEER_MEDIAN + "{stage!=\"\"}\n"
           "or on (run, stage) quantile by (run, stage) (0.5,\n"
           "  rank:rankscope_phase_seconds:compute_per_step{stage!=\"\"} >= 0\n"
           ")"),
    Record("stage:rankscope_phase_seconds:compute_per_step_ratio",
           "stage:rankscope_phase_seconds:compute_per_step\n"
           "/ on (run) group_left () quantile by (run) (0.5,\n"
           "  stage:rankscope_phase_seconds:compute_per_step\n"
           "  unless on (run, stage) topk by (run) (1, stage:rankscope_phase_seconds:compute_per_step)\n"
           ")"),
    # The load imbalance's measure, each evaluation: the slowest rank's last step over its
    # stage's median (ranks that train, a stage of two ranks or more). Averaged over a window
    # it is the share of each step the stage loses to its slowest rank of the moment.
    Record("stage:rankscope_step_last_compute_seconds:max_over_median",
           "max by (run, stage) (" + LAST_COMPUTE + ")\n"
           "/ quantile by (run, stage) (0.5, " + LAST_COMPUTE + ")\n"
           "and on (run, stage) (count by (run, stage) (" + LAST_COMPUTE + ") > 1)"),
    # 1 for a rank whose rate window still reaches back before its first step of
    # this launch: it has not stepped yet, or had not a window ago (absent or 0),
    # or its counter restarted within the window (a new launch of the run).
    Record("rank:rankscope_steps:warming_up",
           "rankscope_steps_total{SEL} * 0 + 1\n"
           "unless on (run, rank) (\n"
           "  rankscope_steps_total{SEL} offset <<rate_window>> > 0\n"
           "  unless on (run, rank) (resets(rankscope_steps_total{SEL}[<<rate_window>>]) > 0)\n"
           ")"),
    # Throughput per run.
    Record("run:rankscope_steps:rate", "avg by (run) (rate(rankscope_steps_total{SEL}[<<rate_window>>]))"),
    Record("run:rankscope_samples:rate", "sum by (run) (rate(rankscope_samples_total{SEL}[<<rate_window>>]))"),
    Record("run:rankscope_tokens:rate", "sum by (run) (rate(rankscope_tokens_total{SEL}[<<rate_window>>]))"),
    # ---- goodput and MFU (docs/goodput.md) ----------------------------------------
    # Productive seconds per wall second of each rank over goodput_window. A rank
    # that hangs or idles (its wall time goes to idle) or is frozen (its counter
    # stops) counts its 0. Finished ranks are left out: their clocks stop by design.
    Record("rank:rankscope_goodput:ratio",
           "sum without (category) (rate(rankscope_wall_seconds_total{SEL,category=\"productive\"}[<<goodput_window>>]))\n"
           "unless on (run, rank) (rankscope_rank_state{SEL,state=\"finished\"} == 1)"),
    Record("run:rankscope_goodput:ratio", "avg by (run) (rank:rankscope_goodput:ratio)"),
    # Every category's share of wall time (productive: goodput; the others: badput
    # by cause), averaged over the run's ranks; they add up to 1 per run.
    Record("run_category:rankscope_wall_seconds:ratio",
           "avg by (run, category) (\n"
           "  rate(rankscope_wall_seconds_total{SEL}[<<goodput_window>>])\n"
           "  unless on (run, rank) (rankscope_rank_state{SEL,state=\"finished\"} == 1)\n"
           ")"),
    # Model FLOPs utilisation: model FLOP/s over the device's dense peak, per rank;
    # only where both exist (a FLOPs figure is configured, the GPU's peak is known).
    Record("rank:rankscope_mfu:ratio",
           "rate(rankscope_model_flops_total{SEL}[<<rate_window>>])\n"
           "/ (rankscope_device_peak_flops{SEL} > 0)\n"
           "unless on (run, rank) (rankscope_rank_state{SEL,state=\"finished\"} == 1)"),
    Record("run:rankscope_mfu:ratio", "avg by (run) (rank:rankscope_mfu:ratio)"),
    # Mean collective latency per rank and op.
    Record("rank_op:rankscope_collective_duration_seconds:mean",
           "rate(rankscope_collective_duration_seconds_sum{SEL}[<<rate_window>>])\n"
           "/ rate(rankscope_collective_duration_seconds_count{SEL}[<<rate_window>>])"),
    # Memory headroom: 1 - used / limit (only where the limit is known).
    Record("rank:rankscope_device_memory:headroom_ratio",
           "1 - rankscope_device_memory_reserved_bytes{SEL} / (rankscope_device_memory_total_bytes{SEL} > 0)"),
    Record("rank:rankscope_host_memory:headroom_ratio",
           "1 - rankscope_host_memory_rss_bytes{SEL} / (rankscope_host_memory_limit_bytes{SEL} > 0)"),
    # ---- a lost node ------------------------------------------------------------
    # Ranks alive within the window whose series are gone now, behind an exporter
    # that does not answer (down, or dropped from service discovery): what a lost
    # node looks like from Prometheus. An exporter that is merely down looks the
    # same; the run's other ranks tell them apart (the next two records).
    Record("rank:rankscope_rank_up:lost",
           "max_over_time(rankscope_rank_up{SEL}[<<node_lost_window>>]) == 1\n"
           "unless on (run, rank) rankscope_rank_up{SEL}\n"
           "unless on (run, rank) (last_over_time(rankscope_rank_state{SEL,state=\"finished\"}[<<node_lost_window>>]) == 1)\n"
           "unless on (job, instance) (up{SEL} == 1)"),
    # Every rank of the run still visible is dead: the launcher tore the run down.
    # rankscope_rank_state is one-hot, so "no rank in another state" is "every rank's
    # dead series is 1": one state series per rank read, not all seven.
    Record("run:rankscope_ranks:torn_down",
           "count by (run) (rankscope_rank_state{SEL,state=\"dead\"} == 1)\n"
           "and on (run) (min by (run) (rankscope_rank_state{SEL,state=\"dead\"}) == 1)"),
    # No visible rank of the run starts or progresses; some are stuck, frozen or dead.
    Record("run:rankscope_ranks:stopped",
           "count by (run) (rankscope_rank_state{SEL,state=~\"stuck_in_collective|stuck|frozen|dead\"} == 1)\n"
           "unless on (run) (rankscope_rank_state{SEL,state=~\"starting|progressing\"} == 1)"),
    # ---- every process group: sequence numbers and the wavefront of a hang ----
    # How long each rank has waited in the oldest collective of an op on a group.
    Record("rank_group_op:rankscope_process_group_in_flight:seconds",
           "time() - (rankscope_process_group_in_flight_started_timestamp_seconds{SEL} > 0)"),
    # The front of each process group (the same group_id on every member rank,
    # whichever node it is on): its highest last-enqueued sequence number, and
    # its longest wait.
    Record("group:rankscope_process_group_last_enqueued_seq:max",
           "max by (run, group, group_id) (rankscope_process_group_last_enqueued_seq{SEL})"),
    Record("group:rankscope_process_group_in_flight:max_seconds",
           "max by (run, group, group_id) (rank_group_op:rankscope_process_group_in_flight:seconds)"),
    # The waits in a process group past collective_behind_wait_seconds, as of the scrape.
    Record(LONG_WAITS_RECORD, LONG_WAITS),
    # Collectives a rank is behind its group's front while a peer of the group
    # has waited past the bar and the rank itself waits in nothing that long, has
    # not stepped for as long and is not frozen.
    Record(SEQ_BEHIND_RECORD, COLLECTIVE_BEHIND),
    # ---- hang suspects and stalled ranks (read by their alerts and causes) -----
    Record(BLOCK_RECORD, BLOCK),
    Record(HANG_SUSPECT_RECORD, HANG_SUSPECT),
    Record(STALLED_RECORD, STALLED),
    # ---- causes present in a run (1 per cause): their victims are not blamed ---
    Record(RANK_DOWN_RECORD, RANK_DOWN),
    Record(RANK_FROZEN_RECORD, RANK_FROZEN),
    cause("rank_down", "RankscopeRankDown", RANK_DOWN_RECORD),
    cause("node_lost", "RankscopeNodeLost", NODE_LOST),
    cause("hang_suspect", "RankscopeHangSuspect", HANG_SUSPECT_RECORD),
    cause("frozen", "RankscopeRankFrozen", RANK_FROZEN_RECORD),
    cause("collective_behind", "RankscopeCollectiveBehind", SEQ_BEHIND_RECORD),
    cause("stalled", "RankscopeRunStalled", STALLED_RECORD),
    cause("straggler", "RankscopeStraggler", STRAGGLER),
    cause("stage_imbalance", "RankscopeStageImbalance", STAGE_IMBALANCE),
    cause("load_imbalance", "RankscopeLoadImbalance", LOAD_IMBALANCE),
    cause("input_bound", "RankscopeInputBound", INPUT_BOUND),
    Record(COMPLETION_BEHIND_RECORD, COMPLETION_BEHIND),
    cause("completion_behind", "RankscopeCompletionsBehind", COMPLETION_BEHIND_RECORD),
    Record(NETWORK_STALL_RECORD, NETWORK_STALL),
    cause("network_stall", "RankscopeNetworkStall", NETWORK_STALL_RECORD),
    Record(STARTUP_WAIT_RECORD, STARTUP_WAIT),
    Record(STARTUP_BLOCKED_RECORD, STARTUP_BLOCKED),
    cause("startup_blocked", "RankscopeStartupBlocked", STARTUP_BLOCKED_RECORD),
    Record(STARTUP_MISSING_RECORD, STARTUP_MISSING),
    cause("startup_missing", "RankscopeStartupRanksMissing", STARTUP_MISSING_RECORD),
    Record(RETRANSMIT_RATIO_RECORD, RETRANSMIT_RATIO),
    cause("network_degraded", "RankscopeNetworkDegraded", NETWORK_DEGRADED),
    Record(ALGORITHM_BANDWIDTH,
           "rate(rankscope_collective_bytes_total{SEL}[<<bandwidth_window>>])\n"
           "/ (rate(rankscope_collective_duration_seconds_sum{SEL}[<<bandwidth_window>>]) > 0)"),
    Record(BUS_BANDWIDTH,
           "rate(rankscope_collective_bus_bytes_total{SEL}[<<bandwidth_window>>])\n"
           "/ (rate(rankscope_collective_duration_seconds_sum{SEL}[<<bandwidth_window>>]) > 0)"),
    Record(RUN_BUS_BANDWIDTH, "quantile by (run, op) (0.5,\n  " + BUS_BANDWIDTH + _indent(BANDWIDTH_SETTLED) + "\n)"),
    Record(GROUP_BUS_BANDWIDTH,
           "sum without (group_id) (rate(rankscope_process_group_collective_bus_bytes_total{SEL}[<<bandwidth_window>>]))\n"
           "/ (rate(rankscope_process_group_collective_duration_seconds_sum{SEL}[<<bandwidth_window>>]) > 0)"),
    Record(RUN_GROUP_BUS_BANDWIDTH,
           "quantile by (run, group, op) (0.5,\n  " + GROUP_BUS_BANDWIDTH + _indent(BANDWIDTH_SETTLED) + "\n)"),
    Record(FABRIC_NODE_EVIDENCE, FABRIC_NODE_EVIDENCE_EXPR),
    cause("fabric_slow", "RankscopeFabricSlow",
          FABRIC_SLOW + "\nunless on (run) run:rankscope_cause:present{cause=\"network_degraded\"}"),
    # ---- the rank using each GPU (read by the GPU alerts of the same group) ----
    Record(GPU_RANK_LIVE, gpu_rank_map("rankscope_rank_up{SEL} == 1")),
    Record(GPU_RANK_PROGRESSING, gpu_rank_map("rankscope_rank_state{SEL,state=\"progressing\"} == 1")),
    # ---- what the GPU alerts report (read by them, in the same group) ----
    Record(GPU_ERRORS_NEW,
           "label_replace(" + new_events("rankscope_gpu_xid_errors_total{SEL}", "<<gpu_error_window>>")
           + ", \"error\", \"xid\", \"\", \"\")\nor label_replace("
           + new_events("rankscope_gpu_ecc_errors_total{SEL,type=\"uncorrected\"}", "<<gpu_error_window>>")
           + ", \"error\", \"ecc_uncorrected\", \"\", \"\")"),
    Record(GPU_THROTTLED_NOW, "rankscope_gpu_throttled{SEL,reason=~\"<<gpu_throttle_reasons>>\"} == 1"),
    # ---- replicas: each check of each group, its camps, and the ranks outside the largest ----
    Record(REPLICA_CHECKS_RECORD, REPLICA_CHECKS),
    Record(REPLICA_AGREEING, "count by (" + REPLICA_CHECK + ", fingerprint) (" + REPLICA_CHECKS_RECORD + ")"),
    Record(REPLICA_CHECKED, "count by (" + REPLICA_CHECK + ") (" + REPLICA_CHECKS_RECORD + ")"),
    Record(REPLICA_LARGEST, "max by (" + REPLICA_CHECK + ") (" + REPLICA_AGREEING + ")"),
    Record(REPLICA_DIFFERS_RECORD, REPLICA_DIFFERS),
    # The share of a group's replicas in its largest camp, at the worse of its last two checks that
    # every rank has made (dashboards).
    Record(REPLICA_AGREEMENT_RECORD,
           "min by (run, replicas, group) (\n"
           "  " + REPLICA_LARGEST + " / " + REPLICA_GROUP_SIZE + "\n"
           "  and on (" + REPLICA_CHECK + ") " + REPLICA_CHECKED + " == " + REPLICA_GROUP_SIZE + "\n)"),
)


ALERTS: tuple[Alert, ...] = (
    # ---- divergence -------------------------------------------------------
    # A rank whose replicated weights (or reduced gradients) left its replicas': the value is
    # the latest check that differs.
    Alert("RankscopeReplicaDiverged",
          "max by (run, rank, node, replicas, group, shard) (" + REPLICA_DIFFERS_RECORD + ")",
          "critical",
          "Replica diverged in run {{ $labels.run }}: rank {{ $labels.rank }} ({{ $labels.replicas }} group "
          "{{ $labels.group }}{{ if $labels.shard }}, shard {{ $labels.shard }}{{ end }})",
          "In " + WHO + ", what it holds as a {{ $labels.replicas }} replica (process group "
          "{{ $labels.group }}{{ if $labels.shard }}, shard {{ $labels.shard }}{{ end }}) is no longer the same "
          "bits as its replicas' (its weights, or its reduced gradients) at step {{ $value | printf \"%.0f\" }}."
          + REPLICA_VERDICT + REPLICA_SINCE + REPLICA_GRADS + REPLICA_FIRST_PART
          + " Checkpoints it writes from there are suspect; the runbook says what each cause looks like."),
    Alert("RankscopeNonFiniteLoss",
          new_events("rankscope_nonfinite_total{SEL}", "<<event_window>>"),
          "critical",
          "Non-finite {{ $labels.what }} in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} step(s) in the last <<event_window>> had a NaN or infinite "
          "{{ $labels.what }}. Training is diverging or corrupt; checkpoints written since are suspect."),
    Alert("RankscopeLossSpikes",
          new_events("rankscope_loss_spikes_total{SEL}", "<<loss_spike_window>>", "<<loss_spike_count>>"),
          "warning",
          "Repeated loss spikes in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} steps in the last <<loss_spike_window>> had a loss far above "
          "its rolling mean (rank-side z-score test)."),
    # A rising LR (warm-up, a schedule's restart) explains a rising loss; a flat
    # or falling one (a step decay, ReduceLROnPlateau, cosine) does not.
    Alert("RankscopeLossDiverging",
          "deriv(rankscope_loss{SEL}[<<loss_trend_window>>]) * <<loss_trend_window:seconds>>\n"
          "> <<loss_trend_rise_ratio>> * avg_over_time(rankscope_loss{SEL}[<<loss_trend_window>>])\n"
          "and rankscope_learning_rate{SEL}\n"
          "<= (1 + <<lr_rise_tolerance_ratio>>) * min_over_time(rankscope_learning_rate{SEL}[<<loss_trend_window>>])\n"
          # A fit over a mostly empty window extrapolates batch noise into a trend
          # (a young run's plateau "rises" by its noise x window/history).
          "and rankscope_loss{SEL} offset <<loss_trend_min_history>>",
          "warning",
          "Loss rising in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", the loss rose by {{ printf `%.3g` $value }} over the last <<loss_trend_window>> "
          "(linear fit) while the learning rate did not rise (no warm-up or schedule restart explains it)."),
    # A gradient-norm explosion in a run whose loss spiked in the same window is
    # the spike's echo (DDP averages one rank's spiked gradients into every
    # rank's): LossSpikes judges it. The explosion counts on the same step as
    # the spike, before a third spike could fire LossSpikes and inhibit it.
    Alert("RankscopeGradNormExplosion",
          "(\n  " + _indent(new_events("rankscope_grad_norm_spikes_total{SEL}", "<<grad_explosion_window>>",
                                        "<<grad_explosion_count>>")) + "\n)\n"
          "unless on (run) (\n  "
          + _indent(new_events("rankscope_loss_spikes_total{SEL}", "<<grad_explosion_window>>")) + "\n)",
          "warning",
          "Gradient-norm explosion in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} step(s) in the last <<grad_explosion_window>> had a gradient norm "
          "far above its moving average."),
    # ---- liveness and hangs -------------------------------------------------
    # Ranks of a lost node's run that the launcher tore down are its victims:
    # NodeLost pages for them (`for:` gives the lost exporter a scrape or two to
    # be noticed; Alertmanager also inhibits them).
    Alert("RankscopeRankDown",
          RANK_DOWN_RECORD + "\n"
          "unless on (run) run:rankscope_cause:present{cause=\"node_lost\"}",
          "critical",
          "Rank {{ $labels.rank }} of run {{ $labels.run }} is down",
          "In " + WHO + " (local rank {{ $labels.local_rank }}), the rank process is gone without finishing"
          "{{ with printf `rankscope_rank_failure_info{SEL,run=\"%s\",rank=\"%s\"}` $labels.run $labels.rank "
          "| query }}{{ range . }}: it raised {{ .Labels.exception }}{{ end }}{{ else }}: it was killed or exited "
          "without closing its monitor{{ end }}. Its peers will block in their next collective." + FIRST_FAILURE
          + IN_START_UP + EVIDENCE),
    Alert("RankscopeNodeLost",
          NODE_LOST,
          "critical",
          "Run {{ $labels.run }} lost node {{ $labels.node }}: rank {{ $labels.rank }} is gone",
          "In " + WHO + " (local rank {{ $labels.local_rank }}), the rank was alive and is gone with its node: "
          "the exporter at {{ $labels.instance }} does not answer, and the run's other ranks stopped ("
          "{{ range $i, $s := printf `count by (state) (rankscope_rank_state{SEL,run=\"%s\"} == 1)` $labels.run "
          "| query | sortByLabel \"state\" }}{{ if $i }}, {{ end }}{{ $s.Value }} {{ $s.Labels.state }}{{ end }}). "
          "Lost with node {{ $labels.node }}: rank(s) "
          "{{ range $i, $s := printf `rank:rankscope_rank_up:lost{run=\"%s\",instance=\"%s\"}` $labels.run "
          "$labels.instance | query | sortByLabel \"rank\" }}{{ if $i }}, {{ end }}{{ $s.Labels.rank }}{{ end }}."
          + RUN_EVIDENCE),
    Alert("RankscopeHangSuspect",
          HANG_SUSPECT_RECORD,
          "critical",
          "Run {{ $labels.run }} hangs; suspect rank {{ $labels.rank }} on node {{ $labels.node }}",
          "In " + WHO + ", no step for {{ $value | humanizeDuration }} and the rank is outside any collective "
          "while its peers wait in "
          "{{ with printf `topk(1, max by (op) (rankscope_collective_in_flight_seconds{SEL,run=\"%s\"}) > 0)` "
          "$labels.run | query }}{{ range . }}{{ .Labels.op }} (for {{ .Value | humanizeDuration }})"
          "{{ end }}{{ else }}a collective{{ end }}. This rank is the likely culprit." + BLOCK_OVERDUE + EVIDENCE),
    # The same hang located by sequence numbers, for every process group and
    # across nodes: FSDP, tensor parallel, pipeline and sub-group collectives,
    # which the rank-state suspect (HangSuspect: DDP and explicit collectives)
    # does not see. Where HangSuspect (or a dead, lost or frozen rank) already
    # names the cause, it stays quiet: one page per hang.
    Alert("RankscopeCollectiveBehind",
          SEQ_BEHIND_RECORD + "\n"
          # hang_suspect: recorded earlier in this group, as of this evaluation.
          "unless on (run) run:rankscope_cause:present{cause=~\"rank_down|node_lost|hang_suspect|frozen\"}",
          "critical",
          "Run {{ $labels.run }} hangs in process group {{ $labels.group }}: rank {{ $labels.rank }} "
          "on node {{ $labels.node }} is behind",
          "In " + WHO + ", the last collective enqueued on process group {{ $labels.group }} "
          "(id {{ $labels.group_id }}) is "
          "{{ with printf `rankscope_process_group_last_enqueued_seq{SEL,run=\"%s\",rank=\"%s\",group=\"%s\",group_id=\"%s\"}` "
          "$labels.run $labels.rank $labels.group $labels.group_id | query }}seq {{ . | first | value }}{{ end }}, "
          "{{ $value }} behind its peers, who wait in "
          # The records of its own group, current as of this evaluation (the process-group
          # summaries are recorded only once a minute).
          "{{ with printf `topk(1, max by (op) (" + LONG_WAITS_RECORD +
          "{run=\"%s\",group_id=\"%s\"}))` $labels.run $labels.group_id | query }}{{ range . }}{{ .Labels.op }} "
          "(for {{ .Value | humanizeDuration }}){{ end }}{{ else }}a collective{{ end }} up to "
          "{{ with printf `max(rankscope_process_group_last_enqueued_seq{SEL,run=\"%s\",group=\"%s\",group_id=\"%s\"})` "
          "$labels.run $labels.group $labels.group_id | query }}seq {{ . | first | value }}{{ end }}. "
          "This rank has not issued that collective: it is the likely culprit." + EVIDENCE),
    Alert("RankscopeCompletionsBehind",
          COMPLETION_BEHIND_RECORD + "\n"
          "unless on (run) run:rankscope_cause:present{cause=~\"rank_down|node_lost|hang_suspect|frozen\"}",
          "critical",
          "Run {{ $labels.run }} hangs in process group {{ $labels.group }}: the collectives of rank "
          "{{ $labels.rank }} on node {{ $labels.node }} stopped completing",
          "In " + WHO + ", the collectives of process group {{ $labels.group }} (id {{ $labels.group_id }}) "
          "stopped completing at "
          "{{ with printf `rankscope_process_group_last_completed_seq{SEL,run=\"%s\",rank=\"%s\",group=\"%s\",group_id=\"%s\"}` "
          "$labels.run $labels.rank $labels.group $labels.group_id | query }}seq {{ . | first | value }}{{ end }}, {{ $value }} "
          "behind its peers, who completed up to "
          "{{ with printf `max(rankscope_process_group_last_completed_seq{SEL,run=\"%s\",group=\"%s\",group_id=\"%s\"})` "
          "$labels.run $labels.group $labels.group_id | query }}seq {{ . | first | value }}{{ end }} and wait; it issued them as "
          "they did. Its device stopped running its kernels (an assert in a kernel, an Xid, a hung kernel): it is "
          "the likely culprit." + EVIDENCE),
    # Start-up: the ranks its peers wait for in the rendezvous, by name; those that never reported, counted.
    Alert("RankscopeStartupBlocked",
          STARTUP_BLOCKED_RECORD,
          "critical",
          "Run {{ $labels.run }} cannot start: rank {{ $labels.rank }} on node {{ $labels.node }} has not reached "
          "init_process_group",
          "In " + WHO + ", the rank is still in its own start-up, before init_process_group, "
          "{{ $value | humanizeDuration }} after its process started, while "
          "{{ with printf `count(" + STARTUP_WAIT_RECORD + "{run=\"%s\"})` $labels.run | query }}"
          "{{ . | first | value }}{{ end }} rank(s) of the run wait for it in the rendezvous, the longest for "
          "{{ with printf `max(" + STARTUP_WAIT_RECORD + "{run=\"%s\"})` $labels.run | query }}"
          "{{ . | first | value | humanizeDuration }}{{ end }}. This rank holds up the start: its stack shows "
          "where it is (data, model building, a checkpoint read, a lock)." + EVIDENCE),
    Alert("RankscopeStartupRanksMissing",
          STARTUP_MISSING_RECORD,
          "critical",
          "Run {{ $labels.run }} cannot start: {{ $value }} of its ranks never reported",
          "Run {{ $labels.run }}: {{ $value }} of its "
          "{{ with printf `max(rankscope_launch_world_size{SEL,run=\"%s\"})` $labels.run | query }}"
          "{{ . | first | value }}{{ end }} ranks never reached rankscope (no exporter serves them), while the "
          "ranks that did wait in init_process_group's rendezvous, the longest for "
          "{{ with printf `max(" + STARTUP_WAIT_RECORD + "{run=\"%s\"})` $labels.run | query }}"
          "{{ . | first | value | humanizeDuration }}{{ end }}. Nodes that reported: "
          "{{ range $i, $s := printf `count by (node) (rankscope_launch_world_size{SEL,run=\"%s\"})` $labels.run "
          "| query | sortByLabel \"node\" }}{{ if $i }}, {{ end }}{{ $s.Labels.node }} ({{ $s.Value }} ranks){{ end }}. "
          "The missing ranks' node may not have started its launcher, or cannot be reached (its exporter: "
          "RankscopeTargetDown)."),
    # Every rank blocked inside a collective, none outside: no rank to blame.
    Alert("RankscopeNetworkStall",
          NETWORK_STALL_RECORD,
          "critical",
          "Run {{ $labels.run }} is blocked in the network: all {{ $value }} ranks wait inside collectives",
          "Every rank of run {{ $labels.run }} ({{ $value }}, on nodes "
          "{{ range $i, $s := printf `count by (node) (rankscope_rank_up{SEL,run=\"%s\"} == 1)` $labels.run | query "
          "| sortByLabel \"node\" }}{{ if $i }}, {{ end }}{{ $s.Labels.node }}{{ end }}) "
          "has waited inside a collective for over <<hang_peer_wait_seconds>>s"
          "{{ with printf `topk(1, max by (op) (rankscope_collective_in_flight_seconds{SEL,run=\"%s\"}))` $labels.run "
          "| query }}{{ range . }} ({{ .Labels.op }}, {{ .Value | humanizeDuration }}){{ end }}{{ end }}, and none "
          "is outside one: no rank is the culprit. The collective stopped between them: suspect the network (a "
          "link, NIC or switch port between these nodes) or the communication library."
          "{{ with printf `min by (node, group) (rankscope_process_group_last_enqueued_seq{SEL,run=\"%s\"})`"
          " $labels.run | query | sortByLabel \"node\" }} Per node, the last collective its ranks enqueued:"
          "{{ range $i, $s := . }}{{ if $i }},{{ end }} {{ $s.Labels.node }} {{ $s.Labels.group }} seq {{ $s.Value }}"
          "{{ end }}.{{ end }}"
          # The run's nodes' links: down now (and up within the hour), or flapped in the last 15 minutes.
          "{{ with printf `rankscope_node_network_up{SEL} == 0 and on (node) (max_over_time(rankscope_node_network_up"
          "{SEL}[1h]) == 1) and on (node) group by (node) (rankscope_rank_up{SEL,run=\"%s\"})` $labels.run | query "
          "| sortByLabel \"node\" }} Links down now:{{ range $i, $s := . }}{{ if $i }},{{ end }} {{ $s.Labels.node }} "
          "{{ $s.Labels.device }}{{ end }}.{{ end }}"
          "{{ with printf `sum by (node, device) (changes(rankscope_node_network_carrier_changes_total{SEL}[15m])) > 0"
          " and on (node) group by (node) (rankscope_rank_up{SEL,run=\"%s\"})` $labels.run | query "
          "| sortByLabel \"node\" }} Links that went down or up in the last 15 minutes:{{ range $i, $s := . }}"
          "{{ if $i }},{{ end }} {{ $s.Labels.node }} {{ $s.Labels.device }}{{ end }}.{{ end }}"),
    # The victims of a dead, lost, hung or frozen rank stall too: the cause's own
    # alert pages for the run, this one only when no cause is known.
    Alert("RankscopeRunStalled",
          STALLED_RECORD + "\n"
          f"unless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}\"}}",
          "critical",
          "Run {{ $labels.run }} stalled: rank {{ $labels.rank }} completed no step",
          "In " + WHO + ", no step completed for {{ $value | humanizeDuration }}"
          "{{ with printf `rankscope_collective_in_flight_seconds{SEL,run=\"%s\",rank=\"%s\"} > 0` "
          "$labels.run $labels.rank | query }}{{ range . }}; it waits in {{ .Labels.op }} for "
          "{{ .Value | humanizeDuration }}{{ end }}{{ else }}; it is in no collective{{ end }}." + BLOCK_OVERDUE + EVIDENCE),
    Alert("RankscopeRankFrozen",
          RANK_FROZEN_RECORD,
          "critical",
          "Rank {{ $labels.rank }} of run {{ $labels.run }} is frozen",
          "In " + WHO + ", the process is alive but its heartbeat stopped {{ $value | humanizeDuration }} ago: "
          "the interpreter is stuck (GIL held in native code, SIGSTOP, D state)." + EVIDENCE),
    # Two live processes claiming one rank of a run (a launcher's environment wrong on one node:
    # RANK set by hand, a host list with a node twice). On one node the second Monitor() is
    # refused; across nodes only the rules see both. Every rule that joins on (run, rank) is
    # unsure of that rank meanwhile: said, not paged.
    Alert("RankscopeDuplicateRank",
          "count by (run, rank) (rankscope_rank_up{SEL} == 1) > 1",
          "warning",
          "Run {{ $labels.run }}: rank {{ $labels.rank }} is claimed by {{ $value }} live processes",
          "In run {{ $labels.run }}, {{ $value }} live processes say they are rank {{ $labels.rank }}, on nodes"
          "{{ range $i, $s := printf `rankscope_rank_up{SEL,run=\"%s\",rank=\"%s\"} == 1` $labels.run $labels.rank "
          "| query | sortByLabel \"node\" }}{{ if $i }},{{ end }} {{ $s.Labels.node }}{{ end }}: the launcher's "
          "environment (RANK, its node rank, the host list) is wrong on one of them. Alerts about this rank "
          "may mix the two processes' figures."),
    # One alert per run that had live ranks behind the exporter (they are
    # invisible now), else one for the exporter itself.
    Alert("RankscopeTargetDown",
          "group by (job, instance, node, run) (\n"
          "  last_over_time(rankscope_rank_up{SEL}[<<node_lost_window>>]) == 1\n"
          "  unless on (run, rank) rankscope_rank_up{SEL}\n"
          ")\n"
          "and on (job, instance) (up{SEL} == 0)\n"
          "or on (job, instance) (\n"
          "  (up{SEL} == 0)\n"
          "  * on (job, instance) group_left (node)\n"
          "  max by (job, instance, node) (last_over_time(rankscope_exporter_info{SEL}[1h]))\n"
          "  or on (job, instance) (up{SEL} == 0)\n"
          ")",
          "warning",
          "rankscope exporter {{ $labels.instance }} is down",
          "Prometheus cannot scrape the rankscope exporter at {{ $labels.instance }} (job {{ $labels.job }}"
          "{{ with $labels.node }}, node {{ . }}{{ end }}): "
          "{{ if $labels.run }}rank(s) "
          "{{ range $i, $s := printf `last_over_time(rankscope_rank_up{SEL,run=\"%s\",instance=\"%s\"}"
          "[<<node_lost_window>>]) == 1 unless on (run, rank) rankscope_rank_up{SEL}` $labels.run $labels.instance "
          "| query | sortByLabel \"rank\" }}{{ if $i }}, {{ end }}{{ $s.Labels.rank }}{{ end }} of run {{ $labels.run }} "
          "there, alive at the last scrape, are invisible, as is every other run on that node"
          "{{ else }}every run and rank on that node is invisible{{ end }}."),
    # ---- memory ---------------------------------------------------------------
    Alert("RankscopeOutOfMemory",
          new_events("rankscope_oom_total{SEL}", "<<event_window>>"),
          "critical",
          "Out of memory in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} out-of-memory error(s) were raised in the last <<event_window>>."),
    Alert("RankscopeMemoryHeadroomLow",
          hysteresis("RankscopeMemoryHeadroomLow",
                     lambda bar: (f"label_replace(rank:rankscope_device_memory:headroom_ratio < {bar},"
                                  " \"memory\", \"device\", \"\", \"\")\n"
                                  f"or label_replace(rank:rankscope_host_memory:headroom_ratio < {bar},"
                                  " \"memory\", \"host\", \"\", \"\")"),
                     "<<memory_headroom_min_ratio>>", "<<memory_headroom_hold_ratio>>", on="run, rank, memory"),
          "warning",
          "Low {{ $labels.memory }} memory headroom in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", only {{ $value | humanizePercentage }} of {{ $labels.memory }} memory is left."),
    Alert("RankscopeMemoryExhaustionPredicted",
          "label_replace(predict_linear(rankscope_device_memory_reserved_bytes{SEL}[<<memory_predict_window>>],"
          " <<memory_predict_horizon_seconds>>)\n"
          "  > (rankscope_device_memory_total_bytes{SEL} > 0), \"memory\", \"device\", \"\", \"\")\n"
          "or label_replace(predict_linear(rankscope_host_memory_rss_bytes{SEL}[<<memory_predict_window>>],"
          " <<memory_predict_horizon_seconds>>)\n"
          "  > (rankscope_host_memory_limit_bytes{SEL} > 0), \"memory\", \"host\", \"\", \"\")",
          "warning",
          "{{ $labels.memory }} memory of run {{ $labels.run }} (rank {{ $labels.rank }}) predicted to run out",
          "In " + WHO + ", {{ $labels.memory }} memory use is on course to reach {{ $value | humanize1024 }}B "
          "within <<memory_predict_horizon_seconds>>s, above the limit."),
    Alert("RankscopeAllocRetriesRising",
          new_events("rankscope_alloc_retries_total{SEL}", "<<alloc_retry_window>>", "<<alloc_retry_count>>"),
          "warning",
          "Allocator retries rising in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", the CUDA caching allocator had to flush and retry {{ $value }} times in the last "
          "<<alloc_retry_window>>: memory is fragmented or nearly full."),
    # ---- bottlenecks --------------------------------------------------------
    Alert("RankscopeStraggler",
          # A hung, frozen, dead or lost rank stops its peers too: their compute
          # per step is then meaningless, and the cause already pages.
          STRAGGLER + f"\nunless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}|network_degraded|fabric_slow\"}}",
          "warning",
          "Straggler in run {{ $labels.run }}: {{ if $labels.rank }}rank {{ $labels.rank }}{{ else }}tensor-parallel "
          "group {{ $labels.tp_group }}{{ end }} on node {{ $labels.node }}",
          "In run {{ $labels.run }}, {{ if $labels.rank }}rank {{ $labels.rank }}{{ else }}tensor-parallel group "
          "{{ $labels.tp_group }} (ranks "
          "{{ range $i, $s := printf `" + LAYOUT_RECORD + "{run=\"%s\",tp_group=\"%s\",node=\"%s\"}` $labels.run "
          "$labels.tp_group $labels.node | query | sortByLabel \"rank\" }}{{ if $i }}, {{ end }}{{ $s.Labels.rank }}"
          "{{ end }}: its ranks compute equally long by construction, so no metric picks one GPU of them){{ end }} "
          "on node {{ $labels.node }}{{ if $labels.stage }} (pipeline stage {{ $labels.stage }}){{ end }}, "
          "compute takes {{ printf `%.2g` $value }}x the median of its peers{{ if $labels.stage }} in its stage"
          "{{ end }} per step ("
          "{{ with printf `max(rank:rankscope_phase_seconds:compute_per_step"
          "{run=\"%s\",rank=~\"%s\",tp_group=\"%s\"})` "
          "$labels.run (or $labels.rank \".+\") $labels.tp_group | query }}{{ . | first | value | humanizeDuration }}"
          "{{ end }} against "
          "{{ with printf `" + STAGE_PEER_MEDIAN + "{run=\"%s\",stage=\"%s\"}` $labels.run $labels.stage | query }}"
          "{{ . | first | value | humanizeDuration }}{{ end }}); its peers wait for it in every collective."),
    Alert("RankscopeStageImbalance",
          STAGE_IMBALANCE + f"\nunless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}\"}}",
          "warning",
          "Pipeline stage {{ $labels.stage }} of run {{ $labels.run }} is {{ printf `%.2g` $value }}x slower "
          "than the other stages",
          "In run {{ $labels.run }}, pipeline stage {{ $labels.stage }} computes {{ printf `%.2g` $value }}x the "
          "median of the other stages per step ("
          "{{ with printf `stage:rankscope_phase_seconds:compute_per_step{run=\"%s\",stage=\"%s\"}` $labels.run "
          "$labels.stage | query }}{{ . | first | value | humanizeDuration }}{{ end }}; every stage: "
          "{{ range $i, $s := printf `stage:rankscope_phase_seconds:compute_per_step{run=\"%s\"}` $labels.run | query "
          "| sortByLabel \"stage\" }}{{ if $i }}, {{ end }}{{ $s.Labels.stage }} {{ $s.Value | humanizeDuration }}"
          "{{ end }}). Its ranks: "
          "{{ range $i, $s := printf `" + LAYOUT_RECORD + "{run=\"%s\",stage=\"%s\"}` $labels.run $labels.stage "
          "| query | sortByLabel \"rank\" }}{{ if $i }}, {{ end }}{{ $s.Labels.rank }}{{ end }}. All of them are "
          "slower alike: the split of the model between stages is uneven, not a rank or node, and the other "
          "stages wait for this one at every hand-off. Rebalance the stages (move layers out of stage "
          "{{ $labels.stage }}, or weigh the split by each layer's cost)."),
    Alert("RankscopeLoadImbalance",
          LOAD_IMBALANCE + f"\nunless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}|straggler|fabric_slow\"}}",
          "warning",
          "Uneven work per step in run {{ $labels.run }}{{ if $labels.stage }} (pipeline stage "
          "{{ $labels.stage }}){{ end }}",
          "In run {{ $labels.run }}{{ if $labels.stage }}, pipeline stage {{ $labels.stage }}{{ end }}, the slowest "
          "rank of a step computes {{ printf `%.2g` $value }}x the median rank's compute (the median over the "
          "last <<load_imbalance_window>>), while no rank is persistently slower than its peers (each within "
          "<<load_imbalance_max_rank_ratio>>x over <<rate_window>>): the slowest rank changes from step to step, "
          "and every step waits for it. No rank is to blame: the work per rank and step is uneven (sequences "
          "of random length, unpacked batches, MoE routing). Balance it: pack or bucket sequences by length, "
          "balance tokens per rank, check the router's load balancing."),
    Alert("RankscopeNetworkDegraded",
          NETWORK_DEGRADED,
          "warning",
          "Run {{ $labels.run }} waits on the network of node {{ $labels.node }}",
          "The ranks of run {{ $labels.run }} on node {{ $labels.node }} spend {{ $value | humanizePercentage }} "
          "of their step waiting in communication, and node {{ $labels.node }} retransmits "
          "{{ with printf `" + RETRANSMIT_RATIO_RECORD + "{node=\"%s\"}` $labels.node | query }}"
          "{{ . | first | value | humanizePercentage }}{{ end }} of its TCP segments: suspect its link or NIC "
          "(or the switch port it is on), not the ranks' compute."
          "{{ with printf `max by (node) (rate(rankscope_node_tcp_segments_retransmitted_total{SEL,node!=\"%s\"}"
          "[<<rate_window>>]) / rate(rankscope_node_tcp_segments_sent_total{SEL}[<<rate_window>>])"
          " * on (node) group_left () max by (node) (rankscope_rank_state{SEL,run=\"%s\"}))` $labels.node "
          "$labels.run | query | sortByLabel \"node\" }} The run's other nodes retransmit:{{ range $i, $s := . }}"
          "{{ if $i }},{{ end }} {{ $s.Labels.node }} {{ $s.Value | humanizePercentage }}{{ end }}.{{ end }}"),
    Alert("RankscopeFabricSlow",
          FABRIC_SLOW + f"\nunless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}|network_degraded\"}}",
          "warning",
          "The fabric of run {{ $labels.run }} is slow: {{ $labels.op }}{{ if $labels.group }} on group "
          "{{ $labels.group }}{{ end }} at {{ $value | humanize1024 }}B/s bus bandwidth",
          "The {{ $labels.op }} collectives of run {{ $labels.run }}{{ if $labels.group }} on process group "
          "{{ $labels.group }}{{ end }} run at {{ $value | humanize1024 }}B/s bus bandwidth (the median of its "
          "ranks), against {{ if $labels.group }}" + _bandwidth_before(RUN_GROUP_BUS_BANDWIDTH, group=True)
          + "{{ else }}" + _bandwidth_before(RUN_BUS_BANDWIDTH, group=False) + "{{ end }} over the "
          "<<throughput_baseline_window>> before, while every rank computes as it did and within "
          "<<straggler_ratio>>x its peers, and no rank is stuck outside a collective: the fabric carrying them is "
          "slow, not the ranks (their wait in communication is not their compute; none is a straggler)."
          "{{ with printf `" + FABRIC_NODE_EVIDENCE + " * on (node) group_left () max by (node) "
          "(rankscope_rank_up{SEL,run=\"%s\"})` $labels.run | query | sortByLabel \"node\" }} Where the nodes' "
          "data show it:{{ range $i, $s := . }}{{ if $i }};{{ end }} node {{ $s.Labels.node }} "
          "({{ $s.Labels.device }}): {{ $s.Labels.evidence }}{{ end }}.{{ else }} No node of the run shows it in its "
          "own counters (queues, link speeds, credit waits): look at the switches between them.{{ end }}"),
    Alert("RankscopeInputBound",
          INPUT_BOUND,
          "warning",
          "Run {{ $labels.run }} is input-bound on rank {{ $labels.rank }}",
          "In " + WHO + ", {{ $value | humanizePercentage }} of step time is spent waiting for data."),
    # Exposed communication wait is what every victim shows: a straggler's or a
    # starved rank's peers wait for it, a hung or dead rank's peers wait forever.
    Alert("RankscopeCommunicationBound",
          "(\n  " + _indent(COMM_BOUND) + "\n)\n"
          "unless on (run) run:rankscope_cause:present",
          "warning",
          "Run {{ $labels.run }} is communication-bound on rank {{ $labels.rank }}",
          "In " + WHO + ", {{ $value | humanizePercentage }} of step time is exposed communication wait."),
    Alert("RankscopeThroughputDrop",
          "(\n  " + _indent(THROUGHPUT_DROP) + "\n)\n"
          "unless on (run) (max by (run) (rankscope_rank_state{SEL,state=\"finished\"}) == 1)\n"
          "unless on (run) run:rankscope_cause:present",
          "warning",
          "Throughput of run {{ $labels.run }} dropped",
          "Run {{ $labels.run }} makes {{ printf `%.3g` $value }} steps/s, below <<throughput_drop_ratio>>x its level "
          "of the previous <<throughput_baseline_window>>; slowest rank: "
          "{{ with printf `topk(1, rank:rankscope_step_duration_seconds:mean{run=\"%s\"})` $labels.run | query }}"
          "{{ range . }}rank {{ .Labels.rank }} on node {{ .Labels.node }} at {{ .Value | humanizeDuration }} per step"
          "{{ end }}{{ else }}unknown{{ end }}."),
    Alert("RankscopeRunSlowedFurther",
          "(\n  " + _indent(RUN_SLOWED_FURTHER) + "\n)\n"
          "unless on (run) (max by (run) (rankscope_rank_state{SEL,state=\"finished\"}) == 1)\n"
          f"unless on (run) run:rankscope_cause:present{{cause=~\"{STALL_CAUSES}\"}}",
          "warning",
          "Run {{ $labels.run }} slowed further under its standing cause",
          "Run {{ $labels.run }} makes {{ printf `%.3g` $value }} steps/s, below <<throughput_drop_ratio>>x its level "
          "of the previous <<throughput_baseline_window>>, while it already trains under "
          "{{ range $i, $s := printf `run:rankscope_cause:present{run=\"%s\",cause=~\"" + PACE_CAUSES + "\"}` "
          "$labels.run | query | sortByLabel \"cause\" }}{{ if $i }}, {{ end }}{{ $s.Labels.cause }}{{ end }} "
          "(whose alerts keep firing as they were, and are not sent again)."
          "{{ with printf `rank:rankscope_phase_seconds:compute_per_step{run=\"%s\"} / avg_over_time("
          "rank:rankscope_phase_seconds:compute_per_step{run=\"%s\"}[<<throughput_baseline_window>>] offset "
          "<<throughput_baseline_offset>>) > <<straggler_peer_rise_ratio>>` $labels.run $labels.run | query "
          "| sortByLabel \"rank\" }} Slower than they were: {{ range $i, $s := . }}{{ if $i }}, {{ end }}rank "
          "{{ $s.Labels.rank }} on node {{ $s.Labels.node }} ({{ printf `%.2g` $s.Value }}x its compute per step)"
          "{{ end }}.{{ else }} No rank's own compute rose by <<straggler_peer_rise_ratio>>x: the time went to "
          "waiting (data, communication).{{ end }}"),
    # A ticket, not a page: the run goes on, only wastefully. Not for a finished
    # run, nor while a cause that explains it pages or warns (GOODPUT_CAUSES).
    Alert("RankscopeGoodputLow",
          "(\n  " + _indent(GOODPUT_LOW) + "\n)\n"
          "unless on (run) (max by (run) (rankscope_rank_state{SEL,state=\"finished\"}) == 1)\n"
          f"unless on (run) run:rankscope_cause:present{{cause=~\"{GOODPUT_CAUSES}\"}}",
          "warning",
          "Goodput of run {{ $labels.run }} is low",
          "Run {{ $labels.run }} trained only {{ $value | humanizePercentage }} of its ranks' wall time over the "
          "last <<goodput_window>> (productive seconds per second, averaged over its ranks; the bar is "
          "<<goodput_min_ratio>>). Most of the rest went to "
          "{{ with printf `topk(1, run_category:rankscope_wall_seconds:ratio{run=\"%s\",category!=\"productive\"})` "
          "$labels.run | query }}{{ range . }}{{ .Labels.category }} ({{ .Value | humanizePercentage }})"
          "{{ end }}{{ else }}an unknown category{{ end }}."),
    # ---- GPUs ---------------------------------------------------------------
    Alert("RankscopeGPUUnderutilized",
          hysteresis("RankscopeGPUUnderutilized",
                     lambda bar: with_rank_of_gpu(
                         f"avg_over_time(rankscope_gpu_utilization_ratio{{SEL}}[<<gpu_util_window>>]) < {bar}",
                         required=True, ranks=GPU_RANK_PROGRESSING),
                     "<<gpu_util_min_ratio>>", "<<gpu_util_hold_ratio>>", on="uuid"),
          "warning",
          "GPU under-utilised in run {{ $labels.run }} (rank {{ $labels.rank }})",
          GPU_WHO + " was busy only {{ $value | humanizePercentage }} of the last <<gpu_util_window>> "
                    "while the rank trains."),
    Alert("RankscopeGPUErrors",
          with_rank_of_gpu(GPU_ERRORS_NEW),
          "critical",
          "GPU {{ $labels.error }} errors on node {{ $labels.node }} GPU {{ $labels.gpu }}",
          GPU_WHO + " reported {{ $value }} {{ $labels.error }} error(s) in the last <<gpu_error_window>>."),
    Alert("RankscopeGPUThrottled",
          with_rank_of_gpu(GPU_THROTTLED_NOW),
          "warning",
          "GPU {{ $labels.gpu }} on node {{ $labels.node }} throttled ({{ $labels.reason }})",
          GPU_WHO + " runs at reduced clocks because of {{ $labels.reason }}."),
    # ---- the exporter itself ----------------------------------------------
    Alert("RankscopeExporterCollectorFailing",
          "rankscope_exporter_collector_success{SEL} == 0",
          "warning",
          "rankscope exporter {{ $labels.instance }}: collector {{ $labels.collector }} failing",
          "The {{ $labels.collector }} collector of the exporter at {{ $labels.instance }} keeps failing; "
          "its metrics are missing or stale (see the exporter's log)."),
)


# ---- rule groups ---------------------------------------------------------------
# Prometheus evaluates groups concurrently, each on its own timer, and the rules of
# one group in order: a rule sees the records of earlier rules of its group from the
# same evaluation, and those of another group as of that group's last evaluation (up
# to one interval older). So each record sits in the group of the rules that read it
# where it can, and the groups are split by concern so that no one group carries the
# whole cost (docs/scaling.md, "One Prometheus 2.42, measured").
#
# The record-only groups (recording.yml) come first, then the alert groups
# (alerts.yml): an alert reads another group's record one evaluation late at most,
# as it did when all records were one group and all alerts another, and promtool
# (tests list this order as group_eval_order) evaluates them in this order at each
# step. The GPU alerts' rank map and what they report are the only records in an alert
# group: only they read them.


# How often a group evaluates: the thresholds.yaml key that holds its interval. At
# 1,024 nodes the rules' CPU is the Prometheus's; a rule evaluated half as often
# costs half (docs/scaling.md). tests/unit/test_rules.py checks that no page waits on
# a less frequent group: a critical alert, and every record it reads, is PAGING.
PAGING = "rule_interval"            # pages, and what they read (Prometheus's global interval, 15 s)
HANG = "hang_rule_interval"         # hangs and liveness: pages in the first minute, and what they read (5 s)
WARNING = "warning_rule_interval"   # warnings (chat, not pager), and records only they read (30 s)
SLOW = "slow_rule_interval"         # warnings over long windows with `for:` >= 10 m; dashboard summaries (1 m)


@dataclass(frozen=True)
class Group:
    name: str
    # Record names (a cause record as run:rankscope_cause:present{<cause>}) and alert names, in order.
    rules: tuple[str, ...]
    interval: str = PAGING


def rule_key(rule: Record | Alert) -> str:
    if isinstance(rule, Alert):
        return rule.alert
    cause_label = dict(rule.labels).get("cause")
    return f"{rule.record}{{{cause_label}}}" if cause_label else rule.record


def _cause(name: str) -> str:
    return f"run:rankscope_cause:present{{{name}}}"


RULE_GROUPS: tuple[Group, ...] = (
    # Step time per rank and its run summaries; the run's step rate (ThroughputDrop).
    Group("rankscope.recording.steps", (
        "rank:rankscope_step_duration_seconds:mean",
        "run:rankscope_step_duration_seconds:median",
        "run:rankscope_step_duration_seconds:spread_ratio",
        "run:rankscope_steps:rate",
    ), WARNING),
    # Warm-up, the ranks' layout and compute per step against the peers of their stage (the
    # straggler's records), the stages against each other and the spread of each step's
    # compute, and the causes computed from them. Only warnings read them (the bottleneck
    # alerts, whose victims the straggler cause keeps quiet).
    Group("rankscope.recording.phases", (
        "rank:rankscope_steps:warming_up",
        LAYOUT_RECORD,
        "rank:rankscope_phase_seconds:compute_per_step",
        STAGE_PEER_MEDIAN,
        "rank:rankscope_phase_seconds:compute_per_step_peer_ratio",
        RUN_COMPUTE_ROSE_RECORD,
        SLOW_MAJORITY_RECORD,
        "stage:rankscope_phase_seconds:compute_per_step",
        "stage:rankscope_phase_seconds:compute_per_step_ratio",
        "stage:rankscope_step_last_compute_seconds:max_over_median",
        _cause("straggler"),
        _cause("stage_imbalance"),
        _cause("load_imbalance"),
    ), WARNING),
    # Each phase's share of the step (InputBound, CommunicationBound) and the
    # input_bound cause; the cause reads the warm-up record of the group above as
    # of its last evaluation (it changes once, at a launch's start).
    Group("rankscope.recording.phase_fractions", (
        "rank_phase:rankscope_phase_seconds:fraction",
        _cause("input_bound"),
        RETRANSMIT_RATIO_RECORD,
        _cause("network_degraded"),
        ALGORITHM_BANDWIDTH,
        BUS_BANDWIDTH,
        RUN_BUS_BANDWIDTH,
        GROUP_BUS_BANDWIDTH,
        RUN_GROUP_BUS_BANDWIDTH,
        FABRIC_NODE_EVIDENCE,
        _cause("fabric_slow"),
    ), WARNING),
    # Summaries that no alert's expression reads, every minute: the step-time p90
    # from every rank's histogram buckets (18 series per rank, a fifth of the samples
    # the rules read) and each goodput category's share (dashboards; GoodputLow's
    # description names the largest).
    Group("rankscope.recording.slow", (
        "run:rankscope_step_duration_seconds:p90",
        "run_category:rankscope_wall_seconds:ratio",
    ), SLOW),
    # Read by dashboards only: run-wide summaries, every minute (their panels plot
    # 1 h at most; a 1,024-node Prometheus spends its CPU on the 15 s groups).
    Group("rankscope.recording.summaries", (
        "run_phase:rankscope_phase_seconds:fraction_avg",
        "run:rankscope_phase_seconds:compute_per_step_median",
        "run:rankscope_samples:rate",
        "run:rankscope_tokens:rate",
        "rank:rankscope_mfu:ratio",
        "run:rankscope_mfu:ratio",
        "rank_op:rankscope_collective_duration_seconds:mean",
    ), SLOW),
    # Read by GoodputLow and MemoryHeadroomLow, warnings.
    Group("rankscope.recording.goodput_memory", (
        "rank:rankscope_goodput:ratio",
        "run:rankscope_goodput:ratio",
        "rank:rankscope_device_memory:headroom_ratio",
        "rank:rankscope_host_memory:headroom_ratio",
    ), WARNING),
    # Dead, lost and frozen ranks: the records and causes of the liveness alerts.
    Group("rankscope.recording.liveness", (
        RANK_DOWN_RECORD,
        RANK_FROZEN_RECORD,
        "rank:rankscope_rank_up:lost",
        "run:rankscope_ranks:torn_down",
        "run:rankscope_ranks:stopped",
        _cause("rank_down"),
        _cause("node_lost"),
        _cause("frozen"),
    ), HANG),
    # Every process group's front and waits (dashboards, and CollectiveBehind's
    # description), every minute: CollectiveBehind's own expression reads the raw series.
    Group("rankscope.recording.process_groups", (
        "rank_group_op:rankscope_process_group_in_flight:seconds",
        "group:rankscope_process_group_last_enqueued_seq:max",
        "group:rankscope_process_group_in_flight:max_seconds",
    ), SLOW),
    # ---- alert groups (alerts.yml) ----
    # A hang, two ways. The hang suspects, recorded once, then read in the same
    # evaluation by the hang_suspect cause and by HangSuspect. Then the ranks behind
    # their process group's front, recorded once, then read in the same evaluation by
    # the collective_behind cause and by CollectiveBehind, which so pages one scrape
    # and one evaluation after the peers' wait crosses its bar, and stays quiet when
    # the hang_suspect cause just recorded names the hang. First of the alert groups:
    # their causes are read by the liveness, stall and bottleneck alerts.
    Group("rankscope.alerts.hangs", (
        BLOCK_RECORD,
        HANG_SUSPECT_RECORD,
        _cause("hang_suspect"),
        "RankscopeHangSuspect",
        LONG_WAITS_RECORD,
        SEQ_BEHIND_RECORD,
        _cause("collective_behind"),
        "RankscopeCollectiveBehind",
        COMPLETION_BEHIND_RECORD,
        _cause("completion_behind"),
        "RankscopeCompletionsBehind",
        NETWORK_STALL_RECORD,
        _cause("network_stall"),
        "RankscopeNetworkStall",
        STARTUP_WAIT_RECORD,
        STARTUP_BLOCKED_RECORD,
        _cause("startup_blocked"),
        "RankscopeStartupBlocked",
        STARTUP_MISSING_RECORD,
        _cause("startup_missing"),
        "RankscopeStartupRanksMissing",
    ), HANG),
    Group("rankscope.alerts.liveness", (
        "RankscopeRankDown",
        "RankscopeNodeLost",
        "RankscopeRankFrozen",
        "RankscopeTargetDown",
        "RankscopeDuplicateRank",
    ), HANG),
    # Ranks stalled with no known cause: the stalled ranks recorded once, then the
    # stalled cause and RunStalled read them in the same evaluation.
    Group("rankscope.alerts.stalls", (
        STALLED_RECORD,
        _cause("stalled"),
        "RankscopeRunStalled",
    )),
    # Replicas: each check's camps, recorded in order, then the page, in the same evaluation.
    Group("rankscope.alerts.replicas", (
        REPLICA_CHECKS_RECORD,
        REPLICA_AGREEING,
        REPLICA_CHECKED,
        REPLICA_LARGEST,
        REPLICA_DIFFERS_RECORD,
        REPLICA_AGREEMENT_RECORD,
        "RankscopeReplicaDiverged",
    )),
    # Counted events that page at once (a non-finite loss, OOM): no rule here reads a
    # record or another rule of its group.
    Group("rankscope.alerts.training", (
        "RankscopeNonFiniteLoss",
        "RankscopeOutOfMemory",
    )),
    # Counted spikes that warn (LossSpikes, GradNormExplosion): a chat message at most 15 s later.
    Group("rankscope.alerts.spikes", (
        "RankscopeLossSpikes",
        "RankscopeGradNormExplosion",
    ), WARNING),
    # Warnings with `for:` of 5 m or more.
    Group("rankscope.alerts.memory", (
        "RankscopeAllocRetriesRising",
        "RankscopeMemoryHeadroomLow",
        "RankscopeExporterCollectorFailing",
    ), WARNING),
    Group("rankscope.alerts.bottlenecks", (
        "RankscopeNetworkDegraded",
        "RankscopeFabricSlow",
        "RankscopeStraggler",
        "RankscopeStageImbalance",
        "RankscopeLoadImbalance",
        "RankscopeInputBound",
        "RankscopeCommunicationBound",
        "RankscopeThroughputDrop",
        "RankscopeRunSlowedFurther",
        "RankscopeGoodputLow",
    ), WARNING),
    Group("rankscope.alerts.gpu", (
        GPU_RANK_LIVE,
        GPU_ERRORS_NEW,
        GPU_THROTTLED_NOW,
        "RankscopeGPUErrors",
        "RankscopeGPUThrottled",
    )),
    # Warnings over windows of 10 m to 1 h with `for:` of 10-15 m, every minute.
    Group("rankscope.alerts.slow", (
        GPU_RANK_PROGRESSING,
        "RankscopeGPUUnderutilized",
        "RankscopeLossDiverging",
        "RankscopeMemoryExhaustionPredicted",
    ), SLOW),
)


def group_rules(group: Group) -> list[Record | Alert]:
    by_key = {rule_key(r): r for r in (*RECORDING_RULES, *ALERTS)}
    return [by_key[k] for k in group.rules]


def check_groups() -> None:
    """Every rule in exactly one group; a record read in its own group is evaluated before its readers."""
    placed = [k for g in RULE_GROUPS for k in g.rules]
    every = [rule_key(r) for r in (*RECORDING_RULES, *ALERTS)]
    if sorted(placed) != sorted(every) or len(set(every)) != len(every):
        raise ValueError(f"rule groups: unplaced {sorted(set(every) - set(placed))}, "
                         f"unknown or twice {sorted(k for k in placed if placed.count(k) > 1 or k not in every)}")
