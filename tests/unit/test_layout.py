"""The code's layout, pinned: packages by role, no import circles, one definition of each
threshold, no dead code the last review found, adapters on public API only."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.helpers.jobs import REPO

TRAINING, EXPORTER = REPO / "training", REPO / "exporter"
PACKAGES = ("step", "device", "collectives", "publishing", "tracing", "contract", "console", "integrations", "pages",
            "sinks", "reference")
# The readers of the exporter's page: they take it, the run figures and the rank states from the
# read side (rankscope.pages) and the contract, never from the exporter.
READERS = ("console", "pages", "sinks")


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
                         "parts", "train"], top_level
    for package in PACKAGES:
        init = TRAINING / package / "__init__.py"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{package}/__init__.py says what the package is for"
        exported = [n for n in tree.body if isinstance(n, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
        assert exported or package in ("contract", "console", "integrations"), f"{package}: no __all__"


# How each generated value may be spelled again, beyond its own digits or names: the words of what
# it is compared with (a share of comm_wait > 0.5 is the comm-bound bar, whatever it is called).
SPELLED_NEAR = {"STRAGGLER_RATIO": ("straggler", "ratio", "peer"), "COMM_BOUND_RATIO": ("comm",),
                "INPUT_BOUND_RATIO": ("data", "input")}
# Values too common to be a copy on their own (0.5 is a median, a half second ...): only caught beside their words.
COMMON_VALUES = {0, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.75, 0.8, 0.9, 1, 1.5, 2}


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def copies_of(name: str, value, text: str, where: str, tree: ast.AST | None = None) -> list[str]:
    """Where the source ``text`` (parsed: ``tree``) spells the generated ``value`` again instead of reading ``name``."""
    tree = tree or ast.parse(text)
    found = []
    if isinstance(value, tuple):   # a list of names: as a collection, or written out in a string
        joined = re.compile(r"\W+(?:and\W+)?".join(map(re.escape, value)))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) == len(value) and {
                    e.value for e in node.elts if isinstance(e, ast.Constant)} == set(value):
                found.append(f"{where}:{node.lineno}: {name} as a collection")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and joined.search(node.value):
                found.append(f"{where}:{node.lineno}: {name} written out: {joined.search(node.value).group()!r}")
        return found
    if value not in COMMON_VALUES:   # its digits anywhere, comments included, and as a percentage
        for spelling in (repr(value), f"{value * 100:g}%"):
            found += [f"{where}:{n}: {name} as {spelling!r}" for n, line in enumerate(text.splitlines(), 1)
                      if spelling in line]
    for node in ast.walk(tree):   # compared beside its words
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literal = [o for o in operands if isinstance(o, ast.Constant) and not isinstance(o.value, bool)
                       and o.value == value]
            if not literal:
                continue
            words = " ".join(ast.get_source_segment(text, o) or "" for o in operands if o not in literal).lower()
            if any(w in words for w in SPELLED_NEAR[name]):
                found.append(f"{where}:{node.lineno}: {name} compared: {ast.get_source_segment(text, node)}")
    return found


def test_each_threshold_the_readers_show_has_one_definition():
    """The bars and the phase list the alert rules judge by live in prometheus/thresholds.yaml; the
    rank side and the exporter read them from the module generated from it (deploy/generate.py
    --check keeps that in step), never spell them again (a literal, a tuple, a regex alternation,
    a phrase in a message, a percentage), and each one generated has a reader."""
    from prometheus.generate import SHARED_PARAMS, load_thresholds
    from rankscope.contract import thresholds

    params = load_thresholds()["params"]
    generated = {name: getattr(thresholds, name) for name, _, _ in SHARED_PARAMS.values()}
    assert {n for n in vars(thresholds) if n.isupper()} == set(generated)
    for key, (name, convert, _) in SHARED_PARAMS.items():
        assert generated[name] == convert(params[key])
    assert thresholds.STRAGGLER_PHASES == tuple(params["straggler_phases"].split("|"))
    unspelled = {n for n, v in generated.items() if not isinstance(v, tuple)} - set(SPELLED_NEAR)
    assert not unspelled, f"say in SPELLED_NEAR what a copy of {unspelled} would be compared with"
    module = TRAINING / "contract" / "thresholds.py"
    sources = [p for p in [*TRAINING.rglob("*.py"), *EXPORTER.rglob("*.py")] if p != module]
    parsed = {p: (p.read_text(), ast.parse(p.read_text())) for p in sources}
    copies = [c for p, (text, tree) in parsed.items() for name, value in generated.items()
              for c in copies_of(name, value, text, str(p.relative_to(REPO)), tree)]
    assert copies == []
    readers: dict[str, list[str]] = {name: [] for name in generated}
    for p, (_, tree) in parsed.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "rankscope.contract.thresholds":
                for alias in node.names:
                    readers.get(alias.name, []).append(p.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "thresholds":
                readers.get(node.attr, []).append(p.name)
    assert [name for name, found in readers.items() if not found] == []


PROBE = '''
PHASES = ('optimizer', 'forward', 'backward')
EXPR = 'rate(x{phase=~"forward|backward|optimizer"}[2m])'
HELP = 'compute: forward, backward and optimizer'
def f(ratio, shares):
    """forward + backward + optimizer, in a docstring, is prose"""
    return ratio > 1.35 or shares["comm_wait"] >= 0.5 or shares.get("data", 0) > 0.3
NOTE = 'fires above 135%'
HALF = 0.5
'''


def test_the_threshold_scan_finds_every_spelling():
    found = [*copies_of("STRAGGLER_PHASES", ("forward", "backward", "optimizer"), PROBE, "probe"),
             *copies_of("STRAGGLER_RATIO", 1.35, PROBE, "probe"), *copies_of("COMM_BOUND_RATIO", 0.5, PROBE, "probe"),
             *copies_of("INPUT_BOUND_RATIO", 0.3, PROBE, "probe")]
    assert sorted(int(f.split(":")[1]) for f in found) == [2, 3, 4, 7, 7, 7, 7, 8], found


def test_the_readers_take_rank_states_from_the_contract_not_the_exporter():
    """rankscope top, report and the sinks read the exporter's page, never import the exporter; the
    rank states are defined once, in rankscope.contract.states."""
    from rankscope.contract import states
    from rankscope.exporter import catalog

    graph = import_graph()
    reading = {m: sorted(d for d in deps if d.startswith("rankscope.exporter")) for m, deps in graph.items()
               if any(m == f"rankscope.{r}" or m.startswith(f"rankscope.{r}.") for r in READERS)}
    assert len(reading) > 15 and {m: deps for m, deps in reading.items() if deps} == {}
    assert set(states.STALLED_STATES) <= set(states.LIVE_STATES) <= set(states.RANK_STATES)
    assert set(states.ENDED_STATES) <= set(states.RANK_STATES) - set(states.LIVE_STATES)
    assert (catalog.RANK_STATES, catalog.STALLED_STATES, catalog.LIVE_STATES) == \
        (states.RANK_STATES, states.STALLED_STATES, states.LIVE_STATES)   # the exporter's are the contract's
    copies = []
    for p in TRAINING.rglob("*.py"):   # the rank side; the exporter, which assigns them, groups them its own ways
        if p == TRAINING / "contract" / "states.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                if len(names & set(states.RANK_STATES)) >= 3:
                    copies.append(f"{p.relative_to(REPO)}:{node.lineno}")
    assert copies == []


def test_the_read_side_stays_small():
    """No module of the readers over 500 lines, no class over 200."""
    big = []
    for package in READERS:
        for p in (TRAINING / package).rglob("*.py"):
            text = p.read_text()
            if text.count("\n") > 500:
                big.append(f"{p.relative_to(REPO)}: {text.count(chr(10))} lines")
            big += [f"{p.relative_to(REPO)}: class {n.name}, {n.end_lineno - n.lineno + 1} lines"
                    for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno >= 200]
    assert big == []


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


def test_the_house_stays_small_and_typed():
    """No module of the rank side or the exporter over 500 lines, no class of the rank side over
    200, and ``Any`` on at most 5% of the parameters outside the framework adapters (whose
    frameworks' objects are typed by those frameworks)."""
    big_modules, big_classes, anys, params = [], [], 0, 0
    for base in (TRAINING, EXPORTER):
        for p in base.rglob("*.py"):
            text = p.read_text()
            if len(text.splitlines()) > 500:
                big_modules.append(str(p.relative_to(REPO)))
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ClassDef) and base == TRAINING and node.end_lineno - node.lineno >= 200:
                    big_classes.append(f"{p.relative_to(REPO)}:{node.name}")
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and "integrations" not in p.parts:
                    a = node.args
                    for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]:
                        if arg.arg in ("self", "cls"):
                            continue
                        params += 1
                        anys += arg.annotation is not None and "Any" in ast.unparse(arg.annotation)
    assert big_modules == [] and big_classes == []
    assert params > 1000 and anys <= 0.05 * params, f"Any on {anys} of {params} parameters"
