"""The values a loop reports with ``step.observe()``, declared once.

Everything between ``observe()`` and the page follows this table: the step keeps one
slot per value, the handoff reads, versions and defers them in this order, the
accounting reads them into the publish's totals (judging those a judge watches), and
the publisher writes each one's last reading to its gauge. Adding a per-step value
is one entry here (its gauge declared in ``rankscope.contract.catalog``) plus its
keyword in ``Step.observe``; ``tests/unit/step/test_observed.py`` checks that the
three agree.
"""

from __future__ import annotations

from typing import NamedTuple


class ObservedValue(NamedTuple):
    name: str           # the keyword of Step.observe()
    metric: str         # the gauge its last reading of a publish goes to
    versioned: bool     # a tensor changed in place after its step ended is dropped, never read with its new
                        # value (not the learning rate: a scheduler may update a tensor lr in place, rightly)


# In the order a step's anomaly is chosen: the loss is the primary signal, then the gradient norm.
OBSERVED_VALUES = (
    ObservedValue("loss", "rankscope_loss", versioned=True),
    ObservedValue("grad_norm", "rankscope_grad_norm", versioned=True),
    ObservedValue("lr", "rankscope_learning_rate", versioned=False),
)
NAMES = tuple(v.name for v in OBSERVED_VALUES)
VERSIONED = tuple(v.versioned for v in OBSERVED_VALUES)
