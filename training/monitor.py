"""The instrumentation API a training loop calls: ``Monitor``.

    from rankscope import Monitor

    monitor = Monitor(device=device)                      # reads torchrun's environment
    model = monitor.watch(DDP(model))                     # times the gradient all-reduces
    for x, y in monitor.data(loader):                     # measures data wait
        with monitor.step(samples=len(x)) as step:
            with step.phase("forward"):
                loss = loss_fn(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                opt.step(); opt.zero_grad()
            step.observe(loss=loss, lr=sched.get_last_lr())

This module only wires the parts together and is the public face; each part
does one job, in a package by role (docs/design.md, "The rank side"):

    step          StepTimer (clocks), StepHandoff (training thread -> publisher),
                  StepAccounting (what the steps add up to), Judge, TraceFeed, goodput
    device        RankDevice (the CUDA device, its streams and events), DeviceReads, memory
    collectives   CollectiveTracker, comm_timing (DDP hook / reducer / off), process groups,
                  flight recorder
    publishing    Publisher (the thread that writes the metric files), RankMetrics,
                  UserMetrics, startup (run claim, run directory, rank_info)
    tracing       spans of sampled and anomalous steps, in the rank's span process
    replicas      ReplicaCheck: fingerprints of what a rank's replicas must hold bit for bit
    errors        counted, logged-once errors and drops

Once the Monitor is constructed nothing raises into the loop except misuse
that would give wrong numbers (``UsageError``: a nested step).
"""

from __future__ import annotations

import atexit
import functools
import sys
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any, ContextManager, Iterable, Iterator, Sequence, TypeVar

from rankscope import exit_status, layout, sinks
from rankscope.collectives import comm_timing
from rankscope.collectives.explicit import timed_collective
from rankscope.config import MonitorConfig
from rankscope.contract.catalog import STEP_BUCKETS
from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import run_slug
from rankscope.errors import TelemetryErrors
from rankscope.flops import FlopsConfig
from rankscope.identity import RankIdentity
from rankscope.layout import Layout
from rankscope.parts import RankParts
from rankscope.publishing.startup import claim_run
from rankscope.publishing.user_metrics import UserMetric
from rankscope.step.blocks import checkpoint_category
from rankscope.step.timer import Step
from rankscope.tracing import Tracing, build_tracing

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

Batch = TypeVar("Batch")
Watchable = TypeVar("Watchable")   # a torch.nn.Module (DDP, FSDP, ...) or a PipelineStage, returned as it is

_active_lock = threading.Lock()
_active: "Monitor | None" = None   # one open Monitor per process: two would split one rank's counts


