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
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Sequence

from rankscope import exit_status, layout, sinks
from rankscope.collectives import comm_timing
from rankscope.collectives.flight_recorder import FlightRecorder, ring_size
from rankscope.collectives.process_groups import FlightRecorderSource, ProcessGroupMetrics, ProcessGroupReader
from rankscope.collectives.tracker import CollectiveTracker, check_op, group_size, tensor_nbytes
from rankscope.config import MonitorConfig
from rankscope.contract.catalog import STEP_BUCKETS
from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import run_slug
from rankscope.device.memory import MemorySampler
from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors, UsageError
from rankscope.flops import FlopsConfig
from rankscope.identity import RankIdentity
from rankscope.layout import Layout
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import Publisher
from rankscope.publishing.stacks import StackDumps, parse_signal
from rankscope.publishing.startup import RankInfo, claim_run, prepare_run_dir
from rankscope.publishing.startup_phases import StartupPhases, watch_init
from rankscope.publishing.user_metrics import UserMetric, UserMetrics
from rankscope.replicas.check import ReplicaCheck
from rankscope.step.accounting import StepAccounting
from rankscope.step.goodput import Progress, TimeUse, process_start_perf
from rankscope.step.handoff import StepHandoff
from rankscope.step.watched import Watched
from rankscope.step.judging import Judge, JudgeSettings
from rankscope.step.timer import Step, StepTimer
from rankscope.step.trace_feed import TraceFeed
from rankscope.tracing import Tracing, build_tracing

_active_lock = threading.Lock()
_active: "Monitor | None" = None   # one open Monitor per process: two would split one rank's counts


