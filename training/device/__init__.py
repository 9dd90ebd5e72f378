"""The rank's CUDA device: which one it is, its streams and events, and what is read from it.

* ``cuda``: ``Cuda``, the one place rankscope calls CUDA, and which thread may call what;
* ``rank_device``: ``RankDevice``, the device (given, or learnt from the first CUDA model or
  value), its event pool and current stream;
* ``reads``: CUDA values and phase events, read once the device is done, never waited for;
* ``memory``: the device's allocator figures and the host's memory, read by the publisher.
"""

from rankscope.device.cuda import Cuda
from rankscope.device.rank_device import EventPool, RankDevice

__all__ = ["Cuda", "EventPool", "RankDevice"]
