"""The node's network, as the rules need it to name a link instead of a rank.

When a link between nodes goes down, every rank on both sides blocks inside
the same collective: no rank is the culprit, and the ranks' own series cannot
say which link it is. When a link degrades (a NIC or a switch port dropping
packets), every rank's collectives slow down alike. What the node sees itself
tells them apart:

* per network device (``/sys/class/net``): whether it is up, how often its
  carrier went down and up (a flapping port), its receive/transmit errors;
* per InfiniBand port (``/sys/class/infiniband``, where present): link-downed
  and error counters;
* TCP (``/proc/net/snmp``): segments sent and retransmitted. A degraded link
  under gloo, or NCCL over sockets, shows as retransmits on the sending node.

A slow link that does not drop (a lossless fabric with flow control, a NIC
trained at a lower speed, a shaper with a deep queue, a congested switch port)
retransmits nothing: it queues. For it the collector reads what a queue leaves:

* per device: its nominal speed (``speed``, Mb/s; absent where the driver has
  none) and the bytes it moved each way, so throughput reads against the speed
  and against the same device on the run's other nodes;
* per device, from netlink: the root queueing discipline's backlog, overlimits
  (a shaper or policer holding packets back) and drops;
* per InfiniBand port: its rate and state, its data counters, and
  ``port_xmit_wait`` (ticks it had data to send and no credit: the lossless
  fabric's congestion), plus RoCE's ECN counters where the driver has them
  (``hw_counters``);
* IP (``/proc/net/netstat``): packets received with ECN's congestion mark.

Pause frames are in the NIC driver's ethtool statistics only (named per driver,
read by ioctl): not read here.

Read in the exporter's network namespace (a container's own, or the host's with
``hostNetwork``). Virtual devices (loopback, container veths and bridges) are
left out by default (``--network-devices``): they are not links between nodes,
and a node with many containers would otherwise add a series set per container.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankscope.exporter.catalog import BY_NAME

log = logging.getLogger("rankscope.exporter")

# Devices that are not links between nodes (a container's veth, bridges, tunnels, loopback).
DEFAULT_EXCLUDED_DEVICES = r"lo|veth.*|docker.*|br-.*|virbr.*|cni.*|flannel.*|cali.*|tunl.*|kube-.*|vxlan.*|cilium.*"
# InfiniBand port counters read (/sys/class/infiniband/<dev>/ports/<n>/counters/<name>).
IB_ERRORS = ("symbol_error", "port_rcv_errors", "port_xmit_discards", "link_error_recovery",
             "local_link_integrity_errors", "excessive_buffer_overrun_errors")


# InfiniBand RoCE congestion counters (/sys/class/infiniband/<dev>/ports/<n>/hw_counters/<name>, mlx5):
# packets that arrived ECN-marked, and congestion notifications the sender acted on.
IB_ECN = ("np_ecn_marked_roce_packets", "rp_cnp_handled")


TC_H_ROOT = 0xFFFFFFFF   # the parent handle of a device's root queueing discipline


@dataclass(frozen=True)
class QueueStats:
    """A device's root queueing discipline, as netlink reports it."""
    backlog_bytes: float
    overlimits: float
    drops: float


