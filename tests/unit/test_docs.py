"""The docs a newcomer reads, checked against the code they describe.

Code blocks. Every fenced ```python block of README.md and docs/**.md is either
a whole program or a fragment:

* A **program** runs as it is (under torchrun where it needs a process group):
  here it must compile and use no name it does not define or import; the
  integration test tests/integration/test_docs_snippets.py runs each one for
  real (torchrun, 2 ranks, gloo).
* A **fragment** is marked by an HTML comment on the line just before its
  fence, invisible once rendered: ``<!-- fragment (uses: a, b) -->`` names what
  it takes from the reader's own program (a model, a Trainer); plain
  ``<!-- fragment -->`` takes nothing. It must compile, and use no name it does
  not define, import, or list there (the README's gradient-accumulation
  fragment once used ``contextlib`` unimported).

Names. Every metric (``rankscope_...``), recorded rule (``level:rankscope_...:ops``),
alert (``Rankscope...``), label value in a selector (``{state="dead"}``), rank
state, environment variable (``RANKSCOPE_...``), command-line flag of a
rankscope program, and ``Monitor(...)`` / ``FlopsConfig(...)`` keyword written
in the docs exists in the code. The sets of known names are built from the
code itself (the catalogs, ``prometheus.rules_spec.ALERTS``, the rule files,
the configuration dataclasses, the argparse parsers, the variables the
readers of the environment ask for), never listed here; the only list here is
of other programs' flags the docs mention alone (py-spy's, Slurm's, ...).

Settings. docs/configuration.md lists every field of the ranks' and the
exporter's configuration with its variable and default, read from the fields;
the FLOPs, tracing and console settings are in their own pages.

Also: the exporter mode each deployment gives its ranks (docs/deploying.md)
is the one its files set, and the evidence link the docs tell a person to
build (``/evidence/RUN/RANK``) answers over HTTP for a run id with a colon.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib.util
import json
import re
import shlex
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rankscope.config import EXPORTER_MODES, MonitorConfig
from rankscope.console import cli as console_cli
from rankscope.contract import catalog
from rankscope.contract.environment import PREFIX, default_node
from rankscope.contract.rundir import Registration, run_slug
from rankscope.exporter import catalog as exporter_catalog
from rankscope.exporter import cli as exporter_cli
from rankscope.exporter import evidence
from rankscope.exporter.config import ExporterConfig
from rankscope.flops import FlopsConfig
from rankscope.identity import RankIdentity
from rankscope.tracing.api import TracingConfig

from prometheus.rules_spec import ALERTS

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "frameworks").glob("*.md"))]
CONFIGURATION = REPO / "docs" / "configuration.md"

# Other programs' flags the docs name on their own (not after the program's name, where they are
# not checked at all): no code of this repository defines them.
FOREIGN_FLAGS = {
    "--pid": "py-spy", "--native": "py-spy", "--locals": "py-spy",
    "--signal": "Slurm's sbatch", "--allow-incomplete-ranks": "torch's fr_trace",
    "--decoder-first-pipeline-num-layers": "Megatron-LM", "--decoder-last-": "Megatron-LM",
    "--comm.trace_buf_size": "torchtitan", "--checkpoint.async_mode": "torchtitan",
    "--parallelism.pipeline_parallel_split_points": "torchtitan", "--web.config.file": "node_exporter",
    "--export": "Slurm's sbatch", "--gpu-bind": "Slurm's srun", "--server-side": "kubectl apply",
    "--prot": "the bad-configuration drill's deliberate typo (docs/reliability.md)",
    "--stpes": "the bad-configuration drill's deliberate typo (docs/reliability.md)",
}


def rel(path: Path) -> str:
    return str(path.relative_to(REPO))


@lru_cache(maxsize=None)
def text(path: Path) -> str:
    return path.read_text()


# -- code blocks ------------------------------------------------------------------------------
FENCE = re.compile(r"^```(\w*)\s*$")
FRAGMENT = re.compile(r"^<!-- fragment(?: \(uses: ([\w, ]*)\))? -->$")


@dataclasses.dataclass
class Block:
    path: Path
    line: int            # of the opening fence, 1-based
    lang: str
    code: str
    uses: frozenset[str] | None   # a fragment's names from outside; None: a whole program

    @property
    def where(self) -> str:
        return f"{rel(self.path)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    out, lines, i = [], text(path).splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        start, indent = i, len(lines[i]) - len(lines[i].lstrip())
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        marker = FRAGMENT.match(lines[start - 1].strip()) if start else None
        uses = None if marker is None else frozenset(n.strip() for n in (marker.group(1) or "").split(",") if n.strip())
        out.append(Block(path, start + 1, m.group(1), "\n".join(body) + "\n", uses))
        i += 1
    return out


PYTHON_BLOCKS = [b for path in DOCS for b in blocks(path) if b.lang == "python"]


def python_programs() -> list[Block]:
    """The whole programs among the docs' python blocks (tests/integration/test_docs_snippets.py runs them)."""
    return [b for b in PYTHON_BLOCKS if b.uses is None]


