"""The metric files' layout as rankscope knows it (rankscope.contract.mmap_layout), held against the
files prometheus_client really writes: if a version pyproject.toml allows lays them out otherwise,
this fails before the exporter misreads a page."""

from __future__ import annotations

import struct

from prometheus_client.mmap_dict import MmapedDict

from rankscope.contract.mmap_layout import (HEADER_BYTES, INITIAL_BYTES, USED, DbName, db_file_pid, db_name,
                                            entry_bytes, entry_format, entry_key, value_offset)
from rankscope.exporter.db_file import DbFile
from rankscope.publishing.mmapfile import ReservedMmapedDict


def test_a_file_prometheus_client_writes_is_read_back_entry_by_entry(tmp_path):
    path = tmp_path / db_name("gauge_mostrecent", 42)
    written = [(entry_key("rankscope_loss", "rankscope_loss", ("rank",), (str(i) * i,), "help " * i), i / 3, 100.0 + i)
               for i in range(1, 12)]   # keys of every length modulo 8
    out = MmapedDict(str(path))
    for key, value, stamp in written:
        out.write_value(key, value, stamp)
    out.close()
    data = path.read_bytes()
    used = USED.unpack_from(data, 0)[0]
    assert used == HEADER_BYTES + sum(entry_bytes(len(k.encode())) for k, _, _ in written)
    pos, read = HEADER_BYTES, []
    while pos < used:
        n = USED.unpack_from(data, pos)[0]
        key, value, stamp = struct.unpack_from("=" + entry_format(n), data, pos)
        assert struct.unpack_from("=dd", data, value_offset(pos + 4, n)) == (value, stamp)
        read.append((key.decode(), value, stamp))
        pos += entry_bytes(n)
    assert read == written
    f = DbFile(str(path))
    assert f.refresh() and list(f.values) == [v for _, v, _ in written]
    assert (f.typ, f.mode, f.pid) == DbName.parse(path) == ("gauge", "mostrecent", "42")


def test_the_reserved_file_starts_at_the_libraries_initial_size(tmp_path):
    path = tmp_path / db_name("counter", 7)
    ReservedMmapedDict(str(path)).close()
    assert path.stat().st_size == INITIAL_BYTES
    assert DbName.parse(path) == ("counter", "", "") and db_file_pid(path) == 7
    assert db_file_pid(tmp_path / "x.db") is None
