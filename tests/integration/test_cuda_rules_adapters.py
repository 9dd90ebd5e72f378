"""The framework adapters' CUDA paths against the strict double of rankscope's CUDA boundary
(tests/helpers/strict_cuda.py; the Monitor's own paths: tests/unit/test_cuda_rules.py).

Each framework trains in this process, its tensors taken for ones on the rank's GPU (cuda:1):
a call of rankscope's (or of a framework's, made for rankscope) that waits for the device on
the training thread, or touches another device, fails the test.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.strict_cuda import StrictCuda
from tests.helpers.tiny_models import faults, lightning_module
from tests.unit.test_cuda_rules import RANK_GPU

STEPS = 24


@pytest.fixture
def one_rank(monkeypatch, tmp_path):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return dict(exporter="off", metrics_dir=tmp_path / "metrics", publish_interval_s=60, max_process_groups=0)


def test_lightning_with_progress_bar_values_and_a_logged_grad_norm_never_waits(one_rank, tmp_path):
    """Finding 2: the adapter read trainer.callback_metrics for the grad norm, which turns every
    prog_bar=True value into a number with .item(): a host-device sync a step."""
    pl = pytest.importorskip("lightning.pytorch")

    from rankscope.integrations.lightning import RankscopeCallback

    data = torch.utils.data.TensorDataset(torch.randn(STEPS * 4, 8), torch.randn(STEPS * 4, 1))
    callback = RankscopeCallback(run="strict-lightning", **one_rank)
    with StrictCuda(rank_device=RANK_GPU) as cuda:
        cuda.set_device(RANK_GPU)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[callback], logger=False,
                             enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path,
                             enable_progress_bar=True, log_every_n_steps=1)
        with open(os.devnull, "w") as quiet, _stdout(quiet):
            trainer.fit(lightning_module(pl, 8), torch.utils.data.DataLoader(data, batch_size=4))
    m = callback.monitor.parts.metrics
    assert m.steps._value.get() == STEPS
    assert m.observed["grad_norm"]._value.get() > 0 and m.observed["loss"]._value.get() > 0
    assert faults(callback.monitor) == {}


def test_hf_trainer_steps_never_wait_for_the_device(one_rank, tmp_path):
    transformers = pytest.importorskip("transformers")

    from rankscope.integrations.hf import RankscopeCallback, instrument

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                                                 n_layer=1, n_head=2))
    ids = torch.randint(0, 64, (STEPS * 4, 16), generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS,
                                          per_device_train_batch_size=4, learning_rate=1e-3, report_to="none",
                                          use_cpu=True, save_strategy="no", logging_steps=1000,
                                          disable_tqdm=True, dataloader_num_workers=0, max_grad_norm=1.0,
                                          logging_nan_inf_filter=False)
    callback = RankscopeCallback(run="strict-hf", **one_rank)
    with StrictCuda(rank_device=RANK_GPU) as cuda:
        cuda.set_device(RANK_GPU)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])
        instrument(trainer)
        trainer.train()
    monitor = callback.monitor
    assert monitor.parts.metrics.steps._value.get() == STEPS
    assert monitor.parts.metrics.observed["loss"]._value.get() > 0 and monitor.parts.metrics.observed["grad_norm"]._value.get() > 0
    assert faults(monitor) == {}


def _stdout(stream):
    import contextlib

    return contextlib.redirect_stdout(stream)
