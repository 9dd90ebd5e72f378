"""Overhead of the framework adapters: each framework's own training run, with rankscope in half its steps.

    .venv/bin/python tests/benchmarks/adapters.py                          # lightning, hf, torchtitan
    .venv/bin/python tests/benchmarks/adapters.py --framework lightning --steps 16000
    .venv/bin/python tests/benchmarks/adapters.py --quick                  # a smoke run, not a measurement

A 2-rank torchrun job (gloo, 127.0.0.1) per framework, one training run each.
A framework runs its own loop, so the caller cannot put rankscope around some
of its steps and not others as overhead.py does. Instead the adapter is
switched in and out between steps of the one run, in quads of steps: bare,
rankscope, rankscope, bare (ABBA) or the reverse (BAAB), drawn per quad, so
that a drift inside a quad cancels, work the framework does every N steps
falls on both kinds of step alike, and both variants' steps run in the same
warm process, on the same model, data loader and process group. Switching
changes exactly what adding the adapter changes:

* Lightning: ``RankscopeCallback`` is in ``trainer.callbacks`` or not (so
  Lightning's own dispatch to a callback is counted);
* HF: the same for the Trainer's callback list, and ``instrument(trainer)``'s
  ``training_step`` and ``clip_grad_norm_`` and the callback's forward hook
  on the model are in place or not;
* torchtitan: the Trainer object's methods are ``instrument(trainer)``'s wrappers
  or its own (and the batch generator and the clipping function alike). The job
  is tests/loops/torchtitan_job.py's (the llama3 debug model, FSDP over both
  ranks, float32, with that script's four CPU patches; no periodic metrics log
  or garbage collection), in ``.venv-torchtitan``, with two changes that steady
  its step and leave the adapter's work as it is: the model keeps its first
  transformer block (``--titan-layers``), and the loader's first 64 batches are
  fetched once and then cycled (``--titan-batches``: its dataset tokenises and
  packs documents inside each fetch).

The switch happens at each step's last event (after rankscope's own work for
the step), so it falls once in a bare and once in a rankscope step of a quad.
A step's time is from the end of one step to the end of the next, the data
fetch included.

Per quad, the difference is (its two rankscope steps' times - its two bare
ones) / 2; their mean over the quads and its 95% interval, as a share of the
bare steps' mean time, is the **wall-clock** figure. The same computed on the
training thread's CPU time gives the adapter's work per step (cache misses
included), without preemptions and without waits for the other rank. The
monitor's background threads (publisher, process-group reader) run through
both kinds of step, so the pairs do not see them: their CPU is reported
beside, as a share of one core over the measured steps (as overhead.py does).
``--ranks 1``: one process, no DDP, no second rank on the same cores.
``--empty-callback``: a callback that does nothing, switched the same way.

One Monitor is open for the whole job with its defaults (metrics on, the node
exporter auto-started, tracing off unless OTEL_* says otherwise; DDP timing by
the CPU default, DDP's own timers); a thread here scrapes /metrics every second.

Models: Lightning, overhead.py's 3 x 1024 MLP at batch 64 (``--hidden 256
--batch 16``: a 6 ms step, the worst case for a per-step cost); HF, a GPT-2 of
128 x 2 layers from its config, 4 x 32 tokens a micro-batch, gradient
accumulation 2 (HF_HUB_OFFLINE=1); torchtitan, the job above (a 0.15-0.18 s
step here; with all 6 blocks and its own loader, 0.46 s varying by 10% a step).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (REPO, emit_json, kill_noted_ranks, loadavg, machine, mean_ci, mlp, note_rank_pid,  # noqa: E402
                    table, threads_cpu_seconds)

FRAMEWORKS = ("lightning", "hf", "torchtitan")
DEFAULT_STEPS = {"lightning": 8000, "hf": 8000, "torchtitan": 8000}   # torchtitan: 0.15-0.18 s a step here
DEFAULT_WARMUP = {"lightning": 200, "hf": 100, "torchtitan": 20}
QUICK_STEPS = {"lightning": 24, "hf": 24, "torchtitan": 12}   # --quick, after a warm-up of 4 steps
TITAN_VENV = REPO / ".venv-torchtitan"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    p.add_argument("--steps", type=int, help="steps of the run, warm-up included (default: "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_STEPS.items()) + ")")
    p.add_argument("--warmup", type=int, help="steps left out at the start (default: "
                   + ", ".join(f"{k} {v}" for k, v in DEFAULT_WARMUP.items()) + ")")
    p.add_argument("--ranks", type=int, choices=(1, 2), default=2,
                   help="1: one process, no DDP and no second rank on the shared cores (Lightning and HF): the "
                        "adapter's own cost, without the contention of 2 ranks on 2 cores")
    p.add_argument("--hidden", type=int, default=1024,
                   help="Lightning: the width of the 3-layer MLP (1024 at batch 64: overhead.py's step)")
    p.add_argument("--batch", type=int, default=64, help="Lightning: the batch size")
    p.add_argument("--hf-width", type=int, default=128, help="HF: GPT-2's n_embd")
    p.add_argument("--hf-layers", type=int, default=2, help="HF: GPT-2's n_layer")
    p.add_argument("--titan-batches", type=int, default=64,
                   help="torchtitan: its loader's first N batches, cycled (0: its loader as is, tokenising and "
                        "packing documents inside each fetch, a step of varying length)")
    p.add_argument("--titan-layers", type=int, default=1,
                   help="torchtitan: the debug model's first N transformer blocks (of 6; the adapter's work does "
                        "not grow with them, the step's time and its spread do)")
    p.add_argument("--empty-callback", action="store_true",
                   help="Lightning and HF: switch a callback that does nothing instead of rankscope's (what the "
                        "framework's own dispatch to one more callback costs)")
    p.add_argument("--quick", action="store_true", help="a few dozen steps: a smoke run, not a measurement")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not 1 <= args.titan_layers <= 6 or args.titan_batches < 0:
        p.error("--titan-layers takes 1 to 6 (the debug model's blocks), --titan-batches 0 or more")
    return args


# -- rank side ---------------------------------------------------------------------------
# A quad's steps, with rankscope (True) or bare: ABBA or BAAB, drawn per quad from a seeded generator
# (the same on every rank), so that a framework's work every N steps (a log, a garbage collection)
# falls on both kinds of step alike instead of always on one position of the quad.
QUAD_ORDERS = ((False, True, True, False), (True, False, False, True))
QUAD_SEED = 0


class Alternation:
    """Stamps each step's end and switches the adapter in or out for the next step.

    ``switch(on)`` puts the adapter in place (True) or takes it out; the run starts
    with it in place (the adapter's set-up hooks must see it), so step 0 is a
    rankscope step whatever its quad's order says; it is warm-up. The background threads'
    CPU is read at the warm-up's end and at the last step's (the monitor may close
    before the run returns)."""

    def __init__(self, switch: Callable[[bool], None], warmup: int, steps: int):
        self.switch = switch
        self.warmup, self.steps = warmup, steps
        self.orders = random.Random(QUAD_SEED)
        self.quad = QUAD_ORDERS[0]
        self.on = True
        self.wall: list[float] = []    # perf_counter at each step's end
        self.cpu: list[float] = []     # the training thread's CPU seconds at each step's end
        self.arms: list[bool] = []     # whether each step ran with rankscope
        self.background_cpu = [0.0, 0.0]   # at the warm-up's end, at the last step's end

    def step_ended(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())
        self.arms.append(self.on)
        if len(self.wall) in (self.warmup, self.steps):
            self.background_cpu[len(self.wall) == self.steps] = monitor_threads_cpu()
        step = len(self.wall)   # the next step's index
        if step % 4 == 0:
            self.quad = self.orders.choice(QUAD_ORDERS)
        on = self.quad[step % 4]
        if on != self.on:
            self.switch(on)
            self.on = on

    def figures(self) -> dict:
        return {"wall": self.wall, "cpu": self.cpu, "arms": self.arms,
                "background_cpu_s": self.background_cpu[1] - self.background_cpu[0]}


def monitor_threads_cpu() -> float:
    """CPU seconds of the monitor's background threads (``rankscope-*``) in this process so far."""
    return threads_cpu_seconds(t for t in threading.enumerate() if t.name.startswith("rankscope"))


def lightning_worker(args, monitor) -> Alternation:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset

    from rankscope.integrations.lightning import RankscopeCallback

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp(args.hidden)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class StepEnd(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            alternation.step_ended()

    class Batches(Dataset):
        """The same batch every step (as overhead.py's loop): no per-sample collation in the step."""

        def __init__(self):
            self.batch = (torch.randn(args.batch, args.hidden), torch.randn(args.batch, args.hidden))

        def __len__(self):
            return 2 * args.steps   # each rank takes half

        def __getitem__(self, i):
            return self.batch

    torch.manual_seed(0)
    rankscope = pl.Callback() if args.empty_callback else RankscopeCallback(monitor=monitor)
    step_end = StepEnd()
    trainer = pl.Trainer(accelerator="cpu", devices=args.ranks, strategy="ddp" if args.ranks > 1 else "auto",
                         max_steps=args.steps, max_epochs=1,
                         callbacks=[rankscope, step_end], logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    with_rankscope = list(trainer.callbacks)
    assert with_rankscope.index(step_end) > with_rankscope.index(rankscope), with_rankscope
    bare = [c for c in with_rankscope if c is not rankscope]
    alternation = Alternation(lambda on: setattr(trainer, "callbacks", with_rankscope if on else bare),
                              args.warmup, args.steps)
    trainer.fit(Regression(), DataLoader(Batches(), batch_size=None))
    return alternation


def hf_worker(args, monitor) -> Alternation:
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

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            alternation.step_ended()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=args.hf_width,
                                       n_layer=args.hf_layers, n_head=2))
    training = TrainingArguments(
        output_dir=str(args.out / "hf-output"), max_steps=args.steps, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulate, learning_rate=1e-4, logging_steps=10 ** 9, save_strategy="no",
        report_to="none", use_cpu=True, ddp_backend="gloo", dataloader_num_workers=0, seed=0, disable_tqdm=True)
    callback = TrainerCallback() if args.empty_callback else RankscopeCallback(monitor=monitor)
    step_end = StepEnd()
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(4096), callbacks=[callback, step_end])
    accelerator = trainer.accelerator
    own = (trainer.training_step, accelerator.clip_grad_norm_)
    if not args.empty_callback:
        instrument(trainer)
    wrapped = (trainer.training_step, accelerator.clip_grad_norm_)
    handler = trainer.callback_handler
    with_rankscope = list(handler.callbacks)
    assert with_rankscope.index(step_end) > with_rankscope.index(callback), with_rankscope
    bare = [c for c in with_rankscope if c is not callback]
    taken_out: dict = {}   # the callback's forward hooks while they are off the model

    def switch(on: bool) -> None:
        handler.callbacks = with_rankscope if on else bare
        trainer.training_step, accelerator.clip_grad_norm_ = wrapped if on else own
        for handle in getattr(callback, "_hooks", ()):
            hooks = handle.hooks_dict_ref()
            if on:
                hooks[handle.id] = taken_out.pop(handle.id)
            else:
                taken_out[handle.id] = hooks.pop(handle.id)

    alternation = Alternation(switch, args.warmup, args.steps)
    trainer.train()
    return alternation


