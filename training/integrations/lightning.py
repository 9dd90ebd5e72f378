"""rankscope for PyTorch Lightning: every rank's telemetry in one line.

    from rankscope.integrations.lightning import RankscopeCallback

    trainer = Trainer(accelerator="gpu", devices=8, strategy="ddp", callbacks=[RankscopeCallback()])

The callback runs on every rank (Lightning calls callbacks on all of them)
and drives the rank's ``Monitor`` from Lightning's hooks, one step per
optimizer step (``trainer.global_step``):

    (gap since the last batch: the batch is fetched)   -> ``data``
    on_train_batch_start ... on_before_backward         -> ``forward`` (training_step)
    on_before_backward ... on_after_backward            -> ``backward``
    on_after_backward ... on_train_batch_end            -> ``optimizer`` (clipping, step)
    on_before_optimizer_step                            -> this batch steps; the learning rate it uses
    on_train_batch_end                                  -> this rank's loss (training_step's output); the
                                                           step ends if the optimizer stepped
    on_save_checkpoint                                  -> a checkpoint save, until the next event
    on_validation_start ... on_validation_end           -> ``evaluation`` (a save before it ends there)
    on_exception                                        -> the step ends with the exception (an OOM is counted)

Built on ``lightning`` (``import lightning.pytorch``), or on the older
``pytorch_lightning`` package where ``lightning`` is not installed (CI tests
``lightning`` only).
"""

from __future__ import annotations

import os
import time
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("rankscope.integrations.lightning needs Lightning: "
                          "pip install 'rankscope[lightning]'") from e

from rankscope.contract.environment import ConfigError
from rankscope.integrations.events import EventSteps, batch_size, first_lr, guarded

__all__ = ["RankscopeCallback", "GRAD_NORM_KEYS"]

# Logged metrics read as the step's gradient norm, when the LightningModule logs one:
# ``self.log("grad_norm", ...)``, or ``self.log_dict(lightning.pytorch.utilities.grad_norm(self, 2))``.
GRAD_NORM_KEYS = ("grad_norm", "grad_2.0_norm_total")
# The logged values are looked up in the training loop's result collection (a dict per logged
# name): a module that logged no gradient norm in its first GRAD_NORM_PROBE_STEPS steps is asked
# again only every GRAD_NORM_RECHECK_EVERY steps (one that starts logging later is found then).
GRAD_NORM_PROBE_STEPS = 16
GRAD_NORM_RECHECK_EVERY = 64


