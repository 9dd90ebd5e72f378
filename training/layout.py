"""Where a rank sits in its job's parallel layout: its coordinate on each named dimension of the
job's device mesh (``pp=1,dp=0,tp=3``).

Ranks of a pipeline, tensor, context or expert parallel job do different work by design, so
"slower than the run's median" is not "faulty". The rules compare a rank only with the ranks
of its pipeline stage (``stage``), and page a tensor-parallel group, whose ranks compute
equally long by construction, once (``tp_group``: the group's coordinates on every other
dimension). Exported once per rank as ``rankscope_rank_layout_info`` (a label on every series
would multiply them).

Learnt without user code where the job has a device mesh: ``watch()`` on a model whose
parameters are DTensors reads their root mesh, ``watch()`` on a
``torch.distributed.pipelining.PipelineStage`` reads its stage. Stated in one line where not:
``Monitor(layout=...)`` (a DeviceMesh, a mapping or ``"pp=1,tp=0"``) or ``RANKSCOPE_LAYOUT``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from rankscope.contract.environment import ConfigError

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

# Mesh dimension names, as torchtitan, Megatron and torch's own examples spell them.
PIPELINE_DIMS = ("pp", "pipeline", "pipeline_parallel", "stage")
TENSOR_PARALLEL_DIMS = ("tp", "tensor", "tensor_parallel")
_DIM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,31}")
MAX_DIMS = 8


@dataclass(frozen=True)
class Layout:
    """The rank's coordinate on each named dimension, in the mesh's order; empty: unknown."""

    coordinates: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        names = [name for name, _ in self.coordinates]
        if len(names) > MAX_DIMS:
            raise ConfigError(f"at most {MAX_DIMS} dimensions, got {len(names)}", field="layout")
        for name, value in self.coordinates:
            if not _DIM_NAME.fullmatch(name):
                raise ConfigError(f"dimension name {name!r} must be a word of letters, digits and _ "
                                  "(pp, dp_shard, tp)", field="layout")
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name}={value!r}: a coordinate is a whole number >= 0", field="layout")
        if len(set(names)) != len(names):
            raise ConfigError(f"dimension named twice in {names}", field="layout")
        if sum(name in PIPELINE_DIMS for name in names) > 1 or sum(name in TENSOR_PARALLEL_DIMS for name in names) > 1:
            raise ConfigError(f"{names}: one pipeline ({'/'.join(PIPELINE_DIMS)}) and one tensor-parallel "
                              f"({'/'.join(TENSOR_PARALLEL_DIMS)}) dimension at most", field="layout")

    @classmethod
    def parse(cls, text: str | None) -> "Layout":
        """``"pp=1,dp=0,tp=3"`` (RANKSCOPE_LAYOUT); None or "" is unknown."""
        if not text or not text.strip():
            return cls()
        pairs = []
        for part in text.split(","):
            name, eq, value = part.partition("=")
            if not eq or not value.strip().isdigit():
                raise ConfigError(f"{text!r}: expected name=coordinate pairs, e.g. pp=1,dp=0,tp=3", field="layout")
            pairs.append((name.strip(), int(value)))
        return cls(tuple(pairs))

    @classmethod
    def of(cls, value: Any) -> "Layout":
        """From what ``Monitor(layout=...)`` takes: a Layout, a string, a mapping, or a DeviceMesh."""
        if value is None or isinstance(value, Layout):
            return value or cls()
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping):
            return cls(tuple((str(k), v) for k, v in value.items()))
        if hasattr(value, "mesh_dim_names") and hasattr(value, "get_coordinate"):
            layout = from_mesh(value)
            if layout is None:
                raise ConfigError("the device mesh has no dimension names (init_device_mesh(..., "
                                  "mesh_dim_names=(...))), or this rank is not in it", field="layout")
            return layout
        raise ConfigError(f"expected a DeviceMesh, a mapping or 'pp=1,tp=0', got {type(value).__name__}",
                          field="layout")

    def merged(self, other: "Layout") -> "Layout":
        """This layout with ``other``'s coordinates added where this one has none on that dimension
        (a stated layout wins over one learnt; a pipeline stage adds its ``pp``)."""
        have = {name for name, _ in self.coordinates}
        roles = [dims for dims in (PIPELINE_DIMS, TENSOR_PARALLEL_DIMS) if have & set(dims)]   # already stated
        extra = tuple((n, v) for n, v in other.coordinates
                      if n not in have and not any(n in dims for dims in roles))
        return Layout(self.coordinates + extra) if extra else self

    @property
    def stage(self) -> str:
        """The pipeline stage, "" in a job without one."""
        return next((str(v) for n, v in self.coordinates if n in PIPELINE_DIMS), "")

    @property
    def tp_group(self) -> str:
        """The rank's tensor-parallel group, named by its coordinates on every other dimension
        (the same on each of its ranks); "" in a job without tensor parallelism."""
        if not any(n in TENSOR_PARALLEL_DIMS for n, _ in self.coordinates):
            return ""
        return ",".join(f"{n}={v}" for n, v in self.coordinates if n not in TENSOR_PARALLEL_DIMS) or "all"

    @property
    def mesh(self) -> str:
        return ",".join(f"{n}={v}" for n, v in self.coordinates)

    def labels(self) -> dict[str, str]:
        return {"stage": self.stage, "tp_group": self.tp_group, "mesh": self.mesh}


def _root(mesh: DeviceMesh) -> Any:
    """The whole job's mesh, of which ``mesh`` may be a sub-mesh (a model's parameters often hold one)."""
    try:   # torch >= 2.8 keeps the root on the mesh; before, in the mesh registry
        get_root = getattr(mesh, "_get_root_mesh", None)
        if get_root is None:
            from torch.distributed.device_mesh import _mesh_resources

            get_root = functools.partial(_mesh_resources.get_root_mesh, mesh)
        return get_root() or mesh
    except Exception:   # a mesh it does not know
        return mesh


def from_mesh(mesh: DeviceMesh) -> Layout | None:
    """The rank's coordinates on the root of ``mesh``; None without dimension names or outside the mesh."""
    root = _root(mesh)
    names, coordinate = getattr(root, "mesh_dim_names", None), root.get_coordinate()
    if not names or coordinate is None:
        return None
    return Layout(tuple(zip((str(n) for n in names), (int(c) for c in coordinate))))