def torchtitan_worker(args) -> Alternation:
    """torchtitan's own ``main`` on the test job's config; the Trainer instrumented, then alternated."""
    import importlib

    sys.path.insert(0, str(REPO / "tests" / "loops"))
    job = importlib.import_module("torchtitan_job")   # its CPU patches, made at import

    def bench_config():
        """The test job's config, its model cut to the first ``--titan-layers`` transformer blocks."""
        config = job.rankscope_cpu_debug()
        config.model_spec.model.layers = config.model_spec.model.layers[:args.titan_layers]
        return config

    job.rankscope_cpu_bench = bench_config
    import torchtitan.distributed.utils as titan_dist
    import torchtitan.train
    from torchtitan.trainer import Trainer

    from rankscope.integrations import torchtitan as adapter

    box: list[Alternation] = []
    train = Trainer.train

    def alternating_train(trainer):
        per_step = [(trainer, "forward_backward_step"), (trainer, "loss_fn"), (trainer.lr_schedulers, "step"),
                    (trainer.checkpointer, "save"), (titan_dist, "clip_grad_norm_")]
        own = [getattr(owner, name) for owner, name in per_step]
        own_step, own_batches = trainer.train_step, trainer.batch_generator
        adapter.instrument(trainer, run="adapters-bench-torchtitan", metrics_port=args.port)
        wrapped = [getattr(owner, name) for owner, name in per_step]
        wrapped_step, steps = trainer.train_step, trainer._rankscope

        def switch(on: bool) -> None:
            for (owner, name), function in zip(per_step, wrapped if on else own):
                setattr(owner, name, function)

        alternation = Alternation(switch, args.warmup, args.steps)
        box.append(alternation)

        def train_step(*a, **k):
            result = (wrapped_step if alternation.on else own_step)(*a, **k)
            alternation.step_ended()
            return result

        def batch_generator(data_iterable):
            if args.titan_batches:   # tokenised once, then cycled: a data fetch of the same cost every step
                data_iterable = itertools.cycle(list(itertools.islice(data_iterable, args.titan_batches)))
            bare = own_batches(data_iterable)
            counted = steps._batch_generator(lambda _: bare)(None)   # the adapter's, over the same batches
            while True:
                try:
                    yield next(counted if alternation.on else bare)
                except StopIteration:
                    return

        trainer.train_step, trainer.batch_generator = train_step, batch_generator
        return train(trainer)

    Trainer.train = alternating_train
    sys.argv[1:] = ["--module", "torchtitan_job", "--config", "rankscope_cpu_bench",
                    "--dump_folder", str(args.out / "dump"), "--parallelism.spmd_backend", "partial_dtensor",
                    "--training.steps", str(args.steps), "--debug.seed", "0",
                    # torchtitan logs its metrics (a loss all-reduce, a print) and collects garbage every few
                    # steps: pauses of 100 ms or more in single steps of quads, bare or not, that only widen
                    # the interval
                    "--metrics.log_freq", str(10 ** 6), "--training.gc_freq", str(10 ** 6)]
    torchtitan.train.main()
    return box[0]


