"""rankscope for Hugging Face ``transformers.Trainer``: every rank's telemetry in two lines.

    from rankscope.integrations.hf import RankscopeCallback, instrument

    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[RankscopeCallback()])
    instrument(trainer)   # this rank's own loss, the grad norm, DDP bucket timing (docs/frameworks/hf.md)
    trainer.train()

The callback runs on every rank (the Trainer calls callbacks on all of them)
and drives the rank's ``Monitor`` from the Trainer's events:

    (gap: log / evaluate / save, then the batches are fetched)   -> outside the step, then ``data``
    on_step_begin                                                -> the step begins; the learning rate it uses
    ... forward hook ... on_substep_end ...                      -> ``forward`` / ``backward`` per micro-batch
    end of the last training_step (instrument) or on_pre_optimizer_step -> ``optimizer`` (clipping, step, scheduler)
    on_step_end                                                  -> the step ends (one per optimizer step)
    on_save                                                      -> a checkpoint save, and how long it took

The Trainer's logged ``loss`` is the mean over ranks (and skips NaN with
``logging_nan_inf_filter``), and callbacks are never handed the Trainer, its
per-micro-batch loss or its gradient norm. ``instrument(trainer)`` wraps two
methods of that one Trainer object (not its class): ``training_step``, whose
return value is this rank's own loss for the micro-batch, whose first
argument is the DDP-wrapped model (``monitor.watch()`` it on the first call)
and whose second is the micro-batch (its samples and tokens are counted there;
without ``instrument``, a forward pre-hook on the model counts them),
and ``accelerator.clip_grad_norm_``, whose return value is the gradient norm
the Trainer computes on every optimizer step. Any Trainer subclass (TRL's
trainers included) keeps its own ``training_step``: the wrapper calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rankscope.integrations.hf needs transformers: pip install 'rankscope[hf]'") from e

from rankscope.contract.environment import ConfigError
from rankscope.integrations.events import EventSteps, first_lr, guarded

__all__ = ["RankscopeCallback", "instrument"]


class RankscopeCallback(TrainerCallback):
    """A ``TrainerCallback`` that reports this rank's steps, phases and values through rankscope.

    ``monitor``: a ``rankscope.Monitor`` to use (it stays open after training);
    without one, the callback opens its own when the Trainer is built (or when
    training begins) and closes it when training ends. ``options`` go to that
    ``Monitor`` (``run=...``, ``metrics_port=...``; see ``MonitorConfig``).
    """

    def __init__(self, monitor: Any = None, **options: Any):
        if monitor is not None and options:
            raise ConfigError("RankscopeCallback: give either a monitor or Monitor options, not both")
        self.monitor = monitor
        self._own_monitor = monitor is None
        self._options = options
        self.steps: EventSteps | None = None
        self._optimizer: Any = None
        self._hooks: list[Any] = []
        self.instrumented = False      # instrument(trainer) gives the loss, grad norm and DDP model
        self._watched: Any = None

    # -- the monitor's lifetime ---------------------------------------------------
    def _ensure_monitor(self, args: Any) -> None:
        if self.monitor is not None and not self.monitor.closed:
            return
        if not self._own_monitor:
            raise ConfigError("RankscopeCallback: the monitor it was given is closed")
        from rankscope.monitor import Monitor

        self.monitor = Monitor(device=getattr(args, "device", None), **self._options)
        self.steps = None
        self._watched = None   # the new monitor times the DDP model afresh

    def on_init_end(self, args, state, control, **kwargs):
        # At the Trainer's construction (the process group exists by then): start-up costs
        # and configuration errors come here, not in the timed training.
        self._ensure_monitor(args)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._ensure_monitor(args)
        if self.steps is None:
            self.steps = EventSteps(self.monitor)
        self._optimizer = optimizer
        self._remove_hooks()
        if model is not None:
            # instrument() counts each micro-batch in training_step: a hook less on the model's forward.
            self._hooks = [model.register_forward_hook(self._forward_ends)]
            if not self.instrumented:
                self._hooks.append(model.register_forward_pre_hook(self._forward_starts, with_kwargs=True))
        self.steps.between_steps()

    @guarded
    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()
        if self.steps is not None:
            self.steps.end()
        if self._own_monitor and self.monitor is not None:
            self.monitor.close()

    def _remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- a step ---------------------------------------------------------------------
    @guarded
    def on_epoch_begin(self, args, state, control, **kwargs):
        if self.steps is not None:
            self.steps.between_steps()

    @guarded
    def on_step_begin(self, args, state, control, **kwargs):
        if self.steps is None:
            return
        # Numbered as the Trainer numbers it once done: after 40 steps, rankscope_step is 40.
        steps = self.steps
        steps.begin(state.global_step + 1)
        # The scheduler moved on at the end of the last step: this is the rate this step uses.
        steps.lr = first_lr(self._optimizer)
        steps.switch("forward")

    @guarded
    def _forward_starts(self, module, args, kwargs):
        if module.training:
            self._count(kwargs if "input_ids" in kwargs or not args else args)
        return None

    @guarded
    def _micro_batch_starts(self, inputs: Any) -> None:
        self._count(inputs)

    def _count(self, inputs: Any) -> None:
        """A micro-batch's samples and tokens, from its input ids (or its first input): a mapping
        (a dict, a ``BatchEncoding``), a sequence (a forward's positional arguments, a custom
        collator's tuple) or the tensor itself."""
        steps = self.steps
        if steps is None or steps.step is None:
            return
        if isinstance(inputs, Mapping):
            ids = inputs["input_ids"] if "input_ids" in inputs else next(iter(inputs.values()), None)
        elif isinstance(inputs, (list, tuple)):
            ids = inputs[0] if inputs else None
        else:
            ids = inputs
        shape = getattr(ids, "shape", None)
        if shape:
            steps.step.count(samples=int(shape[0]), tokens=ids.numel() if len(shape) >= 2 else 0)

    @guarded
    def _forward_ends(self, module, args, output):
        # The model's forward (its loss included, when it is given labels) has returned:
        # what follows in the micro-batch is backward. Entered here, inside the Trainer's
        # no_sync() for all but the last micro-batch, so the all-reduce is counted in
        # flight only while a backward really launches one (hang location).
        steps = self.steps
        if steps is not None and steps.phase_name == "forward" and module.training:
            steps.switch("backward")
        return None

    @guarded
    def on_substep_end(self, args, state, control, **kwargs):
        if self.steps is not None and self.steps.open:
            self.steps.switch("forward")

    @guarded
    def _micro_batch_done(self, loss: Any) -> None:
        steps = self.steps
        if steps is not None and steps.open:
            steps.add_loss(loss)
            steps.switch("optimizer")   # on the last micro-batch: clipping, then the optimizer

    @guarded
    def _grad_norm(self, norm: Any) -> None:
        if self.steps is not None and self.steps.open:
            self.steps.grad_norm = norm

    @guarded
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        steps = self.steps
        if steps is not None and steps.open and steps.phase_name != "optimizer":
            steps.switch("optimizer")

    @guarded
    def on_step_end(self, args, state, control, **kwargs):
        if self.steps is not None:
            self.steps.end()

    def _step_failed(self, exc: BaseException) -> None:
        try:
            if self.steps is not None:
                self.steps.end(exc)
        except Exception:
            if self.monitor is not None:
                self.monitor.errors.error("step")

    # -- between steps ----------------------------------------------------------------
    @guarded
    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.steps is not None:
            self.steps.between_steps()

    @guarded
    def on_evaluate(self, args, state, control, **kwargs):
        if self.steps is not None:
            self.steps.between_steps()

    @guarded
    def on_save(self, args, state, control, **kwargs):
        # The save began after the Trainer's last event (the step's end, a log or an evaluation).
        if self.steps is not None:
            self.steps.checkpoint_saved(started=self.steps.idle_since)


def instrument(trainer: Any) -> Any:
    """Give the Trainer's ``RankscopeCallback`` what callbacks are not handed; returns ``trainer``.

    Wraps, on this Trainer object only, ``training_step`` (this rank's own loss
    per micro-batch, its samples and tokens, the end of its backward, the DDP
    model to time, an exception inside the step) and ``accelerator.clip_grad_norm_`` (the
    gradient norm the Trainer computes). Adds a ``RankscopeCallback`` if the
    Trainer has none. Call it once, before ``trainer.train()``.
    """
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, RankscopeCallback)), None)
    if callback is None:
        callback = RankscopeCallback()
        trainer.add_callback(callback)
        callback.on_init_end(trainer.args, trainer.state, trainer.control)
    if callback.instrumented:
        return trainer
    training_step = trainer.training_step

    def rankscope_training_step(model, *args: Any, **kwargs: Any):
        if model is not callback._watched and callback.monitor is not None:
            # The first step of a train() call; each call may wrap the model anew.
            callback._watched = model
            callback.monitor.watch(model)   # DDP: all-reduces timed; any model: its CUDA device learnt
        callback._micro_batch_starts(args[0] if args else kwargs.get("inputs"))
        try:
            loss = training_step(model, *args, **kwargs)
        except BaseException as exc:
            callback._step_failed(exc)
            raise
        callback._micro_batch_done(loss)
        return loss

    trainer.training_step = rankscope_training_step
    accelerator = getattr(trainer, "accelerator", None)
    clip = getattr(accelerator, "clip_grad_norm_", None)
    if clip is not None:
        def rankscope_clip_grad_norm_(*args: Any, **kwargs: Any):
            norm = clip(*args, **kwargs)
            callback._grad_norm(norm)
            return norm

        accelerator.clip_grad_norm_ = rankscope_clip_grad_norm_
    callback.instrumented = True
    return trainer
