"""``rankscope``: the console script (``rankscope top``, ``rankscope report``).

A source that cannot be read, a run that does not exist or a bad option is one
``rankscope: error: ...`` line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rankscope.console.sources import DEFAULT_EXPORTER, SourceError

USAGE_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankscope", description="Look at the ranks of a distributed training run.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    top = sub.add_parser("top", help="live table of every rank of a run (htop for a training job)",
                         description="Live table of every rank of a run: state, step and lag, step time, phases, "
                                     "loss, memory, the collective in flight and the hang suspect. Keys: t step time, "
                                     "l step lag, c comm wait, r rank (sort); n next node, a all nodes; q quit.")
    top.add_argument("exporters", nargs="*", metavar="EXPORTER_URL",
                     help=f"node exporters to read (host:port or URL; default: this node's, {DEFAULT_EXPORTER} unless "
                          "RANKSCOPE_METRICS_ADDR / RANKSCOPE_METRICS_PORT say otherwise; none with --prometheus)")
    top.add_argument("--prometheus", metavar="URL",
                     help="read the run from Prometheus instead; with exporter URLs too, only the alerts come from it")
    top.add_argument("--run", help="run to show (default: the most recently active live run)")
    top.add_argument("--once", action="store_true",
                     help="print the table once as plain text and exit (the default without a terminal)")
    top.add_argument("--interval", type=float, default=1.0, metavar="S", help="seconds between refreshes (1)")
    top.add_argument("--window", type=float, default=30.0, metavar="S",
                     help="seconds over which steps/s, median step time and phases are taken (30)")
    top.add_argument("--sort", choices=("rank", "step_time", "lag", "comm_wait"), default="rank")
    top.add_argument("--node", help="show only the ranks of this node")

    report = sub.add_parser("report", help="self-contained HTML report of a run, with plots, from Prometheus",
                            description="Write one self-contained HTML file (plots embedded) about a run, "
                                        "from Prometheus's history of it.")
    report.add_argument("--prometheus", required=True, metavar="URL", help="Prometheus server that scraped the run")
    report.add_argument("--run", required=True, help="run label")
    report.add_argument("--from", dest="start", metavar="TIME",
                        help="start (unix seconds, ISO 8601, or now-DURATION like now-2h; default: the run's start)")
    report.add_argument("--to", dest="end", metavar="TIME",
                        help="end (same forms; default: the run's last heartbeat or step)")
    report.add_argument("--lookback", default="7d", metavar="DURATION",
                        help="how far back to look for the run's start and end when --from/--to are not given (7d)")
    report.add_argument("--out", type=Path, required=True, metavar="FILE", help="HTML file to write")
    report.add_argument("--png-dir", type=Path, metavar="DIR", help="also write each plot as a PNG into DIR")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "top":
            return _top(args)
        return _report(args)
    except SourceError as e:
        print(f"rankscope: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except ImportError as e:   # rich / matplotlib are the console extra
        print(f"rankscope: error: {e.name or e} is not installed: pip install 'rankscope[console]'", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130


def _top(args: argparse.Namespace) -> int:
    from rankscope.console import top
    from rankscope.console.sources import Prometheus, exporter_url, local_exporter_url

    if args.interval <= 0 or args.window <= 0:
        raise SourceError("--interval and --window must be > 0")
    prometheus = Prometheus(args.prometheus) if args.prometheus else None
    if prometheus is not None:
        prometheus.check()
    if args.exporters or prometheus is None:
        urls = [exporter_url(u) for u in args.exporters] or [local_exporter_url(os.environ)]
        source = top.ExporterSource(urls, args.run, args.window, alerts=prometheus)
    else:
        source = top.PrometheusSource(prometheus, args.run, args.window)
    screen = top.Screen(sort_key=top.SORT_BY_NAME[args.sort], node=args.node)
    if args.once or not sys.stdout.isatty():
        top.print_once(source, screen)
    else:
        top.run_live(source, screen, args.interval)
    return 0


def _report(args: argparse.Namespace) -> int:
    from rankscope.console import report

    written = report.write_report(args.prometheus, args.run, args.out, start=args.start, end=args.end,
                                  lookback=args.lookback, png_dir=args.png_dir)
    print(f"wrote {written.html}" + (f" and {len(written.pngs)} PNGs in {args.png_dir}" if written.pngs else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