def free_names(code: str) -> set[str]:
    """Names the code reads but never binds (imports, assignments, defs, arguments, targets), builtins aside."""
    tree = ast.parse(code)
    bound, loaded = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins))


def test_the_readme_and_the_framework_pages_have_python_blocks():
    where = {rel(b.path) for b in PYTHON_BLOCKS}
    assert "README.md" in where and {f"docs/frameworks/{n}.md" for n in ("hf", "lightning", "torchtitan")} <= where
    assert python_programs(), "the README's quick-start is a whole program"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_every_python_block_compiles_and_uses_only_names_it_has(block):
    compile(block.code, block.where, "exec")
    missing = free_names(block.code) - (block.uses or set())
    kind = "program" if block.uses is None else "fragment"
    assert not missing, (f"{block.where}: this {kind} uses {sorted(missing)} without defining or importing "
                         "them" + ("" if block.uses is None else " (nor naming them in its <!-- fragment (uses: ...) -->)"))
    unused = (block.uses or set()) - {n.id for n in ast.walk(ast.parse(block.code)) if isinstance(n, ast.Name)}
    assert not unused, f"{block.where}: the fragment's marker names {sorted(unused)}, which it does not use"


def test_a_fragment_marker_is_only_ever_right_before_a_python_fence():
    for path in DOCS:
        lines = text(path).splitlines()
        for i, line in enumerate(lines):
            if "<!-- fragment" in line:
                assert FRAGMENT.match(line.strip()), f"{rel(path)}:{i + 1}: malformed marker {line!r}"
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", \
                    f"{rel(path)}:{i + 1}: a fragment marker must be the line right before a ```python fence"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=lambda b: b.where)
def test_values_are_observed_as_they_are(block):
    """The README's advice: no .detach() (a tensor op on the hot path), no .item() (a device sync)."""
    for node in ast.walk(ast.parse(block.code)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "observe":
            calls = [n.func.attr for arg in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(arg)
                     if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
            assert not {"detach", "item"} & set(calls), f"{block.where}: observe() given {calls}"


# -- known names, from the code ---------------------------------------------------------------
METRICS = {m.name for m in catalog.RANK_METRICS + exporter_catalog.EXPORTER_METRICS}
LABELS = {label for m in catalog.RANK_METRICS + exporter_catalog.EXPORTER_METRICS for label in m.label_names}
SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def rule_files() -> list[dict]:
    return [yaml.safe_load(p.read_text()) for p in sorted((REPO / "prometheus" / "rules").glob("*.yml"))]


RECORDS = {r["record"] for doc in rule_files() for g in doc["groups"] for r in g["rules"] if "record" in r}
ALERT_NAMES = {a.alert for a in ALERTS}


def python_files(*folders: str) -> list[Path]:
    return [p for folder in folders for p in sorted((REPO / folder).rglob("*.py"))]


@lru_cache(maxsize=None)
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@lru_cache(maxsize=None)
def class_names(prefix: str) -> set[str]:
    return {n.name for p in python_files("training", "exporter") for n in ast.walk(tree(p))
            if isinstance(n, ast.ClassDef) and n.name.startswith(prefix)}


@lru_cache(maxsize=None)
def string_constants(*folders: str) -> set[str]:
    return {n.value for p in python_files(*folders) for n in ast.walk(tree(p))
            if isinstance(n, ast.Constant) and isinstance(n.value, str)}


class Recording(dict):
    """An environment that records every variable a reader asks for."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.asked: set[str] = set()

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def dataclass_variables(cls) -> dict[str, tuple[str, ...]]:
    """field -> the variables ``rankscope.contract.environment.from_env`` reads it from."""
    return {f.name: f.metadata.get("env", (PREFIX + f.name.upper(),)) for f in dataclasses.fields(cls)}


@lru_cache(maxsize=None)
def variables_read() -> set[str]:
    """Every RANKSCOPE_* variable rankscope's code reads: asked of a recording environment by each reader."""
    env = Recording({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    for cls in (MonitorConfig, ExporterConfig, FlopsConfig):
        cls.from_env(env)
    TracingConfig.from_env(env)
    RankIdentity.from_env(None, env)
    default_node(env)
    # the exporter a rank starts (rankscope.launch) and the per-field readers the dataclasses name
    asked = set(env.asked) | {v for cls in (MonitorConfig, ExporterConfig, FlopsConfig)
                              for vs in dataclass_variables(cls).values() for v in vs}
    launch = (REPO / "training" / "launch.py").read_text()
    asked |= set(re.findall(r'"(RANKSCOPE_[A-Z0-9_]+)"', launch))
    return {v for v in asked if v.startswith(PREFIX)}


def script_variables() -> dict[str, str]:
    """RANKSCOPE_* variables the deployment scripts read (``${RANKSCOPE_X:-default}``) -> the script."""
    out = {}
    for path in sorted((REPO / "deploy").rglob("*")):
        if path.suffix in (".sh", ".sbatch"):
            for var in re.findall(r"\$\{(RANKSCOPE_[A-Z0-9_]+):-", path.read_text()):
                out.setdefault(var, rel(path))
    return out


def suite_knobs() -> set[str]:
    """Variables the test suite itself reads (os.environ.get("RANKSCOPE_...")), e.g. to rewrite a doc's figure."""
    return {m for p in python_files("tests") for m in re.findall(r'environ\.get\(\s*"(RANKSCOPE_[A-Z0-9_]+)"',
                                                                     p.read_text())}


@lru_cache(maxsize=None)
def known_variables() -> set[str]:
    return variables_read() | set(script_variables()) | suite_knobs()


# -- metric names, rules, alerts -----------------------------------------------------------------
def doc_ids():
    return [rel(p) for p in DOCS]


RECORD_NAME = re.compile(r"\b[a-z_]+:rankscope_[a-z0-9_]+:[a-z0-9_]+\b")
METRIC_NAME = re.compile(r"(?<![\w:./-])rankscope_[a-z0-9_]*[a-z0-9_](?![\w:])(\*?)")


def metric_problems(doc: str) -> list[str]:
    problems = []
    user_names = string_constants("training")
    for m in RECORD_NAME.finditer(doc):
        if m.group(0) not in RECORDS:
            problems.append(f"recorded rule {m.group(0)} is in no prometheus/rules/*.yml")
    for m in METRIC_NAME.finditer(RECORD_NAME.sub(" ", doc)):
        name, star = m.group(0).rstrip("*"), m.group(1)
        if star or name.endswith("_"):                                    # a family: rankscope_collective_*
            if not any(k.startswith(name) for k in METRICS | {catalog.USER_PREFIX}):
                problems.append(f"no metric begins with {name}")
            continue
        base = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
        if name in METRICS or base in METRICS or name in LABELS:
            continue
        if name.startswith(catalog.USER_PREFIX) and (name.removeprefix(catalog.USER_PREFIX) in user_names or
                                                     base.removeprefix(catalog.USER_PREFIX) in user_names):
            continue   # a user metric rankscope's own adapters declare (rankscope.integrations)
        problems.append(f"metric {name} is in neither catalog")
    return sorted(set(problems))


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_metric_and_recorded_rule_named_exists(path):
    assert not metric_problems(text(path)), metric_problems(text(path))


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_alert_named_exists(path):
    known = ALERT_NAMES | class_names("Rankscope")   # RankscopeCallback is a class, not an alert
    unknown = sorted(set(re.findall(r"\bRankscope[A-Z][A-Za-z0-9]*\b", text(path))) - known)
    assert not unknown, f"{rel(path)} names alerts no rule defines: {unknown}"


# -- label values ----------------------------------------------------------------------------
def label_values() -> dict[tuple[str | None, str], set[str]]:
    """(metric or None for any, label) -> the values the code can give it."""
    generic = {
        "phase": set(catalog.PHASES) | set(catalog.STARTUP_PHASES),
        "state": set(exporter_catalog.RANK_STATES),
        "what": set(catalog.NONFINITE_WHAT) | set(catalog.DROP_REASONS),
        "component": set(catalog.ERROR_COMPONENTS),
        "op": set(catalog.PROCESS_GROUP_OPS),
        "category": set(catalog.GOODPUT_CATEGORIES),
        "block": set(catalog.BLOCKS),
        "reason": set(exporter_catalog.THROTTLE_REASONS),
        "trigger": set(evidence.TRIGGERS),
        "severity": {a.severity for a in ALERTS},
        "alertname": ALERT_NAMES,
    }
    out = {(None, k): v for k, v in generic.items()}
    out.update({("rankscope_phase_seconds_total", "phase"): set(catalog.PHASES),
                ("rankscope_startup_phase", "phase"): set(catalog.STARTUP_PHASES),
                ("rankscope_nonfinite_total", "what"): set(catalog.NONFINITE_WHAT),
                ("rankscope_telemetry_dropped_total", "what"): set(catalog.DROP_REASONS),
                ("rankscope_collective_duration_seconds", "op"): set(catalog.COLLECTIVE_OPS)})
    return out


SELECTOR = re.compile(r"([A-Za-z_:][\w:]*)?\{([^{}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(=~|!~|!=|=)\s*\"([^\"]*)\"")
# Prose that names a value: "the rank `dead`", "goodput's `idle`", "state `frozen`".
PROSE = {
    "state": re.compile(r"(?<![\w-])(?:ranks?|ranks? reads?|rank state|state|states)\s+`([a-z_]+)`"),
    "category": re.compile(r"\bgoodput(?:'s)?\s+`([a-z_]+)`"),
}


def label_problems(doc: str) -> list[str]:
    known, problems = label_values(), []
    for sel in SELECTOR.finditer(doc):
        metric = sel.group(1) or None
        for label, op, value in MATCHER.findall(sel.group(2)):
            allowed = known.get((metric, label)) or known.get((None, label))
            if allowed is None or "$" in value or "{{" in value or "%" in value:
                continue
            values = value.split("|") if op in ("=~", "!~") else [value]
            for v in values:
                if re.fullmatch(r"\w+", v) and v not in allowed:
                    problems.append(f"{metric or ''}{{{label}{op}\"{value}\"}}: {v!r} is not one of {sorted(allowed)}")
    for label, pattern in PROSE.items():
        for v in pattern.findall(doc):
            if v not in known[(None, label)]:
                problems.append(f"{label} `{v}` is not one of {sorted(known[(None, label)])}")
    return sorted(set(problems))


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_label_value_and_rank_state_written_exists(path):
    problems = label_problems(text(path))
    assert not problems, f"{rel(path)}: {problems}"


def test_the_label_checks_catch_what_the_docs_once_said():
    assert label_problems('`rankscope_rank_state{state="failed"}`') and label_problems("the rank `failed` with")
    assert label_problems("rank `failed` with") and not label_problems("two 2-rank `torchrun` jobs")
    assert label_problems("goodput `failed_step`") and label_problems('`{phase="comm"}`')
    assert not label_problems('`rankscope_rank_state{state="dead"}`, `{phase=~"forward|backward"}`, goodput `idle`')
    assert metric_problems("`rankscope_loss_spike_total`") and metric_problems("`rank:rankscope_loss:nope`")
    assert not metric_problems("`rankscope_steps_total`, `rankscope_step_duration_seconds_bucket`, "
                               "`rankscope_collective_*`, `run:rankscope_goodput:ratio`")


# -- environment variables ----------------------------------------------------------------------
@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_variable_named_is_read_by_the_code(path):
    known = known_variables()
    problems = []
    for m in re.finditer(r"\bRANKSCOPE_[A-Z0-9_]+", text(path)):
        name = m.group(0)
        if name.endswith("_"):   # a family, RANKSCOPE_FLOPS_*
            if not any(k.startswith(name) for k in known):
                problems.append(name)
        elif name not in known:
            problems.append(name)
    assert not problems, f"{rel(path)} names variables no code reads: {sorted(set(problems))}"


# -- command-line flags -------------------------------------------------------------------------
def parser_flags(parser) -> set[str]:
    out = set()
    for action in parser._actions:
        out |= {o for o in action.option_strings if o.startswith("--")}
        if isinstance(action.choices, dict):   # sub-commands
            for sub in action.choices.values():
                out |= parser_flags(sub)
    return out


@lru_cache(maxsize=None)
def ast_flags(path: Path) -> frozenset[str]:
    """Flags a Python script's argparse calls define (add_argument("--x", ...)), read from its source."""
    calls = [n for n in ast.walk(tree(path))
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add_argument"]
    return frozenset({"--help"}) | {a.value for call in calls for a in call.args
                                    if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")}


def shell_flags(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r"[\"(|\s](--[a-z][a-z0-9-]*)[\")|]", path.read_text()))


@lru_cache(maxsize=None)
def torchrun_flags() -> frozenset[str]:
    """torchrun's own flags, from torch/distributed/run.py's source (without importing torch)."""
    spec = importlib.util.find_spec("torch")
    return ast_flags(Path(spec.submodule_search_locations[0]) / "distributed" / "run.py")


@lru_cache(maxsize=None)
def console_flags(command: str) -> frozenset[str]:
    sub = next(a for a in console_cli.build_parser()._actions if hasattr(a, "choices") and a.choices
               and command in a.choices)
    return frozenset(parser_flags(sub.choices[command]))


def program_of(word: str, following: str | None) -> tuple[str, set[str] | None] | None:
    """Which rankscope program a command word starts, and its flags (None: not checked, e.g. torchtitan's)."""
    name = Path(word).name
    if word in ("rankscope-exporter",) or (word == "-m" and following == "rankscope.exporter"):
        return "rankscope-exporter", parser_flags(exporter_cli.build_parser())
    if word == "-m" and following == "rankscope.exporter.sizing":
        return following, ast_flags(REPO / "exporter" / "sizing.py")
    if word == "rankscope" and following in ("top", "report"):
        return f"rankscope {following}", console_flags(following)
    if (word == "-m" and following == "rankscope.train") or word == "rankscope-train":
        return "rankscope.train", ast_flags(REPO / "training" / "train.py")
    if word == "-m" and following == "rankscope.integrations.torchtitan":
        return following, None   # torchtitan's own flags follow
    if word == "-m" and following and following.startswith(("tests.", "prometheus.")):
        path = REPO / (following.replace(".", "/") + ".py")
        return (following, ast_flags(path)) if path.exists() else None
    if name == "torchrun":
        return "torchrun", torchrun_flags()
    if name.endswith(".py"):
        for path in (REPO / word, REPO / "tests" / "benchmarks" / name, REPO / "tests" / "loops" / name):
            if path.is_file():
                return rel(path), ast_flags(path)
        return None
    if name == "demo.sh":
        return "deploy/local/demo.sh", ast_flags(REPO / "training" / "train.py") | shell_flags(REPO / "deploy" / "local" / "demo.sh")
    if name == "run.sh" and "tests" in word:
        return "tests/run.sh", shell_flags(REPO / "tests" / "run.sh")
    return None


def commands(doc: str) -> list[str]:
    """Shell lines of the doc's code blocks (continuations joined) and its inline code spans."""
    out = []
    in_block = False
    joined = ""
    for line in doc.splitlines():
        if line.strip().startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            joined += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                out.append(joined)
                joined = ""
    prose = re.sub(r"```.*?```", "", doc, flags=re.S)
    out += re.findall(r"`([^`\n]+)`", prose)
    return out


@lru_cache(maxsize=None)
def every_flag() -> frozenset[str]:
    """Every flag any program of this repository defines (its Python scripts' argparse, its shell scripts), and torchrun's."""
    return frozenset(set().union(
        *(ast_flags(p) for p in python_files("training", "exporter", "tests", "deploy", "prometheus")),
        *(shell_flags(p) for p in (REPO / "deploy").rglob("*.sh")), shell_flags(REPO / "tests" / "run.sh"),
        torchrun_flags()))


def flag_problems(doc: str) -> list[str]:
    every = every_flag()
    problems = []
    for line in commands(doc):
        try:
            words = shlex.split(line.split(" # ")[0], comments=False)
        except ValueError:
            words = line.split()
        program: tuple[str, set[str] | None] | None = None
        for i, word in enumerate(words):
            following = words[i + 1] if i + 1 < len(words) else None
            if word in ("|", "&&", ";", "||") or word.startswith("#"):
                program = None
                continue
            found = program_of(word, following)
            if found is not None:
                program = found
                continue
            flag = re.match(r"--[a-z][\w.-]*", word)
            if not flag or "=" in word.split(flag.group(0))[0]:
                continue
            flag_name = flag.group(0).rstrip(".")
            if program is not None:
                if program[1] is not None and flag_name not in program[1]:
                    problems.append(f"{program[0]} has no {flag_name} (in `{line.strip()[:90]}`)")
            elif i == 0 and flag_name not in every and flag_name not in FOREIGN_FLAGS:
                problems.append(f"no program here has {flag_name} (in `{line.strip()[:90]}`)")
            if program is None:
                break   # a flag alone, or another program's: only the span's first word is checked
    return sorted(set(problems))


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_flag_written_exists(path):
    problems = flag_problems(text(path))
    assert not problems, f"{rel(path)}: {problems}"


def test_the_flag_check_catches_a_wrong_flag():
    assert flag_problems("`rankscope-exporter --stuck-after-s 30`")
    assert flag_problems("```bash\nrankscope top --refresh 2\n```")
    assert flag_problems("`torchrun --nproc-per-node 2 -m rankscope.train --step 5`")
    assert flag_problems("`--no-such-flag`")
    assert not flag_problems("`rankscope-exporter --stuck-after 30`, `--rank-histograms sum-count`, "
                             "`torchrun --nproc-per-node 2 -m rankscope.train --steps 5`")


# -- keyword arguments ----------------------------------------------------------------------------
def monitor_keywords() -> set[str]:
    init = next(n for n in ast.walk(tree(REPO / "training" / "monitor.py"))
                if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    params = {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}
    return params | {f.name for f in dataclasses.fields(MonitorConfig)}


def keyword_problems(doc: str) -> list[str]:
    known = {"Monitor": monitor_keywords(), "MonitorConfig": {f.name for f in dataclasses.fields(MonitorConfig)},
             "FlopsConfig": {f.name for f in dataclasses.fields(FlopsConfig)}}
    problems = []
    for call in re.finditer(r"\b(Monitor|MonitorConfig|FlopsConfig)\(", doc):
        depth, i = 1, call.end()
        while i < len(doc) and depth:
            depth += {"(": 1, ")": -1}.get(doc[i], 0)
            i += 1
        arguments = re.sub(r"\"[^\"]*\"|'[^']*'", '""', doc[call.end():i - 1])   # strings aside
        while re.search(r"\([^()]*\)", arguments):   # and nested calls: FlopsConfig(...) inside Monitor(...)
            arguments = re.sub(r"\([^()]*\)", "", arguments)
        for kw in re.findall(r"(?<![=\w.])(\w+)\s*=(?!=)", arguments):
            if kw not in known[call.group(1)]:
                problems.append(f"{call.group(1)}({kw}=...)")
    return sorted(set(problems))


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_monitor_keyword_written_exists(path):
    problems = keyword_problems(text(path))
    assert not problems, f"{rel(path)}: no such keyword: {problems}"


def test_the_keyword_check_catches_a_wrong_keyword():
    assert keyword_problems("`Monitor(metrics_prot=9400)`") and keyword_problems("`FlopsConfig(params=1)`")
    assert not keyword_problems("`Monitor(device=device, flops=rankscope.FlopsConfig(model_params=N))`")


# -- every setting documented, with its default ---------------------------------------------------
def table_rows(doc: str, heading: str) -> list[list[str]]:
    """The rows of the first table after ``heading``: cells, ``\\|`` unescaped."""
    section = doc[doc.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        if line.startswith("|") and not line.startswith("| ---"):
            cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append(cells)
        elif rows and not line.startswith("|"):
            break
    return rows[1:]   # the header row aside


def code(cell: str) -> str | None:
    m = re.fullmatch(r"`([^`]*)`", cell)
    return m.group(1) if m else None


def default_text(f: dataclasses.Field) -> str | None:
    """The default as the docs write it, or None where it is computed (a directory, the hostname)."""
    if f.default is dataclasses.MISSING:
        return None
    if f.default is None:
        return "–"
    return f"{f.default:g}" if isinstance(f.default, float) else str(f.default)


def test_every_option_of_the_ranks_is_in_the_configuration_page_with_its_variable_and_default():
    rows = {code(r[0]): r for r in table_rows(text(CONFIGURATION), "## The ranks")}
    variables = dataclass_variables(MonitorConfig)
    for f in dataclasses.fields(MonitorConfig):
        assert f.name in rows, f"docs/configuration.md lacks Monitor option {f.name}"
        _, variable, default, _ = rows[f.name]
        assert code(variable) == variables[f.name][0], f"{f.name}: its variable is {variables[f.name][0]}"
        expected = default_text(f)
        if expected is not None:
            assert (code(default) or default) == expected, f"{f.name}: default {default}, the code's is {expected}"
    assert set(rows) == {f.name for f in dataclasses.fields(MonitorConfig)}, "a row names no option"
    keywords = {code(r[0]) for r in table_rows(text(CONFIGURATION), "besides those options")}
    assert keywords == monitor_keywords() - {f.name for f in dataclasses.fields(MonitorConfig)} | {"layout"}


def test_every_flag_of_the_exporter_is_in_the_configuration_page_with_its_variable_and_default():
    rows = {code(r[0]): r for r in table_rows(text(CONFIGURATION), "## The node exporter")}
    for f in dataclasses.fields(ExporterConfig):
        flag = f.metadata["option"]
        assert flag in rows, f"docs/configuration.md lacks the exporter's {flag}"
        _, variable, default, _ = rows[flag]
        env = f.metadata["env"]
        assert (code(variable) or variable) == (env[0] if env else "–"), f"{flag}: its variable is {env or 'none'}"
        expected = default_text(f)
        if expected is not None and not isinstance(f.default, bool):
            assert (code(default) or default) == expected, f"{flag}: default {default}, the code's is {expected}"
    assert set(rows) == parser_flags(exporter_cli.build_parser()) - {"--help"}, "the exporter's flags and the table differ"


def test_the_flops_tracing_and_console_settings_are_on_their_pages():
    goodput = text(REPO / "docs" / "goodput.md")
    for name, variables in dataclass_variables(FlopsConfig).items():
        assert f"`{variables[0]}` | `{name}`" in goodput, f"docs/goodput.md lacks {variables[0]} ({name})"
    env = Recording({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"})
    TracingConfig.from_env(env)
    tracing = text(REPO / "docs" / "tracing.md")
    assert {v for v in env.asked if v.startswith(PREFIX)} and all(
        f"`{v}`" in tracing for v in env.asked if v.startswith(PREFIX)), "docs/tracing.md lacks a variable"
    console = text(REPO / "docs" / "console.md")
    for command in ("top", "report"):
        for flag in console_flags(command) - {"--help"}:
            assert flag in console, f"docs/console.md lacks rankscope {command} {flag}"


# -- deployments ---------------------------------------------------------------------------------
DEPLOY_FILES = {"docker compose": "deploy/docker-compose.yml", "Kubernetes sidecar": "deploy/kubernetes/sidecar/pytorchjob.yaml",
                "Kubernetes DaemonSet": "deploy/kubernetes/daemonset/pytorchjob.yaml", "Slurm": "deploy/slurm/train.sbatch",
                "systemd": "deploy/systemd/rankscope-exporter.service"}


def test_each_deployment_gives_its_ranks_the_exporter_mode_the_docs_say():
    rows = table_rows(text(REPO / "docs" / "deploying.md"), "never start a private exporter")
    said = {mode.strip(): code(value) for r in rows for mode, value in [(m, r[1]) for m in r[0].split(",")]}
    assert set(said) == set(DEPLOY_FILES), said
    for mode, path in DEPLOY_FILES.items():
        assert said[mode] in EXPORTER_MODES
        found = set(re.findall(r"RANKSCOPE_EXPORTER[\s:=\"]*(?:value:\s*)?\"?(\w+)", (REPO / path).read_text()))
        assert found == {said[mode]}, f"{path} sets RANKSCOPE_EXPORTER to {found}; docs/deploying.md says {said[mode]}"


# -- the evidence link, over HTTP ------------------------------------------------------------------
def test_a_hand_built_evidence_link_answers_for_a_run_id_with_a_colon(tmp_path, monkeypatch):
    """README and docs/runbook.md: `http://NODE:PORT/evidence/RUN/RANK`. The run id without RANKSCOPE_RUN
    or a scheduler is MASTER_ADDR:MASTER_PORT, whose run directory is not the id itself: the link
    answers with the id raw or URL-quoted, with the directory's name, and the captures' own links
    are URL-quoted. A real exporter server on a free port, a real capture of a rank that raised."""
    from prometheus_client import CollectorRegistry

    from rankscope.exporter.server import make_app, serve
    from tests.helpers.jobs import free_port

    monkeypatch.setattr(evidence, "CPU_SAMPLE_S", 0.02)
    run = "10.0.0.1:29500"
    run_dir = tmp_path / run_slug(run)
    run_dir.mkdir()
    reg = Registration(run=run, rank=1, local_rank=1, node="n", world_size=2, local_world_size=2, pid=1,
                       pid_start_ticks=1, agent_pid=1, agent_start_ticks=None, started_at=time.time(),
                       failed_at=time.time(), exception="ValueError", failure="Traceback ...\nValueError: bad batch\n")
    cfg = ExporterConfig(directory=tmp_path, port=free_port(), nvml=False, network=False)
    keeper = evidence.EvidenceKeeper(cfg)
    server = serve(cfg, make_app(cfg, CollectorRegistry(auto_describe=False), None, None, keeper))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        keeper.observe(run_dir, [SimpleNamespace(reg=reg, state="dead", suspect=False, in_flight={})], {}, time.time())
        deadline = time.monotonic() + 10
        while not keeper.captures() and time.monotonic() < deadline:
            time.sleep(0.02)
        (capture,) = keeper.captures()
        assert capture["path"] == f"/evidence/{urllib.parse.quote(run_dir.name, safe='')}/1"
        base = f"http://127.0.0.1:{cfg.port}"
        for path in (f"/evidence/{urllib.parse.quote(run, safe='')}/1", f"/evidence/{run}/1",
                     f"/evidence/{run_dir.name}/1", capture["path"]):
            with urllib.request.urlopen(base + path + "?format=json", timeout=10) as resp:
                doc = json.loads(resp.read())
            assert doc["run"] == run and doc["rank"] == 1 and doc["failure"]["exception"] == "ValueError", path
            with urllib.request.urlopen(base + path, timeout=10) as resp:
                assert "ValueError" in resp.read().decode(), path
        for path in (f"/evidence/{urllib.parse.quote('10.0.0.2:29500', safe='')}/1", f"/evidence/{run}/0",
                     "/evidence/..%2F..%2Fetc/1"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path, timeout=10)
            assert e.value.code == 404, path
        # The WSGI application alone, as another server would call it: PATH_INFO already decoded.
        app = make_app(cfg, CollectorRegistry(auto_describe=False), None, None, keeper)
        status = []
        body = b"".join(app({"PATH_INFO": f"/evidence/{run}/1", "QUERY_STRING": "format=json"},
                            lambda s, h, *a: status.append(s)))
        assert status == ["200 OK"] and json.loads(body)["run"] == run
    finally:
        server.shutdown()
        server.server_close()
        keeper.stop()


# -- links and figures ------------------------------------------------------------------------------
def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors of a page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    out, seen = set(), {}
    for m in re.finditer(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", text(path), flags=re.S), re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen[slug] = seen.get(slug, -1) + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("path", DOCS, ids=doc_ids())
def test_every_relative_link_and_anchor_resolves(path):
    problems = []
    for m in re.finditer(r"\]\(([^)\s]+)\)", re.sub(r"```.*?```", "", text(path), flags=re.S)):
        link = m.group(1)
        if re.match(r"\w+://|mailto:", link):
            continue
        target_path, _, anchor = link.partition("#")
        target = (path.parent / target_path).resolve() if target_path else path
        if not target.exists():
            problems.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in heading_anchors(target):
            problems.append(f"{link}: no such heading")
    assert not problems, f"{rel(path)}: {problems}"


def test_every_figure_of_the_readmes_performance_table_names_its_script_and_date():
    rows = table_rows(text(REPO / "README.md"), "## Performance")
    assert len(rows) >= 5
    for what, command, result, _ in rows:
        scripts = re.findall(r"tests/[\w/]+\.py", command)
        assert scripts and all((REPO / s).is_file() for s in scripts), f"{what[:40]}: no script in {command}"
        assert re.search(r"\(20\d\d-\d\d-\d\d\)", result), f"{what[:40]}: its result names no date"


def test_every_variable_the_code_reads_is_documented():
    everything = "".join(text(p) for p in DOCS)
    missing = sorted(v for v in variables_read() | set(script_variables()) if f"`{v}" not in everything)
    assert not missing, f"read by the code, documented nowhere: {missing}"
