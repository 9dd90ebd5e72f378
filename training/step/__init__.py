"""The step path: from ``with monitor.step()`` on the training thread to what a publish writes.

    timer       StepTimer, Step, Phase: clocks and bookkeeping on the training thread
    handoff     StepHandoff: each finished step handed over as one record (StepEnded)
    accounting  StepAccounting: what the records add up to, on the publisher thread
    values      the documented rules that turn an observed value into one number
    judging     divergence (non-finite, spikes, explosions) and slow steps, on every value
    trace_feed  which steps become traces, and their records
    goodput     where the rank's wall time goes (TimeUse), and its completed steps (Progress)
    watched     what watch() attached: the comm-timing strategy, the replica check (one holder)
    records     the records themselves
"""

from rankscope.step.records import IntervalEnded, StepEnded, TraceContext
from rankscope.step.timer import Phase, Step, StepTimer

__all__ = ["IntervalEnded", "Phase", "Step", "StepEnded", "StepTimer", "TraceContext"]
