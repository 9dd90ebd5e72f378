"""rankscope.collectives.tracker without a job: bus-bandwidth factors, and the group a collective
is timed on."""

from __future__ import annotations

import pytest

from rankscope.collectives.tracker import bus_factor, group_size


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 2, 1.0), ("all_reduce", 1, 0.0),
    ("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4), ("all_to_all", 4, 3 / 4), ("gather", 4, 3 / 4),
    ("scatter", 4, 3 / 4), ("broadcast", 8, 1.0), ("reduce", 8, 1.0), ("send", 2, 1.0), ("recv", 2, 1.0),
    ("barrier", 8, 0.0)])
def test_bus_bandwidth_factors_are_nccl_tests(op, n, factor):
    """nccl-tests (doc/PERFORMANCE.md): busBw = algBw x the op's factor, so that every op reads
    against the link's speed. A group of one moves nothing over a bus."""
    assert bus_factor(op, n) == pytest.approx(factor)


def test_a_collective_group_that_is_no_process_group_is_refused_clearly():
    class Group:
        def size(self):
            return 4

    assert group_size(Group()) == 4
    with pytest.raises(TypeError, match="process group"):
        group_size([0, 1])
