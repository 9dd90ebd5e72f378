"""What stands behind a ``Monitor``: the rank's parts, built and wired once, in the order a
step travels them (docs/design.md, "A step, end to end"), and stopped in order.

``Monitor`` (rankscope.monitor) is the loop's face and checks what the user gave it;
everything here is built from that, by constructor: no part is handed another after it
is made. What ``watch()`` learns goes to the one holder made for it (``Watched``).
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from rankscope import exit_status
from rankscope.collectives.flight_recorder import FlightRecorder, ring_size
from rankscope.collectives.group_metrics import ProcessGroupMetrics
from rankscope.collectives.group_reader import ProcessGroupReader
from rankscope.collectives.ring_source import FlightRecorderSource
from rankscope.collectives.tracker import CollectiveTracker
from rankscope.config import MonitorConfig
from rankscope.contract.environment import ConfigError
from rankscope.device.memory import MemorySampler
from rankscope.device.rank_device import RankDevice
from rankscope.errors import TelemetryErrors
from rankscope.flops import FlopsConfig
from rankscope.identity import RankIdentity
from rankscope.layout import Layout
from rankscope.publishing.metrics import RankMetrics
from rankscope.publishing.publisher import Publisher
from rankscope.publishing.stacks import StackDumps, parse_signal
from rankscope.publishing.startup import RankInfo, prepare_run_dir
from rankscope.publishing.startup_phases import StartupPhases, watch_init
from rankscope.publishing.user_metrics import UserMetrics
from rankscope.replicas.check import ReplicaCheck
from rankscope.step.accounting import StepAccounting
from rankscope.step.blocks import Blocks
from rankscope.step.goodput import Progress, TimeUse, process_start_perf
from rankscope.step.handoff import StepHandoff
from rankscope.step.judging import Judge, JudgeSettings
from rankscope.step.timer import StepTimer
from rankscope.step.trace_feed import TraceFeed
from rankscope.step.watched import Watched
from rankscope.tracing import Tracing

if TYPE_CHECKING:
    import torch
    from rankscope.sinks import SinkProcess

log = logging.getLogger("rankscope")


class RankParts:
    def __init__(self, cfg: MonitorConfig, identity: RankIdentity, run_dir: Path, layout: Layout,
                 flops: FlopsConfig, errors: TelemetryErrors, tracing: Tracing, sink: SinkProcess | None,
                 backend: str | None, device: Any):
        self.errors, self.tracing, self.sink = errors, tracing, sink
        self.registration = prepare_run_dir(run_dir, identity)
        # The stacks the node exporter may ask for when this rank stops making progress.
        self.stacks = StackDumps(run_dir, self.registration, parse_signal(cfg.stack_signal))
        self.stacks.start()
        progress = Progress(run_dir, identity.rank)
        try:
            self.metrics = RankMetrics(run_dir, identity.labels)
        except OSError as e:
            raise ConfigError(f"metrics_dir: cannot create metric files in {run_dir}: {e.strerror or e}") from None
        errors.bind(self.metrics)
        if cfg.exporter != "off" and identity.local_rank == 0:
            from rankscope.launch import ensure_exporter

            url = ensure_exporter(cfg.metrics_addr, cfg.metrics_port, cfg.metrics_dir, cfg.exporter)
            if sink is not None:
                sink.local_exporter(url)   # another user's exporter may hold the configured port
        # The CUDA device: given, else learnt from the model watch() sees or the first CUDA value.
        self.device = RankDevice(errors.drop)
        try:
            self.device.bind(device)
        except (RuntimeError, AssertionError, TypeError) as e:   # not a device, or no CUDA here
            raise ConfigError(f"device: {device!r} cannot be used: {e}") from None
        self.tracker = CollectiveTracker(self.device)
        self.watched = Watched()   # what watch() attaches (comm timing, replica check): one holder
        # The step path, in the order a step travels it (docs/design.md, "A step, end to end").
        self.trace_feed = TraceFeed(tracing, self.tracker)
        self.handoff = StepHandoff(self.device, self.watched, errors, self.trace_feed)
        self.steps = StepTimer(self.tracker, self.watched, self.handoff.step_ended, errors.drop,
                               functools.partial(errors.error, "step"))
        judge = Judge(JudgeSettings(cfg.loss_window, cfg.loss_ema_alpha, cfg.spike_zscore, cfg.spike_warmup_steps,
                                    cfg.grad_spike_factor))
        self.accounting = StepAccounting(judge, self.trace_feed, TimeUse(process_start_perf(), progress.completed),
                                         progress, self.steps, self.watched, errors)
        self.blocks = Blocks(self.steps, self.handoff, self.metrics, errors)
        self.user_metrics = UserMetrics(self.metrics, errors, self.device)
        memory = MemorySampler(self.device)
        self.rank_info = RankInfo(identity, self.device, backend, self.registration, run_dir, self.metrics,
                                  self.handoff)
        ring = ring_size()   # torch's flight-recorder ring, read once
        # From process start to the first step: which phase the rank is in (rendezvous: inside
        # init_process_group, seen through a pass-through put in its place until close()).
        import torch.distributed as dist

        initialized = dist.is_available() and dist.is_initialized()
        self.startup = StartupPhases(time.time() - (time.perf_counter() - process_start_perf()), initialized)
        self.publisher = Publisher(self.metrics, self.handoff, self.accounting, self.watched, self.tracker,
                                   self.device, memory, tracing, errors,
                                   FlightRecorder(run_dir, identity.rank, cfg.flight_recorder_after_s, ring),
                                   self.rank_info, self.stacks, flops, cfg.publish_interval_s, cfg.memory_every_s,
                                   self.startup)
        self.optimizer_hook: Any = None   # torch's global optimizer pre-hook, once a replicated model is watched
        self.process_groups = process_group_reader(cfg, self.metrics, errors, run_dir, identity.rank, self.device,
                                                   ring)
        m = self.metrics
        m.start_ts.set(self.registration.started_at)
        m.launch_world_size.set(identity.world_size)
        for gauge in (*m.block_started.values(), m.block_ended):
            gauge.set(0.0)   # in no block, none ended: every series there from the start
        m.mem_total.set(memory.total())          # 0 until a CUDA device is known (the publisher)
        m.bind_flops(flops.counts_flops)         # the device's peak: once it is known
        m.mem_limit.set(memory.host_limit)
        m.set_layout(layout.labels(), None)
        # Last, once nothing here can fail: a torch built without distributed has no
        # init_process_group to watch.
        self.restore_init: Callable[[], None] = \
            watch_init(self.startup) if dist.is_available() and not initialized else _nothing

    def start(self) -> None:
        self.publisher.start()
        if self.sink is not None:
            self.sink.start()
        if self.process_groups is not None:
            self.process_groups.start()
        exit_status.install()

    def check_replicas(self, model: torch.nn.Module, every: int) -> None:
        """Fingerprints of what ``model`` replicates, every ``every`` steps (rankscope.replicas):
        the weights after a step, the gradients before its optimizer step."""
        try:
            check = ReplicaCheck.of(model, every, self.metrics, self.device, self.errors.drop)
        except Exception:   # a model whose parameters cannot be read: no check, training untouched
            self.errors.error("replicas")
            return
        if check is None:
            return
        self.watched.check_replicas(check)
        if self.optimizer_hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self.optimizer_hook = register_optimizer_step_pre_hook(self._before_optimizer_step)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Every optimizer's step in the process (torch's global pre-hook); reads, never changes."""
        check, step = self.watched.replica_check, self.steps.step
        if check is not None and step.open:
            try:
                check.before_optimizer_step(step.number)
            except Exception:
                self.errors.error("replicas")

    def close(self, ending: BaseException | None, run_dir: Path) -> None:
        """Publish what is left and stop, each part bounded in time; ``ending``: the exception the
        process ends with, if any (its rank then ends ``failed``: rankscope.exit_status)."""
        self.steps.settle()
        self.restore_init()
        if self.optimizer_hook is not None:
            self.optimizer_hook.remove()
        self.publisher.flush(timeout_s=2.0)   # the last steps' traces are built here, before the tracer stops
        self.tracing.shutdown(timeout_s=2.0)
        if self.process_groups is not None:
            self.process_groups.stop(timeout_s=2.0)
        self.publisher.stop(timeout_s=2.0)   # after the tracer: spans dropped at shutdown are counted too
        self.rank_info.publish_when_known(final=True)
        self.registration.end(time.time(), exit_status.failure(ending), exit_status.failure_detail(ending))
        self.registration.save(run_dir)
        self.stacks.stop()
        if self.sink is not None:
            self.sink.stop(timeout_s=3.0)   # last: a slow backend cannot delay the rank's own state


