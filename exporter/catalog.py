"""Every metric the node exporter derives itself (rank liveness and state,
per-GPU NVML readings, its own health).

The rank-written metrics are in ``rankscope.contract.catalog``; together the two
modules are the whole metric-name contract.
"""

from __future__ import annotations

from rankscope.contract.catalog import BY_NAME as RANK_BY_NAME
from rankscope.contract.catalog import MetricSpec
# Rank states, one-hot in rankscope_rank_state: defined once, in the contract the readers share
# (imported from here by the exporter's modules).
from rankscope.contract.states import LIVE_STATES, RANK_STATES, STALLED_STATES


THROTTLE_REASONS: tuple[str, ...] = (
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
)

GPU_LABELS: tuple[str, ...] = ("node", "gpu", "uuid")


def _rank(name: str, kind: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, help, labels)  # type: ignore[arg-type]


def _node(name: str, kind: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, identity=False)  # type: ignore[arg-type]


NODE_HISTOGRAM_PREFIX = "rankscope_node_"


def node_histogram_name(name: str) -> str:
    """The node-level histogram of a rank histogram (--rank-histograms node-buckets):
    ``rankscope_step_duration_seconds`` -> ``rankscope_node_step_duration_seconds``."""
    return NODE_HISTOGRAM_PREFIX + name.removeprefix("rankscope_")


def node_histogram_help(documentation: str) -> str:
    return f"{documentation} Summed over the node's ranks of a run (--rank-histograms node-buckets)."


def _node_histogram(rank_name: str) -> MetricSpec:
    """The rank histogram's buckets, _count and _sum added up over the node's ranks of a run: its labels
    without rank and local_rank (rankscope.exporter.cardinality)."""
    spec = RANK_BY_NAME[rank_name]
    return MetricSpec(node_histogram_name(rank_name), "histogram", node_histogram_help(spec.help),
                      ("run", "node") + spec.labels, identity=False, buckets=spec.buckets)


