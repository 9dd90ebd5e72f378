"""How a DDP model's gradient all-reduces are timed: one strategy per ``comm_timing`` mode.

Every strategy answers the same three questions for the step accounting:

* ``attach(model)``: set up on ``Monitor.watch()``;
* ``backward_in_flight``: the collective a rank counts as in flight while its
  backward phase runs (so a hang inside backward is located), or None;
* ``exposed_wait(backward_start, backward_end, backward_seconds)``: how much of
  the step's last backward (host clock) only waited for communication after
  its compute was done; the step accounting moves it from ``backward`` to
  ``comm_wait``. Called once per step, after which ``step_ended`` lets the
  strategy read what it samples.

Strategies:

* ``HookTiming`` (``hook``): a comm hook times every bucket (CUDA events on
  GPU). On CPU any Python comm hook costs 3-5% of a DDP step, because DDP then
  stops fusing the gradient division into its bucket copy
  (docs/performance.md).
* ``ReducerTiming`` (``reducer``): DDP's own C++ timers, read on one step in
  ``REDUCER_SAMPLE_EVERY``; no hook, so nothing changes in DDP's backward.
* ``CommTiming`` (``off``): nothing is timed.

``auto`` is the hook on CUDA and the reducer timers on CPU.

The hook must never change what DDP computes (tests/integration/test_same_weights.py
checks the weights bit for bit):

* it reduces over the model's own process group (``process_group=`` or
  ``device_mesh=``, read when each bucket is reduced), never the world, and
  scales each bucket exactly as DDP's built-in reduction does (a multiply by
  the reciprocal of the group's size, or a division where DDP divides:
  ``allreduce_like_ddp``; the two differ in the last bit for group sizes that
  are not powers of two);
* DDP takes one comm hook per model. A model that already has one (the
  user's PowerSGD or bf16 compression, DDP's own for ``mixed_precision=``)
  is timed by DDP's timers instead (said once); a hook the user registers
  *after* ``watch()`` runs inside rankscope's, which times it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from rankscope.collectives.tracker import CollectiveRecord, CollectiveTracker
from rankscope.contract.environment import ConfigError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

log = logging.getLogger("rankscope")

REDUCER_SAMPLE_EVERY = 10   # steps between reads of DDP's own communication timers
# On CUDA DDP's timer synchronises on the events of each sampled iteration: keep DDP's own
# default rate there rather than adding syncs.
REDUCER_SAMPLE_EVERY_CUDA = 100
UNUSUAL_BACKWARD_FACTOR = 2.0   # a backward this many times the usual one waited for a peer on this step


class CommTiming:
    """The ``off`` strategy, and the interface of the others."""

    mode = "off"
    # Each step's own wait in backward is known (0 without DDP, measured by the hook): its
    # backward, less that wait, is the rank's own work. DDP's timers sample one step in ten.
    waits_known_each_step = True

    def __init__(self) -> None:
        self.model: torch.nn.Module | None = None

    def attach(self, model: torch.nn.Module) -> None:
        self.model = model

    @property
    def backward_in_flight(self) -> str | None:
        return None

    def step_started(self) -> None:
        pass

    def exposed_wait(self, backward_start: float, backward_end: float, backward_seconds: float) -> float:
        return 0.0

    def step_ended(self) -> None:
        pass

    def last_device_bucket(self) -> Any:
        """CUDA: the step's last-launched bucket span (its duration bounds the exposed wait)."""
        return None


