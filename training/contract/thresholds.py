"""The bars the alert rules judge by, for the readers that show them too.

Generated from prometheus/thresholds.yaml by deploy/generate.py: do not edit; change that file
and regenerate (.venv/bin/python deploy/generate.py).
"""

# params.straggler_ratio: a rank's compute per step over the median of its peers' at which it is a straggler
STRAGGLER_RATIO = 1.35
# params.straggler_phases: the phases that are compute, for the straggler ratio
STRAGGLER_PHASES = ('forward', 'backward', 'optimizer')
# params.comm_bound_ratio: comm_wait's share of a rank's step time that is comm-bound
COMM_BOUND_RATIO = 0.5
# params.input_bound_ratio: data wait's share of a rank's step time that is input-bound
INPUT_BOUND_RATIO = 0.3
