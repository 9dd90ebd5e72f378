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

Read in the exporter's network namespace (a container's own, or the host's with
``hostNetwork``). Virtual devices (loopback, container veths and bridges) are
left out by default (``--network-devices``): they are not links between nodes,
and a node with many containers would otherwise add a series set per container.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rankscope.exporter.catalog import BY_NAME

# Devices that are not links between nodes (a container's veth, bridges, tunnels, loopback).
DEFAULT_EXCLUDED_DEVICES = r"lo|veth.*|docker.*|br-.*|virbr.*|cni.*|flannel.*|cali.*|tunl.*|kube-.*|vxlan.*|cilium.*"
# InfiniBand port counters read (/sys/class/infiniband/<dev>/ports/<n>/counters/<name>).
IB_ERRORS = ("symbol_error", "port_rcv_errors", "port_xmit_discards", "link_error_recovery",
             "local_link_integrity_errors", "excessive_buffer_overrun_errors")


class NetworkCollector(Collector):
    def __init__(self, node: str, excluded: str = DEFAULT_EXCLUDED_DEVICES, root: Path = Path("/")):
        self.node = node
        self.excluded = re.compile(excluded)
        self.sys_net = root / "sys" / "class" / "net"
        self.sys_ib = root / "sys" / "class" / "infiniband"
        self.snmp = root / "proc" / "net" / "snmp"

    def collect(self) -> Iterator[Metric]:
        up, carrier_changes, errors = (_family(n) for n in (
            "rankscope_node_network_up", "rankscope_node_network_carrier_changes_total",
            "rankscope_node_network_errors_total"))
        for dev in self.devices():
            state = _read(dev / "operstate")
            carrier = _read(dev / "carrier")   # unreadable (EINVAL) while the device is administratively down
            # "unknown" is what drivers without operstate support report while the carrier is on.
            up.add_metric([self.node, dev.name], 1.0 if state == "up" or (state == "unknown" and carrier == "1")
                          else 0.0)
            changes = _number(dev / "carrier_changes")
            if changes is not None:
                carrier_changes.add_metric([self.node, dev.name], changes)
            for direction in ("rx", "tx"):
                count = _number(dev / "statistics" / f"{direction}_errors")
                if count is not None:
                    errors.add_metric([self.node, dev.name, direction], count)
        yield from (up, carrier_changes, errors)
        yield from self._infiniband()
        yield from self._tcp()

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
        downed, errors = (_family(n) for n in ("rankscope_node_infiniband_link_downed_total",
                                               "rankscope_node_infiniband_errors_total"))
        for port in ports:
            device = port.parent.parent.name
            counters = port / "counters"
            value = _number(counters / "link_downed")
            if value is not None:
                downed.add_metric([self.node, device, port.name], value)
            for kind in IB_ERRORS:
                value = _number(counters / kind)
                if value is not None:
                    errors.add_metric([self.node, device, port.name, kind], value)
        yield from (downed, errors)

    def _tcp(self) -> Iterator[Metric]:
        tcp = read_snmp(self.snmp).get("Tcp", {})
        for name, key in (("rankscope_node_tcp_segments_sent_total", "OutSegs"),
                          ("rankscope_node_tcp_segments_retransmitted_total", "RetransSegs")):
            if key in tcp:
                family = _family(name)
                family.add_metric([self.node], tcp[key])
                yield family


def read_snmp(path: Path) -> dict[str, dict[str, float]]:
    """/proc/net/snmp: each protocol's header line, then its values line."""
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
