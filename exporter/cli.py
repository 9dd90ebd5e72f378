"""``rankscope-exporter`` / ``python -m rankscope.exporter``: the per-node service."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Mapping

from prometheus_client import CollectorRegistry

from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import forget_exporter_address, load_registrations, save_exporter_address
from rankscope.exporter.collector import NodeCollector
from rankscope.exporter.compaction import Compactor
from rankscope.exporter.config import RANK_HISTOGRAM_MODES, ExporterConfig, ExporterConfigError
from rankscope.exporter.ranks import RankCollector
from rankscope.exporter.server import make_app, serve
from rankscope.exporter.webconfig import load_web_config

log = logging.getLogger("rankscope.exporter")

JANITOR_INTERVAL_S = 2.0
FIELDS = {f.name: f for f in dataclasses.fields(ExporterConfig)}


def build_parser() -> argparse.ArgumentParser:
    """Every option defaults to None (not given): ExporterConfig holds the defaults and reads the environment."""
    def default(name: str) -> str:
        variables = " or ".join(FIELDS[name].metadata["env"])
        value = FIELDS[name].default
        value = f"{value:g}" if isinstance(value, float) else value
        return f"(default: {variables} or {value})" if variables else f"(default {value})"

    p = argparse.ArgumentParser(prog="rankscope-exporter",
                                description="Serve /metrics for every training rank of this node.")
    p.add_argument("--dir", type=Path, help="metrics directory shared with the ranks "
                   "(default: RANKSCOPE_METRICS_DIR or /dev/shm/rankscope-UID)")
    p.add_argument("--addr", help=f"bind address {default('addr')}; "
                   "0.0.0.0 exposes it to the network: see README, Security")
    p.add_argument("--port", type=int, help=f"TCP port {default('port')}")
    p.add_argument("--node", help="node label (default: RANKSCOPE_NODE, SLURMD_NODENAME, NODE_NAME or hostname)")
    p.add_argument("--stuck-after", type=float,
                   help=f"seconds without a step before a live rank is stuck {default('stuck_after_s')}")
    p.add_argument("--frozen-after", type=float,
                   help=f"seconds without a heartbeat before a live rank is frozen {default('frozen_after_s')}")
    p.add_argument("--stuck-after-steps", type=float, help="... and for this many of the rank's own recent step "
                   f"times (long steps are not hangs) {default('stuck_after_steps')}")
    p.add_argument("--suspect-after", type=float, help="seconds peers wait in a collective before a rank outside it "
                   f"is a hang suspect {default('suspect_after_s')}")
    p.add_argument("--first-step-suspect-after", type=float, help="... and for a rank before its first step (a first "
                   f"compile, a checkpoint load) {default('first_step_suspect_after_s')}")
    p.add_argument("--retention", type=float, help="seconds a finished or dead run is still served, "
                   f"then its files are removed {default('retention_s')}")
    p.add_argument("--compact-after", type=float, help="seconds a rank process must have been dead before its "
                   "files are folded into its launch's compacted files, 0: at once "
                   f"{default('compact_after_s')}")
    p.add_argument("--exit-when-idle", type=float, help="exit after no rank has been alive for this many seconds, "
                   f"0: never {default('exit_when_idle_s')}")
    p.add_argument("--rank-histograms", metavar="{" + ",".join(RANK_HISTOGRAM_MODES) + "}",
                   help="per-rank histograms: full (every bucket), sum-count (_sum and _count only: ~35%% fewer "
                   "series per rank), node-buckets (sum-count plus buckets summed per node and run, as "
                   f"rankscope_node_*); docs/scaling.md {default('rank_histograms')}")
    p.add_argument("--no-nvml", action="store_true", help="do not read GPUs through NVML")
    p.add_argument("--no-network", action="store_true", help="do not read the node's network devices and TCP "
                   "counters (links named in network alerts; docs/runbook.md)")
    p.add_argument("--network-excluded-devices", metavar="REGEX",
                   help=f"network devices left out, a regular expression over the whole name {default('network_excluded_devices')}")
    p.add_argument("--no-evidence", action="store_true", help="capture no evidence of ranks that stop making "
                   "progress (stacks, collectives, process and device state, tracebacks; docs/runbook.md)")
    p.add_argument("--evidence-max-episodes", type=int,
                   help=f"evidence captures kept per run {default('evidence_max_episodes')}")
    p.add_argument("--web-config", type=Path, help="exporter-toolkit web configuration file (TLS, basic auth)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> ExporterConfig:
    return ExporterConfig.from_env(
        env, directory=args.dir, addr=args.addr, port=args.port, node=args.node,
        stuck_after_s=args.stuck_after, stuck_after_steps=args.stuck_after_steps, frozen_after_s=args.frozen_after, suspect_after_s=args.suspect_after,
        first_step_suspect_after_s=args.first_step_suspect_after,
        retention_s=args.retention, compact_after_s=args.compact_after, exit_when_idle_s=args.exit_when_idle,
        rank_histograms=args.rank_histograms, nvml=False if args.no_nvml else None, web_config=args.web_config,
        evidence=False if args.no_evidence else None, evidence_max_episodes=args.evidence_max_episodes,
        network=False if args.no_network else None, network_excluded_devices=args.network_excluded_devices)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s rankscope-exporter %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        _prepare_directory(cfg.directory, _origin(args.dir, "directory"))
        web = load_web_config(cfg.web_config) if cfg.web_config is not None else None
        collector = NodeCollector(cfg)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        scrape_lock = threading.Lock()
        app = make_app(cfg, registry, scrape_lock, web, collector.evidence)
    except ConfigError as e:
        print(f"rankscope-exporter: error: {e}", file=sys.stderr)
        return 2
    try:
        server = serve(cfg, app, web)
    except OSError as e:
        # Only binding happens here, so the error is the address's or the port's.
        port = _origin(args.port, "port")
        if e.errno == errno.EADDRINUSE:
            print(f"rankscope-exporter: error: {port}: {cfg.addr}:{cfg.port} is already in use", file=sys.stderr)
        else:
            print(f"rankscope-exporter: error: {_origin(args.addr, 'addr')}/{port}: "
                  f"cannot listen on {cfg.addr}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:   # where it listens, for the ranks and `rankscope top` of this directory
        save_exporter_address(cfg.directory, cfg.addr, server.server_address[1])
    except OSError as e:
        log.warning("cannot write %s/exporter.json: %s", cfg.directory, e)
    scheme = "https" if web is not None and web.ssl_context is not None else "http"
    log.info("serving %s://%s:%d/metrics for %s (node %s)%s", scheme, cfg.addr, cfg.port, cfg.directory, cfg.node,
             " with basic auth" if web is not None and web.auth_required else "")
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    threading.Thread(target=_janitor, args=(server, cfg, collector.ranks, scrape_lock), name="janitor",
                     daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        forget_exporter_address(cfg.directory)
    return 0


def _origin(cli_value: object, name: str) -> str:
    """Whom to name in an error about ExporterConfig's field ``name``: its option, or the variable it was read from."""
    variables = [var for var in FIELDS[name].metadata["env"] if os.environ.get(var)] if cli_value is None else []
    return variables[0] if variables else FIELDS[name].metadata["option"]