class HookTiming(CommTiming):
    """Every bucket timed by a comm hook that all-reduces exactly as DDP's default does."""

    mode = "hook"

    def __init__(self, tracker: CollectiveTracker, on_error: Callable[[], None]):
        super().__init__()
        self.tracker = tracker
        self.on_error = on_error
        self.last_launch = 0.0        # perf_counter of the step's latest bucket launch (CPU clock)
        self.last_device_span: Any = None
        self.inner: tuple[Callable, Any] | None = None   # (hook, state) the user registers after watch()
        # gradient_as_bucket_view=True: whether the gradients were DDP's bucket views when the
        # step's forward began (kept, not set to None), so that DDP would divide them in place.
        self.views_kept = False

    def attach(self, model: torch.nn.Module) -> None:
        super().attach(model)
        if getattr(model, "gradient_as_bucket_view", False):
            first = next((p for p in model.parameters() if p.requires_grad), None)
            if first is not None:
                def note_views(module: torch.nn.Module, args: tuple) -> None:
                    self.views_kept = first.grad is not None

                model.register_forward_pre_hook(note_views)
        model.register_comm_hook(model.process_group, ddp_timing_hook(self))
        model._rankscope_hook_timing = self
        # DDP takes one hook: one registered later becomes the hook the timing hook runs.
        model.register_comm_hook = self._register_inner
        model._register_builtin_comm_hook = _builtin_after_watch

    def _register_inner(self, state: object, hook: Callable) -> None:
        model = self.model
        if self.inner is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        model._check_comm_hook(hook)
        if model.logger is not None:
            model.logger._set_comm_hook_name(hook.__qualname__)
        model._comm_hooks.append((hook, state))
        self.inner = (hook, state)

    def step_started(self) -> None:
        self.last_launch = 0.0
        self.last_device_span = None

    def exposed_wait(self, backward_start: float, backward_end: float, backward_seconds: float) -> float:
        # After the last bucket was launched, backward had no compute left and
        # only waited for the all-reduces to finish.
        if backward_start <= self.last_launch <= backward_end:
            return backward_end - self.last_launch
        return 0.0

    def last_device_bucket(self) -> Any:
        return self.last_device_span


class ReducerTiming(CommTiming):
    """DDP's own timers; the all-reduce counted in flight while backward runs.

    Backward inside ``model.no_sync()`` launches no all-reduce, so it is not
    counted in flight then (DDP clears ``require_backward_grad_sync``)."""

    mode = "reducer"
    waits_known_each_step = False

    def __init__(self, tracker: CollectiveTracker, on_error: Callable[[], None]):
        super().__init__()
        self.tracker = tracker
        self.on_error = on_error
        self.timers: ReducerTimers | None = None
        self.usual_backward = 0.0     # seconds: the rank's usual backward compute (see exposed_wait)

    def attach(self, model: torch.nn.Module) -> None:
        super().attach(model)
        try:
            on_cuda = self.tracker.device.first_cuda_index(model) is not None
            self.timers = ReducerTimers(model, REDUCER_SAMPLE_EVERY_CUDA if on_cuda else REDUCER_SAMPLE_EVERY)
        except Exception as e:   # DDP's private logging API moved: say so now, not mid-training
            import torch

            raise ConfigError(f"comm_timing=reducer: cannot read DDP's timers in torch {torch.__version__} ({e!r}); "
                              "use comm_timing=hook") from None

    @property
    def backward_in_flight(self) -> str | None:
        return "all_reduce" if getattr(self.model, "require_backward_grad_sync", True) else None

    def exposed_wait(self, backward_start: float, backward_end: float, backward_seconds: float) -> float:
        """DDP's timers, from the latest sampled step, stand for the steps between samples;
        but a backward far longer than usual waited for a peer or the fabric (a frozen rank,
        a slow link) on *this* step, and the sample cannot know it: the excess over the usual
        compute is counted as waiting, not as this rank's compute.

        "Usual" is the rank's own backward compute as DDP's timers measured it on the sampled
        steps (from the end of forward to its last gradient ready), never the whole backward:
        when every step waits long (a fabric slowed for everyone), the whole backward is long
        on every step and would become usual, and the wait would be booked as every rank's
        compute. Until the first sample, a clipped moving average of the backward stands in."""
        timers = self.timers
        if timers.compute:
            usual = self.usual_backward = timers.compute
        else:
            usual = self.usual_backward
            # A clipped moving average: one long wait must not become the usual.
            clipped = min(backward_seconds, UNUSUAL_BACKWARD_FACTOR * usual) if usual else backward_seconds
            self.usual_backward = usual + 0.05 * (clipped - usual) if usual else clipped
        exposed = timers.exposed
        if usual and backward_seconds > UNUSUAL_BACKWARD_FACTOR * usual:
            exposed = max(exposed, backward_seconds - usual)
        return min(exposed, backward_seconds)

    def step_ended(self) -> None:
        try:
            record = self.timers.poll()
            if record is not None:
                self.tracker.record(record)
        except Exception:
            self.on_error()