def netlink_queues() -> dict[str, QueueStats]:
    """Device name -> its root qdisc's counters, in this process's network namespace."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ipr.get_links()}
        out = {}
        for qdisc in ipr.get_qdiscs():
            if qdisc["parent"] != TC_H_ROOT or qdisc["index"] not in names:
                continue
            queue = dict((qdisc.get_attr("TCA_STATS2") or {}).get("attrs", ())).get("TCA_STATS_QUEUE")
            if queue is not None:
                out[names[qdisc["index"]]] = QueueStats(queue["backlog"], queue["overlimits"], queue["drops"])
        return out


class NetworkCollector(Collector):
    def __init__(self, node: str, excluded: str = DEFAULT_EXCLUDED_DEVICES, root: Path = Path("/"),
                 queues: Callable[[], dict[str, QueueStats]] = netlink_queues):
        self.node = node
        self.excluded = re.compile(excluded)
        self.sys_net = root / "sys" / "class" / "net"
        self.sys_ib = root / "sys" / "class" / "infiniband"
        self.snmp = root / "proc" / "net" / "snmp"
        self.netstat = root / "proc" / "net" / "netstat"
        self.queues = queues
        self._queues_failed = False

    def collect(self) -> Iterator[Metric]:
        up, carrier_changes, errors, speed, moved = (_family(n) for n in (
            "rankscope_node_network_up", "rankscope_node_network_carrier_changes_total",
            "rankscope_node_network_errors_total", "rankscope_node_network_speed_bytes",
            "rankscope_node_network_bytes_total"))
        devices = self.devices()
        for dev in devices:
            state = _read(dev / "operstate")
            carrier = _read(dev / "carrier")   # unreadable (EINVAL) while the device is administratively down
            # "unknown" is what drivers without operstate support report while the carrier is on.
            up.add_metric([self.node, dev.name], 1.0 if state == "up" or (state == "unknown" and carrier == "1")
                          else 0.0)
            changes = _number(dev / "carrier_changes")
            if changes is not None:
                carrier_changes.add_metric([self.node, dev.name], changes)
            mbits = _number(dev / "speed")   # unreadable while down; -1 where the driver does not know
            if mbits is not None and mbits > 0:
                speed.add_metric([self.node, dev.name], mbits * 125_000)
            for direction in ("rx", "tx"):
                count = _number(dev / "statistics" / f"{direction}_errors")
                if count is not None:
                    errors.add_metric([self.node, dev.name, direction], count)
                count = _number(dev / "statistics" / f"{direction}_bytes")
                if count is not None:
                    moved.add_metric([self.node, dev.name, direction], count)
        yield from (up, carrier_changes, errors, speed, moved)
        yield from self._queue_families({dev.name for dev in devices})
        yield from self._infiniband()
        yield from self._tcp()
        yield from self._ecn()

    def _queue_families(self, devices: set[str]) -> Iterator[Metric]:
        try:
            queues = self.queues()
        except Exception as e:   # no netlink here (a sandbox): the rest of the node's network still serves
            if not self._queues_failed:
                log.warning("network: queueing disciplines unreadable (%r): no qdisc series", e)
                self._queues_failed = True
            return
        backlog, overlimits, drops = (_family(n) for n in (
            "rankscope_node_network_qdisc_backlog_bytes", "rankscope_node_network_qdisc_overlimits_total",
            "rankscope_node_network_qdisc_drops_total"))
        for name in sorted(devices & set(queues)):
            q = queues[name]
            backlog.add_metric([self.node, name], q.backlog_bytes)
            overlimits.add_metric([self.node, name], q.overlimits)
            drops.add_metric([self.node, name], q.drops)
        yield from (backlog, overlimits, drops)

    def devices(self) -> list[Path]:
        try:
            found = sorted(self.sys_net.iterdir())
        except OSError:
            return []
        return [d for d in found if not self.excluded.fullmatch(d.name)]

    def _infiniband(self) -> Iterator[Metric]:
        ports = sorted(self.sys_ib.glob("*/ports/*")) if self.sys_ib.is_dir() else []
        if not ports:
            return
        downed, errors, rate, active, moved, xmit_wait, ecn = (_family(n) for n in (
            "rankscope_node_infiniband_link_downed_total", "rankscope_node_infiniband_errors_total",
            "rankscope_node_infiniband_rate_bytes", "rankscope_node_infiniband_port_active",
            "rankscope_node_infiniband_bytes_total", "rankscope_node_infiniband_xmit_wait_total",
            "rankscope_node_infiniband_congestion_total"))
        for port in ports:
            device = port.parent.parent.name
            labels = [self.node, device, port.name]
            counters = port / "counters"
            value = _number(counters / "link_downed")
            if value is not None:
                downed.add_metric(labels, value)
            for kind in IB_ERRORS:
                value = _number(counters / kind)
                if value is not None:
                    errors.add_metric(labels + [kind], value)
            gbits = _ib_rate_gbits(_read(port / "rate"))   # "200 Gb/sec (4X HDR)"
            if gbits is not None:
                rate.add_metric(labels, gbits * 125_000_000)
            state = _read(port / "state")                  # "4: ACTIVE"
            if state is not None:
                active.add_metric(labels, 1.0 if state.endswith("ACTIVE") else 0.0)
            for direction, name in (("rx", "port_rcv_data"), ("tx", "port_xmit_data")):
                value = _number(counters / name)
                if value is not None:   # counted in 4-byte words
                    moved.add_metric(labels + [direction], value * 4)
            value = _number(counters / "port_xmit_wait")
            if value is not None:
                xmit_wait.add_metric(labels, value)
            for kind in IB_ECN:
                value = _number(port / "hw_counters" / kind)
                if value is not None:
                    ecn.add_metric(labels + [kind], value)
        yield from (downed, errors, rate, active, moved, xmit_wait, ecn)

    def _tcp(self) -> Iterator[Metric]:
        tcp = read_snmp(self.snmp).get("Tcp", {})
        for name, key in (("rankscope_node_tcp_segments_sent_total", "OutSegs"),
                          ("rankscope_node_tcp_segments_retransmitted_total", "RetransSegs")):
            if key in tcp:
                family = _family(name)
                family.add_metric([self.node], tcp[key])
                yield family

    def _ecn(self) -> Iterator[Metric]:
        ip = read_snmp(self.netstat).get("IpExt", {})
        if "InCEPkts" in ip:
            family = _family("rankscope_node_ecn_congestion_marked_packets_total")
            family.add_metric([self.node], ip["InCEPkts"])
            yield family


def _ib_rate_gbits(text: str | None) -> float | None:
    match = re.match(r"\s*([0-9.]+)\s*Gb/sec", text or "")
    return float(match.group(1)) if match else None


def read_snmp(path: Path) -> dict[str, dict[str, float]]:
    """/proc/net/snmp (or /proc/net/netstat): each protocol's header line, then its values line."""
    out: dict[str, dict[str, float]] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for header, values in zip(lines[::2], lines[1::2]):
        proto, _, names = header.partition(":")
        _, _, numbers = values.partition(":")
        try:
            out[proto] = dict(zip(names.split(), map(float, numbers.split())))
        except ValueError:
            continue
    return out


def _family(name: str) -> GaugeMetricFamily | CounterMetricFamily:
    spec = BY_NAME[name]
    kind = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
    return kind(name.removesuffix("_total") if spec.kind == "counter" else name, spec.help,
                labels=list(spec.label_names))


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(path: Path) -> float | None:
    text = _read(path)
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
