"""The layout of the metric files ranks write and the node exporter reads: the one place
rankscope knows it.

The files are prometheus_client's multiprocess files (``prometheus_client.mmap_dict``,
as of the versions pyproject.toml allows): one per kind and process, named
``<kind>_<pid>.db`` (a gauge's kind holds its multiprocess mode: ``gauge_mostrecent_<pid>.db``).
A file is an 8-byte header (its used bytes, an int32, then 4 unused), then entries, each:

    int32 key length n | key (n bytes of UTF-8 JSON: [metric, sample, labels, help]) |
    padding to a multiple of 8 | float64 value | float64 timestamp

Written by prometheus_client (through ``rankscope.publishing.mmapfile``, which reserves the
space first) and by compaction; read by ``rankscope.exporter.db_file``.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

from prometheus_client.mmap_dict import _INITIAL_MMAP_SIZE, mmap_key

HEADER_BYTES = 8
USED = struct.Struct("=i")          # the header's used bytes; also each entry's key length
INITIAL_BYTES = _INITIAL_MMAP_SIZE  # a new file's size before it first doubles
entry_key = mmap_key                # (metric, sample, label names, label values, help) -> the key's text


def key_padding(n: int) -> int:
    """Bytes after a key of ``n`` bytes, so that its value starts on an 8-byte boundary."""
    return 8 - (n + 4) % 8


def entry_bytes(n: int) -> int:
    """The size of an entry whose key is ``n`` bytes."""
    return 4 + n + key_padding(n) + 16


def entry_format(n: int) -> str:
    """A ``struct`` format for one entry from its key length on: key bytes, value, timestamp."""
    return f"4x{n}s{key_padding(n)}xdd"


def value_offset(key_at: int, n: int) -> int:
    """Where the value of the entry whose ``n``-byte key starts at ``key_at`` lies."""
    return key_at + n + key_padding(n)


class DbName(NamedTuple):
    kind: str      # counter, histogram, gauge, summary
    mode: str      # a gauge's multiprocess mode (mostrecent, all, livesum, ...); "" otherwise
    pid: str

    @classmethod
    def parse(cls, path: str | Path) -> "DbName":
        """As ``MultiProcessCollector`` reads a file's name."""
        parts = Path(path).name.split("_")
        kind = parts[0]
        if kind == "gauge":
            return cls(kind, parts[1] if len(parts) > 1 else "", parts[2][:-3] if len(parts) > 2 else "")
        return cls(kind, "", "")


def db_name(kind: str, pid: int) -> str:
    """A file's name; ``kind`` includes a gauge's mode (``gauge_mostrecent``)."""
    return f"{kind}_{pid}.db"


def db_file_pid(path: Path) -> int | None:
    """The pid in a file's name (counter_123.db -> 123)."""
    head, _, tail = Path(path).stem.rpartition("_")
    return int(tail) if head and tail.isdigit() else None
