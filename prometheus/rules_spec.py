"""The rankscope recording and alerting rules, written once against named thresholds.

Expressions and annotations use two placeholders that prometheus/generate.py
fills from prometheus/thresholds.yaml:

- ``<<name>>`` is a threshold from ``params`` (``<<name:seconds>>`` converts a
  Prometheus duration such as ``1h`` to seconds);
- ``{SEL}`` / ``{SEL,label="v"}`` is a metric's matcher list with the
  configured ``selector`` (e.g. ``job="rankscope"``) put in front.

Only metric names from rankscope.contract.catalog and rankscope.exporter.catalog (plus Prometheus's
own ``up``) may appear; tests/test_rules.py checks it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    alert: str
    expr: str
    severity: str  # critical (pages) | warning (chat) | info
    summary: str
    description: str


def new_events(metric: str, window: str, at_least: str = "1") -> str:
    """Events a counter gained in the window, exactly (no rate() extrapolation).

    The second branch covers a series born less than a window ago already
    above zero (the first event of a new rank): ``offset`` finds nothing then.
    """
    return (f"({metric} - {metric} offset {window}) >= {at_least}\n"
            f"or ({metric} >= {at_least} unless {metric} offset {window})")


def with_rank_of_gpu(expr: str, *, required: bool = False, rank_filter: str = "rankscope_rank_up{SEL} == 1") -> str:
    """Adds run/rank/local_rank of the rank using a GPU (joined on its UUID via rankscope_rank_info).

    A GPU no live rank uses keeps its alert unless ``required`` (``or on (uuid)``).
    """
    ranks = ("topk by (uuid) (1,\n"
             "  label_replace(rankscope_rank_info{SEL}, \"uuid\", \"$1\", \"gpu_uuid\", \"(.+)\")\n"
             f"  and on (run, rank) ({rank_filter})\n"
             ")")
    joined = f"({expr})\n* on (uuid) group_left (run, rank, local_rank)\n{ranks}"
    return joined if required else f"{joined}\nor on (uuid) ({expr})"


# Where (run, rank, node) go in every per-rank description.
WHO = "run {{ $labels.run }}, rank {{ $labels.rank }} on node {{ $labels.node }}"
# For GPU alerts, whose rank labels are joined in when a live rank uses the GPU.
GPU_WHO = ("GPU {{ $labels.gpu }} ({{ $labels.uuid }}) on node {{ $labels.node }}"
           "{{ if $labels.rank }}, used by run {{ $labels.run }}, rank {{ $labels.rank }}"
           "{{ else }}, used by no live rank{{ end }}")


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
    # Compute seconds per step (the straggler signal: its peers' time goes to comm_wait instead).
    Record("rank:rankscope_phase_seconds:compute_per_step",
           "sum without (phase) (rate(rankscope_phase_seconds_total{SEL,phase=~\"<<straggler_phases>>\"}[<<rate_window>>]))\n"
           "/ rate(rankscope_steps_total{SEL}[<<rate_window>>])"),
    Record("run:rankscope_phase_seconds:compute_per_step_median",
           "quantile by (run) (0.5, rank:rankscope_phase_seconds:compute_per_step)"),
    # Throughput per run.
    Record("run:rankscope_steps:rate", "avg by (run) (rate(rankscope_steps_total{SEL}[<<rate_window>>]))"),
    Record("run:rankscope_samples:rate", "sum by (run) (rate(rankscope_samples_total{SEL}[<<rate_window>>]))"),
    Record("run:rankscope_tokens:rate", "sum by (run) (rate(rankscope_tokens_total{SEL}[<<rate_window>>]))"),
    # Mean collective latency per rank and op.
    Record("rank_op:rankscope_collective_duration_seconds:mean",
           "rate(rankscope_collective_duration_seconds_sum{SEL}[<<rate_window>>])\n"
           "/ rate(rankscope_collective_duration_seconds_count{SEL}[<<rate_window>>])"),
    # Memory headroom: 1 - used / limit (only where the limit is known).
    Record("rank:rankscope_device_memory:headroom_ratio",
           "1 - rankscope_device_memory_reserved_bytes{SEL} / (rankscope_device_memory_total_bytes{SEL} > 0)"),
    Record("rank:rankscope_host_memory:headroom_ratio",
           "1 - rankscope_host_memory_rss_bytes{SEL} / (rankscope_host_memory_limit_bytes{SEL} > 0)"),
)


ALERTS: tuple[Alert, ...] = (
    # ---- divergence -------------------------------------------------------
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
    Alert("RankscopeLossDiverging",
          "deriv(rankscope_loss{SEL}[<<loss_trend_window>>]) * <<loss_trend_window:seconds>>\n"
          "> <<loss_trend_rise_ratio>> * avg_over_time(rankscope_loss{SEL}[<<loss_trend_window>>])\n"
          "and (max_over_time(rankscope_learning_rate{SEL}[<<loss_trend_window>>])"
          " - min_over_time(rankscope_learning_rate{SEL}[<<loss_trend_window>>]))\n"
          "<= <<lr_flat_tolerance_ratio>> * max_over_time(rankscope_learning_rate{SEL}[<<loss_trend_window>>])\n"
          # A fit over a mostly empty window extrapolates batch noise into a trend
          # (a young run's plateau "rises" by its noise x window/history).
          "and rankscope_loss{SEL} offset <<loss_trend_min_history>>",
          "warning",
          "Loss rising in run {{ $labels.run }} with a flat learning rate",
          "In " + WHO + ", the loss rose by {{ printf `%.3g` $value }} over the last <<loss_trend_window>> "
          "(linear fit) while the learning rate stayed flat."),
    Alert("RankscopeGradNormExplosion",
          new_events("rankscope_grad_norm_spikes_total{SEL}", "<<grad_explosion_window>>",
                     "<<grad_explosion_count>>"),
          "warning",
          "Gradient-norm explosion in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} step(s) in the last <<grad_explosion_window>> had a gradient norm "
          "far above its moving average."),
    # ---- liveness and hangs -------------------------------------------------
    Alert("RankscopeRankDown",
          "rankscope_rank_up{SEL} == 0\n"
          "unless on (run, rank) (rankscope_rank_state{SEL,state=\"finished\"} == 1)",
          "critical",
          "Rank {{ $labels.rank }} of run {{ $labels.run }} is down",
          "In " + WHO + " (local rank {{ $labels.local_rank }}), the rank process is gone without finishing"
          "{{ with printf `rankscope_rank_failure_info{SEL,run=\"%s\",rank=\"%s\"}` $labels.run $labels.rank "
          "| query }}{{ range . }}: it raised {{ .Labels.exception }}{{ end }}{{ else }}: it was killed or exited "
          "without closing its monitor{{ end }}. Its peers will block in their next collective."),
    Alert("RankscopeHangSuspect",
          # The exporter marks a rank outside any collective while its node's
          # peers wait in one; the second branch finds the same across nodes.
          "rankscope_step_stalled_seconds{SEL}\n"
          "and on (run, rank) (\n"
          "  rankscope_hang_suspect{SEL} == 1\n"
          "  or on (run, rank) (\n"
          "    max by (run, rank) (rankscope_collective_in_flight_seconds{SEL}) == 0\n"
          "    and on (run) (max by (run) (rankscope_collective_in_flight_seconds{SEL}) > <<hang_peer_wait_seconds>>)\n"
          "    and on (run, rank) (rankscope_step_stalled_seconds{SEL} > <<hang_peer_wait_seconds>>)\n"
          "  )\n"
          ")",
          "critical",
          "Run {{ $labels.run }} hangs; suspect rank {{ $labels.rank }} on node {{ $labels.node }}",
          "In " + WHO + ", no step for {{ $value | humanizeDuration }} and the rank is outside any collective "
          "while its peers wait in "
          "{{ with printf `topk(1, max by (op) (rankscope_collective_in_flight_seconds{SEL,run=\"%s\"}) > 0)` "
          "$labels.run | query }}{{ range . }}{{ .Labels.op }} (for {{ .Value | humanizeDuration }})"
          "{{ end }}{{ else }}a collective{{ end }}. This rank is the likely culprit."),
    Alert("RankscopeRunStalled",
          "rankscope_step_stalled_seconds{SEL} > <<stall_seconds>>",
          "critical",
          "Run {{ $labels.run }} stalled: rank {{ $labels.rank }} completed no step",
          "In " + WHO + ", no step completed for {{ $value | humanizeDuration }}"
          "{{ with printf `rankscope_collective_in_flight_seconds{SEL,run=\"%s\",rank=\"%s\"} > 0` "
          "$labels.run $labels.rank | query }}{{ range . }}; it waits in {{ .Labels.op }} for "
          "{{ .Value | humanizeDuration }}{{ end }}{{ else }}; it is in no collective{{ end }}."),
    Alert("RankscopeRankFrozen",
          "rankscope_heartbeat_age_seconds{SEL}\n"
          "and on (run, rank) (rankscope_rank_state{SEL,state=\"frozen\"} == 1)",
          "critical",
          "Rank {{ $labels.rank }} of run {{ $labels.run }} is frozen",
          "In " + WHO + ", the process is alive but its heartbeat stopped {{ $value | humanizeDuration }} ago: "
          "the interpreter is stuck (GIL held in native code, SIGSTOP, D state)."),
    Alert("RankscopeTargetDown",
          "(up{SEL} == 0)\n"
          "* on (job, instance) group_left (node)\n"
          "max by (job, instance, node) (last_over_time(rankscope_exporter_info{SEL}[1h]))\n"
          "or on (job, instance) (up{SEL} == 0)",
          "warning",
          "rankscope exporter {{ $labels.instance }} is down",
          "Prometheus cannot scrape the rankscope exporter at {{ $labels.instance }} (job {{ $labels.job }}"
          "{{ with $labels.node }}, node {{ . }}{{ end }}): every run and rank on that node is invisible."),
    # ---- memory ---------------------------------------------------------------
    Alert("RankscopeOutOfMemory",
          new_events("rankscope_oom_total{SEL}", "<<event_window>>"),
          "critical",
          "Out of memory in run {{ $labels.run }} (rank {{ $labels.rank }})",
          "In " + WHO + ", {{ $value }} out-of-memory error(s) were raised in the last <<event_window>>."),
    Alert("RankscopeMemoryHeadroomLow",
          "label_replace(rank:rankscope_device_memory:headroom_ratio < <<memory_headroom_min_ratio>>,"
          " \"memory\", \"device\", \"\", \"\")\n"
          "or label_replace(rank:rankscope_host_memory:headroom_ratio < <<memory_headroom_min_ratio>>,"
          " \"memory\", \"host\", \"\", \"\")",
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
          "rank:rankscope_phase_seconds:compute_per_step\n"
          "> on (run) group_left () (<<straggler_ratio>> * run:rankscope_phase_seconds:compute_per_step_median)\n"
          "and on (run, rank) (\n"
          "  rank:rankscope_phase_seconds:compute_per_step\n"
          "  - on (run) group_left () run:rankscope_phase_seconds:compute_per_step_median\n"
          "  > <<straggler_min_excess_seconds>>\n"
          ")",
          "warning",
          "Straggler in run {{ $labels.run }}: rank {{ $labels.rank }} on node {{ $labels.node }}",
          "In " + WHO + ", compute takes {{ $value | humanizeDuration }} per step, more than <<straggler_ratio>>x "
          "the run median of "
          "{{ with printf `run:rankscope_phase_seconds:compute_per_step_median{run=\"%s\"}` $labels.run | query }}"
          "{{ . | first | value | humanizeDuration }}{{ end }}; its peers wait for it."),
    Alert("RankscopeInputBound",
          "rank_phase:rankscope_phase_seconds:fraction{phase=\"data\"} > <<input_bound_ratio>>",
          "warning",
          "Run {{ $labels.run }} is input-bound on rank {{ $labels.rank }}",
          "In " + WHO + ", {{ $value | humanizePercentage }} of step time is spent waiting for data."),
    Alert("RankscopeCommunicationBound",
          "rank_phase:rankscope_phase_seconds:fraction{phase=\"comm_wait\"} > <<comm_bound_ratio>>",
          "warning",
          "Run {{ $labels.run }} is communication-bound on rank {{ $labels.rank }}",
          "In " + WHO + ", {{ $value | humanizePercentage }} of step time is exposed communication wait."),
    Alert("RankscopeThroughputDrop",
          "run:rankscope_steps:rate\n"
          "< <<throughput_drop_ratio>> * avg_over_time(run:rankscope_steps:rate[<<throughput_baseline_window>>]"
          " offset <<throughput_baseline_offset>>)\n"
          "unless on (run) (max by (run) (rankscope_rank_state{SEL,state=\"finished\"}) == 1)",
          "warning",
          "Throughput of run {{ $labels.run }} dropped",
          "Run {{ $labels.run }} makes {{ printf `%.3g` $value }} steps/s, below <<throughput_drop_ratio>>x its level "
          "of the previous <<throughput_baseline_window>>; slowest rank: "
          "{{ with printf `topk(1, rank:rankscope_step_duration_seconds:mean{run=\"%s\"})` $labels.run | query }}"
          "{{ range . }}rank {{ .Labels.rank }} on node {{ .Labels.node }} at {{ .Value | humanizeDuration }} per step"
          "{{ end }}{{ else }}unknown{{ end }}."),
    # ---- GPUs ---------------------------------------------------------------
    Alert("RankscopeGPUUnderutilized",
          with_rank_of_gpu("avg_over_time(rankscope_gpu_utilization_ratio{SEL}[<<gpu_util_window>>])"
                           " < <<gpu_util_min_ratio>>",
                           required=True, rank_filter="rankscope_rank_state{SEL,state=\"progressing\"} == 1"),
          "warning",
          "GPU under-utilised in run {{ $labels.run }} (rank {{ $labels.rank }})",
          GPU_WHO + " was busy only {{ $value | humanizePercentage }} of the last <<gpu_util_window>> "
                    "while the rank trains."),
    Alert("RankscopeGPUErrors",
          with_rank_of_gpu(
              "label_replace(" + new_events("rankscope_gpu_xid_errors_total{SEL}", "<<gpu_error_window>>")
              + ", \"error\", \"xid\", \"\", \"\")\nor label_replace("
              + new_events("rankscope_gpu_ecc_errors_total{SEL,type=\"uncorrected\"}", "<<gpu_error_window>>")
              + ", \"error\", \"ecc_uncorrected\", \"\", \"\")"),
          "critical",
          "GPU {{ $labels.error }} errors on node {{ $labels.node }} GPU {{ $labels.gpu }}",
          GPU_WHO + " reported {{ $value }} {{ $labels.error }} error(s) in the last <<gpu_error_window>>."),
    Alert("RankscopeGPUThrottled",
          with_rank_of_gpu("rankscope_gpu_throttled{SEL,reason=~\"<<gpu_throttle_reasons>>\"} == 1"),
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
