"""Regenerate every generated file in the repository, or check that none is stale.

    .venv/bin/python deploy/generate.py           # rewrite what differs (prints each file written)
    .venv/bin/python deploy/generate.py --check   # write nothing; exit 1 listing the stale files

The generators, in dependency order; each keeps its render logic and exposes
``outputs() -> dict[Path, str]`` (path -> full text of each file it owns):

1. prometheus/generate.py         prometheus/rules/{recording,alerts}.yml
2. grafana/generate.py            grafana/dashboards/<uid>.json
3. deploy/kubernetes/generate.py  deploy/kubernetes/generated/*.yaml, copies of 1 and 2
                                  (computed from their rendered text, not the files on disk,
                                  so one run is enough and --check does not depend on order)
4. rankscope.exporter.catalog     the metric catalog between README.md's catalog markers
5. rankscope.flops                the peak-FLOPS table between docs/goodput.md's peak-flops markers
6. prometheus/generate.py         training/contract/thresholds.py (the bars other readers show)

A file is stale when it differs from its rendering, is missing, or sits in a
folder that holds only generated files (GENERATED_ONLY) but no generator makes
it any more; a plain run deletes such leftovers.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: make prometheus/ and grafana/ importable
    sys.path.insert(0, str(REPO))

COMMAND = ".venv/bin/python deploy/generate.py"
README = REPO / "README.md"

# (folder, pattern): every matching file there must come from a generator.
GENERATED_ONLY: tuple[tuple[Path, str], ...] = (
    (REPO / "prometheus" / "rules", "*.yml"),
    (REPO / "grafana" / "dashboards", "*.json"),
    (REPO / "deploy" / "kubernetes" / "generated", "*.yaml"),
)


def _kubernetes():
    """deploy/kubernetes/generate.py (a file in a folder that is not a package: loaded by path)."""
    name = "rankscope_kubernetes_generate"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / "kubernetes" / "generate.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def readme_outputs() -> dict[Path, str]:
    """README.md with its metric catalog spliced in from the two catalogs."""
    from rankscope.exporter import catalog

    return {README: catalog.splice(README.read_text())}


def goodput_outputs() -> dict[Path, str]:
    """docs/goodput.md with the peak-FLOPS table spliced in from rankscope.flops.PEAK_FLOPS."""
    from rankscope import flops

    path = REPO / "docs" / "goodput.md"
    head, rest = path.read_text().split("<!-- peak-flops:start -->\n", 1)
    _, tail = rest.split("\n<!-- peak-flops:end -->", 1)
    return {path: f"{head}<!-- peak-flops:start -->\n{flops.peak_table_markdown()}\n<!-- peak-flops:end -->{tail}"}


def render_all() -> dict[Path, str]:
    """Path -> text of every generated file, rendered in dependency order."""
    from grafana import generate as grafana_generate
    from prometheus import generate as prometheus_generate

    out: dict[Path, str] = {}
    out.update(prometheus_generate.outputs())
    out.update(grafana_generate.outputs())
    out.update(_kubernetes().outputs(upstream=dict(out)))
    out.update(readme_outputs())
    out.update(goodput_outputs())
    out[REPO / "training" / "contract" / "thresholds.py"] = prometheus_generate.shared_thresholds_module()
    return out


def leftovers(rendered: Iterable[Path]) -> list[Path]:
    """Files in the GENERATED_ONLY folders that no generator makes."""
    made = set(rendered)
    return sorted(p for folder, pattern in GENERATED_ONLY for p in folder.glob(pattern) if p not in made)


def stale(rendered: dict[Path, str]) -> list[Path]:
    """Files that differ from ``rendered``, are missing, or are leftovers."""
    differ = [p for p, text in rendered.items() if not p.is_file() or p.read_text() != text]
    return sorted(set(differ) | set(leftovers(rendered)))


def show(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 and list the stale files")
    args = p.parse_args(argv)
    rendered = render_all()
    if args.check:
        out_of_date = stale(rendered)
        if out_of_date:
            print(f"{len(out_of_date)} generated file(s) out of date:", file=sys.stderr)
            for path in out_of_date:
                print(f"  {show(path)}", file=sys.stderr)
            print(f"regenerate them with: {COMMAND}", file=sys.stderr)
            return 1
        print(f"all {len(rendered)} generated files are up to date")
        return 0
    changed = 0
    for path in leftovers(rendered):
        path.unlink()
        print(f"removed {show(path)} (no generator makes it)")
        changed += 1
    for path, text in rendered.items():
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {show(path)}")
            changed += 1
    if not changed:
        print(f"all {len(rendered)} generated files were up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
