"""Two simulated nodes with a real network between them, for the network faults of the fault
matrix (root only: ``ip netns``, veth pairs and ``tc``).

    with Fabric() as fabric:
        fabric.exec_prefix(1)     # ["ip", "netns", "exec", <node b's namespace>]: run a node's job in it
        fabric.link_down()        # node b's side of the fabric link down (a pulled cable)
        fabric.throttle("2mbit")  # node b's egress on the fabric limited (tbf): a degraded NIC or port
        fabric.slow_link("2mbit") # node b's own port shaped with a deep queue: a slow link that drops nothing

Each node is a network namespace with two links:

* ``fab0``, the fabric (10.231.K.1 and .2): a veth pair from the node to its port on a
  switch, a third namespace whose bridge joins the ports ``swa`` and ``swb``. The job's
  collectives use it (``GLOO_SOCKET_IFNAME=fab0``, the rendezvous on node a's fabric
  address). Faults are made at the switch, as on a real fabric: node b's port down
  (its ``fab0`` loses its carrier), or the port towards node a throttled, so that the
  switch drops node b's packets and node b's TCP retransmits them (throttled at the
  sender itself, TCP's local back-pressure keeps the queue from ever dropping);
* ``mgmt0``, the management network: a veth pair to this (root) namespace
  (10.232.K.4i+1 here, .4i+2 in the node), over which Prometheus scrapes the
  node's exporter. A fault on the fabric leaves it alone, as on a real cluster.

Only addresses inside the namespaces this helper creates are used; everything is
removed on exit (deleting a namespace deletes its veths, and their peers with them).
"""

from __future__ import annotations

import itertools
import os
import subprocess
import tempfile
import threading

FABRIC_DEVICE = "fab0"
_taken: set[int] = set()
_lock = threading.Lock()


def available() -> bool:
    """Whether this machine lets the tests build namespaces (root, iproute2)."""
    if os.geteuid() != 0:
        return False
    try:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Fabric:
    def __init__(self) -> None:
        with _lock:
            used = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
            self.k = next(k for k in itertools.count(1) if k not in _taken and f"10.232.{k}." not in used)
            _taken.add(self.k)
        tag = f"rs{os.getpid() % 10000}x{self.k}"
        self.namespaces = [f"{tag}a", f"{tag}b"]
        self.switch = f"{tag}s"
        self._root_mgmt = [f"rsm{self.k}a{os.getpid() % 1000}", f"rsm{self.k}b{os.getpid() % 1000}"]
        self._files: list[str] = []

    # -- addresses -------------------------------------------------------------------
    def fabric_ip(self, node: int) -> str:
        return f"10.231.{self.k}.{node + 1}"

    def mgmt_ip(self, node: int) -> str:
        """Where this namespace reaches node ``node`` (its exporter)."""
        return f"10.232.{self.k}.{4 * node + 2}"

    def exec_prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node]]

    # -- faults ----------------------------------------------------------------------
    def link_down(self) -> None:
        """Node b's switch port down (a pulled cable): both ends lose the carrier."""
        _ip("-n", self.switch, "link", "set", "swb", "down")

    def link_up(self) -> None:
        _ip("-n", self.switch, "link", "set", "swb", "up")

    def throttle(self, rate: str) -> None:
        """What node b sends through the switch limited to ``rate`` by a token bucket on the
        port towards node a (packets beyond its 100 ms queue are dropped; node b retransmits)."""
        subprocess.run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", "swa",
                        "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "100ms"],
                       check=True, capture_output=True, timeout=30)

    def slow_link(self, rate: str) -> None:
        """Node b's own fabric port sends at ``rate`` through a token bucket with a deep queue
        (400 ms): a link that queues instead of dropping, as a lossless fabric under flow control
        or a NIC trained at a lower speed do. Shaped at the sender, TCP's local back-pressure keeps
        the queue from dropping: nothing is retransmitted, and node b's qdisc counts its
        overlimits."""
        subprocess.run(["ip", "netns", "exec", self.namespaces[1], "tc", "qdisc", "add", "dev", FABRIC_DEVICE,
                        "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                       check=True, capture_output=True, timeout=30)

    def link_speed_prefix(self, node: int, mbits: int) -> list[str]:
        """A command prefix (TrainJob's ``wrap``) that runs in node ``node``'s namespace with its
        fabric port's sysfs ``speed`` reading ``mbits``: a veth's speed is fixed (10000), so the port
        "trained at a lower speed" is a file bind-mounted over the attribute, in a mount namespace
        of the command's own. Whatever reads the port's speed there (the node exporter) sees it;
        the link itself is unchanged."""
        fd, path = tempfile.mkstemp(prefix="rankscope-speed-")
        os.write(fd, f"{mbits}\n".encode())
        os.close(fd)
        self._files.append(path)
        script = f'mount --bind {path} /sys/class/net/{FABRIC_DEVICE}/speed && exec "$@"'
        return [*self.exec_prefix(node), "unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]

    # -- building and removing -------------------------------------------------------
    def __enter__(self) -> "Fabric":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        for ns in (*self.namespaces, self.switch):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for node, ns in enumerate(self.namespaces):
            end, port = f"rsf{self.k}{'ab'[node]}{os.getpid() % 1000}", f"rsp{self.k}{'ab'[node]}{os.getpid() % 1000}"
            _ip("link", "add", end, "type", "veth", "peer", "name", port)
            _ip("link", "set", end, "netns", ns)
            _ip("-n", ns, "link", "set", end, "name", FABRIC_DEVICE)
            _ip("-n", ns, "addr", "add", f"{self.fabric_ip(node)}/24", "dev", FABRIC_DEVICE)
            _ip("-n", ns, "link", "set", FABRIC_DEVICE, "up")
            swport = "sw" + "ab"[node]
            _ip("link", "set", port, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "name", swport)
            _ip("-n", self.switch, "link", "set", swport, "master", "br0")
            _ip("-n", self.switch, "link", "set", swport, "up")
        for node, (ns, root_end) in enumerate(zip(self.namespaces, self._root_mgmt)):
            inner = f"rsn{self.k}{'ab'[node]}{os.getpid() % 1000}"
            _ip("link", "add", root_end, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", ns)
            _ip("-n", ns, "link", "set", inner, "name", "mgmt0")
            _ip("addr", "add", f"10.232.{self.k}.{4 * node + 1}/30", "dev", root_end)
            _ip("link", "set", root_end, "up")
            _ip("-n", ns, "addr", "add", f"{self.mgmt_ip(node)}/30", "dev", "mgmt0")
            _ip("-n", ns, "link", "set", "mgmt0", "up")

    def close(self) -> None:
        for ns in (*self.namespaces, self.switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for dev in self._root_mgmt:   # gone with their peers; in case a build stopped half-way
            subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=30)
        for path in self._files:
            os.unlink(path)
        self._files.clear()
        with _lock:
            _taken.discard(self.k)
