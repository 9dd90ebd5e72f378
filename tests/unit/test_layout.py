"""The code's layout, pinned: packages by role, no import circles, one definition of each
threshold, no dead code the last review found, adapters on public API only."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.helpers.jobs import REPO

TRAINING, EXPORTER = REPO / "training", REPO / "exporter"
PACKAGES = ("step", "device", "collectives", "publishing", "tracing", "contract", "console", "integrations")


def _module(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("").parts
    parts = ["rankscope", *rel[1:]] if rel[0] == "training" else ["rankscope", "exporter", *rel[1:]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the rankscope modules it imports, function-level imports included (an import of
    the module's own package is not an edge: Python runs a package's __init__ first anyway)."""
    modules = {_module(p): p for base in (TRAINING, EXPORTER) for p in base.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    graph = import_graph()
    assert len(graph) > 60 and "rankscope.step.handoff" in graph   # the scan sees the real packages
    assert cycles(graph) == []


def test_the_scan_finds_a_circle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_the_rank_side_is_grouped_by_role():
    top_level = sorted(p.stem for p in TRAINING.glob("*.py") if p.stem != "__init__")
    assert top_level == ["config", "errors", "exit_status", "flops", "holds", "identity", "launch", "layout", "monitor",
                         "pages", "sinks", "train"], top_level
    for package in PACKAGES:
        init = TRAINING / package / "__init__.py"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{package}/__init__.py says what the package is for"
        exported = [n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
        assert exported or package in ("contract", "console", "integrations"), f"{package}: no __all__"


def test_each_threshold_the_readers_show_has_one_definition():
    """The straggler bar and its phases live in prometheus/thresholds.yaml; the rank side reads
    them from the module generated from it (deploy/generate.py --check keeps that in step)."""
    from prometheus.generate import load_thresholds
    from rankscope.contract import thresholds

    params = load_thresholds()["params"]
    assert thresholds.STRAGGLER_RATIO == params["straggler_ratio"]
    assert thresholds.STRAGGLER_PHASES == tuple(params["straggler_phases"].split("|"))
    generated = TRAINING / "contract" / "thresholds.py"
    phases = re.compile(r"""\(\s*["']forward["'],\s*["']backward["'],\s*["']optimizer["'],?\s*\)""")
    copies = [f"{p.relative_to(REPO)}: {what}" for p in [*TRAINING.rglob("*.py"), *EXPORTER.rglob("*.py")]
              if p != generated for what, hit in (("1.35", "1.35" in p.read_text()),
                                                  ("the compute phases", bool(phases.search(p.read_text()))))
              if hit]
    assert copies == []


def test_no_dead_code_of_the_last_review():
    from rankscope.collectives.tracker import CollectiveTracker
    from rankscope.contract import rundir
    from rankscope.exporter import catalog
    from rankscope.exporter.webconfig import WebConfig

    assert not hasattr(rundir, "now")
    assert "world_size" not in CollectiveTracker.__init__.__code__.co_varnames
    assert not hasattr(catalog, "COLLECTORS")
    assert "client_auth_type" not in WebConfig.__dataclass_fields__


def test_adapters_use_only_the_monitors_public_api():
    """rankscope.integrations drives a Monitor as a user's code would: no private attribute, no
    part of its inside (the step timer, accounting, publisher ...)."""
    inside = {"steps", "handoff", "accounting", "publisher", "tracker", "device", "comm", "trace_feed", "metrics",
              "process_groups"}
    found = []
    for path in (TRAINING / "integrations").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute)):
                owner = node.value.id if isinstance(node.value, ast.Name) else node.value.attr
                if owner == "monitor" and (node.attr.startswith("_") or node.attr in inside):
                    found.append(f"{path.name}:{node.lineno}: monitor.{node.attr}")
    assert found == []
