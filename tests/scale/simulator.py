"""Scale simulator: realistic rankscope node-exporter pages for N nodes x 8 ranks.

Each simulated node serves the page the real exporter served for the reference
trainer (``recorded_page.prom``, captured from a real torchrun job), with the
identities rewritten (run, rank, local_rank, node, GPU uuid) and the values
moving like a run's: steps advance, counters grow with the steps, heartbeats
are fresh. Each node also serves the exporter's NVML series for 8 GPUs (label
sets from the exporter's own catalog), joined to the ranks by ``gpu_uuid``.

Two runs share the cluster, each on half the nodes (two runs so that a hang
does not hide the straggler: the straggler alert stands down while its run
hangs):

- ``scale-a``: one straggler (compute 1.5x its peers' per step, from the
  start) and, from ``--fault-after`` seconds on, one rank with a NaN loss;
- ``scale-b``: from ``--fault-after`` seconds on, one rank stops outside any
  collective while all its peers wait in an all_reduce (the exporter's view of
  a hang: suspect flag, stuck states, in-flight collective).

Which ranks carry the faults is printed at start and written to
``--manifest`` (JSON), so a measurement can check the pages name them.

A few processes serve all nodes: process ``k`` listens on a free port (or
``base_port + k``) and serves every node ``i`` with ``i % processes == k`` at
``/node/<i>/metrics``. ``--targets`` writes a Prometheus ``file_sd`` /
static-config list with one target per node (``__metrics_path__`` and an
``instance`` label per node, so every node is its own target as in a real
cluster). Pages are pre-rendered format strings; only the numbers change.

    python -m tests.scale.simulator --nodes 64 --processes 2 \\
        --targets /tmp/targets.json --manifest /tmp/manifest.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from rankscope.contract import catalog as rank_catalog
from rankscope.exporter.catalog import BY_NAME, THROTTLE_REASONS

RECORDED = Path(__file__).with_name("recorded_page.prom")
RANKS_PER_NODE = 8
RUNS = ("scale-a", "scale-b")
STEP_SECONDS = 0.6  # a run's step time (set by its slowest rank)
STRAGGLER_FACTOR = 1.5  # the straggler's compute per step against its peers'
# A healthy rank's seconds per step in each phase; comm_wait is what is left of the step.
PHASES = {"data": 0.02, "forward": 0.12, "backward": 0.24, "optimizer": 0.02, "other": 0.01}
COMPUTE = ("forward", "backward", "optimizer")
ALL_REDUCES_PER_STEP = 4
BYTES_PER_STEP = 4 * 1024 * 1024
STATES = ("starting", "progressing", "stuck_in_collective", "stuck", "frozen", "dead", "finished")
SUSPECT_AFTER_S = 10.0  # the exporter's defaults (RANKSCOPE_SUSPECT_AFTER_S / _STUCK_AFTER_S)
STUCK_AFTER_S = 30.0
_LINE = re.compile(r'^(\w+)\{(.*)\} (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Layout:
    """Which node runs what; every process derives the same layout from the same arguments."""

    nodes: int
    start: float
    fault_after: float

    def run_of(self, node: int) -> tuple[str, int]:
        """(run, index of the node within the run)."""
        half = max(1, self.nodes // 2)
        return (RUNS[0], node) if node < half else (RUNS[1], node - half)

    def run_nodes(self, run: str) -> int:
        half = max(1, self.nodes // 2)
        return half if run == RUNS[0] else self.nodes - half

    def faults(self) -> dict[str, dict]:
        """The injected faults: the rank of each in its run, and its node (mid-run, not rank 0)."""
        a, b = self.run_nodes(RUNS[0]), self.run_nodes(RUNS[1])
        straggler = (a // 2) * RANKS_PER_NODE + 3
        nan = (a // 3) * RANKS_PER_NODE + 5
        hang = (b // 2) * RANKS_PER_NODE + 6
        return {
            "straggler": {"run": RUNS[0], "rank": straggler, "node": node_name(straggler // RANKS_PER_NODE)},
            "nan": {"run": RUNS[0], "rank": nan, "node": node_name(nan // RANKS_PER_NODE)},
            "hang": {"run": RUNS[1], "rank": hang,
                     "node": node_name(self.run_nodes(RUNS[0]) + hang // RANKS_PER_NODE)},
        }


def node_name(node: int) -> str:
    return f"node-{node:04d}"


def gpu_uuid(node: int, local_rank: int) -> str:
    return f"GPU-{zlib.crc32(node_name(node).encode()):08x}-{local_rank:04x}-sim"


def _labels(text: str) -> dict[str, str]:
    return dict(_LABEL.findall(text))


def _render_labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def load_recorded(path: Path = RECORDED) -> tuple[list[tuple[str, dict, str]], list[tuple[str, dict, str]]]:
    """The recorded page as (per-rank samples of one rank, node-level samples)."""
    rank_samples, node_samples = [], []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"unparsed line in {path}: {line}")
        name, labels, value = m.group(1), _labels(m.group(2)), m.group(3)
        if "rank" in labels:
            if labels["rank"] == "0":
                rank_samples.append((name, labels, value))
        else:
            node_samples.append((name, labels, value))
    # Device memory gauges and the device's peak FLOP/s exist only on CUDA ranks; the recording
    # is a CPU run.
    ident = {k: rank_samples[0][1][k] for k in ("local_rank", "node", "rank", "run")}
    for name in ("rankscope_device_memory_allocated_bytes", "rankscope_device_memory_reserved_bytes",
                 "rankscope_device_memory_peak_allocated_bytes", "rankscope_device_peak_flops"):
        rank_samples.append((name, dict(ident), "0"))
    # Series added to the catalog after the recording (goodput, data wait, model FLOPs), with the
    # label sets the rank writes them with.
    recorded = {n for n, _, _ in rank_samples}
    if "rankscope_wall_seconds_total" not in recorded:
        for category in rank_catalog.GOODPUT_CATEGORIES:
            rank_samples.append(("rankscope_wall_seconds_total", {**ident, "category": category}, "0"))
    if "rankscope_data_wait_seconds_count" not in recorded:
        for le in (*rank_catalog.DATA_WAIT_BUCKETS, "+Inf"):
            rank_samples.append(("rankscope_data_wait_seconds_bucket", {**ident, "le": _le(le)}, "0"))
        rank_samples.append(("rankscope_data_wait_seconds_sum", dict(ident), "0"))
        rank_samples.append(("rankscope_data_wait_seconds_count", dict(ident), "0"))
    if "rankscope_model_flops_total" not in recorded:
        rank_samples.append(("rankscope_model_flops_total", dict(ident), "0"))
    if "rankscope_step_last_compute_seconds" not in recorded:
        rank_samples.append(("rankscope_step_last_compute_seconds", dict(ident), "0"))
    if "rankscope_rank_layout_info" not in recorded:   # a data-parallel job: no stages, no tensor parallelism
        rank_samples.append(("rankscope_rank_layout_info", {**ident, "stage": "", "tp_group": "", "mesh": ""}, "1"))
    return rank_samples, node_samples


def _le(bound) -> str:
    """A bucket bound as prometheus_client writes it (0.5 -> "0.5", 1 -> "1.0")."""
    return bound if isinstance(bound, str) else repr(float(bound))


def _value_key(name: str, labels: dict[str, str]) -> str | None:
    """Which simulated quantity a per-rank sample shows; None keeps the recorded value."""
    if name == "rankscope_phase_seconds_total":
        return f"phase_{labels['phase']}"
    if name == "rankscope_rank_state":
        return f"state_{labels['state']}"
    if name == "rankscope_nonfinite_total":
        return f"nonfinite_{labels['what']}"
    if name == "rankscope_wall_seconds_total":
        return f"wall_{labels['category']}"
    if name.endswith("_bucket"):
        base = name[: -len("_bucket")]
        return f"{base}@{labels['le']}"
    if name in ("rankscope_collective_in_flight", "rankscope_collective_started_timestamp_seconds",
                "rankscope_collective_in_flight_seconds",
                "rankscope_process_group_in_flight_started_timestamp_seconds"):
        return name
    if name in ("rankscope_process_group_collectives_total", "rankscope_process_group_collective_bytes_total"):
        return f"{name}@{labels['op']}"
    simulated = {
        "rankscope_steps_total", "rankscope_step", "rankscope_samples_total", "rankscope_tokens_total",
        "rankscope_step_duration_seconds_sum", "rankscope_step_duration_seconds_count",
        "rankscope_step_last_duration_seconds", "rankscope_step_last_compute_seconds",
        "rankscope_last_step_timestamp_seconds", "rankscope_collective_duration_seconds_sum", "rankscope_collective_duration_seconds_count",
        "rankscope_collective_last_duration_seconds", "rankscope_collective_bytes_total",
        "rankscope_loss", "rankscope_loss_ema", "rankscope_loss_zscore", "rankscope_grad_norm",
        "rankscope_heartbeat_timestamp_seconds", "rankscope_heartbeat_age_seconds",
        "rankscope_step_stalled_seconds", "rankscope_hang_suspect", "rankscope_rank_up",
        "rankscope_rank_start_timestamp_seconds", "rankscope_process_group_last_enqueued_seq",
        "rankscope_process_group_last_completed_seq", "rankscope_device_memory_total_bytes",
        "rankscope_device_memory_allocated_bytes", "rankscope_device_memory_reserved_bytes",
        "rankscope_device_memory_peak_allocated_bytes", "rankscope_device_peak_flops", "rankscope_model_flops_total",
        "rankscope_data_wait_seconds_sum", "rankscope_data_wait_seconds_count",
    }
    return name if name in simulated else None


def _fmt(v: float) -> str:
    if v != v:
        return "NaN"
    return repr(float(v))


class NodePage:
    """One simulated node's page: a format string built once, filled per scrape."""

    def __init__(self, layout: Layout, node: int, rank_samples, node_samples) -> None:
        self.layout, self.node = layout, node
        self.run, self.index = layout.run_of(node)
        self.world = layout.run_nodes(self.run) * RANKS_PER_NODE
        self.ranks = [self.index * RANKS_PER_NODE + lr for lr in range(RANKS_PER_NODE)]
        faults = layout.faults()
        self.role = {}
        for kind, f in faults.items():
            if f["run"] == self.run and f["rank"] in self.ranks:
                self.role[f["rank"]] = kind
        self.hang_rank = faults["hang"]["rank"] if self.run == faults["hang"]["run"] else None
        parts: list[str] = []
        self.keys: list[tuple[int, str | None, str]] = []  # (local rank or -1, key, recorded value)
        name = node_name(node)
        for lr, rank in enumerate(self.ranks):
            for metric, labels, value in rank_samples:
                labels = dict(labels, run=self.run, rank=str(rank), local_rank=str(lr), node=name)
                if metric == "rankscope_rank_info":
                    labels.update(hostname=name, device=f"cuda:{lr}", backend="nccl", gpu_uuid=gpu_uuid(node, lr),
                                  world_size=str(self.world), local_world_size=str(RANKS_PER_NODE),
                                  process_id=str(1000 + lr), nccl_version="2.21.5")
                parts.append(f"{metric}{{{_render_labels(labels)}}} %s\n")
                self.keys.append((lr, _value_key(metric, labels), value))
        for metric, labels, value in node_samples:
            labels = dict(labels)
            if "node" in labels:
                labels["node"] = name
            if "directory" in labels:
                labels["directory"] = "/dev/shm/rankscope-0"
            parts.append(f"{metric}{{{_render_labels(labels)}}} %s\n")
            key = f"exporter_ranks_{labels['state']}" if metric == "rankscope_exporter_ranks" else None
            self.keys.append((-1, key, value))
        for gpu in range(RANKS_PER_NODE):
            base = {"node": name, "gpu": str(gpu), "uuid": gpu_uuid(node, gpu)}
            for metric in (m for m in BY_NAME if m.startswith("rankscope_gpu_")):
                extra: list[dict[str, str]] = [{}]
                if metric == "rankscope_gpu_info":
                    extra = [{"name": "NVIDIA H100 80GB HBM3", "driver_version": "550.54.15"}]
                elif metric == "rankscope_gpu_throttled":
                    extra = [{"reason": r} for r in THROTTLE_REASONS]
                elif metric == "rankscope_gpu_ecc_errors_total":
                    extra = [{"type": "corrected"}, {"type": "uncorrected"}]
                for e in extra:
                    parts.append(f"{metric}{{{_render_labels({**base, **e})}}} %s\n")
                    self.keys.append((gpu, f"gpu:{metric}", "0"))
        self.template = "".join(parts)
        self.bucket_bounds = sorted({k.split("@", 1)[1] for _, k, _ in self.keys
                                     if k and "@" in k and k.split("@", 1)[0].endswith("_seconds")})
        self.data_wait_bounds = sorted({k.split("@", 1)[1] for _, k, _ in self.keys
                                        if k and k.startswith("rankscope_data_wait_seconds@")})

    def rank_values(self, lr: int, now: float) -> dict[str, float]:
        """The quantities one rank shows at ``now``."""
        lo = self.layout
        rank = self.ranks[lr]
        role = self.role.get(rank)
        faulted = now >= lo.start + lo.fault_after
        elapsed = max(0.0, now - lo.start)
        # A little per-rank variation, stable over time, so medians and spreads are not degenerate.
        jitter = 1.0 + ((zlib.crc32(f"{self.run}/{rank}".encode()) % 61) - 30) / 1000.0
        hang_at = lo.start + lo.fault_after
        hung_run = self.hang_rank is not None and faulted
        stop = min(now, hang_at) if hung_run else now
        steps = math.floor(max(0.0, stop - lo.start) / STEP_SECONDS)
        if hung_run and rank != self.hang_rank:
            steps += 0  # peers finished the same step and wait in its first all_reduce
        last_step_ts = lo.start + steps * STEP_SECONDS
        phase = {p: s * jitter for p, s in PHASES.items()}
        if role == "straggler":
            for p in COMPUTE:
                phase[p] *= STRAGGLER_FACTOR
        phase["comm_wait"] = max(0.002, STEP_SECONDS - sum(phase.values()))
        v: dict[str, float] = {f"phase_{p}": steps * s for p, s in phase.items()}
        step_s = sum(phase.values())
        v.update({
            "rankscope_steps_total": steps, "rankscope_step": steps,
            "rankscope_samples_total": steps * 32.0, "rankscope_tokens_total": steps * 32.0 * 4096,
            "rankscope_step_duration_seconds_sum": steps * step_s,
            "rankscope_step_duration_seconds_count": steps,
            "rankscope_step_last_duration_seconds": step_s,
            "rankscope_step_last_compute_seconds": sum(phase[p] for p in COMPUTE),
            "rankscope_last_step_timestamp_seconds": last_step_ts,
            "rankscope_collective_duration_seconds_sum": steps * ALL_REDUCES_PER_STEP * phase["comm_wait"] / 2,
            "rankscope_collective_duration_seconds_count": steps * ALL_REDUCES_PER_STEP,
            "rankscope_collective_last_duration_seconds": phase["comm_wait"] / 2,
            "rankscope_collective_bytes_total": steps * BYTES_PER_STEP,
            "rankscope_loss": 0.4 + 2.0 * math.exp(-steps / 3000.0) * jitter,
            "rankscope_loss_zscore": (jitter - 1.0) * 10,
            "rankscope_grad_norm": 0.4 * jitter,
            "rankscope_heartbeat_timestamp_seconds": now - 0.2,
            "rankscope_heartbeat_age_seconds": 0.2,
            "rankscope_step_stalled_seconds": now - last_step_ts,
            "rankscope_hang_suspect": 0.0, "rankscope_rank_up": 1.0,
            "rankscope_rank_start_timestamp_seconds": lo.start - 20.0,
            "rankscope_process_group_last_enqueued_seq": steps * ALL_REDUCES_PER_STEP + 6,
            "rankscope_process_group_last_completed_seq": steps * ALL_REDUCES_PER_STEP + 6,
            "rankscope_device_memory_total_bytes": 80e9,
            "rankscope_device_memory_allocated_bytes": 52e9 * jitter,
            "rankscope_device_memory_reserved_bytes": 60e9 * jitter,
            "rankscope_device_memory_peak_allocated_bytes": 58e9 * jitter,
            "rankscope_collective_in_flight": 0.0, "rankscope_collective_started_timestamp_seconds": 0.0,
            "rankscope_collective_in_flight_seconds": 0.0,
            "rankscope_process_group_in_flight_started_timestamp_seconds": 0.0,
            "nonfinite_loss": 1.0 if role == "nan" and faulted else 0.0, "nonfinite_grad": 0.0,
        })
        v["rankscope_loss_ema"] = v["rankscope_loss"]
        # Goodput: the step's compute is productive, its data wait is data_wait, the rest of the
        # wall time since the run started is start-up (20 s) and idle (the hung rank's wait).
        wall = {c: 0.0 for c in rank_catalog.GOODPUT_CATEGORIES}
        wall["startup"] = 20.0
        wall["data_wait"] = steps * phase["data"]
        wall["productive"] = steps * (step_s - phase["data"])
        wall["idle"] = max(0.0, elapsed - wall["data_wait"] - wall["productive"])
        v.update({f"wall_{c}": s for c, s in wall.items()})
        v["rankscope_data_wait_seconds_sum"] = steps * phase["data"]
        v["rankscope_data_wait_seconds_count"] = steps
        v["rankscope_model_flops_total"] = steps * 32.0 * 4096 * 6 * 1.3e9   # a 1.3 B-parameter model, 6N per token
        v["rankscope_device_peak_flops"] = 989.4e12                          # H100 SXM, dense bf16
        if role == "nan" and faulted:
            v["rankscope_loss"] = float("nan")
        for op, per_step in (("all_reduce", ALL_REDUCES_PER_STEP), ("broadcast", 0), ("all_gather", 0), ("barrier", 0)):
            v[f"rankscope_process_group_collectives_total@{op}"] = steps * per_step + (4 if op == "broadcast" else 1)
            v[f"rankscope_process_group_collective_bytes_total@{op}"] = steps * BYTES_PER_STEP * (op == "all_reduce")
        for le in self.bucket_bounds:
            bound = math.inf if le == "+Inf" else float(le)
            # 90% of steps near the mean step time, 10% up to 1.5x it.
            frac = (0.9 if bound >= step_s else 0.0) + (0.1 if bound >= 1.5 * step_s else 0.0)
            v[f"rankscope_step_duration_seconds@{le}"] = steps * frac
            cfrac = 1.0 if bound >= phase["comm_wait"] else 0.0
            v[f"rankscope_collective_duration_seconds@{le}"] = steps * ALL_REDUCES_PER_STEP * cfrac
        for le in self.data_wait_bounds:
            bound = math.inf if le == "+Inf" else float(le)
            v[f"rankscope_data_wait_seconds@{le}"] = steps if bound >= phase["data"] else 0.0
        state = "progressing"
        if hung_run:
            waited = now - hang_at
            if rank == self.hang_rank:
                v["rankscope_hang_suspect"] = 1.0 if waited >= SUSPECT_AFTER_S else 0.0
                state = "stuck" if waited >= STUCK_AFTER_S else "progressing"
            else:
                v["rankscope_collective_in_flight"] = 1.0
                v["rankscope_collective_started_timestamp_seconds"] = hang_at
                v["rankscope_collective_in_flight_seconds"] = waited
                v["rankscope_process_group_in_flight_started_timestamp_seconds"] = hang_at
                v["rankscope_process_group_last_enqueued_seq"] += 1
                state = "stuck_in_collective" if waited >= STUCK_AFTER_S else "progressing"
        for s in STATES:
            v[f"state_{s}"] = 1.0 if s == state else 0.0
        return v

    def gpu_values(self, gpu: int, now: float) -> dict[str, float]:
        elapsed = now - self.layout.start
        return {
            "gpu:rankscope_gpu_info": 1.0, "gpu:rankscope_gpu_utilization_ratio": 0.93,
            "gpu:rankscope_gpu_memory_utilization_ratio": 0.41, "gpu:rankscope_gpu_memory_used_bytes": 61e9,
            "gpu:rankscope_gpu_memory_total_bytes": 80e9, "gpu:rankscope_gpu_power_watts": 610.0,
            "gpu:rankscope_gpu_power_limit_watts": 700.0, "gpu:rankscope_gpu_energy_joules_total": 610.0 * elapsed,
            "gpu:rankscope_gpu_temperature_celsius": 64.0, "gpu:rankscope_gpu_sm_clock_hertz": 1.98e9,
            "gpu:rankscope_gpu_throttled": 0.0, "gpu:rankscope_gpu_ecc_errors_total": 0.0,
            "gpu:rankscope_gpu_xid_errors_total": 0.0, "gpu:rankscope_gpu_last_xid": 0.0,
        }

    def render(self, now: float | None = None) -> bytes:
        now = time.time() if now is None else now
        ranks = [self.rank_values(lr, now) for lr in range(RANKS_PER_NODE)]
        gpus = [self.gpu_values(g, now) for g in range(RANKS_PER_NODE)]
        counts = {s: sum(r[f"state_{s}"] for r in ranks) for s in STATES}
        values = []
        for who, key, recorded in self.keys:
            if key is None:
                values.append(recorded)
            elif key.startswith("gpu:"):
                values.append(_fmt(gpus[who][key]))
            elif who < 0:
                values.append(_fmt(counts[key[len("exporter_ranks_"):]]))
            else:
                values.append(_fmt(ranks[who][key]))
        return (self.template % tuple(values)).encode()


