"""One multiprocess metric file as last read: its parsed entries and latest values, read again
only where it changed, and a step's values read together (the fences). The file's layout is
``rankscope.contract.mmap_layout``'s; how files merge into a page is ``rankscope.exporter.reader``'s.
"""

from __future__ import annotations

import json
import os
import struct
import time

from rankscope.contract.catalog import VALUES_FENCE_BEGIN, VALUES_FENCE_END
from rankscope.contract.mmap_layout import HEADER_BYTES, USED, DbName, entry_format, value_offset

_INT = USED.unpack_from
_FIRST_READ = 16384
_FENCE_KEYS = tuple(f'["{name}", "{name}"'.encode() for name in (VALUES_FENCE_END, VALUES_FENCE_BEGIN))
FENCE_TRIES = 5            # reads of a file caught mid-write before its last whole copy is kept
FENCE_TRIES_FIRST = 100    # ... for a file never read whole yet (there is no last whole copy)
FENCE_RETRY_S = 0.0002     # the publisher writes a step's values in microseconds


class CorruptFile(RuntimeError):
    pass


class DbFile:
    """One multiprocess file as last read: its parsed entries and latest values."""

    __slots__ = ("path", "typ", "mode", "pid", "ident", "data", "end", "keys", "parsed", "struct", "values",
                 "stamps", "version", "fences", "torn", "_intern")

    _versions = 0

    def __init__(self, path: str, intern: dict | None = None):
        self.path = path
        # Strings and label tuples shared by the files of a run (every rank's entries
        # repeat the run, node, metric names and help texts).
        self._intern = intern if intern is not None else {}
        self.typ, self.mode, self.pid = DbName.parse(path)
        self.ident: tuple = ()
        self.data = b""       # the bytes up to the used end, as last read
        self.end = 0          # where the parsed entries end
        self.keys = 0          # hash of the tuple of every entry's key bytes
        self.parsed: list[tuple] = []
        self.struct: struct.Struct | None = None
        self.values: tuple = ()
        self.stamps: tuple = ()
        self.version = 0
        self.fences: tuple[int, int] | None = None   # where the two fence values lie, once found
        self.torn = 0          # copies taken mid-write (read again)

    def refresh(self) -> bool:
        """Read the file again. Returns False if it is gone. Raises CorruptFile."""
        for _ in range(FENCE_TRIES if self.data else FENCE_TRIES_FIRST):
            read = self._read()
            if read is None:
                return False
            st, data, used, whole = read
            if self.mode == "mostrecent" and ((st.st_dev, st.st_ino) != self.ident or self.fences is None):
                fences = _fence_offsets(data)
                if fences is not None and fences != self.fences:
                    self.fences = fences   # found (or moved): this copy was read without them
                    continue
            if whole:
                break
            self.torn += 1
            time.sleep(FENCE_RETRY_S)
        else:
            if self.data:
                return True   # written to all along: the last whole copy stands until the next scrape
        return self._take(st, data, used)

    def _read(self) -> tuple[os.stat_result, bytes, int, bool] | None:
        """The file's bytes up to its used end, and whether no step's values were half-written in
        them: the end fence is read on its own before the copy and the begin fence after it, so
        that the copy (whose loads a CPU may reorder among themselves: x86's fast string copy
        does) lies between the two reads."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        fences = self.fences if self.mode == "mostrecent" else None
        try:
            st = os.fstat(fd)
            end = os.pread(fd, 8, fences[0]) if fences else b""
            data = os.pread(fd, _FIRST_READ, 0)
            used = _INT(data, 0)[0] if len(data) >= HEADER_BYTES else 0
            if used > len(data):
                data += os.pread(fd, used - len(data), len(data))
            begin = os.pread(fd, 8, fences[1]) if fences else b""
        finally:
            os.close(fd)
        return st, data, used, end == begin

    def _take(self, st: os.stat_result, data: bytes, used: int) -> bool:
        if used <= HEADER_BYTES:
            # No entry yet; a file its process has only just created may not even have its header.
            used, data = HEADER_BYTES, b"\0" * HEADER_BYTES
        elif len(data) > used:
            data = data[:used]
        elif len(data) < used:
            raise CorruptFile(f"{self.path}: {len(data)} bytes, header says {used}")
        ident = (st.st_dev, st.st_ino)
        if ident == self.ident and data == self.data:
            return True                                    # nothing changed: nothing to unpack
        old = self.end
        if ident == self.ident and len(data) >= old and self.struct is not None:
            t = self.struct.unpack_from(data, HEADER_BYTES)
            if hash(t[0::3]) == self.keys:                 # the same entries, maybe more after them
                if len(data) == old:
                    self.data, self.values, self.stamps = data, t[1::3], t[2::3]
                    return True
                self._parse(data, old)
                return True
        self.ident = ident
        self.parsed, self.keys, self.struct = [], 0, None
        self._parse(data, HEADER_BYTES)
        return True

    def _parse(self, data: bytes, pos: int) -> None:
        """Parse entries from ``pos`` (the end of those already parsed) to the used end."""
        used = len(data)
        fmt = [self.struct.format[1:] if self.struct is not None and pos > HEADER_BYTES else ""]
        parsed = self.parsed
        intern = self._intern.setdefault
        while pos < used:
            n = _INT(data, pos)[0]
            if n < 0 or n + pos > used:
                raise CorruptFile(f"{self.path}: read beyond file size detected, file is corrupted")
            key = data[pos + 4:pos + 4 + n]
            pos = value_offset(pos + 4, n)
            if pos + 16 > used:
                raise CorruptFile(f"{self.path}: entry beyond the used size, file is corrupted")
            metric_name, name, labels, help_text = json.loads(key)
            labels = tuple(sorted(labels.items()))
            labels = intern(labels, tuple(intern(pair, (intern(pair[0], pair[0]), intern(pair[1], pair[1])))
                                          for pair in labels))
            parsed.append((intern(metric_name, metric_name), intern(name, name), labels,
                           intern(help_text, help_text)))
            fmt.append(entry_format(n))
            pos += 16
        self.struct = struct.Struct("=" + "".join(fmt))
        t = self.struct.unpack_from(data, HEADER_BYTES)
        self.keys, self.values, self.stamps = hash(t[0::3]), t[1::3], t[2::3]
        self.data, self.end = data, used
        DbFile._versions += 1
        self.version = DbFile._versions


def _fence_offsets(data: bytes) -> tuple[int, int] | None:
    """The offsets of the fence values (end's, begin's) in a file's bytes; None without both.
    An entry is a 4-byte key length, the key (JSON: ``[metric, sample, labels, help]``), padding
    to 8 bytes, then its value and timestamp (``rankscope.contract.mmap_layout``)."""
    offsets = []
    for key in _FENCE_KEYS:
        at = data.find(key)
        if at < 4:
            return None
        n = _INT(data, at - 4)[0]
        offsets.append(value_offset(at, n))
    return offsets[0], offsets[1]