class Monitor:
    """Per-rank telemetry. Construct once per rank process, before or after
    ``init_process_group``; everything that can be wrong is checked here."""

    def __init__(self, config: MonitorConfig | None = None, *, device: torch.device | int | str | None = None,
                 backend: str | None = None,
                 flops: FlopsConfig | None = None, layout: Any = None, **options: Any):
        self.config = config if config is not None else MonitorConfig.from_env(**options)
        # Where the rank sits in the job's parallel layout (rankscope.layout): stated here or in
        # RANKSCOPE_LAYOUT; watch() adds what a device mesh or a pipeline stage tells.
        self.layout = Layout.of(layout).merged(Layout.parse(self.config.layout))
        # FLOPs per token or sample, for MFU (rankscope.flops; RANKSCOPE_MODEL_PARAMS and friends)
        self.flops = flops if flops is not None else FlopsConfig.from_env()
        self.identity = claim_run(RankIdentity.from_env(self.config.run), self.config.metrics_dir)
        self.run_dir = self.config.metrics_dir / run_slug(self.identity.run)
        self.errors = TelemetryErrors()
        # Everything that can reject the configuration runs before anything is started.
        self.tracing: Tracing = build_tracing(self.identity, functools.partial(self.errors.error, "tracing"))
        self.sink = sinks.build(self.config, self.identity, self.errors)   # rank 0's TensorBoard / MLflow run
        _claim(self)
        try:
            self.parts = RankParts(self.config, self.identity, self.run_dir, self.layout, self.flops, self.errors,
                                   self.tracing, self.sink, backend, device)
        except BaseException:
            _release(self)
            raise
        self._closed = False
        self.parts.start()
        atexit.register(self.close)

    def watch(self, model: Watchable) -> Watchable:
        """Returns ``model``, unchanged in what it computes. A DistributedDataParallel model
        also gets its gradient all-reduces timed, as ``comm_timing`` says (``auto``: the comm
        hook on CUDA, DDP's own timers otherwise; DDP's timers where the model already has a
        comm hook of its own).

        Any other model (FSDP2 ``fully_shard``, FSDP1, tensor parallel, a pipeline stage,
        a plain module) is returned as it is: every collective of every process
        group is already seen through torch's flight recorder
        (``rankscope.collectives.group_reader``), with no wrapping.

        A model on a CUDA device tells a ``Monitor()`` made without one which device
        to time on. Parameters that are DTensors tell the rank's coordinates in the job's
        device mesh, and a ``torch.distributed.pipelining.PipelineStage`` (returned as it
        is) its pipeline stage (rankscope.layout)."""
        parts = self.parts
        learnt = layout.learn(model)
        if learnt is not None:
            self._learn_layout(learnt)
            if parts.process_groups is not None:   # groups named by their mesh dimension, from now on
                parts.process_groups.roles = {**parts.process_groups.roles, **layout.group_roles(model)}
        if not hasattr(model, "parameters"):
            if learnt is not None and hasattr(model, "submod"):   # a pipeline stage
                parts.device.bind(parts.device.first_cuda_index(model.submod))
                return model
            raise ConfigError(f"watch(): expected a torch.nn.Module or a PipelineStage, got {type(model).__name__}")
        parts.device.bind(parts.device.first_cuda_index(model))
        parts.check_replicas(model, self.config.replica_check_every)
        if comm_timing.is_ddp(model):
            parts.watched.use_comm_timing(comm_timing.choose(self.config.comm_timing, model, parts.tracker,
                                                             functools.partial(self.errors.error, "collectives")))
        return model

    def _learn_layout(self, learnt: Layout) -> None:
        merged = self.layout.merged(learnt)
        if merged != self.layout:
            previous, self.layout = self.layout, merged
            self.parts.metrics.set_layout(merged.labels(), previous.labels())

    # -- the hot path ---------------------------------------------------------
    def data(self, iterable: Iterable[Batch]) -> Iterator[Batch]:
        """Wrap the training data loader: the wait for each batch becomes the
        ``data`` phase of the step it belongs to (see rankscope.step.timer)."""
        it = iter(iterable)
        timer = self.parts.steps
        fetched = timer.data_fetched
        while True:
            t0 = timer.fetch_started = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                timer.fetch_started = 0.0
                return
            fetched(t0, time.perf_counter())
            yield item

    def waited_for_data(self, t0: float, t1: float) -> None:
        """A batch took from ``t0`` to ``t1`` (``time.perf_counter()``) to arrive: what ``data()``
        records, for code that cannot wrap the loader (framework callbacks). Before a step,
        that step then starts at ``t0``; inside one, it adds to its ``data`` phase."""
        self.parts.steps.data_fetched(t0, t1)

    def awaiting_next_event(self, since: float) -> None:
        """For code that only sees events (framework callbacks): the time since ``since``
        (``time.perf_counter()``) is told apart by the next event (a data wait, a checkpoint save,
        the framework's own work), so it is not counted as idle meanwhile; 0: nothing is waiting."""
        self.parts.steps.settling_since = since

    def step(self, samples: int = 0, tokens: int = 0, step: int | None = None) -> Step:
        """Context manager for one training step (an optimizer step, with all its
        micro-batches). ``step`` defaults to a counter from 0."""
        return self.parts.steps.arm(samples, tokens, step)

    def checkpoint(self, kind: str = "save") -> ContextManager[None]:
        """Time a checkpoint ``save`` or ``restore``: its seconds count as that badput, not as idle
        time or as the step's (rankscope_wall_seconds_total{category="checkpoint_save"})."""
        return self.parts.blocks.block(checkpoint_category(kind, "checkpoint"))

    def evaluation(self) -> ContextManager[None]:
        """Time an evaluation pass: its seconds count as evaluation, not as idle time."""
        return self.parts.blocks.block("evaluation")

    def checkpoint_took(self, t0: float, t1: float, kind: str = "save") -> None:
        """A checkpoint ``save`` or ``restore`` ran from ``t0`` to ``t1`` (``time.perf_counter()``):
        what ``with monitor.checkpoint(kind)`` records, for code that only learns of it afterwards
        (framework callbacks)."""
        self.parts.blocks.took(checkpoint_category(kind, "checkpoint_took"), t0, t1)

    def evaluation_took(self, t0: float, t1: float) -> None:
        """An evaluation pass ran from ``t0`` to ``t1`` (``time.perf_counter()``): what
        ``with monitor.evaluation()`` records, for code that only learns of it afterwards."""
        self.parts.blocks.took("evaluation", t0, t1)

    def collective(self, op: str, *tensors: torch.Tensor, nbytes: int | None = None,
                   group: ProcessGroup | None = None) -> ContextManager[None]:
        """Time an explicit collective (blocking call inside the block)::

            with monitor.collective("all_reduce", t, group=tp_group):
                dist.all_reduce(t, group=tp_group)

        ``nbytes`` defaults to the size of the tensors given, which should be
        the message size as nccl-tests counts it (all_gather: the output).
        ``group``: the collective's process group (default: the world), whose
        size makes its bus bandwidth.
        """
        return timed_collective(self.parts.tracker, op, tensors, nbytes, group)

    # -- user metrics --------------------------------------------------------
    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> UserMetric:
        return self.parts.user_metrics.declare(name, "gauge", documentation, labels)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> UserMetric:
        return self.parts.user_metrics.declare(name, "counter", documentation, labels)

    def histogram(self, name: str, documentation: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = STEP_BUCKETS) -> UserMetric:
        return self.parts.user_metrics.declare(name, "histogram", documentation, labels, buckets)

    # -- shutdown -------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Publish what is left and stop. The rank is ``finished`` only if no
        exception is on its way (see rankscope.exit_status); else ``failed``."""
        self._end(exit_status.ending_exception())

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end(exit_status.ending_exception(exc))

    def _end(self, ending: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            steps = self.parts.steps
            if steps.step.open:
                # A step begun by a framework callback (step.begin()) that an exception cut
                # short: end it with that exception, so an out-of-memory error is counted.
                steps.step.end(_exception_in_flight())
            self.parts.close(ending, self.run_dir)
        except Exception:
            self.errors.error("publisher")
        finally:
            _release(self)


def _exception_in_flight() -> BaseException:
    """The exception being handled, or the one that ended the interpreter (set before the
    exit hooks run); a stand-in when there is none (a step left open is not completed)."""
    exc = sys.exc_info()[1] or getattr(sys, "last_value", None)
    return exc if exc is not None else RuntimeError("the monitor closed while a step was open")


def _claim(monitor: Monitor) -> None:
    global _active
    with _active_lock:
        if _active is not None:
            raise ConfigError(f"a Monitor for run {_active.identity.run!r} rank {_active.identity.rank} is already "
                              "open in this process: use that one, or close() it first")
        _active = monitor


def _release(monitor: Monitor) -> None:
    global _active
    with _active_lock:
        if _active is monitor:
            _active = None
