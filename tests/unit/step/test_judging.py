"""The judges of observed values (rankscope.step.judging): loss spikes and non-finite values,
exactly, and gradient-norm explosions."""

from __future__ import annotations

import math

from rankscope.step.judging import GradNormTracker, LossTracker


def test_loss_tracker_flags_spikes_and_nonfinite_exactly():
    t = LossTracker(window=50, ema_alpha=0.1, spike_z=6.0, warmup=20)
    for i in range(100):
        v = t.observe(2.0 + 0.01 * math.sin(i))
        assert not v.spike and not v.nonfinite
    assert t.observe(float("nan")).nonfinite
    assert t.observe(float("inf")).nonfinite
    spike = t.observe(5.0)
    assert spike.spike and spike.zscore > 6
    assert not t.observe(2.0).spike  # one spike does not poison the window


def test_loss_tracker_respects_warmup_and_flat_loss():
    t = LossTracker(window=10, ema_alpha=0.1, spike_z=6.0, warmup=5)
    t.observe(1.0)
    t.observe(1.0)
    assert not t.observe(100.0).spike        # before warm-up
    flat = LossTracker(window=10, ema_alpha=0.1, spike_z=6.0, warmup=2)
    for _ in range(20):
        assert not flat.observe(1.0).spike   # a flat loss never spikes on float noise


def test_grad_norm_tracker():
    g = GradNormTracker(factor=10.0, warmup=5)
    for _ in range(20):
        assert g.observe(1.0) == (False, False)
    assert g.observe(50.0) == (False, True)
    assert g.observe(float("nan")) == (True, False)
    assert g.avg < 2.0