def _nothing() -> None:
    pass


def process_group_reader(cfg: MonitorConfig, metrics: RankMetrics, errors: TelemetryErrors, run_dir: Path,
                         rank: int, device: RankDevice, ring: int) -> ProcessGroupReader | None:
    """Every collective of every process group (rankscope.collectives.group_reader); None when
    max_process_groups=0 turns it off, or torch has no flight recorder."""
    if cfg.max_process_groups == 0:
        return None
    import torch

    c10d = getattr(torch._C, "_distributed_c10d", None)
    if c10d is None or not hasattr(c10d, "_dump_fr_trace_json") or not hasattr(c10d, "_WorkerServer"):
        log.warning("rankscope: torch %s has no flight recorder to read: only DDP's and monitor.collective()'s "
                    "collectives are seen", torch.__version__)
        return None
    # No flight-recorder hand-off from here: gloo's last-completed number can stay one short
    # after concurrent collectives, so a hung culprit's own last collective can look stuck,
    # and the culprit must leave no dump (docs/collectives.md).
    return ProcessGroupReader(ProcessGroupMetrics(metrics), errors.drop,
                              functools.partial(errors.error, "collectives"),
                              FlightRecorderSource(run_dir, rank, device=device),
                              cfg.max_process_groups,
                              cfg.publish_interval_s, ring=ring, timing=cfg.collective_timing)