def worker(args: argparse.Namespace) -> int:
    import torch

    note_rank_pid(args.out)
    torch.set_num_threads(1)   # 2 ranks share 2 cores
    rank = int(os.environ["RANK"])
    framework = args.framework[0]
    if framework == "torchtitan":   # torchtitan makes its own process group and the adapter its Monitor
        alternation, monitor = torchtitan_worker(args), None
    else:
        import torch.distributed as dist

        from rankscope.monitor import Monitor

        dist.init_process_group("gloo")
        monitor = Monitor(run=f"adapters-bench-{framework}", metrics_port=args.port)
        alternation = (hf_worker if framework == "hf" else lightning_worker)(args, monitor)
    figures = alternation.figures()
    if monitor is not None:
        monitor.close()
    (args.out / f"rank{rank}.json").write_text(json.dumps({"rank": rank, **figures}))
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
    import shutil

    from tests.helpers.jobs import free_port

    tmp = Path(tempfile.mkdtemp(prefix="rankscope-adapters-"))
    port = free_port()
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)[framework]
    warmup = args.warmup if args.warmup is not None else 4 if args.quick else DEFAULT_WARMUP[framework]
    env = {**os.environ, "RANKSCOPE_METRICS_DIR": str(tmp / "metrics"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "GLOO_SOCKET_IFNAME": "lo",
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    python = sys.executable
    if framework == "torchtitan":
        from tests.helpers.titan_assets import make_assets

        python = str(TITAN_VENV / "bin" / "python")
        env.update(TITAN_ASSETS=str(make_assets(tmp / "assets")), HF_HOME=str(tmp / "hf"), HF_DATASETS_OFFLINE="1")
    ranks = 2 if framework == "torchtitan" else args.ranks
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           str(Path(__file__).resolve()), "--worker", "--framework", framework, "--out", str(tmp),
           "--port", str(port), "--steps", str(steps), "--warmup", str(warmup),
           "--hidden", str(args.hidden), "--batch", str(args.batch),
           "--hf-width", str(args.hf_width), "--hf-layers", str(args.hf_layers),
           "--titan-batches", str(args.titan_batches), "--titan-layers", str(args.titan_layers),
           *(["--empty-callback"] if args.empty_callback else []),
           "--ranks", str(ranks)]
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
    try:
        if proc.returncode != 0:
            raise SystemExit(f"{framework}: torchrun failed with exit code {proc.returncode}:\n"
                             f"{output.decode(errors='replace')[-4000:]}")
        results = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(ranks)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"framework": framework, "steps": steps, "warmup": warmup, "ranks": results, "scrapes_ok": scraper.ok,
            "wall_s": time.perf_counter() - started}