class Monitor:
    """Per-rank telemetry. Construct once per rank process, before or after
    ``init_process_group``; everything that can be wrong is checked here."""

    def __init__(self, config: MonitorConfig | None = None, *, device: Any = None, backend: str | None = None,
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
            self._start(backend, device)
        except BaseException:
            getattr(self, "_restore_init", _nothing)()
            _release(self)
            raise

    def _start(self, backend: str | None, device: Any) -> None:
        cfg = self.config
        self.registration = prepare_run_dir(self.run_dir, self.identity)
        # The stacks the node exporter may ask for when this rank stops making progress.
        self.stacks = StackDumps(self.run_dir, self.registration, parse_signal(cfg.stack_signal))
        self.stacks.start()
        self._progress = Progress(self.run_dir, self.identity.rank)
        try:
            self.metrics = RankMetrics(self.run_dir, self.identity.labels)
        except OSError as e:
            raise ConfigError(f"metrics_dir: cannot create metric files in {self.run_dir}: {e.strerror or e}") from None
        self.errors.bind(self.metrics)
        if cfg.exporter != "off" and self.identity.local_rank == 0:
            from rankscope.launch import ensure_exporter

            url = ensure_exporter(cfg.metrics_addr, cfg.metrics_port, cfg.metrics_dir, cfg.exporter)
            if self.sink is not None:
                self.sink.local_exporter(url)   # another user's exporter may hold the configured port
        # The CUDA device: given, else learnt from the model watch() sees or the first CUDA value.
        self.device = RankDevice(self.errors.drop)
        try:
            self.device.bind(device)
        except (RuntimeError, AssertionError, TypeError) as e:   # not a device, or no CUDA here
            raise ConfigError(f"device: {device!r} cannot be used: {e}") from None
        self.tracker = CollectiveTracker(self.device)
        self.watched = Watched()   # what watch() attaches (comm timing, replica check): one holder
        # The step path, in the order a step travels it (docs/design.md, "A step, end to end").
        self.trace_feed = TraceFeed(self.tracing, self.tracker)
        self.handoff = StepHandoff(self.device, self.watched, self.errors, self.trace_feed)
        self.steps = StepTimer(self.tracker, self.watched, self.handoff.step_ended, self.errors.drop,
                               functools.partial(self.errors.error, "step"))
        judge = Judge(JudgeSettings(cfg.loss_window, cfg.loss_ema_alpha, cfg.spike_zscore, cfg.spike_warmup_steps,
                                    cfg.grad_spike_factor))
        self.accounting = StepAccounting(judge, self.trace_feed,
                                         TimeUse(process_start_perf(), self._progress.completed), self._progress,
                                         self.steps, self.watched, self.errors)
        self.user_metrics = UserMetrics(self.metrics, self.errors, self.device)
        memory = MemorySampler(self.device)
        rank_info = RankInfo(self.identity, self.device, backend, self.registration, self.run_dir, self.metrics,
                             self.handoff)
        ring = ring_size()   # torch's flight-recorder ring, read once
        # From process start to the first step: which phase the rank is in (rendezvous: inside
        # init_process_group, seen through a pass-through put in its place until close()).
        import torch.distributed as dist

        initialized = _dist_initialized()
        self.startup = StartupPhases(time.time() - (time.perf_counter() - process_start_perf()), initialized)
        # A torch built without distributed has no init_process_group to watch.
        self._restore_init = watch_init(self.startup) if dist.is_available() and not initialized else _nothing
        self.publisher = Publisher(self.metrics, self.handoff, self.accounting, self.watched, self.tracker,
                                   self.device, memory,
                                   self.tracing, self.errors,
                                   FlightRecorder(self.run_dir, self.identity.rank, cfg.flight_recorder_after_s, ring),
                                   rank_info, self.stacks, self.flops, cfg.publish_interval_s, cfg.memory_every_s,
                                   self.startup)
        self._rank_info = rank_info
        self._optimizer_hook: Any = None   # torch's global optimizer pre-hook, once a replicated model is watched
        self.process_groups = _process_group_reader(self, ring)
        self.metrics.start_ts.set(self.registration.started_at)
        self.metrics.launch_world_size.set(self.identity.world_size)
        for gauge in (*self.metrics.block_started.values(), self.metrics.block_ended):
            gauge.set(0.0)   # in no block, none ended: every series there from the start
        self.metrics.mem_total.set(memory.total())          # 0 until a CUDA device is known (the publisher)
        self.metrics.bind_flops(self.flops.counts_flops)   # the device's peak: once it is known
        self.metrics.mem_limit.set(memory.host_limit)
        self.metrics.set_layout(self.layout.labels(), None)
        self._closed = False
        self.publisher.start()
        if self.sink is not None:
            self.sink.start()
        if self.process_groups is not None:
            self.process_groups.start()
        exit_status.install()
        atexit.register(self.close)

    def watch(self, model: Any) -> Any:
        """Returns ``model``, unchanged in what it computes. A DistributedDataParallel model
        also gets its gradient all-reduces timed, as ``comm_timing`` says (``auto``: the comm
        hook on CUDA, DDP's own timers otherwise; DDP's timers where the model already has a
        comm hook of its own).

        Any other model (FSDP2 ``fully_shard``, FSDP1, tensor parallel, a pipeline stage,
        a plain module) is returned as it is: every collective of every process
        group is already seen through torch's flight recorder
        (``rankscope.collectives.process_groups``), with no wrapping.

        A model on a CUDA device tells a ``Monitor()`` made without one which device
        to time on. Parameters that are DTensors tell the rank's coordinates in the job's
        device mesh, and a ``torch.distributed.pipelining.PipelineStage`` (returned as it
        is) its pipeline stage (rankscope.layout)."""
        learnt = layout.learn(model)
        if learnt is not None:
            self._learn_layout(learnt)
            if self.process_groups is not None:   # groups named by their mesh dimension, from now on
                self.process_groups.roles = {**self.process_groups.roles, **layout.group_roles(model)}
        if not hasattr(model, "parameters"):
            if learnt is not None and hasattr(model, "submod"):   # a pipeline stage
                self.device.bind(self.device.first_cuda_index(model.submod))
                return model
            raise ConfigError(f"watch(): expected a torch.nn.Module or a PipelineStage, got {type(model).__name__}")
        self.device.bind(self.device.first_cuda_index(model))
        self._check_replicas(model)
        if not comm_timing.is_ddp(model):
            return model
        self.watched.use_comm_timing(comm_timing.choose(self.config.comm_timing, model, self.tracker,
                                                        functools.partial(self.errors.error, "collectives")))
        return model

    def _check_replicas(self, model: Any) -> None:
        """Fingerprints of what ``model`` replicates, every ``replica_check_every`` steps
        (rankscope.replicas): the weights after a step, the gradients before its optimizer step."""
        try:
            check = ReplicaCheck.of(model, self.config.replica_check_every, self.metrics, self.device,
                                    self.errors.drop)
        except Exception:   # a model whose parameters cannot be read: no check, training untouched
            self.errors.error("replicas")
            return
        if check is None:
            return
        self.watched.check_replicas(check)
        if self._optimizer_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._optimizer_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Every optimizer's step in the process (torch's global pre-hook); reads, never changes."""
        check, step = self.watched.replica_check, self.steps.step
        if check is not None and step.open:
            try:
                check.before_optimizer_step(step.number)
            except Exception:
                self.errors.error("replicas")

    def _learn_layout(self, learnt: Layout) -> None:
        merged = self.layout.merged(learnt)
        if merged != self.layout:
            previous, self.layout = self.layout, merged
            self.metrics.set_layout(merged.labels(), previous.labels())

    # -- the hot path ---------------------------------------------------------
    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Wrap the training data loader: the wait for each batch becomes the
        ``data`` phase of the step it belongs to (see rankscope.step.timer)."""
        it = iter(iterable)
        timer = self.steps
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
        self.steps.data_fetched(t0, t1)

    def awaiting_next_event(self, since: float) -> None:
        """For code that only sees events (framework callbacks): the time since ``since``
        (``time.perf_counter()``) is told apart by the next event (a data wait, a checkpoint save,
        the framework's own work), so it is not counted as idle meanwhile; 0: nothing is waiting."""
        self.steps.settling_since = since

    def step(self, samples: int = 0, tokens: int = 0, step: int | None = None) -> Step:
        """Context manager for one training step (an optimizer step, with all its
        micro-batches). ``step`` defaults to a counter from 0."""
        return self.steps.arm(samples, tokens, step)

    @contextmanager
    def checkpoint(self, kind: str = "save") -> Iterator[None]:
        """Time a checkpoint ``save`` or ``restore``: its seconds count as that badput, not as idle
        time or as the step's (rankscope_wall_seconds_total{category="checkpoint_save"})."""
        if kind not in ("save", "restore"):
            raise ValueError(f"monitor.checkpoint({kind!r}): kind is 'save' or 'restore'")
        with self._block("checkpoint_" + kind):
            yield

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        """Time an evaluation pass: its seconds count as evaluation, not as idle time."""
        with self._block("evaluation"):
            yield

    def checkpoint_took(self, t0: float, t1: float, kind: str = "save") -> None:
        """A checkpoint ``save`` or ``restore`` ran from ``t0`` to ``t1`` (``time.perf_counter()``):
        what ``with monitor.checkpoint(kind)`` records, for code that only learns of it afterwards
        (framework callbacks)."""
        if kind not in ("save", "restore"):
            raise ValueError(f"monitor.checkpoint_took(kind={kind!r}): kind is 'save' or 'restore'")
        self.handoff.interval_ended("checkpoint_" + kind, t0, t1)

    def evaluation_took(self, t0: float, t1: float) -> None:
        """An evaluation pass ran from ``t0`` to ``t1`` (``time.perf_counter()``): what
        ``with monitor.evaluation()`` records, for code that only learns of it afterwards."""
        self.handoff.interval_ended("evaluation", t0, t1)

    @contextmanager
    def _block(self, category: str) -> Iterator[None]:
        timer = self.steps
        if timer.block_started:
            raise UsageError(f"monitor.{category.split('_')[0]}() inside another checkpoint or evaluation block: "
                             "blocks do not nest")
        t0 = timer.block_started = time.perf_counter()
        # Written here, not by the publisher: a save that holds the GIL from its first
        # instruction (a large pickle) would keep the publisher from saying so until it ends.
        # One mmap write each way, at the block's edges only.
        self._mark_block(category, time.time())
        try:
            yield
        finally:
            self._mark_block(category, 0.0, ended=time.time())
            timer.block_started = 0.0
            self.handoff.interval_ended(category, t0, time.perf_counter())

    def _mark_block(self, category: str, started: float, ended: float = 0.0) -> None:
        try:
            if ended:   # first: the block's end is progress before the block is gone from the files
                self.metrics.block_ended.set(ended)
            self.metrics.block_started[category].set(started)
        except Exception:   # a closed monitor's files: counted, never raised into the job
            self.errors.error("publisher")

    @contextmanager
    def collective(self, op: str, *tensors: Any, nbytes: int | None = None, group: Any = None) -> Iterator[None]:
        """Time an explicit collective (blocking call inside the block)::

            with monitor.collective("all_reduce", t, group=tp_group):
                dist.all_reduce(t, group=tp_group)

        ``nbytes`` defaults to the size of the tensors given, which should be
        the message size as nccl-tests counts it (all_gather: the output).
        ``group``: the collective's process group (default: the world), whose
        size makes its bus bandwidth.
        """
        check_op(op)
        size = tensor_nbytes(tensors) if nbytes is None else nbytes
        size_of_group = group_size(group)
        cuda = self.device.device_of(list(tensors))
        if cuda is not None:
            self.device.bind(cuda)   # a Monitor() without a device learns it here at the latest
        if cuda is not None and self.device.events is not None:
            span = self.tracker.begin_device(op, size, group_size=size_of_group)
            try:
                yield
            finally:
                self.tracker.end_device(span)
        else:
            token, t0, start = self.tracker.begin(op)
            try:
                yield
            finally:
                self.tracker.end(token, op, size, t0, start, group_size=size_of_group)

    # -- user metrics --------------------------------------------------------
    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> UserMetric:
        return self.user_metrics.declare(name, "gauge", documentation, labels)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> UserMetric:
        return self.user_metrics.declare(name, "counter", documentation, labels)

    def histogram(self, name: str, documentation: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = STEP_BUCKETS) -> UserMetric:
        return self.user_metrics.declare(name, "histogram", documentation, labels, buckets)

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

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self._end(exit_status.ending_exception(exc))

    def _end(self, ending: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.steps.step.open:
                # A step begun by a framework callback (step.begin()) that an exception cut
                # short: end it with that exception, so an out-of-memory error is counted.
                self.steps.step.end(_exception_in_flight())
            self.steps.settle()
            self._restore_init()
            if self._optimizer_hook is not None:
                self._optimizer_hook.remove()
            self.publisher.flush(timeout_s=2.0)   # the last steps' traces are built here, before the tracer stops
            self.tracing.shutdown(timeout_s=2.0)
            if self.process_groups is not None:
                self.process_groups.stop(timeout_s=2.0)
            self.publisher.stop(timeout_s=2.0)   # after the tracer: spans dropped at shutdown are counted too
            self._rank_info.publish_when_known(final=True)
            self.registration.end(time.time(), exit_status.failure(ending), exit_status.failure_detail(ending))
            self.registration.save(self.run_dir)
            self.stacks.stop()
            if self.sink is not None:
                self.sink.stop(timeout_s=3.0)   # last: a slow backend cannot delay the rank's own state
        except Exception:
            self.errors.error("publisher")
        finally:
            _release(self)


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _nothing() -> None:
    pass


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


def _process_group_reader(monitor: Monitor, ring: int) -> ProcessGroupReader | None:
    """Every collective of every process group (rankscope.collectives.process_groups); None when
    max_process_groups=0 turns it off, or torch has no flight recorder."""
    cfg = monitor.config
    if cfg.max_process_groups == 0:
        return None
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is None or not hasattr(c10d, "_dump_fr_trace_json") or not hasattr(c10d, "_WorkerServer"):
        import logging

        logging.getLogger("rankscope").warning(
            "rankscope: torch %s has no flight recorder to read: only DDP's and monitor.collective()'s "
            "collectives are seen", torch.__version__)
        return None
    errors = monitor.errors
    # No flight-recorder hand-off from here: gloo's last-completed number can stay one short
    # after concurrent collectives, so a hung culprit's own last collective can look stuck,
    # and the culprit must leave no dump (docs/collectives.md).
    return ProcessGroupReader(ProcessGroupMetrics(monitor.metrics), errors.drop,
                              functools.partial(errors.error, "collectives"),
                              FlightRecorderSource(monitor.run_dir, monitor.identity.rank, device=monitor.device),
                              cfg.max_process_groups,
                              cfg.publish_interval_s, ring=ring, timing=cfg.collective_timing)
