"""``rankscope top`` shows every rank state of the contract, each in its own style. No processes."""

from __future__ import annotations

from rankscope.console.top import STATE_STYLES
from rankscope.console.view import RunView, RankRow
from rankscope.contract.states import RANK_STATES


def test_every_state_has_a_style_and_is_counted_in_the_contracts_order():
    assert set(STATE_STYLES) == {*RANK_STATES, "unknown"}
    rows = [RankRow(run="r", rank=i, node="n", state=s) for i, s in enumerate(reversed((*RANK_STATES, "unknown")))]
    view = RunView(run="r", source="test", rows=rows, runs=["r"], taken_at=0.0)
    assert list(view.state_counts()) == [*RANK_STATES, "unknown"]