def _prepare_directory(directory: Path, name: str) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExporterConfigError(f"{name}: cannot create {directory}: {e.strerror or e}") from None
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise ExporterConfigError(f"{name}: {directory} is not readable and writable by this user")


def _janitor(server, cfg: ExporterConfig, ranks: RankCollector, scrape_lock: threading.Lock) -> None:
    """Everything that deletes, away from the scrapes (which only read): removes
    runs past their retention (from the start: what an exporter before this one
    left), compacts dead processes' files (compaction.py) and, with
    --exit-when-idle, stops the server once no rank has been alive that long and
    the runs it served are gone: an auto-started exporter goes away with its runs,
    and leaves none of their files behind."""
    last_alive = time.time()
    logged = False
    compactor = Compactor(cfg.compact_after_s)
    first = True
    while True:
        if not first:
            time.sleep(JANITOR_INTERVAL_S)
        first = False
        now = time.time()
        try:
            if cfg.exit_when_idle_s and _any_rank_alive(ranks):
                last_alive = now
            ranks.watch(now)   # evidence of a rank that stopped making progress (rankscope.exporter.evidence)
            _remove_expired_runs(cfg, ranks, scrape_lock, now)
            for run_dir, done in compactor.compact_runs(ranks.run_dirs(), scrape_lock, now).items():
                if done.aborted:
                    log.info("compaction of %s dropped: %s", run_dir, done.aborted)
                else:
                    log.info("compacted %s: %d dead processes, %d files folded into %d, %d registrations removed",
                             run_dir, done.processes, done.files_removed, done.files_written,
                             done.registrations_removed)
        except Exception:   # one unreadable run must not stop the clean-up and the idle exit for good
            if not logged:
                log.exception("clean-up failed (retried every %.0f s, logged once)", JANITOR_INTERVAL_S)
                logged = True
        idle = now - last_alive
        if cfg.exit_when_idle_s and idle > cfg.exit_when_idle_s:
            # Finished runs stay served, then removed, until their retention is over (bounded:
            # a run that cannot be removed does not keep the exporter forever).
            if _run_dirs(ranks) and idle <= cfg.retention_s + 3 * JANITOR_INTERVAL_S:
                continue
            log.info("no rank alive for %.0f s: exiting", idle)
            server.shutdown()
            return


def _remove_expired_runs(cfg: ExporterConfig, ranks: RankCollector, scrape_lock: threading.Lock, now: float) -> None:
    for run_dir in ranks.expired_run_dirs(now):
        log.info("removing %s: every rank gone for more than %.0f s", run_dir, cfg.retention_s)
        with scrape_lock:   # not while a scrape reads the run's files
            shutil.rmtree(run_dir, ignore_errors=True)


def _run_dirs(ranks: RankCollector) -> list:
    try:
        return list(ranks.run_dirs())
    except OSError:
        return []


def _any_rank_alive(ranks: RankCollector) -> bool:
    return any(reg.process_alive() for run_dir in ranks.run_dirs() for reg in load_registrations(run_dir))
