"""Where the API's cost around a real step goes, segment by segment.

    .venv/bin/python tests/benchmarks/step_segments.py            # 1,500 ABBA pairs
    .venv/bin/python tests/benchmarks/step_segments.py --quick    # 100 pairs, smoke only

One process, one thread, the 3x512 MLP step of api_cost.py. Bare and
instrumented steps alternate in ABBA order; each is cut into the same
segments by ``perf_counter`` calls placed between the loop's own statements:
the batch fetch, entering the step, each phase (with its tensor work), the
``observe`` call, and leaving the step. The table gives each segment's median
in both variants and the mean paired difference, so the API's cost is located
(entering and leaving the step are pure API; a phase's difference is its
enter/exit calls around the tensor work).
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit_json, loadavg, machine, mlp, table  # noqa: E402

SEGMENTS = ("data", "step enter", "forward", "backward", "optimizer", "observe", "step exit", "whole step")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=1500)
    p.add_argument("--quick", action="store_true", help="100 pairs: a smoke run, not a measurement")
    args = p.parse_args(argv)
    pairs = 100 if args.quick else args.pairs
    os.environ.setdefault("RANKSCOPE_METRICS_DIR", tempfile.mkdtemp(prefix="rankscope-segments-"))
    sys.path.insert(0, str(REPO))
    import torch
    import torch.nn.functional as F

    from rankscope.monitor import Monitor

    torch.set_num_threads(1)
    load_before = loadavg()
    monitor = Monitor(run="step-segments", exporter="off")
    model = mlp(512)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x, y = torch.randn(64, 512), torch.randn(64, 512)
    batches, plain = monitor.data(itertools.repeat((x, y))), itertools.repeat((x, y))
    now = time.perf_counter

    def bare() -> list[float]:
        t = [now()]
        xb, yb = next(plain); t.append(now())
        t.append(now())
        loss = F.mse_loss(model(xb), yb); t.append(now())
        loss.backward(); t.append(now())
        opt.step(); opt.zero_grad(set_to_none=True); t.append(now())
        t.append(now())
        t.append(now())
        return t

    def instrumented() -> list[float]:
        t = [now()]
        xb, yb = next(batches); t.append(now())
        step = monitor.step(samples=64).begin(); t.append(now())
        with step.phase("forward"):
            loss = F.mse_loss(model(xb), yb)
        t.append(now())
        with step.phase("backward"):
            loss.backward()
        t.append(now())
        with step.phase("optimizer"):
            opt.step(); opt.zero_grad(set_to_none=True)
        t.append(now())
        step.observe(loss=loss, lr=1e-3); t.append(now())
        step.end(); t.append(now())
        return t

    runs: tuple[list[list[float]], list[list[float]]] = ([], [])
    for r in range(50 + pairs):
        for i in ((0, 1) if r % 2 else (1, 0)):
            t = (bare, instrumented)[i]()
            if r >= 50:
                runs[i].append([b - a for a, b in zip(t, t[1:])] + [t[-1] - t[0]])
    monitor.close()
    rows, figures = [], {}
    for k, name in enumerate(SEGMENTS):
        b = [r[k] for r in runs[0]]
        a = [r[k] for r in runs[1]]
        diff = statistics.fmean(q - p for p, q in zip(b, a))
        figures[name.replace(" ", "_")] = {"bare_median_us": 1e6 * statistics.median(b),
                                           "instrumented_median_us": 1e6 * statistics.median(a),
                                           "mean_diff_us": 1e6 * diff}
        rows.append([name, f"{1e6 * statistics.median(b):.1f}", f"{1e6 * statistics.median(a):.1f}", f"{1e6 * diff:+.1f}"])
    print(f"API cost by segment around a real step (3x512 MLP, 1 thread), {pairs} ABBA pairs, "
          f"load {load_before} -> {loadavg()}")
    print(table(["segment", "bare median us", "instrumented median us", "mean diff us"], rows))
    emit_json({"benchmark": "step_segments", "pairs": pairs, "segments": figures, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
