"""The GPU check's figures: every check records what it measured here; the session writes them
to $GPU_CHECK_OUT (JSON) when it ends (tests/gpu/conftest.py)."""

from __future__ import annotations

FIGURES: dict[str, object] = {}


def record(name: str, value: object) -> None:
    FIGURES[name] = value
    print(f"\n[gpu-check] {name}: {value}")
