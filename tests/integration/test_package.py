"""Package boundaries: one import name, and an exporter that needs nothing of the rank side but the contract.

* The exporter (``rankscope.exporter``) imports from the rank side only
  ``rankscope.contract``, checked twice: statically (every import statement
  in exporter/*.py, function-level ones included) and for real (a fresh
  interpreter imports the CLI; neither torch nor another rank-side module
  gets loaded).
* The built wheel installs exactly one top-level name, ``rankscope``, with
  the exporter and the contract inside it and both console scripts.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.helpers.jobs import REPO

EXPORTER_DIR = REPO / "exporter"
ALLOWED = ("rankscope.exporter", "rankscope.contract")


def _allowed(module: str) -> bool:
    return module == "rankscope" or any(module == a or module.startswith(a + ".") for a in ALLOWED)


def _rankscope_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every rankscope module an exporter file imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 2:   # above rankscope: not a rankscope module at all, flag it
                found.append((node.lineno, "." * node.level + (node.module or "")))
                continue
            # A relative import resolves from rankscope.exporter (the exporter/ folder).
            base = ["rankscope", "exporter"][:3 - node.level] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # `from rankscope import config` imports rankscope.config: judge each name.
            names = [f"{module}.{alias.name}" for alias in node.names] if module == "rankscope" else [module]
            found += [(node.lineno, name) for name in names]
    return [(line, m) for line, m in found if m == "rankscope" or m.startswith(("rankscope.", "."))]


def test_exporter_sources_import_only_the_contract_from_the_rank_side():
    files = sorted(EXPORTER_DIR.glob("*.py"))
    assert len(files) >= 8, files   # the scan sees the real package
    offending = [f"{path.name}:{line}: {module}" for path in files
                 for line, module in _rankscope_imports(path) if not _allowed(module)]
    assert not offending, "exporter imports rank-side modules:\n" + "\n".join(offending)


def test_the_import_scan_sees_function_level_and_relative_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("from . import ranks\n"
                     "def f():\n    from rankscope import config, contract\n    from .. import monitor\n"
                     "    import rankscope.metrics\n")
    found = _rankscope_imports(probe)
    assert found == [(1, "rankscope.exporter"), (3, "rankscope.config"), (3, "rankscope.contract"),
                     (4, "rankscope.monitor"), (5, "rankscope.metrics")]
    assert [m for _, m in found if not _allowed(m)] == ["rankscope.config", "rankscope.monitor", "rankscope.metrics"]


def test_exporter_cli_loads_no_rank_side_module(tmp_path):
    """A fresh interpreter (-P: the cwd is not on sys.path) imports the CLI: no torch, and no
    rankscope module outside rankscope, rankscope.contract* and rankscope.exporter*."""
    code = ("import json, sys, rankscope.exporter.cli; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'rankscope')))))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert "rankscope.exporter.cli" in loaded and "rankscope.contract.environment" in loaded
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")]
    assert [m for m in loaded if not _allowed(m)] == []


def test_wheel_has_one_top_level_name(tmp_path):
    """Built from a clean copy of the sources (a stale build/ in the work tree could add files)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for folder in ("training", "exporter"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(wheels), str(src)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = wheels.glob("rankscope-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        dist_info = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        assert len(dist_info) == 1
        assert {n.split("/")[0] for n in names} - dist_info == {"rankscope"}
        assert "rankscope/exporter/cli.py" in names
        assert "rankscope/contract/catalog.py" in names, "rankscope.contract is not packaged (pyproject packages)"
        entry_points = z.read(f"{dist_info.pop()}/entry_points.txt").decode()
    scripts = _console_scripts(entry_points)
    assert scripts["rankscope-exporter"] == "rankscope.exporter.cli:main"
    assert scripts["rankscope-train"] == "rankscope.train:main"


def _console_scripts(entry_points: str) -> dict[str, str]:
    import configparser

    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    return dict(parser["console_scripts"])