class RankscopeCallback(Callback):
    """A Lightning ``Callback`` that reports this rank's steps, phases and values through rankscope.

    ``monitor``: a ``rankscope.Monitor`` to use (it stays open after fitting);
    without one, the callback opens its own when fitting is set up and closes
    it at the fit's teardown. ``options`` go to that ``Monitor``.
    """

    def __init__(self, monitor: Any = None, **options: Any):
        super().__init__()
        if monitor is not None and options:
            raise ConfigError("RankscopeCallback: give either a monitor or Monitor options, not both")
        self.monitor = monitor
        self._own_monitor = monitor is None
        self._options = options
        self.steps: EventSteps | None = None
        self._stepped = False          # the optimizer stepped in the current batch
        self._batch_end = 0.0          # perf_counter at the last batch's end (a step's micro-batches)
        self._last_grad_norm: Any = None   # the logged value last read (a tensor, read lazily)
        self._grad_norm_logged = False     # the module has logged a gradient norm
        self._grad_norm_asks = 0           # steps that ended since fitting began

    # -- the monitor's lifetime ---------------------------------------------------
    def setup(self, trainer, pl_module, stage):
        if stage != "fit":
            return
        if self.monitor is None or (self._own_monitor and self.monitor.closed):
            # Lightning's own launcher sets LOCAL_RANK and WORLD_SIZE but not RANK: say who
            # this rank is as torchrun would have (variables a launcher set are kept).
            os.environ.setdefault("RANK", str(trainer.global_rank))
            os.environ.setdefault("WORLD_SIZE", str(trainer.world_size))
            os.environ.setdefault("LOCAL_RANK", str(trainer.local_rank))
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(trainer.num_devices))
            from rankscope.monitor import Monitor

            self.monitor = Monitor(device=pl_module.device, **self._options)
        self.steps = EventSteps(self.monitor)

    @guarded
    def teardown(self, trainer, pl_module, stage):
        if stage != "fit" or self.monitor is None:
            return
        if self.steps is not None:
            self.steps.end()
        if self._own_monitor:
            self.monitor.close()

    @guarded
    def on_train_start(self, trainer, pl_module):
        if self.steps is None:
            return
        # DDP: its gradient all-reduces timed; any model: its CUDA device learnt (FSDP and the rest
        # are read through the flight recorder, unwrapped)
        self.monitor.watch(trainer.strategy.model)
        self.steps.between_steps()

    # -- a step ---------------------------------------------------------------------
    @guarded
    def on_train_epoch_start(self, trainer, pl_module):
        if self.steps is not None:
            self.steps.between_steps()

    @guarded
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        steps = self.steps
        if steps is None:
            return
        if steps.open:   # the next micro-batch of an accumulating step
            steps.waited_for_data(self._batch_end)
        else:
            # Numbered as Lightning numbers it once done: after 40 steps, rankscope_step is 40.
            steps.begin(trainer.global_step + 1)
        self._stepped = False
        steps.step.count(samples=batch_size(batch))
        steps.switch("forward")

    @guarded
    def on_before_backward(self, trainer, pl_module, loss):
        if self.steps is not None and self.steps.open:
            self.steps.switch("backward")

    @guarded
    def on_after_backward(self, trainer, pl_module):
        if self.steps is not None and self.steps.open:
            self.steps.switch("optimizer")

    @guarded
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.steps is not None and self.steps.open:
            self._stepped = True
            self.steps.lr = first_lr(optimizer)

    @guarded
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        steps = self.steps
        if steps is None or not steps.open:
            return
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        # Lightning hands over a detached copy already (automatic optimization); detaching costs a
        # dispatcher call (~4 us) on every step.
        steps.add_loss(loss.detach() if getattr(loss, "requires_grad", False) else loss)
        if not self._stepped:   # accumulating: the step goes on with the next micro-batch
            steps.switch(None)
            self._batch_end = time.perf_counter()
            return
        steps.grad_norm = self._logged_grad_norm(trainer)
        steps.end()

    def _logged_grad_norm(self, trainer) -> Any:
        """The gradient norm the module logged in this step, if it logs one (Lightning computes
        none by itself), as the tensor it logged: never through ``trainer.callback_metrics``,
        which rebuilds the progress bar's values with ``.item()`` (a device sync a step on a GPU).
        Lightning keeps a value that was not logged again: the same object as the one read last
        is that stale entry, not this step's."""
        self._grad_norm_asks += 1
        if (not self._grad_norm_logged and self._grad_norm_asks > GRAD_NORM_PROBE_STEPS
                and self._grad_norm_asks % GRAD_NORM_RECHECK_EVERY):
            return None
        value = _logged_on_step(trainer, GRAD_NORM_KEYS)
        if value is None:
            return None
        self._grad_norm_logged = True
        if value is self._last_grad_norm:
            return None
        self._last_grad_norm = value
        return value

    @guarded
    def on_exception(self, trainer, pl_module, exception):
        if self.steps is not None:
            self.steps.end(exception)

    # -- between steps ----------------------------------------------------------------
    @guarded
    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        # Lightning calls this as it assembles the checkpoint, before writing it; no hook marks the
        # write's end, so the save lasts until the next step starts (or training ends).
        if self.steps is not None:
            self.steps.checkpoint_saving()

    @guarded
    def on_validation_start(self, trainer, pl_module):
        if self.steps is not None:
            self.steps.evaluation_started()

    @guarded
    def on_validation_end(self, trainer, pl_module):
        if self.steps is not None:
            self.steps.evaluation_ended()

    @guarded
    def on_train_end(self, trainer, pl_module):
        if self.steps is not None:
            self.steps.between_steps()


def _logged_on_step(trainer: Any, names: tuple[str, ...]) -> Any:
    """The value last logged on step under one of ``names`` in the running loop's results
    (Lightning's ``_ResultCollection``: logged name -> ``_ResultMetric``, whose ``_forward_cache``
    is the logged tensor, as logged), or None. Reads no tensor."""
    results = getattr(trainer, "_results", None)
    if not results:
        return None
    for metric in list(results.values()):
        meta = getattr(metric, "meta", None)
        if meta is not None and meta.name in names and meta.on_step and not getattr(metric, "has_reset", False):
            return metric._forward_cache
    return None
