"""rankscope for torchtitan: every rank's telemetry without touching the training code.

Run torchtitan's own ``main`` with the monitor in place (the same arguments)::

    torchrun --nproc-per-node 8 -m rankscope.integrations.torchtitan --module llama3 --config llama3_8b

or, where you build the Trainer yourself, one line before ``train()``::

    from rankscope.integrations.torchtitan import instrument

    trainer = config.build()
    instrument(trainer)
    trainer.train()

One rankscope step per ``Trainer.train_step``, numbered by ``Trainer.step``
(torchtitan counts it up before the step: after 40 steps, ``rankscope_step`` is 40):

    next(data_iterator) inside train_step            -> ``data`` (samples and tokens: each batch's labels)
    forward_backward_step ... the loss function returns -> ``forward``
    ... forward_backward_step returns                -> ``backward`` (a pipeline schedule: all ``forward``)
    clip_grad_norm_ ... lr_schedulers.step returns   -> ``optimizer`` (torchtitan's own "optim" span)
    checkpointer.save / load that wrote / read        -> a checkpoint save / restore
    validator.validate                               -> ``evaluation``

torchtitan returns each micro-batch's loss as this rank's loss *sum* divided by
the token count of the whole data-parallel batch (so that adding over ranks
gives the global mean). rankscope reports this rank's own mean, as
torchtitan's ``global_max_loss`` does: the step's sum times the global count
over this rank's valid tokens (labels that are not ``IGNORE_INDEX``). With
pipeline parallelism only the last stage has a loss.

Wrapped on the Trainer object only (never its class): ``batch_generator``,
``train_step``, ``forward_backward_step``, ``loss_fn``, ``lr_schedulers.step``,
``checkpointer.save``/``load``, ``validator.validate``, ``close``; and once per
process ``torchtitan.distributed.utils.clip_grad_norm_``, which returns the
gradient norm torchtitan computes (the wrapper returns it unchanged).
docs/frameworks/torchtitan.md.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from typing import Any

try:
    import torchtitan.distributed.utils as _titan_dist
    from torchtitan.components.loss import IGNORE_INDEX
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rankscope.integrations.torchtitan needs torchtitan: pip install 'rankscope[torchtitan]'") from e

from rankscope.contract.environment import ConfigError
from rankscope.integrations.events import first_lr, switch_phase

__all__ = ["instrument", "main"]


def instrument(trainer: Any, monitor: Any = None, **options: Any) -> Any:
    """Report a built torchtitan ``Trainer``'s steps through rankscope; returns the ``Monitor``.

    Call it after the Trainer is built (torchtitan initialises the process group
    and sizes the flight recorder's ring in its constructor) and before
    ``train()``. ``monitor``: a ``rankscope.Monitor`` to use, left open;
    without one, a Monitor is opened with ``options`` (``run=...``; see
    ``MonitorConfig``) and closed by ``trainer.close()``.
    """
    existing = getattr(trainer, "_rankscope", None)
    if existing is not None:
        return existing.monitor
    if monitor is not None and options:
        raise ConfigError("instrument(trainer): give either a monitor or Monitor options, not both")
    own = monitor is None
    if own:
        from rankscope.monitor import Monitor

        monitor = Monitor(**{**_monitor_arguments(trainer), **options})   # what the caller says wins
    steps = TrainerSteps(trainer, monitor, own)
    trainer._rankscope = steps
    return monitor


def _monitor_arguments(trainer: Any) -> dict[str, Any]:
    """What the built Trainer already knows: its device, its FLOPs per token, its parallel layout."""
    from rankscope.flops import FlopsConfig

    arguments: dict[str, Any] = {}
    device = getattr(trainer, "device", None)
    if getattr(device, "type", None) == "cuda":
        arguments["device"] = device
    dims = trainer.parallel_dims
    per_token = getattr(getattr(trainer, "metrics_processor", None), "num_flops_per_token", None)
    if per_token and not FlopsConfig.from_env().counts_flops:   # RANKSCOPE_FLOPS_PER_TOKEN and friends win
        # torchtitan's figure is the whole model's; each rank of a tensor, context or pipeline
        # group does its share of it for the same tokens (as torchtitan's own MFU divides).
        arguments["flops"] = FlopsConfig.from_env(flops_per_token=per_token / max(dims.non_data_parallel_size, 1))
    layout = _layout(dims)
    if layout:
        arguments["layout"] = layout
    return arguments


def _layout(dims: Any) -> dict[str, int]:
    """This rank's coordinate on each parallel dimension torchtitan uses (its ``ParallelDims``),
    named as torchtitan names them; dimensions of degree 1 are left out."""
    degrees = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "fsdp": dims.dp_shard * dims.cp, "tp": dims.tp}
    coordinates = {}
    for name, degree in degrees.items():
        mesh = dims.get_optional_mesh(name) if degree > 1 else None
        if mesh is not None:
            coordinates[name] = int(mesh.get_local_rank())
    return coordinates


class TrainerSteps:
    """One Trainer's open step and phase, moved along by the Trainer's own calls (training thread).

    Each wrapped call runs torchtitan's method as it is; rankscope's work before and after it is
    guarded: an error there is counted (``rankscope_telemetry_errors_total{component="step"}``)
    and never raised into training."""

    def __init__(self, trainer: Any, monitor: Any, own_monitor: bool):
        self.trainer = trainer
        self.monitor = monitor
        self.own_monitor = own_monitor
        self.step: Any = None           # rankscope.step.timer.Step while train_step runs
        self.phase: Any = None          # the running Phase, or None
        self.lr: Any = None             # the learning rate the open step uses
        self.loss: Any = None           # the step's accumulated loss as torchtitan returns it (a tensor)
        self.global_tokens: Any = None  # the data-parallel batch's valid tokens (torchtitan's tensor)
        self.local_tokens: Any = None   # this rank's valid tokens in the step (a tensor: never read here)
        self.grad_norm: Any = None
        self.started = 0.0              # perf_counter at the start of a save, load or validation
        self.thread = threading.get_ident()
        # torchtitan's OptimizersContainer holds one optimizer per model part (its own param_groups
        # carry no learning rate): the first part's is the one its logs report.
        inner = getattr(trainer.optimizers, "optimizers", None)
        self.optimizer = inner[0] if inner else trainer.optimizers
        dims = trainer.parallel_dims
        self.accumulating = trainer.gradient_accumulation_steps > 1 or dims.pp_enabled
        self.last_stage = not dims.pp_enabled or bool(getattr(trainer, "pp_has_last_stage", True))
        for part in trainer.model_parts:
            monitor.watch(part)   # DTensor parameters: the mesh's dimensions name their process groups
        generator = trainer.batch_generator
        trainer.batch_generator = functools.wraps(generator)(self._batch_generator(generator))
        self._wrap(trainer, "train_step", before=self.step_begins, after=self.step_ends, failed=self.step_failed)
        self._wrap(trainer, "forward_backward_step", before=self.micro_batch_begins, after=self.micro_batch_ends)
        self._wrap(trainer, "loss_fn", after=self.loss_computed)
        self._wrap(trainer.lr_schedulers, "step", after=self.optimizer_done)
        self._wrap(trainer.checkpointer, "save", before=self.block_begins, after=self.saved)
        self._wrap(trainer.checkpointer, "load", before=self.block_begins, after=self.loaded)
        validator = getattr(trainer, "validator", None)
        if validator is not None:
            self._wrap(validator, "validate", before=self.block_begins, after=self.validated,
                       failed=self.validated)
        self._wrap(trainer, "close", after=self.closed, failed=self.closed)
        _watch_clipping()
        _instrumented.append(self)

    # -- wrapping ----------------------------------------------------------------------
    def _wrap(self, owner: Any, name: str, before: Any = None, after: Any = None, failed: Any = None) -> None:
        """Replace ``owner.name``, on this object only, with the same call between rankscope's
        ``before(*args, **kwargs)`` and ``after(result)`` (``failed(exc)`` if it raised)."""
        original = getattr(owner, name)
        guard = self.guard

        # Named rankscope_<what it does> like every wrapper that runs a framework's own function in
        # its place: what that function does below it is torchtitan's (tests/helpers/strict_cuda.py).
        @functools.wraps(original, updated=())   # its name and docstring; not an object's attributes
        def rankscope_wrapped(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                guard(before, *args, **kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException as exc:
                if failed is not None:
                    guard(failed, exc)
                raise
            if after is not None:
                guard(after, result)
            return result

        setattr(owner, name, rankscope_wrapped)

    def guard(self, hook: Any, *args: Any, **kwargs: Any) -> None:
        try:
            hook(*args, **kwargs)
        except Exception:
            self.monitor.errors.error("step")

    def switch(self, name: str | None) -> None:
        """Close the running phase and open ``name`` (None: none; the time counts as ``other``)."""
        self.phase = switch_phase(self.step, self.phase, name)

    # -- a step ------------------------------------------------------------------------
    def _batch_generator(self, original: Any) -> Any:
        def batch_generator(data_iterable: Any) -> Any:
            for batch in self.monitor.data(original(data_iterable)):   # each wait: the step's data phase
                if self.step is not None:
                    self.guard(self.count, batch)
                yield batch
        return batch_generator

    def count(self, batch: Any) -> None:
        labels = batch[1]
        self.step.count(samples=int(labels.shape[0]), tokens=int(labels.numel()))
        # Added as a tensor where the labels are (torchtitan yields them on the CPU): no device sync.
        valid = (labels != IGNORE_INDEX).sum()
        self.local_tokens = valid if self.local_tokens is None else self.local_tokens + valid

    def step_begins(self, *args: Any, **kwargs: Any) -> None:
        self.loss = self.global_tokens = self.grad_norm = None
        self.local_tokens = None
        self.lr = first_lr(self.optimizer)   # before the scheduler steps: the rate this step uses
        self.monitor.awaiting_next_event(0.0)
        self.step = self.monitor.step(step=self.trainer.step).begin()   # torchtitan counted it up already

    def step_ends(self, result: Any) -> None:
        if self.step is not None:
            self.step.observe(loss=self.rank_loss(), grad_norm=self.grad_norm, lr=self.lr)
        self._end(None)

    def step_failed(self, exc: BaseException) -> None:
        # Out of data (DataloaderExhaustedError) too: torchtitan cancels the step, so it is not counted.
        self._end(exc)

    def _end(self, exc: BaseException | None) -> None:
        step, self.step = self.step, None
        self.loss = self.global_tokens = self.grad_norm = None
        if step is not None:
            self.phase = switch_phase(None, self.phase, None)
            step.end(exc)
        self.between_steps()

    def between_steps(self) -> None:
        """What torchtitan does next (a save, a validation, the next step) tells what the time
        from now on was: it is not judged idle meanwhile."""
        self.monitor.awaiting_next_event(time.perf_counter())

    def rank_loss(self) -> Any:
        """This rank's mean loss over its valid tokens (a new tensor: never a CUDA graph's output)."""
        if self.loss is None or not self.last_stage or self.local_tokens is None:
            return None
        return self.loss * self.global_tokens / self.local_tokens

    def micro_batch_begins(self, *args: Any, **kwargs: Any) -> None:
        if self.step is not None:
            self.global_tokens = kwargs.get("global_valid_tokens")
            self.switch("forward")

    def micro_batch_ends(self, result: Any) -> None:
        if self.step is None:
            return
        self.switch(None)
        if self.last_stage:
            loss = result.detach()
            if self.loss is None:
                # A CUDA graph's output is overwritten by its next replay: keep a copy to add to.
                self.loss = loss.clone() if self.accumulating else loss
            else:
                self.loss = self.loss + loss

    def loss_computed(self, result: Any) -> None:
        if self.phase is not None and self.phase.name == "forward" and threading.get_ident() == self.thread:
            self.switch("backward")

    def clipping(self) -> None:
        self.switch("optimizer")   # clipping opens torchtitan's "optim" span

    def optimizer_done(self, result: Any) -> None:
        if self.step is not None:
            self.switch(None)

    # -- between steps -------------------------------------------------------------------
    def block_begins(self, *args: Any, **kwargs: Any) -> None:
        self.started = time.perf_counter()

    def saved(self, wrote: Any) -> None:
        if wrote and self.step is None:   # torchtitan calls save() every step; it says whether it wrote
            self.monitor.checkpoint_took(self.started, time.perf_counter(), "save")
            self.between_steps()

    def loaded(self, read: Any) -> None:
        if read and self.step is None:
            self.monitor.checkpoint_took(self.started, time.perf_counter(), "restore")
            self.between_steps()

    def validated(self, result: Any) -> None:
        if self.step is None:
            self.monitor.evaluation_took(self.started, time.perf_counter())
            self.between_steps()

    def closed(self, result: Any) -> None:
        if self in _instrumented:
            _instrumented.remove(self)
        if self.own_monitor:
            self.monitor.close()


# -- the gradient norm: torchtitan's module function, wrapped once per process ---------------
_instrumented: list[TrainerSteps] = []


def _watch_clipping() -> None:
    original = _titan_dist.clip_grad_norm_
    if getattr(original, "_rankscope", False):
        return

    @functools.wraps(original)
    def rankscope_clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        clipping = [s for s in _instrumented if s.step is not None and s.thread == threading.get_ident()]
        for steps in clipping:
            steps.guard(steps.clipping)
        norm = original(*args, **kwargs)
        for steps in clipping:
            steps.grad_norm = norm
        return norm

    rankscope_clip_grad_norm_._rankscope = True  # type: ignore[attr-defined]
    _titan_dist.clip_grad_norm_ = rankscope_clip_grad_norm_


# -- the launcher -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """torchtitan's own ``main`` (``torchtitan.train``), with every Trainer it trains instrumented."""
    rankscope_main(argv)


def rankscope_main(argv: list[str] | None) -> None:
    """``main``'s body: torchtitan's program runs below this frame (a pass-through, by its name)."""
    import torchtitan.train
    from torchtitan.trainer import Trainer

    if argv is not None:
        sys.argv[1:] = argv
    train = Trainer.train
    if not getattr(train, "_rankscope", False):
        @functools.wraps(train)
        def rankscope_train(self: Any) -> Any:
            instrument(self)
            return train(self)

        rankscope_train._rankscope = True  # type: ignore[attr-defined]
        Trainer.train = rankscope_train   # type: ignore[method-assign]
    torchtitan.train.main()


if __name__ == "__main__":
    main()
