"""Turning what a loop passes to ``step.observe()`` into one number, by a documented rule.

Real loops pass more than Python floats:

* ``loss``: a float, a 0-d tensor, or a tensor of per-sample losses
  (``reduction="none"``), or a list of them: the **mean** of all elements.
* ``grad_norm``: a float or tensor, or several norms (one per parameter group
  or per FSDP shard, as a list or a 1-d tensor): the **total 2-norm**,
  sqrt(sum of squares), which is the norm of all gradients together.
* ``lr``: a float, or a list with one value per parameter group (what
  ``scheduler.get_last_lr()`` returns): the **first group's** value.

Anything else (a string, a dict, an empty tensor, a bool) is not a number:
``read`` raises ``NotANumber`` and the step accounting counts it as a drop
(``rankscope_telemetry_dropped_total{what="value"}``). The step itself is
always counted.

A CUDA tensor, or a sequence holding one, is reduced on its device on the
training thread (the reduction is queued, never waited for; floats in the
sequence join it as kernel arguments, never as a host-to-device copy) and
returned as a 0-d tensor for the deferred device reads.

A DTensor (FSDP2, tensor parallel) is read from its local part when that part
is the value: a ``Replicate`` one, or a ``Shard`` of a per-sample loss (the
rank's own samples). A ``Partial`` one (each rank holds a summand, such as
``clip_grad_norm_``'s result before ``.full_tensor()``) and a sharded gradient
norm are not numbers of this rank: reading them would need a collective,
which rankscope never issues.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeAlias

from rankscope.device import cuda

if TYPE_CHECKING:
    import torch

# What step.observe() takes for a value: a number, a tensor (a loss, a DTensor), or a list or tuple of
# them, reduced by the rules below.
Observed: TypeAlias = "float | torch.Tensor | Sequence[float | torch.Tensor] | None"


class NotANumber(ValueError):
    """An observed value that no documented rule turns into a number."""


def read(what: str, value: object, device_of: Callable[[object], int | None] | None = None) -> Any:
    """A float, or a 0-d CUDA tensor to be read later. Raises NotANumber.

    ``device_of``: a tensor's CUDA device index, or None (``rankscope.device.cuda``'s, by default)."""
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return float(value)
    if device_of is None:
        device_of = cuda.api().device_of
    if hasattr(value, "is_cuda") and hasattr(value, "item"):   # a tensor
        if type(value).__name__ == "DTensor":
            value = _local_part(what, value)
        if device_of(value) is not None:
            return _device_scalar(what, value)
        try:
            # The common case, a 0-d CPU loss, in one torch call: each costs
            # ~5 us right after a step (docs/performance.md).
            return _number(what, value.item())
        except RuntimeError:   # more than one element, or none
            return _number(what, _host_reduce(what, value))
    if isinstance(value, (list, tuple)):
        return _read_sequence(what, value, device_of)
    return _number(what, value)


def _number(what: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise NotANumber(f"{what}: {type(value).__name__} {_short(value)} is not a number")
    return float(value)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _host_reduce(what: str, tensor: torch.Tensor) -> Any:
    if tensor.numel() == 0:
        raise NotANumber(f"{what}: an empty tensor")
    flat = tensor.detach().reshape(-1)
    if what == "lr":
        return flat[0].item()
    if flat.dtype.is_complex or not flat.dtype.is_floating_point and flat.dtype.itemsize == 1:
        raise NotANumber(f"{what}: a tensor of {flat.dtype}")
    flat = flat.double()
    return (flat.norm(2) if what == "grad_norm" else flat.mean()).item()


def _device_scalar(what: str, tensor: torch.Tensor) -> Any:
    """A 0-d tensor on the device, reduced there without waiting for it."""
    n = tensor.numel()
    if n == 0 or tensor.dtype.is_complex:
        raise NotANumber(f"{what}: a tensor of {n} {tensor.dtype} values")
    flat = tensor.detach().reshape(-1)
    if n == 1 or what == "lr":
        return flat[0]
    flat = flat.float()
    return flat.norm(2) if what == "grad_norm" else flat.mean()


def _local_part(what: str, value: torch.Tensor) -> Any:
    """A DTensor's local tensor, where that is this rank's value (see the module docstring)."""
    placements = tuple(getattr(value, "placements", ()))
    if any(p.is_partial() for p in placements):
        raise NotANumber(f"{what}: a DTensor with a Partial placement (each rank holds a summand): "
                         f"observe {what}.full_tensor()")
    if what == "grad_norm" and any(p.is_shard() for p in placements):
        raise NotANumber(f"{what}: a sharded DTensor: observe the total norm ({what}.full_tensor())")
    return value.to_local()


def _read_sequence(what: str, values: list | tuple, device_of: Callable[[object], int | None]) -> Any:
    if not values:
        raise NotANumber(f"{what}: an empty {type(values).__name__}")
    if what == "lr":
        return read(what, values[0], device_of)
    numbers = [read(what, v, device_of) for v in values]
    on_host = [n for n in numbers if isinstance(n, float)]
    if len(on_host) < len(numbers):   # combine on the device, without waiting for it
        import torch

        on_device = [n for n in numbers if not isinstance(n, float)]
        device = on_device[0].device
        stacked = torch.stack([n.to(device=device, dtype=torch.float32, non_blocking=True) for n in on_device])
        if what == "grad_norm":
            return (stacked.square().sum() + math.fsum(n * n for n in on_host)).sqrt()
        return (stacked.sum() + math.fsum(on_host)) / len(numbers)
    if what == "grad_norm":
        return math.sqrt(math.fsum(n * n for n in numbers))
    return math.fsum(numbers) / len(numbers)
