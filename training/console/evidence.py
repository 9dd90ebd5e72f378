"""The evidence node exporters captured of stalled ranks (rankscope.exporter.evidence), as the
console shows it: which ranks have some, where it is, and the frames a person reads first.

The series ``rankscope_evidence_captured_timestamp_seconds{scheme, path}`` says a capture
exists on the exporter that served it (``instance``: Prometheus adds it; ``rankscope top``
adds it for the exporters it scrapes itself).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

from rankscope import pages
from rankscope.pages import Series
from rankscope.pages.record import EVIDENCE_SERIES as SERIES

TIMEOUT_S = 5.0


def captures(samples: Iterable[Series], run: str) -> list[dict]:
    """Every rank of ``run`` with evidence: rank, node, trigger, captured_at and its url."""
    out = []
    for s in samples:
        if s.name != SERIES or s.labels.get("run") != run or not s.labels.get("instance"):
            continue
        out.append({"rank": int(s.labels.get("rank", "-1")), "node": s.labels.get("node", ""),
                    "trigger": s.labels.get("trigger", ""), "captured_at": s.value,
                    "url": f"{s.labels.get('scheme', 'http')}://{s.labels['instance']}{s.labels.get('path', '')}"})
    return sorted(out, key=lambda c: (c["rank"], c["captured_at"]))


def fetch(url: str, timeout: float = TIMEOUT_S) -> dict | None:
    """A capture as JSON, or None where its exporter does not answer (a lost node, auth)."""
    try:
        return json.loads(pages.get(url + "?format=json", timeout))
    except (pages.FetchError, ValueError):
        return None


def where(capture: dict, frames: int = 3) -> list[str]:
    """The training thread's innermost frames, ``function (file:line)``: what the rank is doing."""
    stacks = capture.get("stacks") or {}
    threads = stacks.get("threads") or []
    training = ([t for t in threads if t.get("id") == stacks.get("training_thread")]
                or [t for t in threads if t.get("current")] or threads[:1])
    if not training:
        note = stacks.get("note")
        return [note] if note else []
    return [f"{func} ({os.path.basename(path)}:{line})" for path, line, func in training[0]["frames"][:frames]]


def failure_line(capture: dict) -> str:
    """The last line of a failed rank's traceback: its exception and message."""
    lines = [line for line in ((capture.get("failure") or {}).get("traceback") or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def one_line(summary: dict) -> str:
    """What a summarized capture says first: what the rank raised, or where it was."""
    if summary["failure"]:
        return f"raised {summary['failure']}"
    if summary["where"]:
        return "in " + " <- ".join(summary["where"])
    return "its exporter did not answer" if not summary["reachable"] else "no stacks"


def summary(found: dict, capture: dict | None) -> dict[str, Any]:
    """A capture (None: its exporter did not answer) reduced to what a person reads first."""
    return {**found, "reachable": capture is not None, "where": where(capture) if capture else [],
            "failure": failure_line(capture) if capture else ""}


def summarize(found: list[dict]) -> list[dict[str, Any]]:
    """Each capture fetched and summarized."""
    return [summary(c, fetch(c["url"])) for c in found]
