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
from rankscope.integrations.events import first_lr

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

        monitor = Monitor(**_monitor_arguments(trainer), **options)
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
    if per_token:
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
    """One Trainer's open step and phase, moved along by the Trainer's own calls (training thread)."""

    def __init__(self, trainer: Any, monitor: Any, own_monitor: bool):
        self.trainer = trainer
        self.monitor = monitor
        self.own_monitor = own_monitor
        self.step: Any = None           # rankscope.step.timer.Step while train_step runs
        self.phase: Any = None          # the running Phase, or None
        self.loss: Any = None           # the step's accumulated loss as torchtitan returns it (a tensor)
        self.global_tokens: Any = None  # the data-parallel batch's valid tokens (torchtitan's tensor)
        self.local_tokens = 0           # this rank's valid tokens in the step
        self.grad_norm: Any = None
        self.thread = threading.get_ident()
        # torchtitan's OptimizersContainer holds one optimizer per model part (its own param_groups
        # carry no learning rate): the first part's is the one its logs report.
        inner = getattr(trainer.optimizers, "optimizers", None)
        self.optimizer = inner[0] if inner else trainer.optimizers
        self.accumulating = trainer.gradient_accumulation_steps > 1 or trainer.parallel_dims.pp_enabled
        self.last_stage = not trainer.parallel_dims.pp_enabled or bool(getattr(trainer, "pp_has_last_stage", True))
        for part in trainer.model_parts:
            monitor.watch(part)   # DTensor parameters: the mesh's dimensions name their process groups
        _wrap(trainer, "batch_generator", self.batch_generator)
        _wrap(trainer, "train_step", self.train_step)
        _wrap(trainer, "forward_backward_step", self.forward_backward_step)
        _wrap(trainer, "loss_fn", self.loss_fn)
        _wrap(trainer.lr_schedulers, "step", self.lr_schedulers_step)
        _wrap(trainer.checkpointer, "save", self.checkpoint_save)
        _wrap(trainer.checkpointer, "load", self.checkpoint_load)
        validator = getattr(trainer, "validator", None)
        if validator is not None:
            _wrap(validator, "validate", self.validate)
        _wrap(trainer, "close", self.close)
        _watch_clipping()
        _instrumented.append(self)

    # -- phases ----------------------------------------------------------------------
    def switch(self, name: str | None) -> None:
        if self.phase is not None:
            self.phase.stop()
            self.phase = None
        if name is not None and self.step is not None:
            self.phase = self.step.phase(name).start()

    # -- the wrapped calls --------------------------------------------------------------
    def batch_generator(self, original: Any, data_iterable: Any) -> Any:
        batches = self.monitor.data(original(data_iterable))

        def counted() -> Any:
            for batch in batches:
                step = self.step
                if step is not None:
                    labels = batch[1]
                    step.count(samples=int(labels.shape[0]), tokens=int(labels.numel()))
                    self.local_tokens += int((labels != IGNORE_INDEX).sum())
                yield batch

        return counted()

    def train_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        trainer = self.trainer
        self.loss = self.global_tokens = self.grad_norm = None
        self.local_tokens = 0
        lr = first_lr(self.optimizer)   # before the scheduler steps: the rate this step uses
        step = self.step = self.monitor.step(step=trainer.step).begin()
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            self._end(exc)
            raise
        step.observe(loss=self._rank_loss(), grad_norm=self.grad_norm, lr=lr)
        self._end(None)
        return result

    def _end(self, exc: BaseException | None) -> None:
        step, self.step = self.step, None
        self.switch(None)
        self.loss = self.global_tokens = self.grad_norm = None
        if step is not None:
            # Out of data (DataloaderExhaustedError): torchtitan cancels the step, so it is not counted.
            step.end(exc)

    def _rank_loss(self) -> Any:
        """This rank's mean loss over its valid tokens (a new tensor: never a CUDA graph's output)."""
        if self.loss is None or not self.last_stage or not self.local_tokens:
            return None
        return self.loss * self.global_tokens / self.local_tokens

    def forward_backward_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self.step is None:
            return original(*args, **kwargs)
        self.global_tokens = kwargs.get("global_valid_tokens")
        self.switch("forward")
        result = original(*args, **kwargs)
        self.switch(None)
        if self.last_stage:
            loss = result.detach()
            if self.loss is None:
                # A CUDA graph's output is overwritten by its next replay: keep a copy to add to.
                self.loss = loss.clone() if self.accumulating else loss
            else:
                self.loss = self.loss + loss
        return result

    def loss_fn(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self.phase is not None and self.phase.name == "forward" and threading.get_ident() == self.thread:
            self.switch("backward")
        return result

    def lr_schedulers_step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if self.step is not None:
            self.switch(None)
        return result

    def checkpoint_save(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        wrote = original(*args, **kwargs)
        if wrote and self.step is None:
            self.monitor.checkpoint_took(t0, time.perf_counter(), "save")
        return wrote

    def checkpoint_load(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        read = original(*args, **kwargs)
        if read and self.step is None:
            self.monitor.checkpoint_took(t0, time.perf_counter(), "restore")
        return read

    def validate(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self.step is not None:
            return original(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            self.monitor.evaluation_took(t0, time.perf_counter())

    def close(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            if self in _instrumented:
                _instrumented.remove(self)
            if self.own_monitor:
                self.monitor.close()


def _wrap(owner: Any, name: str, method: Any) -> None:
    """Replace ``owner.name`` on this object only with ``method(original, *args, **kwargs)``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(original, *args, **kwargs)

    setattr(owner, name, wrapper)


# -- the gradient norm: torchtitan's module function, wrapped once per process ---------------
_instrumented: list[TrainerSteps] = []


def _watch_clipping() -> None:
    original = _titan_dist.clip_grad_norm_
    if getattr(original, "_rankscope", False):
        return

    @functools.wraps(original)
    def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
        clipping = [s for s in _instrumented if s.step is not None and s.thread == threading.get_ident()]
        for steps in clipping:
            steps.switch("optimizer")   # clipping opens torchtitan's "optim" span
        norm = original(*args, **kwargs)
        for steps in clipping:
            steps.grad_norm = norm
        return norm

    clip_grad_norm_._rankscope = True  # type: ignore[attr-defined]
    _titan_dist.clip_grad_norm_ = clip_grad_norm_


# -- the launcher -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    """torchtitan's own ``main`` (``torchtitan.train``), with every Trainer it trains instrumented."""
    import torchtitan.train
    from torchtitan.trainer import Trainer

    if argv is not None:
        sys.argv[1:] = argv
    train = Trainer.train
    if not getattr(train, "_rankscope", False):
        @functools.wraps(train)
        def instrumented_train(self: Any) -> Any:
            instrument(self)
            return train(self)

        instrumented_train._rankscope = True  # type: ignore[attr-defined]
        Trainer.train = instrumented_train   # type: ignore[method-assign]
    torchtitan.train.main()


if __name__ == "__main__":
    main()
