"""Overhead of the framework adapters: the same Trainer with and without rankscope's callback.

    .venv/bin/python tests/benchmarks/adapters.py                  # both frameworks, 60 rounds each (~8 min idle)
    .venv/bin/python tests/benchmarks/adapters.py --framework hf   # one of them
    .venv/bin/python tests/benchmarks/adapters.py --quick          # 2 short rounds: a smoke run, not a measurement

A 2-rank torchrun job (gloo, 127.0.0.1) per framework. A framework runs its
own loop, so steps of two variants cannot alternate inside one loop as in
overhead.py; instead each rank holds two Trainers over identical copies of one
model and alternates short training runs of ``--block`` steps:

* ``bare``: the framework's Trainer, no rankscope at all;
* ``rankscope``: the same Trainer with ``RankscopeCallback()`` (HF: and
  ``instrument(trainer)``; DDP timing by the CPU default, DDP's own timers).

Round r runs one block of each, bare first on even rounds and last on odd
ones (ABBA), so drift and warm-up fall on both alike. A small timing callback,
present in both variants, stamps the end of every step (the wall clock and the
process's CPU time); a block's figures are the mean and the median of its
step-to-step times after its first step (which includes the run's setup), and
the process's CPU seconds per step over the same steps; the median is not
moved by another process's burst landing in one block of a pair. The paired
difference of the two blocks of a round, over all rounds, gives the overhead
as a fraction of the bare step with its 95% interval, for each figure.

The CPU figure is what rankscope adds to the rank's work per step, every
thread of the process together (the callback's hooks on the training thread,
the publisher and readers behind it), as a share of the bare step's wall time:
an upper bound on the slowdown where that work serialises with training (one
core, the GIL). On 2 cores shared by 2 ranks it is as noisy as the wall clock
(gloo's and the exporter's threads move it); adapter_hooks.py times the hooks
themselves.

One Monitor is open for the whole job (the callback is given it), with its
defaults: metrics on, the node exporter auto-started, tracing off unless
OTEL_* says otherwise; a thread here scrapes /metrics every second. As in
overhead.py, the monitor's background thread and the exporter run during bare
blocks too; their CPU is not in the paired figure.

Models: HF, a 2-layer GPT-2 (64 hidden, 4 x 32 tokens per micro-batch,
gradient accumulation 2) built from its config (HF_HUB_OFFLINE=1); Lightning,
a 3-layer 256-wide MLP, batch 16.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, emit_json, kill_noted_ranks, loadavg, machine, mean_ci, note_rank_pid, table  # noqa: E402

FRAMEWORKS = ("hf", "lightning")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", choices=FRAMEWORKS + ("both",), default="both")
    p.add_argument("--rounds", type=int, default=60, help="rounds of one block per variant (pairs)")
    p.add_argument("--block", type=int, default=20, help="optimizer steps per training run")
    p.add_argument("--quick", action="store_true", help="2 rounds of 4 steps: a smoke run, not a measurement")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.block = min(args.rounds, 2), min(args.block, 4)
    return args


# -- rank side ---------------------------------------------------------------------------
def block_figures(stamps: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Mean and median step-to-step time of a block, after its first step (which includes the
    run's setup), and the process's CPU seconds per step over those steps. The median is what
    a preemption by another process, landing in one block of a pair, does not move."""
    gaps = sorted(b[0] - a[0] for a, b in zip(stamps, stamps[1:]))
    cpu = (stamps[-1][1] - stamps[0][1]) / (len(stamps) - 1)
    return sum(gaps) / len(gaps), gaps[len(gaps) // 2], cpu


def hf_worker(args, monitor) -> tuple[list[float], list[float]]:
    import copy

    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from rankscope.integrations.hf import RankscopeCallback, instrument

    vocab, seq, batch, accumulate = 256, 32, 4, 2

    class Tokens(Dataset):
        def __init__(self, n):
            self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Stamps(TrainerCallback):
        def __init__(self):
            self.stamps: list[tuple[float, float]] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.stamps.append((time.perf_counter(), time.process_time()))

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=2))
    data = Tokens(args.block * accumulate * batch * 2)
    out_dir = tempfile.mkdtemp(prefix="adapters-hf-")

    def trainer(callbacks):
        training = TrainingArguments(
            output_dir=out_dir, max_steps=args.block, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulate, learning_rate=1e-4, logging_steps=10, save_strategy="no",
            report_to="none", use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0,
            disable_tqdm=True)
        return Trainer(model=copy.deepcopy(base), args=training, train_dataset=data, callbacks=callbacks)

    bare_stamps, rs_stamps = Stamps(), Stamps()
    bare = trainer([bare_stamps])
    instrumented = instrument(trainer([RankscopeCallback(monitor=monitor), rs_stamps]))
    return run_blocks(args, lambda: bare.train(), lambda: instrumented.train(), bare_stamps, rs_stamps)


def lightning_worker(args, monitor) -> tuple[list[float], list[float]]:
    import copy

    import lightning.pytorch as pl
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    from rankscope.integrations.lightning import RankscopeCallback

    class Regression(pl.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Stamps(pl.Callback):
        def __init__(self):
            self.stamps: list[tuple[float, float]] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.stamps.append((time.perf_counter(), time.process_time()))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    n = args.block * 16 * 2
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=16)
    modules = [Regression(copy.deepcopy(net)), Regression(copy.deepcopy(net))]
    bare_stamps, rs_stamps = Stamps(), Stamps()
    rankscope_callback = RankscopeCallback(monitor=monitor)

    def fit(module, callbacks):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.block, max_epochs=1,
                             callbacks=callbacks, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
        trainer.fit(module, loader)

    return run_blocks(args, lambda: fit(modules[0], [bare_stamps]),
                      lambda: fit(modules[1], [rankscope_callback, rs_stamps]), bare_stamps, rs_stamps)


