"""``rankscope-exporter`` / ``python -m rankscope.exporter``: the per-node service."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from rankscope.exporter.collector import NodeCollector
from rankscope.exporter.config import ExporterConfig, ExporterConfigError, default_node
from rankscope.exporter.server import make_app, serve
from rankscope.exporter.webconfig import load_web_config

log = logging.getLogger("rankscope.exporter")


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ExporterConfigError(f"{name}={raw!r} is not a number") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankscope-exporter",
                                description="Serve /metrics for every training rank of this node.")
    p.add_argument("--dir", type=Path, default=None,
                   help="metrics directory shared with the ranks (default: RANKSCOPE_METRICS_DIR or /dev/shm/rankscope-UID)")
    p.add_argument("--addr", default=os.environ.get("RANKSCOPE_METRICS_ADDR", "127.0.0.1"),
                   help="bind address (default 127.0.0.1; 0.0.0.0 exposes it to the network: see README, Security)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: RANKSCOPE_METRICS_PORT or 9400)")
    p.add_argument("--node", default=None, help="node label (default: RANKSCOPE_NODE, SLURMD_NODENAME, NODE_NAME or hostname)")
    p.add_argument("--stuck-after", type=float, default=None, help="seconds without a step before a live rank is stuck (30)")
    p.add_argument("--frozen-after", type=float, default=None, help="seconds without a heartbeat before a live rank is frozen (10)")
    p.add_argument("--suspect-after", type=float, default=None,
                   help="seconds peers wait in a collective before a rank outside it is a hang suspect (10)")
    p.add_argument("--retention", type=float, default=900.0, help="seconds a finished or dead run is still served (900)")
    p.add_argument("--exit-when-idle", type=float, default=0.0,
                   help="exit after no rank has been alive for this many seconds (0: never)")
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs through NVML")
    p.add_argument("--web-config", type=Path, default=None,
                   help="exporter-toolkit web configuration file (TLS, basic auth)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace) -> ExporterConfig:
    from rankscope.contract.rundir import default_metrics_dir

    directory = args.dir or Path(os.environ.get("RANKSCOPE_METRICS_DIR") or default_metrics_dir())
    port = args.port if args.port is not None else int(_env_float("RANKSCOPE_METRICS_PORT", 9400))
    return ExporterConfig(
        directory=directory, addr=args.addr, port=port, node=args.node or default_node(),
        stuck_after_s=args.stuck_after or _env_float("RANKSCOPE_STUCK_AFTER_S", 30.0),
        frozen_after_s=args.frozen_after or _env_float("RANKSCOPE_FROZEN_AFTER_S", 10.0),
        suspect_after_s=args.suspect_after or _env_float("RANKSCOPE_SUSPECT_AFTER_S", 10.0),
        retention_s=args.retention, exit_when_idle_s=args.exit_when_idle, nvml=not args.no_nvml,
        web_config=args.web_config,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s rankscope-exporter %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        _prepare_directory(cfg.directory)
        web = load_web_config(cfg.web_config) if cfg.web_config is not None else None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(NodeCollector(cfg))
        app = make_app(cfg, registry, threading.Lock(), web)
    except ExporterConfigError as e:
        print(f"rankscope-exporter: error: {e}", file=sys.stderr)
        return 2
    try:
        server = serve(cfg, app, web)
    except OSError as e:
        # Only binding happens here, so the error is the address's or the port's.
        if e.errno == errno.EADDRINUSE:
            print(f"rankscope-exporter: error: --port: {cfg.addr}:{cfg.port} is already in use", file=sys.stderr)
        else:
            print(f"rankscope-exporter: error: --addr/--port: cannot listen on {cfg.addr}:{cfg.port}: "
                  f"{e.strerror or e}", file=sys.stderr)
        return 2
    scheme = "https" if web is not None and web.ssl_context is not None else "http"
    log.info("serving %s://%s:%d/metrics for %s (node %s)%s", scheme, cfg.addr, cfg.port, cfg.directory, cfg.node,
             " with basic auth" if web is not None and web.auth_required else "")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    if cfg.exit_when_idle_s:
        threading.Thread(target=_exit_when_idle, args=(server, cfg), daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _prepare_directory(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExporterConfigError(f"--dir: cannot create {directory}: {e.strerror or e}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ExporterConfigError(f"--dir: {directory} is not readable and writable by this user")


def _exit_when_idle(server, cfg: ExporterConfig) -> None:
    """Auto-started exporters go away once every run on the node is over."""
    from rankscope.exporter.ranks import RankCollector

    ranks = RankCollector(cfg)
    last_alive = time.time()
    while True:
        time.sleep(min(5.0, cfg.exit_when_idle_s))
        if _any_rank_alive(ranks):
            last_alive = time.time()
        elif time.time() - last_alive > cfg.exit_when_idle_s:
            log.info("no rank alive for %.0f s: exiting", cfg.exit_when_idle_s)
            server.shutdown()
            return


def _any_rank_alive(ranks) -> bool:
    from rankscope.contract.rundir import load_registrations

    return any(reg.process_alive() for run_dir in ranks.run_dirs() for reg in load_registrations(run_dir))