_PAGES: dict[int, NodePage] = {}  # this server process's nodes


def serve(layout: Layout, nodes: list[int], server: ThreadingHTTPServer) -> None:
    """In a server process: serve ``nodes`` at /node/<i>/metrics on ``server`` until SIGTERM."""
    rank_samples, node_samples = load_recorded()
    _PAGES.update({i: NodePage(layout, i, rank_samples, node_samples) for i in nodes})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server.serve_forever()


def make_server(port: int) -> ThreadingHTTPServer:
    """A server bound in the parent (port 0: any free one), so the targets are known before the fork."""
    pages = _PAGES

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            m = re.fullmatch(r"/node/(\d+)/metrics", self.path.split("?")[0])
            page = pages.get(int(m.group(1))) if m else None
            if page is None:
                self.send_error(404)
                return
            body = page.render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


def targets(nodes: int, ports: list[int]) -> list[dict]:
    """One scrape target per node, in file_sd / static_configs form."""
    return [{"targets": [f"127.0.0.1:{ports[i % len(ports)]}"],
             "labels": {"__metrics_path__": f"/node/{i}/metrics", "instance": f"{node_name(i)}:9400"}}
            for i in range(nodes)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, required=True)
    ap.add_argument("--processes", type=int, default=2, help="server processes (each serves nodes i %% P == k)")
    ap.add_argument("--base-port", type=int, default=0, help="process k listens on base-port + k (0: free ports)")
    ap.add_argument("--fault-after", type=float, default=180.0,
                    help="seconds after start when the NaN and the hang begin (the straggler is slow from the start)")
    ap.add_argument("--start", type=float, default=None, help="the runs' start time (default: now)")
    ap.add_argument("--targets", type=Path, help="write the scrape targets (file_sd JSON) here")
    ap.add_argument("--manifest", type=Path, help="write the layout and the injected faults (JSON) here")
    args = ap.parse_args(argv)
    layout = Layout(args.nodes, args.start or time.time(), args.fault_after)
    servers = [make_server(args.base_port + k if args.base_port else 0) for k in range(args.processes)]
    ports = [srv.server_address[1] for srv in servers]
    if args.targets:
        args.targets.write_text(json.dumps(targets(args.nodes, ports), indent=1))
    manifest = {"nodes": args.nodes, "ranks_per_node": RANKS_PER_NODE, "start": layout.start,
                "fault_at": layout.start + layout.fault_after, "runs": list(RUNS), "faults": layout.faults(),
                "ports": ports, "pid": os.getpid()}
    if args.manifest:
        args.manifest.write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest), flush=True)
    procs = []
    for k in range(args.processes):  # fork: each child inherits its bound socket
        nodes = [i for i in range(args.nodes) if i % args.processes == k]
        p = multiprocessing.get_context("fork").Process(target=serve, args=(layout, nodes, servers[k]), daemon=True)
        p.start()
        procs.append(p)

    def stop(*_):
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(5)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(p.is_alive() for p in procs):
        time.sleep(1)
    stop()
    return 1


if __name__ == "__main__":
    sys.exit(main())
