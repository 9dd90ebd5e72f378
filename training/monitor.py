"""The instrumentation API a training loop calls.

    from rankscope import Monitor

    monitor = Monitor()                                   # reads torchrun's environment
    model = monitor.watch(DDP(model))                     # times every gradient bucket
    for x, y in monitor.data(loader):                     # measures data wait
        with monitor.step(samples=len(x)) as step:
            with step.phase("forward"):
                loss = loss_fn(model(x), y)
            with step.phase("backward"):
                loss.backward()
            with step.phase("optimizer"):
                opt.step(); opt.zero_grad()
            step.observe(loss=loss, lr=sched.get_last_lr()[0])

What the hot path does: a few ``perf_counter`` calls, float additions under
an uncontended lock, and appends to bounded buffers. A background thread
(the publisher) beats the heartbeat and writes everything to the mmap files
the node exporter reads, every ``publish_interval_s``. Nothing here raises
into the loop once the monitor is constructed: errors in telemetry are counted
in ``rankscope_telemetry_errors_total`` and logged once per component.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

from rankscope.contract import catalog
from rankscope.contract.catalog import MetricSpec
from rankscope.collectives import CollectiveTracker, ReducerTimers, check_op, ddp_timing_hook, tensor_nbytes
from rankscope.config import ConfigError, MonitorConfig
from rankscope.health import GradNormTracker, LossTracker
from rankscope.identity import RankIdentity
from rankscope.memory import MemorySampler
from rankscope.metrics import RankMetrics
from rankscope.records import PhaseRecord, StepRecord
from rankscope.contract.rundir import Registration, process_start_ticks, remove_previous_launch, run_slug
from rankscope.tracing import Tracing, build_tracing

log = logging.getLogger("rankscope")

MAX_PENDING_STEPS = 10_000   # unpublished step durations kept before dropping the oldest
SLOW_STEP_FACTOR = 3.0       # a step this many times the running median is traced as an anomaly
SLOW_STEP_FLOOR_S = 0.001    # ...if it took at least this long: µs-scale steps jitter by more than 3x


class _Accumulator:
    """What the training thread collected since the last publish."""

    __slots__ = ("steps", "durations", "phase", "samples", "tokens", "last_step", "last_duration",
                 "last_end", "losses", "grad_norms", "lr", "ooms", "nonfinite_loss", "nonfinite_grad",
                 "loss_spikes", "grad_spikes", "loss_ema", "loss_z")

    def __init__(self) -> None:
        self.steps = 0
        self.durations: list[float] = []
        self.phase = dict.fromkeys(catalog.PHASES, 0.0)
        self.samples = 0
        self.tokens = 0
        self.last_step = -1
        self.last_duration = 0.0
        self.last_end = 0.0
        self.losses: list[float] = []
        self.grad_norms: list[float] = []
        self.lr = math.nan
        self.ooms = 0
        self.nonfinite_loss = 0
        self.nonfinite_grad = 0
        self.loss_spikes = 0
        self.grad_spikes = 0
        self.loss_ema = math.nan
        self.loss_z = math.nan


class _Phase:
    """Reusable timer for one phase of the current step (no allocation per use).

    On a CUDA device it also records an event pair on the current stream: the
    host returns from forward long before the GPU finishes it, so device
    phases are measured by events and read later by the publisher."""

    __slots__ = ("name", "step", "t0", "event", "in_flight", "token")

    def __init__(self, name: str, step: "Step"):
        self.name = name
        self.step = step
        self.t0 = 0.0
        self.event = None
        # The op this phase counts as in flight (watch() in reducer mode sets
        # "all_reduce" on backward: a rank blocked there waits on its peers).
        self.in_flight: str | None = None
        self.token = -1

    def __enter__(self) -> "_Phase":
        events = self.step.events
        if events is not None:
            self.event = events.get()
            self.event.record()
        if self.in_flight is not None:
            self.token = self.step.monitor.tracker.mark(self.in_flight, time.time())
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        t1 = time.perf_counter()
        step = self.step
        if self.token >= 0:
            step.monitor.tracker.unmark(self.token)
            self.token = -1
        if step.events is not None and self.event is not None:
            end = step.events.get()
            end.record()
            step.device_phases.append((self.name, self.event, end))
            self.event = None
        step._phase_done(self.name, self.t0, t1)


@dataclass(slots=True)
class _DeviceStep:
    """A CUDA step whose phase events are not read yet."""

    duration: float                      # host wall clock, data wait included
    data: float
    phases: list[tuple[str, Any, Any]]   # (name, start event, end event)
    last_bucket: Any                     # the step's last-launched bucket (its duration is the exposed wait)


class Step:
    """The step in progress. Reused from step to step."""

    def __init__(self, monitor: "Monitor"):
        self.monitor = monitor
        self.events = monitor.tracker.events   # None unless the device is CUDA
        self.device_phases: list[tuple[str, Any, Any]] = []
        self._phases = {name: _Phase(name, self) for name in catalog.PHASES}
        self.number = -1
        self.t0 = 0.0
        self.start_unix = 0.0
        self.samples = 0
        self.tokens = 0
        self.phase_seconds = dict.fromkeys(catalog.PHASES, 0.0)
        self.phase_log: list[tuple[str, float, float]] = []
        self.backward_end = 0.0
        self.backward_start = 0.0
        self.loss: Any = None
        self.grad_norm: Any = None
        self.lr: float | None = None

    def phase(self, name: str) -> _Phase:
        """Time a phase: ``data``, ``forward``, ``backward``, ``optimizer`` (or ``other``)."""
        try:
            return self._phases[name]
        except KeyError:
            raise ValueError(f"phase {name!r} is not one of {', '.join(catalog.PHASES)}") from None

    def _phase_done(self, name: str, t0: float, t1: float) -> None:
        self.phase_seconds[name] += t1 - t0
        self.phase_log.append((name, t0, t1))
        if name == "backward":
            self.backward_start, self.backward_end = t0, t1

    def observe(self, loss: Any = None, grad_norm: Any = None, lr: float | None = None) -> None:
        """Report the step's loss, gradient norm and learning rate.

        Tensors are fine: a CPU tensor is read at once; a CUDA tensor is
        copied to pinned memory without blocking and read once it is ready.
        """
        if loss is not None:
            self.loss = loss
        if grad_norm is not None:
            self.grad_norm = grad_norm
        if lr is not None:
            self.lr = lr

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.monitor._end_step(self, exc)
        return False  # never swallow the loop's exception


class Monitor:
    """Per-rank telemetry. Construct once per rank process, after (or before)
    ``init_process_group``; everything that can be wrong is checked here."""

    def __init__(self, config: MonitorConfig | None = None, *, device: Any = None, backend: str | None = None,
                 **options: Any):
        self.config = config if config is not None else MonitorConfig.from_env(**options)
        self.identity = RankIdentity.from_env(self.config.run)
        self.device = device
        self.run_dir = self.config.metrics_dir / run_slug(self.identity.run)
        self._logged_errors: set[str] = set()
        # Everything that can reject the configuration runs before anything is started.
        self.tracing: Tracing = build_tracing(self.identity, lambda: self._error("tracing"))
        self._prepare_run_dir()
        try:
            self.metrics = RankMetrics(self.run_dir, self.identity.labels)
        except OSError as e:
            raise ConfigError(f"metrics_dir: cannot create metric files in {self.run_dir}: {e.strerror or e}") from None
        if self.config.exporter != "off" and self.identity.local_rank == 0:
            from rankscope.launch import ensure_exporter

            ensure_exporter(self.config)
        self.tracker = CollectiveTracker(self.identity.world_size, _cuda_event_factory(device))
        self._reducer: ReducerTimers | None = None   # set by watch() in reducer mode
        self.loss_tracker = LossTracker(self.config.loss_window, self.config.loss_ema_alpha,
                                        self.config.spike_zscore, self.config.spike_warmup_steps)
        self.grad_tracker = GradNormTracker(self.config.grad_spike_factor)
        self.memory = MemorySampler(device)
        self._lock = threading.Lock()
        self._acc = _Accumulator()
        self._dropped_steps = 0
        self._step = Step(self)
        self._next_step = 0
        self._data_wait = 0.0
        self._data_start = 0.0
        self._pending_device_values: deque[tuple[str, Any, Any]] = deque(maxlen=1024)
        self._pending_device_steps: deque[_DeviceStep] = deque(maxlen=1024)
        self._median_step = 0.0
        self._closed = False
        self._in_flight_published: dict[str, float] = {}
        self._spans_dropped_published = 0
        self._last_memory = 0.0
        self._mem_counters = (0.0, 0.0)
        self._write_rank_info(backend)
        self._flight_recorder_dumped = 0.0   # start of the collective last dumped for
        self.metrics.start_ts.set(self.registration.started_at)
        self.metrics.mem_total.set(self.memory.total)
        self.metrics.mem_limit.set(self.memory.host_limit)
        self._stop = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="rankscope-publisher", daemon=True)
        self._publish()  # heartbeat and zeros visible before the first step
        self._publisher.start()
        atexit.register(self.close)

    # -- set-up -------------------------------------------------------------
    def _prepare_run_dir(self) -> None:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            probe = self.run_dir / f".probe-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ConfigError(f"metrics_dir: cannot write to {self.run_dir}: {e.strerror or e}") from None
        pid, agent = os.getpid(), os.getppid()
        remove_previous_launch(self.run_dir, agent, process_start_ticks(agent))
        ident = self.identity
        self.registration = Registration(
            run=ident.run, rank=ident.rank, local_rank=ident.local_rank, node=ident.node,
            world_size=ident.world_size, local_world_size=ident.local_world_size,
            pid=pid, pid_start_ticks=process_start_ticks(pid), agent_pid=agent,
            agent_start_ticks=process_start_ticks(agent), started_at=time.time(),
        )
        self.registration.save(self.run_dir)

    def _write_rank_info(self, backend: str | None) -> None:
        import torch

        device, uuid = "cpu", ""
        if self.device is not None and getattr(self.device, "type", "") == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            device = f"cuda:{index}"
            uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
            uuid = uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"
        if backend is None:
            import torch.distributed as dist

            backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else ""
        nccl = ""
        try:
            if torch.cuda.is_available():
                nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            nccl = ""
        from rankscope import __version__

        info = {
            "world_size": str(self.identity.world_size), "local_world_size": str(self.identity.local_world_size),
            "process_id": str(os.getpid()), "hostname": os.uname().nodename, "device": device, "gpu_uuid": uuid,
            "backend": str(backend), "torch_version": torch.__version__, "nccl_version": nccl,
            "rankscope_version": __version__, "slurm_job_id": self.identity.slurm_job_id,
            "k8s_pod": self.identity.k8s_pod,
        }
        self.registration.info = info
        self.registration.save(self.run_dir)
        self.metrics.set_rank_info(info)

    def watch(self, ddp_model: Any) -> Any:
        """Time the gradient all-reduces of a DistributedDataParallel model; returns the model.

        How depends on ``comm_timing`` (see MonitorConfig); ``auto`` picks the
        comm hook for a model on CUDA and DDP's own timers otherwise."""
        mode = self.config.comm_timing
        if mode == "off":
            return ddp_model
        if not hasattr(ddp_model, "register_comm_hook"):
            raise ConfigError("watch(): expected a DistributedDataParallel model")
        if mode == "auto":
            on_cuda = any(p.is_cuda for p in ddp_model.parameters())
            mode = "hook" if on_cuda else "reducer"
        if mode == "hook":
            ddp_model.register_comm_hook(None, ddp_timing_hook(self.tracker, lambda: self._error("collectives")))
            return ddp_model
        try:
            self._reducer = ReducerTimers(ddp_model)
        except Exception as e:   # DDP's private logging API moved: say so now, not mid-training
            import torch

            raise ConfigError(f"comm_timing=reducer: cannot read DDP's timers in torch {torch.__version__} ({e!r}); "
                              "use comm_timing=hook") from None
        self._step._phases["backward"].in_flight = "all_reduce"
        return ddp_model

    # -- the hot path ---------------------------------------------------------
    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Wrap a data loader: time spent waiting for the next batch becomes the
        next step's ``data`` phase, and that step starts when the wait began."""
        it = iter(iterable)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            self._data_start = t0
            self._data_wait = time.perf_counter() - t0
            yield item

    def step(self, samples: int = 0, tokens: int = 0, step: int | None = None) -> Step:
        """Context manager for one training step. ``step`` defaults to a counter."""
        s = self._step
        now = time.perf_counter()
        s.number = self._next_step if step is None else step
        self._next_step = s.number + 1
        s.samples, s.tokens = samples, tokens
        for k in s.phase_seconds:
            s.phase_seconds[k] = 0.0
        s.phase_log.clear()
        if s.device_phases:
            s.device_phases = []
        s.loss = s.grad_norm = s.lr = None
        s.backward_end = s.backward_start = 0.0
        if self._data_start:
            s.t0 = self._data_start
            s.phase_seconds["data"] = self._data_wait
            s.phase_log.append(("data", self._data_start, self._data_start + self._data_wait))
            self._data_start = 0.0
        else:
            s.t0 = now
        s.start_unix = time.time() - (now - s.t0)
        self.tracker.last_bucket_launch = 0.0
        self.tracker.last_device_bucket = None
        return s

    def _end_step(self, s: Step, exc: BaseException | None) -> None:
        t1 = time.perf_counter()
        try:
            if exc is not None and _is_oom(exc):
                with self._lock:
                    self._acc.ooms += 1
                self._trace(s, t1, "oom")
                self._publish()  # the process is probably about to die: publish now
                return
            if exc is not None:
                return
            duration = t1 - s.t0
            phases = s.phase_seconds
            if s.events is not None:
                # CUDA: only the data wait is a host time; the rest comes from events.
                self._pending_device_steps.append(_DeviceStep(duration, phases["data"], s.device_phases,
                                                              self.tracker.last_device_bucket))
                phases = dict.fromkeys(catalog.PHASES, 0.0)
                phases["data"] = s.phase_seconds["data"]
            else:
                exposed = self._exposed_comm(s)
                phases["backward"] -= exposed
                phases["comm_wait"] += exposed
                phases["other"] += max(duration - sum(phases.values()), 0.0)
            if self._reducer is not None:
                self._poll_reducer()
            anomaly = ""
            loss = self._read_now("loss", s.loss)
            grad = self._read_now("grad", s.grad_norm)
            with self._lock:
                acc = self._acc
                acc.steps += 1
                if len(acc.durations) < MAX_PENDING_STEPS:
                    acc.durations.append(duration)
                else:
                    self._dropped_steps += 1
                for k, v in phases.items():
                    acc.phase[k] += v
                acc.samples += s.samples
                acc.tokens += s.tokens
                acc.last_step = s.number
                acc.last_duration = duration
                acc.last_end = s.start_unix + duration
                if loss is not None:
                    anomaly = self._judge_loss(loss, acc)
                if grad is not None:
                    grad_anomaly = self._judge_grad(grad, acc)
                    anomaly = anomaly or grad_anomaly   # the loss is the primary signal
                if s.lr is not None:
                    acc.lr = float(s.lr)
            median = self._median_step
            self._median_step = duration if not median else median + 0.05 * (duration - median)
            if not anomaly and median and s.number > 10 and duration > SLOW_STEP_FACTOR * median \
                    and duration >= SLOW_STEP_FLOOR_S:
                anomaly = "slow_step"
            if self.tracing.enabled and (anomaly or self.tracing.sampled(s.number)):
                self._trace(s, t1, anomaly, loss)
        except Exception:
            self._error("step")

    def _exposed_comm(self, s: Step) -> float:
        """Seconds of backward spent only waiting for all-reduces (CPU clock)."""
        if not s.backward_end:
            return 0.0
        if self._reducer is not None:
            # DDP's timers, from the latest sampled step: an estimate for the others.
            return min(self._reducer.exposed, s.phase_seconds["backward"])
        # After the last bucket was launched, backward had no compute left and
        # only waited for the all-reduces to finish.
        launch = self.tracker.last_bucket_launch
        if s.backward_start <= launch <= s.backward_end:
            return s.backward_end - launch
        return 0.0

    def _poll_reducer(self) -> None:
        """Records DDP's own timing of a sampled step's all-reduces, one step in REDUCER_SAMPLE_EVERY."""
        try:
            record = self._reducer.poll()
            if record is not None:
                self.tracker.record(record)
        except Exception:
            self._error("collectives")

    def _read_now(self, what: str, value: Any) -> float | None:
        """A float now if it can be had without waiting on the device; else queue it."""
        if value is None:
            return None
        if isinstance(value, (int, float)):
            return float(value)
        if getattr(value, "is_cuda", False):
            self._queue_device_value(what, value)
            return None
        return value.item()   # no detach(): item() needs none, and each torch call costs ~5 µs cold after a step

    def _queue_device_value(self, what: str, tensor: Any) -> None:
        import torch

        host = torch.empty((), dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor.detach(), non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        self._pending_device_values.append((what, host, ready))

    def _judge_loss(self, loss: float, acc: _Accumulator) -> str:
        """Called under the lock, for every loss value, exactly once."""
        verdict = self.loss_tracker.observe(loss)
        acc.losses.append(loss)
        if verdict.nonfinite:
            acc.nonfinite_loss += 1
            return "nonfinite_loss"
        acc.loss_ema, acc.loss_z = verdict.ema, verdict.zscore
        if verdict.spike:
            acc.loss_spikes += 1
            return "loss_spike"
        return ""

    def _judge_grad(self, norm: float, acc: _Accumulator) -> str:
        nonfinite, explosion = self.grad_tracker.observe(norm)
        acc.grad_norms.append(norm)
        if nonfinite:
            acc.nonfinite_grad += 1
            return "nonfinite_grad"
        if explosion:
            acc.grad_spikes += 1
            return "grad_spike"
        return ""

    def _trace(self, s: Step, t1: float, anomaly: str, loss: float | None = None) -> None:
        base = s.start_unix - s.t0  # perf_counter -> unix seconds
        record = StepRecord(
            step=s.number, start=s.start_unix, duration=t1 - s.t0,
            phases=[PhaseRecord(name, base + a, b - a) for name, a, b in s.phase_log],
            collectives=self.tracker.recent_since(s.start_unix),
            samples=s.samples, tokens=s.tokens,
            loss=loss, anomaly=anomaly,
        )
        self.tracing.submit(record)

    @contextmanager
    def collective(self, op: str, *tensors: Any, nbytes: int | None = None) -> Iterator[None]:
        """Time an explicit collective (blocking call inside the block)::

            with monitor.collective("all_reduce", t):
                dist.all_reduce(t)

        ``nbytes`` defaults to the size of the tensors given, which should be
        the message size as nccl-tests counts it (all_gather: the output).
        """
        check_op(op)
        size = tensor_nbytes(tensors) if nbytes is None else nbytes
        on_cuda = any(getattr(t, "is_cuda", False) for t in tensors)
        if on_cuda and self.tracker.events is not None:
            span = self.tracker.begin_device(op, size)
            try:
                yield
            finally:
                self.tracker.end_device(span)
        else:
            token, t0, start = self.tracker.begin(op)
            try:
                yield
            finally:
                self.tracker.end(token, op, size, t0, start)

    # -- user metrics --------------------------------------------------------
    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> "UserMetric":
        return self._declare(name, "gauge", documentation, labels)

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> "UserMetric":
        return self._declare(name, "counter", documentation, labels)

    def histogram(self, name: str, documentation: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = catalog.STEP_BUCKETS) -> "UserMetric":
        return self._declare(name, "histogram", documentation, labels, tuple(buckets))

    def _declare(self, name: str, kind: str, documentation: str, labels: Sequence[str],
                 buckets: tuple[float, ...] | None = None) -> "UserMetric":
        full = catalog.USER_PREFIX + name
        if not name or not name.replace("_", "a").isalnum() or not name[0].isalpha() or name != name.lower():
            raise ConfigError(f"user metric {name!r}: use lower_snake_case letters, digits and _")
        if kind == "counter" and not name.endswith("_total"):
            raise ConfigError(f"user counter {name!r}: counter names end in _total")
        if kind != "counter" and name.endswith("_total"):
            raise ConfigError(f"user {kind} {name!r}: only counters end in _total")
        reserved = set(catalog.IDENTITY_LABELS) | {"job", "instance", "step", "le", "quantile"}
        bad = reserved & set(labels)
        if bad:
            raise ConfigError(f"user metric {name!r}: label(s) {', '.join(sorted(bad))} are reserved")
        spec = MetricSpec(full, kind, documentation, gauge_mode="mostrecent", buckets=buckets)  # type: ignore[arg-type]
        try:
            metric = self.metrics.declare(spec, tuple(labels))
        except ValueError as e:
            raise ConfigError(f"user metric {name!r}: {e}") from None
        return UserMetric(self, metric, tuple(labels))

    # -- background publishing -------------------------------------------------
    def _publish_loop(self) -> None:
        while not self._stop.wait(self.config.publish_interval_s):
            self._publish()

    def _publish(self) -> None:
        m = self.metrics
        try:
            now = time.time()
            m.heartbeat.set(now)
            if self.tracker.events is not None:
                self.tracker.poll_device()   # first: device steps need their buckets' durations
            self._resolve_device_values()
            self._resolve_device_steps()
            with self._lock:
                acc, self._acc = self._acc, _Accumulator()
            if acc.steps:
                m.steps.inc(acc.steps)
                for d in acc.durations:
                    m.step_duration.observe(d)
                m.step_last.set(acc.last_duration)
                m.step_ts.set(acc.last_end)
                m.step.set(acc.last_step)
                if acc.samples:
                    m.samples.inc(acc.samples)
                if acc.tokens:
                    m.tokens.inc(acc.tokens)
            for k, v in acc.phase.items():  # CUDA steps' phases arrive after their step
                if v:
                    m.phase[k].inc(v)
            if acc.ooms:
                m.ooms.inc(acc.ooms)
            self._publish_loss(acc)
            if not math.isnan(acc.lr):
                m.lr.set(acc.lr)
        except Exception:
            self._error("publisher")
        try:
            self._publish_collectives()
        except Exception:
            self._error("collectives")
        try:
            if time.monotonic() - self._last_memory >= self.config.memory_every_s:
                self._last_memory = time.monotonic()
                self._publish_memory()
        except Exception:
            self._error("memory")
        try:
            dropped = self.tracing.dropped()
            if dropped > self._spans_dropped_published:
                m.spans_dropped.inc(dropped - self._spans_dropped_published)
                self._spans_dropped_published = dropped
        except Exception:
            self._error("tracing")

    def _publish_loss(self, acc: _Accumulator) -> None:
        m = self.metrics
        for n, child in ((acc.nonfinite_loss, m.nonfinite["loss"]), (acc.nonfinite_grad, m.nonfinite["grad"]),
                         (acc.loss_spikes, m.loss_spikes), (acc.grad_spikes, m.grad_spikes)):
            if n:
                child.inc(n)
        if acc.losses:
            m.loss.set(acc.losses[-1])
        if not math.isnan(acc.loss_ema):
            m.loss_ema.set(acc.loss_ema)
            m.loss_z.set(acc.loss_z)
        if acc.grad_norms:
            m.grad_norm.set(acc.grad_norms[-1])

    def _resolve_device_values(self) -> None:
        pending = self._pending_device_values
        while pending and pending[0][2].query():
            what, host, _ = pending.popleft()
            value = float(host)
            with self._lock:
                if what == "loss":
                    self._judge_loss(value, self._acc)
                else:
                    self._judge_grad(value, self._acc)

    def _resolve_device_steps(self) -> None:
        """Turn finished CUDA steps' events into phase seconds (never waits)."""
        pending = self._pending_device_steps
        pool = self.tracker.events
        while pending:
            step = pending[0]
            if not all(end.query() for _, _, end in step.phases):
                return
            if step.last_bucket is not None and step.last_bucket.duration is None:
                return   # its all-reduce is still being read by poll_device
            pending.popleft()
            device = dict.fromkeys(catalog.PHASES, 0.0)
            for name, start, end in step.phases:
                device[name] += start.elapsed_time(end) / 1000.0
                pool.put(start)
                pool.put(end)
            if step.last_bucket is not None:
                exposed = min(step.last_bucket.duration, device["backward"])
                device["backward"] -= exposed
                device["comm_wait"] += exposed
            device["data"] = 0.0  # already counted from the host clock
            device["other"] += max(step.duration - step.data - sum(device.values()), 0.0)
            with self._lock:
                for k, v in device.items():
                    self._acc.phase[k] += v

    def _publish_collectives(self) -> None:
        m = self.metrics
        tracker = self.tracker
        last: dict[str, float] = {}
        nbytes: dict[str, int] = {}
        for rec in tracker.drain():
            m.collective(rec.op).duration.observe(rec.duration)
            last[rec.op] = rec.duration
            nbytes[rec.op] = nbytes.get(rec.op, 0) + rec.nbytes
        for op, v in last.items():
            m.collective(op).last.set(v)
        for op, n in nbytes.items():
            m.collective(op).bytes.inc(n)
        in_flight = tracker.in_flight()
        if in_flight:
            self._maybe_dump_flight_recorder(min(in_flight.values()))
        for op in set(in_flight) | set(self._in_flight_published):
            since = in_flight.get(op, 0.0)
            if self._in_flight_published.get(op) != since:
                series = m.collective(op)
                series.in_flight.set(1.0 if since else 0.0)
                series.started.set(since)
                if since:
                    self._in_flight_published[op] = since
                else:
                    self._in_flight_published.pop(op, None)

    def _maybe_dump_flight_recorder(self, oldest_start: float) -> None:
        """Leave torch's flight recorder where the runbook says to look, once
        per stuck collective: <run dir>/flight-recorder/nccl_trace_rank_<rank>.
        Needs TORCH_FR_BUFFER_SIZE > 0 (the recorder is off otherwise)."""
        if time.time() - oldest_start < self.config.flight_recorder_after_s:
            return
        if self._flight_recorder_dumped == oldest_start:
            return
        self._flight_recorder_dumped = oldest_start
        path = dump_flight_recorder(self.run_dir / "flight-recorder", self.identity.rank)
        if path is not None:
            log.warning("rankscope: collective in flight for over %.0f s; flight recorder dumped to %s",
                        self.config.flight_recorder_after_s, path)

    def _publish_memory(self) -> None:
        m = self.metrics
        r = self.memory.read()
        m.rss.set(r.rss)
        if self.memory.cuda:
            m.mem_allocated.set(r.allocated)
            m.mem_reserved.set(r.reserved)
            m.mem_peak.set(r.peak)
            retries, _ = self._mem_counters
            if r.retries > retries:
                m.alloc_retries.inc(r.retries - retries)
            self._mem_counters = (r.retries, r.ooms)

    def _error(self, component: str) -> None:
        try:
            self.metrics.telemetry_error(component if component in self.metrics.errors else "publisher")
        except Exception:
            pass
        if component not in self._logged_errors:
            self._logged_errors.add(component)
            log.exception("rankscope: telemetry error in %s (training continues; logged once)", component)

    # -- shutdown -------------------------------------------------------------
    def close(self) -> None:
        """Publish what is left, mark the rank finished, stop the publisher."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._publisher.is_alive() and self._publisher is not threading.current_thread():
            self._publisher.join(timeout=2.0)
        self.tracing.shutdown(timeout_s=2.0)
        self._publish()   # after the tracer: spans dropped at shutdown are counted too
        try:
            self.registration.finished_at = time.time()
            self.registration.save(self.run_dir)
        except OSError:
            self._error("publisher")

    def __enter__(self) -> "Monitor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class UserMetric:
    """A user-declared metric with the rank's identity labels. Its methods
    never raise into the loop: a bad value is counted as a telemetry error."""

    def __init__(self, monitor: Monitor, metric: Any, labels: tuple[str, ...]):
        self._monitor = monitor
        self._metric = metric
        self._labels = labels
        self._children: dict[tuple[str, ...], Any] = {}
        if not labels:
            self._children[()] = monitor.metrics.child(metric, {})

    def _child(self, label_values: dict[str, str]):
        key = tuple(str(label_values[k]) for k in self._labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._monitor.metrics.child(
                self._metric, dict(zip(self._labels, key)))
        return child

    def set(self, value: float, **labels: str) -> None:
        try:
            self._child(labels).set(float(value))
        except Exception:
            self._monitor._error("user")

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        try:
            self._child(labels).inc(float(amount))
        except Exception:
            self._monitor._error("user")

    def observe(self, value: float, **labels: str) -> None:
        try:
            self._child(labels).observe(float(value))
        except Exception:
            self._monitor._error("user")


def dump_flight_recorder(directory, rank: int):
    """Write torch's flight recorder (a pickle) for this rank; None where it is off or missing.

    torch >= 2.7 records gloo and NCCL collectives alike once
    TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) is > 0; older CUDA
    builds only have the NCCL entry point.
    """
    import torch

    c10d = torch._C._distributed_c10d
    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    size = os.environ.get("TORCH_FR_BUFFER_SIZE") or os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or "0"
    if dump is None or not size.isdigit() or int(size) <= 0:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"nccl_trace_rank_{rank}"   # the file name torchfrtrace expects
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(dump(True, True, False))
    os.replace(tmp, path)
    return path


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def _cuda_event_factory(device: Any):
    if device is None or getattr(device, "type", "") != "cuda":
        return None
    import torch

    return lambda: torch.cuda.Event(enable_timing=True)
