"""prometheus_client's mmap file, with its space reserved before it is used.

prometheus_client's ``MmapedDict`` grows a file with ``truncate`` and then
writes through a shared mapping. On tmpfs (/dev/shm, the default metrics
directory) and other sparse-file filesystems, ``truncate`` succeeds even when
the filesystem is full; the page is only allocated when the mapping first
touches it, and if there is no room then the kernel sends SIGBUS, which kills
the rank (measured: a Python process that adds keys to an MmapedDict on a
full 512 KiB tmpfs dies with -SIGBUS; see docs/reliability.md, drill 4).

This subclass reserves the space with ``posix_fallocate`` first, so a full
filesystem is an ``OSError`` (ENOSPC) raised where a new series is created,
which the monitor counts in ``rankscope_telemetry_errors_total`` and logs
once, and the training loop never sees. Values of existing series are written
in place, in pages that are already allocated, so they keep working.
"""

from __future__ import annotations

import errno
import os

from prometheus_client.mmap_dict import MmapedDict

from rankscope.contract.mmap_layout import INITIAL_BYTES, entry_bytes

# Filesystems without fallocate: keep prometheus_client's sparse behaviour.
_NOT_SUPPORTED = {errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in _NOT_SUPPORTED:
            raise


class ReservedMmapedDict(MmapedDict):
    def __init__(self, filename: str, read_mode: bool = False):
        if not read_mode:
            fd = os.open(filename, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if os.fstat(fd).st_size < INITIAL_BYTES:
                    _reserve(fd, INITIAL_BYTES)
            finally:
                os.close(fd)
        super().__init__(filename, read_mode)

    def _init_value(self, key: str) -> None:
        # The same entry size and doubling as MmapedDict._init_value.
        entry = entry_bytes(len(key.encode("utf-8")))
        capacity = self._capacity
        while self._used + entry > capacity:
            capacity *= 2
        if capacity > self._capacity:
            _reserve(self._f.fileno(), capacity)
        super()._init_value(key)