def run_blocks(args, run_bare, run_rankscope, bare_stamps, rs_stamps) -> tuple[list[float], list[float]]:
    bare_means, rs_means = [], []
    for r in range(args.rounds + 1):   # round 0: warm-up, discarded
        order = ((run_bare, bare_stamps, bare_means), (run_rankscope, rs_stamps, rs_means))
        for run, stamps, means in (order if r % 2 == 0 else order[::-1]):
            stamps.stamps = []
            run()
            if r > 0:
                means.append(block_figures(stamps.stamps))
    return bare_means, rs_means


def worker(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from rankscope.monitor import Monitor

    note_rank_pid(args.out)
    torch.set_num_threads(1)   # 2 ranks share 2 cores
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    monitor = Monitor(run=f"adapters-bench-{args.framework}", metrics_port=args.port)
    run = hf_worker if args.framework == "hf" else lightning_worker
    bare, instrumented = run(args, monitor)
    monitor.close()
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "bare": bare, "rankscope": instrumented}))
    return 0


# -- launcher ------------------------------------------------------------------------------
class Scraper(threading.Thread):
    """Hits /metrics every second, as a 1 s Prometheus scrape interval would."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stop_event = threading.Event()
        self.ok = 0

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            try:
                with urllib.request.urlopen(self.url, timeout=10) as resp:
                    resp.read()
                self.ok += 1
            except Exception:
                pass


def launch_one(args: argparse.Namespace, framework: str) -> dict:
    from tests.helpers.jobs import free_port

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-adapters-"))
    port = free_port()
    env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(tmp / "metrics"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLOO_SOCKET_IFNAME": "lo",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).resolve()), "--worker", "--framework", framework, "--out", str(tmp),
           "--port", str(port), "--rounds", str(args.rounds), "--block", str(args.block)]
    scraper = Scraper(port)
    scraper.start()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate(timeout=3600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.returncode != 0:
            kill_noted_ranks(tmp)
        scraper.stop_event.set()
        scraper.join(timeout=15)
        try:   # the exporter the job auto-started
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
                os.kill(int(json.loads(resp.read())["pid"]), signal.SIGKILL)
        except Exception:
            pass
    if proc.returncode != 0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"{framework}: torchrun failed with exit code {proc.returncode}:\n"
                         f"{output.decode(errors='replace')[-4000:]}")
    ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    return {"framework": framework, "ranks": ranks, "scrapes_ok": scraper.ok,
            "wall_s": time.perf_counter() - started}


def compare(bare: list[float], instrumented: list[float], bare_step: list[float] | None = None) -> dict:
    """Paired differences of the blocks of each round, as a fraction of the bare step (``bare_step``:
    the bare blocks' wall-clock step, where the figure compared is not itself one)."""
    diffs = [b - a for a, b in zip(bare, instrumented)]
    mean, lo, hi = mean_ci(diffs)
    steps = bare if bare_step is None else bare_step
    base = sum(steps) / len(steps)
    median = lambda v: sorted(v)[len(v) // 2]
    return {"pairs": len(diffs), "bare_step_ms": 1000 * base, "diff_ms": 1000 * mean,
            "frac": mean / base, "ci_frac": [lo / base, hi / base],
            "median_ratio": median(instrumented) / median(bare) - 1}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(REPO))
    frameworks = FRAMEWORKS if args.framework == "both" else (args.framework,)
    load_before = loadavg()
    rows, figures = [], {"rounds": args.rounds, "block": args.block, "frameworks": {}}
    for framework in frameworks:
        result = launch_one(args, framework)
        per_rank = {}
        for r in result["ranks"]:
            bare_means = [b[0] for b in r["bare"]]
            for figure, index in (("block mean", 0), ("block median", 1), ("CPU per step", 2)):
                c = compare([b[index] for b in r["bare"]], [b[index] for b in r["rankscope"]],
                            bare_means if index == 2 else None)
                per_rank.setdefault(str(r["rank"]), {})[figure.replace(" ", "_")] = c
                rows.append([framework, r["rank"], figure, c["pairs"], f"{c['bare_step_ms']:.2f}",
                             f"{c['diff_ms']:+.3f}",
                             f"{100 * c['frac']:+.2f}% [{100 * c['ci_frac'][0]:+.2f}, {100 * c['ci_frac'][1]:+.2f}]",
                             f"{100 * c['median_ratio']:+.2f}%"])
        figures["frameworks"][framework] = {"ranks": per_rank, "scrapes_ok": result["scrapes_ok"],
                                            "wall_s": result["wall_s"]}
    print(f"rankscope framework adapters: 2 ranks (gloo, 127.0.0.1), {args.rounds} rounds of one {args.block}-step "
          f"run per variant, ABBA order")
    print(table(["framework", "rank", "block figure", "pairs", "bare step ms", "mean diff ms",
                 "rankscope / bare - 1 [95% CI]", "median ratio - 1"], rows))
    print(f"\nload average before / after: {load_before} / {loadavg()}")
    figures.update(machine=machine())
    emit_json({"benchmark": "adapters", **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