EXPORTER_METRICS: tuple[MetricSpec, ...] = (
    # per rank, derived from the rank's files and its process
    _rank("rankscope_rank_up", "gauge", "1 if the rank's process is alive, 0 if it is gone."),
    _rank("rankscope_rank_state", "gauge", "1 for the rank's current state, 0 for the others.", ("state",)),
    _rank("rankscope_hang_suspect", "gauge",
          "1 if the rank is outside any collective while peers on this node have waited in one past the threshold."),
    _rank("rankscope_step_stalled_seconds", "gauge",
          "Seconds since the rank last completed a step (since it started, if none)."),
    _rank("rankscope_heartbeat_age_seconds", "gauge", "Seconds since the rank's last heartbeat."),
    _rank("rankscope_rank_failure_info", "gauge",
          "1 for a rank whose monitor ended on an exception, labelled with the exception's type.", ("exception",)),
    _rank("rankscope_rank_failed_timestamp_seconds", "gauge",
          "When the rank's monitor ended on an exception (unix seconds): the earliest of a run is its first failure.",
          ("exception",)),
    _rank("rankscope_evidence_captured_timestamp_seconds", "gauge",
          "When the exporter last captured evidence of the rank (stacks, collectives, process, device, traceback), "
          "served at scheme://<this exporter>path; trigger says what it saw.", ("trigger", "scheme", "path")),
    _rank("rankscope_collective_in_flight_seconds", "gauge",
          "Seconds the collective now in flight has been running; 0 when none is.", ("op",)),
    # per node and run, only with --rank-histograms node-buckets
    _node_histogram("rankscope_step_duration_seconds"),
    _node_histogram("rankscope_data_wait_seconds"),
    _node_histogram("rankscope_collective_duration_seconds"),
    _node_histogram("rankscope_process_group_collective_duration_seconds"),
    # per GPU, from NVML
    _node("rankscope_gpu_info", "gauge", "Identity of a GPU (value 1).", GPU_LABELS + ("name", "driver_version")),
    _node("rankscope_gpu_utilization_ratio", "gauge", "Fraction of time a kernel was running on the GPU.", GPU_LABELS),
    _node("rankscope_gpu_memory_utilization_ratio", "gauge",
          "Fraction of time device memory was being read or written.", GPU_LABELS),
    _node("rankscope_gpu_memory_used_bytes", "gauge", "Device memory used (all processes).", GPU_LABELS),
    _node("rankscope_gpu_memory_total_bytes", "gauge", "Device memory in total.", GPU_LABELS),
    _node("rankscope_gpu_power_watts", "gauge", "Power draw.", GPU_LABELS),
    _node("rankscope_gpu_power_limit_watts", "gauge", "Enforced power limit.", GPU_LABELS),
    _node("rankscope_gpu_energy_joules_total", "counter", "Energy consumed since the driver loaded.", GPU_LABELS),
    _node("rankscope_gpu_temperature_celsius", "gauge", "GPU core temperature.", GPU_LABELS),
    _node("rankscope_gpu_sm_clock_hertz", "gauge", "Streaming-multiprocessor clock.", GPU_LABELS),
    _node("rankscope_gpu_throttled", "gauge", "1 while the clocks are reduced for this reason.",
          GPU_LABELS + ("reason",)),
    _node("rankscope_gpu_ecc_errors_total", "counter", "ECC errors since the driver loaded (volatile).",
          GPU_LABELS + ("type",)),
    _node("rankscope_gpu_xid_errors_total", "counter", "Critical XID error events seen by this exporter.",
          GPU_LABELS),
    _node("rankscope_gpu_last_xid", "gauge", "Code of the last critical XID error seen; 0 if none.", GPU_LABELS),
    # the node's network (rankscope.exporter.network): links, not ranks
    _node("rankscope_node_network_up", "gauge", "1 while the network device is up (operstate up, or unknown with a "
          "carrier), else 0.", ("node", "device")),
    _node("rankscope_node_network_carrier_changes_total", "counter",
          "Times the device's carrier (link) went down or up since it was created: a flapping port.",
          ("node", "device")),
    _node("rankscope_node_network_errors_total", "counter", "Receive or transmit errors of the network device.",
          ("node", "device", "direction")),
    _node("rankscope_node_infiniband_link_downed_total", "counter",
          "Times the InfiniBand port's link went down (link_downed).", ("node", "device", "port")),
    _node("rankscope_node_infiniband_errors_total", "counter", "InfiniBand port error counters, by counter name.",
          ("node", "device", "port", "type")),
    _node("rankscope_node_network_speed_bytes", "gauge",
          "Nominal speed of the network device in bytes per second (sysfs speed; absent where the driver has none).",
          ("node", "device")),
    _node("rankscope_node_network_bytes_total", "counter", "Bytes the network device received (rx) or sent (tx).",
          ("node", "device", "direction")),
    _node("rankscope_node_network_qdisc_backlog_bytes", "gauge",
          "Bytes queued in the device's root queueing discipline now.", ("node", "device")),
    _node("rankscope_node_network_qdisc_overlimits_total", "counter",
          "Times the device's root queueing discipline held packets back over its limit (a shaper or policer: a "
          "slow link that queues instead of dropping).", ("node", "device")),
    _node("rankscope_node_network_qdisc_drops_total", "counter",
          "Packets the device's root queueing discipline dropped.", ("node", "device")),
    _node("rankscope_node_infiniband_rate_bytes", "gauge",
          "The InfiniBand port's link rate in bytes per second (its width times its speed, as trained).",
          ("node", "device", "port")),
    _node("rankscope_node_infiniband_port_active", "gauge", "1 while the InfiniBand port's state is ACTIVE, else 0.",
          ("node", "device", "port")),
    _node("rankscope_node_infiniband_bytes_total", "counter",
          "Bytes the InfiniBand port received (rx) or sent (tx) (port_rcv_data, port_xmit_data).",
          ("node", "device", "port", "direction")),
    _node("rankscope_node_infiniband_xmit_wait_total", "counter",
          "Ticks the InfiniBand port had data to send and no flow-control credit (port_xmit_wait): the lossless "
          "fabric's congestion, which drops nothing.", ("node", "device", "port")),
    _node("rankscope_node_infiniband_congestion_total", "counter",
          "RoCE congestion counters where the driver has them (hw_counters): ECN-marked packets received, "
          "congestion notifications handled.", ("node", "device", "port", "type")),
    _node("rankscope_node_ecn_congestion_marked_packets_total", "counter",
          "IP packets the node received with ECN's congestion-experienced mark (/proc/net/netstat InCEPkts).",
          ("node",)),
    _node("rankscope_node_tcp_segments_sent_total", "counter", "TCP segments the node sent (/proc/net/snmp OutSegs).",
          ("node",)),
    _node("rankscope_node_tcp_segments_retransmitted_total", "counter",
          "TCP segments the node retransmitted (RetransSegs): a degraded link or NIC under gloo or NCCL sockets.",
          ("node",)),
    # the exporter itself
    _node("rankscope_exporter_info", "gauge", "Exporter identity (value 1).", ("node", "version", "directory")),
    _node("rankscope_exporter_collector_success", "gauge", "1 if the collector's last run succeeded.",
          ("collector",)),
    _node("rankscope_exporter_collect_duration_seconds", "gauge", "Duration of the collector's last run.",
          ("collector",)),
    _node("rankscope_exporter_ranks", "gauge", "Rank processes known to this exporter, by state.", ("state",)),
)

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in EXPORTER_METRICS}


def markdown() -> str:
    """The metric catalog as README tables (``python -m rankscope.exporter.catalog --write README.md``)."""
    from rankscope.contract.catalog import IDENTITY_LABELS, RANK_METRICS

    ident = ", ".join(IDENTITY_LABELS)
    lines = [f"Written by every rank (labels {ident}, plus those listed):", "",
             "| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{m.name}` | {m.kind} | {', '.join(m.labels)} | {m.help} |" for m in RANK_METRICS]
    lines += ["", "Derived by the node exporter (rank series carry the identity labels too):", "",
              "| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{m.name}` | {m.kind} | {', '.join(m.labels)} | {m.help} |" for m in EXPORTER_METRICS]
    return "\n".join(lines) + "\n"


START, END = "<!-- catalog:start -->\n", "<!-- catalog:end -->"


def splice(readme: str) -> str:
    head, _, rest = readme.partition(START)
    _, _, tail = rest.partition(END)
    return head + START + markdown() + END + tail


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if sys.argv[1:2] == ["--write"]:
        path = Path(sys.argv[2])
        path.write_text(splice(path.read_text()))
    else:
        print(markdown(), end="")