def is_ddp(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a DistributedDataParallel (FSDP1 has a ``register_comm_hook`` too,
    with another hook signature: it is read through the flight recorder, like FSDP2)."""
    from torch.nn.parallel import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def existing_hook(model: torch.nn.Module) -> str | None:
    """The comm hook a DDP model already has (its name), or None."""
    if getattr(model, "_comm_hooks", None):
        hook = model._comm_hooks[0][0]
        return getattr(hook, "__qualname__", repr(hook))
    try:   # a built-in hook (register_builtin_comm_hook) is only in DDP's logging data
        return model._get_ddp_logging_data().get("comm_hook") or None
    except Exception:
        return None


def choose(mode: str, model: torch.nn.Module, tracker: CollectiveTracker, on_error: Callable[[], None]) -> CommTiming:
    """The strategy for ``mode`` (one of config.COMM_TIMING_MODES), attached to a DDP ``model``."""
    if mode == "auto":
        mode = "hook" if tracker.device.first_cuda_index(model) is not None else "reducer"
    if getattr(model, "_use_python_reducer", False):
        # Compiled autograd's DDP (torch._dynamo optimize_ddp="python_reducer") calls comm hooks with
        # (grad, param), not a bucket, and does not run the C++ reducer whose timers the reducer
        # mode reads: its collectives are counted from the flight recorder instead.
        if mode != "off":
            log.warning("rankscope: this DDP model uses the python reducer (compiled autograd): its all-reduces "
                        "are not timed by rankscope's hook or DDP's timers, only counted from torch's flight "
                        "recorder (comm_timing=off)")
        mode = "off"
    watched = getattr(model, "_rankscope_hook_timing", None)
    if watched is not None:
        # Watched before (a framework wraps per call, a new Monitor per run): DDP keeps the
        # hook it has; it now reports to this monitor.
        watched.tracker, watched.on_error = tracker, on_error
        return watched
    if mode == "hook":
        hook = existing_hook(model)
        if hook is not None:
            log.warning("rankscope: this DDP model already has a comm hook (%s), and DDP takes one: its "
                        "all-reduces are timed by DDP's own timers (comm_timing=reducer) instead", hook)
            mode = "reducer"
    strategy = {"off": CommTiming, "hook": HookTiming, "reducer": ReducerTiming}[mode]
    timing = strategy() if strategy is CommTiming else strategy(tracker, on_error)
    timing.attach(model)
    return timing


class ReducerTimers:
    """DDP's own communication timers, read instead of timing through a comm hook.

    DDP already times its backward communication in C++ on sampled
    iterations: from the first bucket's launch to the last bucket's
    completion. This reads those timers on one step in ``every`` (about 8 us
    a read), on the training thread: the data is not safe to read from
    another one. Durations and bytes both cover the sampled steps only.
    """

    def __init__(self, ddp_model: torch.nn.Module, every: int = REDUCER_SAMPLE_EVERY):
        self.model = ddp_model
        self.every = every
        ddp_model._set_ddp_runtime_logging_sample_rate(every)
        data = ddp_model._get_ddp_logging_data()   # private API: fails here, at start-up, if it is gone
        self.bytes_per_step = int(data["total_parameter_size_bytes"]) - int(data.get("unused_parameter_size", 0))
        self.group_size = ddp_model.process_group.size()
        self.exposed = 0.0        # seconds the last sampled backward waited for communication after its compute
        self.compute = 0.0        # seconds of backward compute on the sampled steps (a moving average; 0: none yet)
        self._steps = 0
        self._last_iteration = -1

    def poll(self) -> CollectiveRecord | None:
        """Call once per step: a record of the latest sampled iteration, once, or None.

        DDP computes a sampled iteration's figures at the next forward, so the
        read is made mid-way between samples, when the latest one is surely in."""
        self._steps += 1
        if self._steps % self.every != self.every // 2:
            return None
        data = self.model._get_ddp_logging_data()
        iteration = data.get("iteration", -1)
        comm_ns = data.get("backward_comm_time")
        if comm_ns is None or iteration == self._last_iteration:
            return None
        self._last_iteration = iteration
        compute_end = data.get("backward_compute_time_end", 0)
        comm_end = data.get("backward_comm_time_end", 0)
        self.exposed = max(comm_end - compute_end, 0) / 1e9 if compute_end and comm_end else 0.0
        compute = data.get("backward_compute_time", 0) / 1e9
        if compute > 0:
            self.compute = compute if not self.compute else self.compute + 0.3 * (compute - self.compute)
        # Bytes go with the timed steps only, so that bytes / seconds stays a bandwidth.
        return CollectiveRecord("all_reduce", self.bytes_per_step, data.get("backward_comm_time_start", 0) / 1e9,
                                comm_ns / 1e9, group_size=self.group_size)


def _builtin_after_watch(comm_hook_type: object) -> None:
    raise RuntimeError(f"register_builtin_comm_hook({comm_hook_type}) after rankscope's watch(): DDP takes one "
                       "comm hook and rankscope's times this model's all-reduces. Register it before watch() "
                       "(rankscope then reads DDP's own timers), or use a Python hook (register_comm_hook), "
                       "which rankscope's runs and times.")


def allreduce_like_ddp(model: torch.nn.Module, bucket: dist.GradBucket, divide: bool = False) -> Any:
    """What DDP does with a bucket when it has no hook: scale by 1 / the size of the model's
    group, then sum over that group, scaling as DDP's reducer does so that the result is the
    same to the last bit: it multiplies by a wrapped scalar 1.0 / size while copying gradients
    into the bucket, but divides in place gradients that already are views of the bucket
    (``gradient_as_bucket_view=True`` once DDP made them so, and the loop keeps them rather than
    setting them to None). On the host the two differ in the last bit for group sizes that are
    not powers of two. ``divide``: the gradients were such views when this backward began
    (``HookTiming.views_kept``). The future's value is ``[bucket]``."""
    import torch.distributed as dist

    group = model.process_group   # read now: DDP's _update_process_group may have replaced it
    buf = bucket.buffer()
    if divide:
        buf.div_(group.size())
    else:
        buf.mul_(1.0 / group.size())
    return dist.all_reduce(buf, group=group, async_op=True).get_future()


def ddp_timing_hook(timing: HookTiming):
    """A DDP comm hook that reduces each bucket as DDP would without rankscope (its default
    all-reduce, or the hook the user registered after ``watch()``) and times it, from launch
    to completion.

    Registering any Python hook replaces DDP's fused C++ scaling with the explicit
    ``mul_`` of ``allreduce_like_ddp``: that pass is the hook's main cost on CPU
    (docs/performance.md).
    """
    model = timing.model

    def hook(state, bucket):
        tracker, on_error = timing.tracker, timing.on_error   # a later watch() may hand them over
        device = tracker.device
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        index = bucket.index()
        inner = timing.inner
        timing.last_launch = time.perf_counter()
        span = token = None
        group_size = 1
        try:
            group_size = model.process_group.size()
            on = device.api.device_of(buf)
            if on is None:
                token, t0, start = tracker.begin("all_reduce")
            elif device.events is not None and on == device.index:
                span = tracker.begin_device("all_reduce", nbytes, index, group_size)
        except Exception:  # telemetry must never fail the backward pass
            on_error()
        timing.last_device_span = span
        # The user's hook returns a future of the bucket; DDP's all-reduce one of [bucket].
        fut = allreduce_like_ddp(model, bucket, timing.views_kept) if inner is None else inner[0](inner[1], bucket)
        unwrap = inner is None

        def done(f):
            try:
                if span is not None:
                    tracker.end_device(span)
                elif token is not None:
                    tracker.end(token, "all_reduce", nbytes, t0, start, index, group_size)
            except Exception:
                on_error()
            value = f.value()
            return value[0] if unwrap else value

        return fut.then(done)

    return hook
