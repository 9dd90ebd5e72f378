"""The reference trainer's parts (``rankscope.train`` runs them): its model and data, and the
faults and noise it injects for the drills.

    model    TeacherDataset, the student MLP, its parallelisms (DDP, FSDP2, HSDP, 2-D, pipeline), evaluation
    faults   StartUpFaults, Faults: what a fault rank does, and the noise of a healthy run; CommCounts
"""

from rankscope.reference.faults import CommCounts, Faults, StartUpFaults
from rankscope.reference.model import IN_FEATURES, TeacherDataset, build_model, parallelize

__all__ = ["CommCounts", "Faults", "IN_FEATURES", "StartUpFaults", "TeacherDataset", "build_model", "parallelize"]