def quads(stamps: list[float], arms: list[bool], warmup: int) -> tuple[list[float], list[float]]:
    """Per quad after the warm-up, (its two rankscope steps' times - its two bare steps') / 2; and the
    bare steps' times."""
    diffs, bare = [], []
    first = max(4, -(-warmup // 4) * 4)
    for q in range(first, len(stamps) - 3, 4):
        g = [stamps[q + i] - stamps[q + i - 1] for i in range(4)]
        on = tuple(arms[q:q + 4])
        assert on in QUAD_ORDERS, f"steps {q}-{q + 3} out of their quad: {on}"
        diffs.append(sum(t if a else -t for t, a in zip(g, on)) / 2)
        bare += [t for t, a in zip(g, on) if not a]
    return diffs, bare


def rank_figures(r: dict, warmup: int) -> dict:
    """A rank's wall-clock and thread-CPU differences (each also as a share of its bare steps' mean
    wall time), and its monitor threads' CPU as a share of one core over the measured steps."""
    wall_diffs, wall_bare = quads(r["wall"], r["arms"], warmup)
    cpu_diffs, _ = quads(r["cpu"], r["arms"], warmup)
    bare_step = sum(wall_bare) / len(wall_bare)
    out = {"quads": len(wall_diffs), "bare_step_ms": 1000 * bare_step}
    for name, diffs in (("wall", wall_diffs), ("cpu", cpu_diffs)):
        mean, lo, hi = mean_ci(diffs)
        out[name] = {"diff_us": 1e6 * mean, "ci_us": [1e6 * lo, 1e6 * hi], "frac": mean / bare_step,
                     "ci_frac": [lo / bare_step, hi / bare_step]}
    measured = r["wall"][-1] - r["wall"][max(warmup, 1) - 1]
    out["background_core_frac"] = r["background_cpu_s"] / measured
    return out


def pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, str(REPO))
    frameworks = args.framework
    if "torchtitan" in frameworks and not (TITAN_VENV / "bin" / "python").exists():
        raise SystemExit(f"{TITAN_VENV} is missing: bash tests/scripts/torchtitan_venv.sh (or leave torchtitan out: "
                         "--framework lightning hf)")
    load_before = loadavg()
    rows, figures = [], {"frameworks": {}}
    for framework in frameworks:
        result = launch_one(args, framework)
        per_rank = {}
        for r in result["ranks"]:
            f = per_rank[str(r["rank"])] = rank_figures(r, result["warmup"])
            rows.append([framework, r["rank"], f["quads"], f"{f['bare_step_ms']:.2f}",
                         f"{f['wall']['diff_us']:+.1f}",
                         f"{pct(f['wall']['frac'])} [{pct(f['wall']['ci_frac'][0])}, {pct(f['wall']['ci_frac'][1])}]",
                         f"{f['cpu']['diff_us']:+.1f} [{f['cpu']['ci_us'][0]:+.1f}, {f['cpu']['ci_us'][1]:+.1f}]",
                         f"{100 * f['background_core_frac']:.2f}%"])
        figures["frameworks"][framework] = {"steps": result["steps"], "warmup": result["warmup"], "ranks": per_rank,
                                            "scrapes_ok": result["scrapes_ok"], "wall_s": result["wall_s"]}
    print(f"rankscope framework adapters: {args.ranks} rank(s) (gloo, 127.0.0.1; torchtitan 2), one run per "
          "framework, the adapter switched in and out between steps in quads (ABBA or BAAB)")
    print(table(["framework", "rank", "quads", "bare step ms", "wall diff us", "wall: rankscope / bare - 1 [95% CI]",
                 "training thread CPU diff us [95% CI]", "monitor threads CPU, share of a core"], rows))
    worst = max((f["wall"]["ci_frac"][1] for fw in figures["frameworks"].values() for f in fw["ranks"].values()),
                default=float("nan"))
    print(f"\nworst upper 95% bound, wall clock: {pct(worst)} (target <= +1%)")
    print(f"load average before / after: {load_before} / {loadavg()}")
    figures.update(machine=machine())
    emit_json({"benchmark": "adapters", **figures})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