def group_roles(obj: Any) -> dict[str, str]:
    """The process groups of the device mesh ``watch(obj)`` learns, by name, each with its mesh
    dimension's name (``{"0": "dp_shard"}``): a dimension spanning the whole world reuses the
    default group, which would otherwise read ``group="default"``. Empty without a named mesh."""
    mesh = _mesh_of(getattr(obj, "submod", obj))
    if mesh is None:
        return {}
    roles: dict[str, str] = {}
    # The root's dimensions, then the parameters' own mesh's: a framework that builds one "world"
    # mesh and unflattens it (torchtitan) shards the model on a dimension ("fsdp") that reuses a
    # group of the root; that group's role for this model is the dimension it is sharded on.
    for source in (_root(mesh), mesh):
        try:
            names = source.mesh_dim_names or ()
            roles.update({str(source.get_group(i).group_name): str(name) for i, name in enumerate(names)})
        except Exception:   # a mesh without groups (a fake process group), or an older torch
            continue
    return roles


def _mesh_of(obj: Any) -> Any:
    """The device mesh of a model's first parameter, if it is a DTensor."""
    parameters = getattr(obj, "parameters", None)
    if parameters is None:
        return None
    try:
        for p in parameters():
            return getattr(p, "device_mesh", None)
    except Exception:
        return None
    return None


def learn(obj: Any) -> Layout | None:
    """What ``watch(obj)`` can learn: a pipeline stage's index, or the mesh of a model's first
    DTensor parameter; None from anything else."""
    if type(obj).__name__.endswith("PipelineStage") and hasattr(obj, "stage_index"):
        layout = Layout((("pp", int(obj.stage_index)),))
        submod = getattr(obj, "submod", None)
        inner = learn(submod) if submod is not None else None
        return inner.merged(layout) if inner is not None else layout
    mesh = _mesh_of(obj)
    try:
        return from_mesh(mesh) if mesh is not None else None
    except Exception:
        return None
