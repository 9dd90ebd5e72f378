"""The exporter's network collector (rankscope.exporter.network) on a built /sys and /proc
tree, and on this machine's own."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.exposition import generate_latest

from rankscope.exporter.network import NetworkCollector, QueueStats, read_snmp

SNMP = """Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1000
Tcp: RtoAlgorithm RtoMin ActiveOpens OutSegs RetransSegs
Tcp: 1 200 10 5000 42
"""


def served(collector: NetworkCollector) -> dict[tuple, float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}


def device(root: Path, name: str, operstate: str, carrier: str | None, changes: int, rx: int = 0, tx: int = 0,
           speed: str | None = None, tx_bytes: int | None = None) -> None:
    d = root / "sys/class/net" / name
    (d / "statistics").mkdir(parents=True)
    (d / "operstate").write_text(operstate + "\n")
    if carrier is not None:
        (d / "carrier").write_text(carrier + "\n")
    (d / "carrier_changes").write_text(f"{changes}\n")
    (d / "statistics/rx_errors").write_text(f"{rx}\n")
    (d / "statistics/tx_errors").write_text(f"{tx}\n")
    if speed is not None:
        (d / "speed").write_text(speed + "\n")
    if tx_bytes is not None:
        (d / "statistics/tx_bytes").write_text(f"{tx_bytes}\n")


def test_links_tcp_and_infiniband_from_the_node_tree(tmp_path):
    device(tmp_path, "eth0", "up", "1", 2, rx=3)
    device(tmp_path, "fab0", "down", None, 5)           # administratively down: carrier unreadable
    device(tmp_path, "ens1", "unknown", "1", 0)         # a driver without operstate, carrier on
    device(tmp_path, "lo", "unknown", "1", 0)           # not a link between nodes
    device(tmp_path, "veth1a2b", "up", "1", 0)          # a container's
    counters = tmp_path / "sys/class/infiniband/mlx5_0/ports/1/counters"
    counters.mkdir(parents=True)
    (counters / "link_downed").write_text("1\n")
    (counters / "symbol_error").write_text("7\n")
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/snmp").write_text(SNMP)
    got = served(NetworkCollector("n1", root=tmp_path))
    up = {dict(k)["device"]: v for (name, k), v in got.items() if name == "rankscope_node_network_up"}
    assert up == {"eth0": 1.0, "fab0": 0.0, "ens1": 1.0}
    assert got[("rankscope_node_network_carrier_changes_total", (("device", "fab0"), ("node", "n1")))] == 5
    assert got[("rankscope_node_network_errors_total", (("device", "eth0"), ("direction", "rx"), ("node", "n1")))] == 3
    assert got[("rankscope_node_infiniband_link_downed_total", (("device", "mlx5_0"), ("node", "n1"), ("port", "1")))] == 1
    assert got[("rankscope_node_infiniband_errors_total",
                (("device", "mlx5_0"), ("node", "n1"), ("port", "1"), ("type", "symbol_error")))] == 7
    assert got[("rankscope_node_tcp_segments_sent_total", (("node", "n1"),))] == 5000
    assert got[("rankscope_node_tcp_segments_retransmitted_total", (("node", "n1"),))] == 42


def test_a_link_that_queues_instead_of_dropping(tmp_path):
    """A slow link that drops nothing shows in what the node queues: the device's speed and
    bytes, its root qdisc's backlog and overlimits, InfiniBand's rate, state, data and
    xmit_wait (lossless back-pressure), RoCE's ECN counters and IP's CE marks."""
    device(tmp_path, "fab0", "up", "1", 0, speed="25000", tx_bytes=10**9)
    device(tmp_path, "eth1", "up", "1", 0, speed="-1")           # a driver that does not know its speed
    port = tmp_path / "sys/class/infiniband/mlx5_0/ports/1"
    (port / "counters").mkdir(parents=True)
    (port / "hw_counters").mkdir()
    (port / "rate").write_text("200 Gb/sec (4X HDR)\n")
    (port / "state").write_text("4: ACTIVE\n")
    (port / "counters/port_xmit_data").write_text("1000\n")
    (port / "counters/port_xmit_wait").write_text("12345\n")
    (port / "hw_counters/np_ecn_marked_roce_packets").write_text("9\n")
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/netstat").write_text("IpExt: InNoRoutes InCEPkts\nIpExt: 0 17\n")
    queues = {"fab0": QueueStats(backlog_bytes=48_000, overlimits=321, drops=0), "lo": QueueStats(0, 0, 0)}
    got = served(NetworkCollector("n1", root=tmp_path, queues=lambda: queues))
    fab0 = (("device", "fab0"), ("node", "n1"))
    assert got[("rankscope_node_network_speed_bytes", fab0)] == 25_000 * 125_000   # 25 Gb/s
    assert not [k for k in got if k[0] == "rankscope_node_network_speed_bytes" and ("device", "eth1") in k[1]]
    assert got[("rankscope_node_network_bytes_total", (("device", "fab0"), ("direction", "tx"), ("node", "n1")))] == 1e9
    assert got[("rankscope_node_network_qdisc_backlog_bytes", fab0)] == 48_000
    assert got[("rankscope_node_network_qdisc_overlimits_total", fab0)] == 321
    assert got[("rankscope_node_network_qdisc_drops_total", fab0)] == 0
    assert not [k for k in got if "qdisc" in k[0] and ("device", "lo") in k[1]]   # lo is not a link
    ib = (("device", "mlx5_0"), ("node", "n1"), ("port", "1"))
    assert got[("rankscope_node_infiniband_rate_bytes", ib)] == 200 * 125_000_000
    assert got[("rankscope_node_infiniband_port_active", ib)] == 1
    assert got[("rankscope_node_infiniband_bytes_total",
                (("device", "mlx5_0"), ("direction", "tx"), ("node", "n1"), ("port", "1")))] == 4000   # 4-byte words
    assert got[("rankscope_node_infiniband_xmit_wait_total", ib)] == 12345
    assert got[("rankscope_node_infiniband_congestion_total", ib + (("type", "np_ecn_marked_roce_packets"),))] == 9
    assert got[("rankscope_node_ecn_congestion_marked_packets_total", (("node", "n1"),))] == 17


def test_unreadable_queues_leave_the_rest_of_the_network_served(tmp_path):
    device(tmp_path, "fab0", "up", "1", 0)

    def no_netlink():
        raise PermissionError("netlink")

    got = served(NetworkCollector("n1", root=tmp_path, queues=no_netlink))
    assert got[("rankscope_node_network_up", (("device", "fab0"), ("node", "n1")))] == 1
    assert not [k for k in got if "qdisc" in k[0]]


def test_a_node_without_the_files_serves_nothing_and_does_not_fail(tmp_path):
    assert served(NetworkCollector("n1", root=tmp_path, queues=dict)) == {}
    assert read_snmp(tmp_path / "nope") == {}


def test_this_machines_own_network():
    got = served(NetworkCollector("here"))
    assert got[("rankscope_node_tcp_segments_sent_total", (("node", "here"),))] >= 0   # read from /proc/net/snmp
    devices = {dict(k)["device"] for (name, k), _ in got.items() if name == "rankscope_node_network_up"}
    assert "lo" not in devices and all(not d.startswith("veth") for d in devices)
