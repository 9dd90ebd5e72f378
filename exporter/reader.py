"""An incremental reader of prometheus_client's multiprocess files, merged as
prometheus_client merges them.

``MultiProcessCollector.merge`` re-reads every ``*.db`` file of a run on every
scrape, decodes every entry's key with ``json.loads`` and rebuilds every
sample; rendering then escapes every label of every sample again. Here:

* **A key is parsed once** (``rankscope.exporter.db_file``). An entry of a file is its key
  (JSON: metric name, sample name, labels, help) followed by a value and a timestamp; the key
  bytes never change once written, only the 16 value bytes do
  (``rankscope.contract.mmap_layout``). Each file's parsed keys are kept between
  scrapes, with one ``struct.Struct`` that unpacks every value of the file
  (and the key bytes, to check them) in one call.
* **Change is detected by content.** The files are written in place through
  ``mmap``, so a file's identity (device, inode) and its used-bytes header say
  whether it is the same file, grown or replaced; its bytes up to ``used`` say
  whether anything changed. An unchanged file is not unpacked; a grown file is
  parsed from its old end only; a file whose key bytes differ (replaced, or a
  recycled name) is parsed again from the start.
* **The merge is planned once per layout.** Which entry adds into which
  merged series, in which order, is worked out by replaying
  ``MultiProcessCollector._accumulate_metrics`` on the keys alone, and kept
  until a file is added, removed, grown or replaced. A scrape then only adds
  numbers into slots, in the same order prometheus_client adds them (so
  float sums are bit-for-bit the same), and renders them.
* **A step's values are read together.** The rank writes a step's number,
  loss, gradient norm and learning rate in place, one after the other, between
  two fence gauges (``rankscope.contract.catalog.VALUES_FENCE_*``): the begin
  fence first, the end fence last. A read takes the end fence on its own, then
  the file, then the begin fence: if the two differ, a step's values were being
  written during the copy, and the file is read again (a seqlock across
  processes). The fences are never exported. The three reads are separate
  system calls, ordered on x86-64 (whose fast string copy may reorder loads
  within one copy, so fences inside the copy would not do); on a weakly ordered
  CPU (ARM) a tear, far rarer, is still possible.
* **Text is rendered from cached prefixes.** Each series' text up to its
  value (name and escaped labels) is rendered once, by prometheus_client's own
  exposition code, per output format (``rankscope.exporter.exposition``).

The merged families are ``MergedFamily`` objects: ``prometheus_client`` Metrics
whose ``samples`` are built only when asked for (tests, OpenMetrics features
this module does not render, ``name[]`` queries), so the library's own
encoders still work on them.

Anything the replay does not model exactly (a metric name written by files
of two types, a stored ``_count`` of a histogram) makes the run fall back to
``MultiProcessCollector.merge``: exact by definition, only slower.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from rankscope.contract.catalog import FENCE_METRICS
from rankscope.exporter.db_file import CorruptFile, DbFile

__all__ = ["CorruptFile", "DbFile", "FENCE_NAMES", "MergedFamily", "Reader"]


# prometheus_client strips its own ``pid`` label from gauges in these modes.
_PID_STRIPPED = frozenset(("min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent", "livemostrecent"))

FENCE_NAMES = frozenset(spec.name for spec in FENCE_METRICS)

# How an entry's value is combined into its merged slot.
SUM, MOSTRECENT, LAST, MIN, MAX = range(5)


class _Unsupported(Exception):
    """A layout the replay does not model exactly: use prometheus_client's merge."""


class _Series:
    """One output sample of a family: its name and labels (as MultiProcessCollector builds them)."""

    __slots__ = ("name", "labels")

    def __init__(self, name: str, labels: tuple):
        self.name, self.labels = name, labels


class _FamilyPlan:
    __slots__ = ("name", "documentation", "typ", "mode", "series", "program", "histogram", "dynamic")

    def __init__(self, name: str, documentation: str, typ: str):
        self.name, self.documentation, self.typ = name, documentation, typ
        self.mode = ""
        self.series: list[_Series] = []
        # How each output value is made from the slots, in output order:
        # plain: a list of slots; histogram: a list of (kind, slot) (see _values).
        self.program: list = []
        self.histogram = False
        self.dynamic = False        # mostrecent: a series exists only once a file set it


class _Plan:
    """How one ordered list of files merges: per file, each entry's slot and how it combines."""

    def __init__(self):
        self.files: list[tuple[DbFile, list[int], int, list[int] | None]] = []
        self.nslots = 0
        self.families: list[_FamilyPlan] = []
        self.has_mostrecent = False
        self.has_minmax = False


def _build_plan(files: list[DbFile]) -> _Plan:
    """Replay MultiProcessCollector._read_metrics and _accumulate_metrics on the keys alone."""
    plan = _Plan()
    metrics: dict[str, _FamilyPlan] = {}
    modes: dict[str, str] = {}
    per_metric: dict[str, list[tuple[int, int, str, tuple]]] = {}   # name -> [(file no, entry no, sample, labels)]
    for fno, f in enumerate(files):
        for eno, (metric_name, name, labels_key, help_text) in enumerate(f.parsed):
            fam = metrics.get(metric_name)
            if fam is None:
                try:
                    Metric(metric_name, help_text, f.typ)      # what MultiProcessCollector builds; it may refuse
                except ValueError as e:
                    raise _Unsupported(str(e)) from None
                fam = metrics[metric_name] = _FamilyPlan(metric_name, help_text, f.typ)
                per_metric[metric_name] = []
            elif fam.typ != f.typ:
                raise _Unsupported(f"{metric_name} is written by {fam.typ} and {f.typ} files")
            if f.typ == "gauge":
                modes[metric_name] = f.mode
                labels_key = labels_key + (("pid", f.pid),)
            per_metric[metric_name].append((fno, eno, name, labels_key))
    entry_slot: list[list[int]] = [[-1] * len(f.parsed) for f in files]
    entry_op: list[list[int]] = [[SUM] * len(f.parsed) for f in files]
    nslots = 0
    for metric_name, fam in metrics.items():
        fam.mode = modes.get(metric_name, "")
        gauge = fam.typ == "gauge"
        op = SUM
        if gauge:
            mode = fam.mode
            op = (MIN if mode in ("min", "livemin") else MAX if mode in ("max", "livemax")
                  else SUM if mode in ("sum", "livesum") else MOSTRECENT if mode in ("mostrecent", "livemostrecent")
                  else LAST)
            fam.dynamic = op == MOSTRECENT
            plan.has_mostrecent |= op == MOSTRECENT
            plan.has_minmax |= op in (MIN, MAX)
        groups: dict[tuple, dict[tuple, object]] = {}       # labels -> {(name, labels): slot or program}
        buckets: dict[tuple, dict[float, int]] = {}          # histogram labels without le -> {bound: slot}
        for fno, eno, name, labels in per_metric[metric_name]:
            if gauge and fam.mode in _PID_STRIPPED:
                labels = tuple(lv for lv in labels if lv[0] != "pid")
            if fam.typ == "histogram":
                for lv in labels:
                    if lv[0] == "le":
                        without_le = tuple(x for x in labels if x[0] != "le")
                        by_bound = buckets.setdefault(without_le, {})
                        bound = float(lv[1])
                        slot = by_bound.get(bound)
                        if slot is None:
                            slot = by_bound[bound] = nslots
                            nslots += 1
                        break
                else:
                    slot = _slot_for(groups, name, labels, nslots)
                    nslots = max(nslots, slot + 1)
            else:
                slot = _slot_for(groups, name, labels, nslots)
                nslots = max(nslots, slot + 1)
            entry_slot[fno][eno] = slot
            entry_op[fno][eno] = op
        if fam.typ == "histogram":
            fam.histogram = True
            for labels, by_bound in buckets.items():
                group = groups.setdefault(labels, {})
                first = True
                for bound in sorted(by_bound):
                    key = (fam.name + "_bucket", labels + (("le", floatToGoString(bound)),))
                    if key in group:
                        raise _Unsupported(f"{key} stored as well as accumulated")
                    group[key] = (1 if first else 2, by_bound[bound])
                    first = False
                key = (fam.name + "_count", labels)
                if key in group:
                    raise _Unsupported(f"{key} stored as well as accumulated")
                group[key] = (3, -1)
        for group in groups.values():
            for (name, labels), how in group.items():
                fam.series.append(_Series(name, labels))
                fam.program.append(how)
        if fam.histogram:
            fam.program = [how if isinstance(how, tuple) else (0, how) for how in fam.program]
        plan.families.append(fam)
    plan.nslots = nslots
    for fno, f in enumerate(files):
        ops = entry_op[fno]
        uniform = ops[0] if ops and all(o == ops[0] for o in ops) else None
        plan.files.append((f, entry_slot[fno], uniform if uniform is not None else -1, None if uniform is not None
                           else ops))
    return plan


def _slot_for(groups: dict, name: str, labels: tuple, nslots: int) -> int:
    group = groups.setdefault(labels, {})
    slot = group.get((name, labels))
    if slot is None:
        slot = group[(name, labels)] = nslots
    return slot


def _accumulate(plan: _Plan) -> tuple[list, list | None]:
    """Every slot's merged value, adding in prometheus_client's order. Also, for
    mostrecent slots, the position of the entry that first set them (None: unset)."""
    acc: list = [0.0] * plan.nslots
    stamps = [0.0] * plan.nslots if plan.has_mostrecent else None
    first: list | None = [None] * plan.nslots if plan.has_mostrecent else None
    seen = [False] * plan.nslots if plan.has_minmax else None
    seq = 0
    for f, slots, op, ops in plan.files:
        values = f.values
        if op == SUM:
            for s, v in zip(slots, values):
                acc[s] += v
        elif op == MOSTRECENT:
            for i, (s, v, t) in enumerate(zip(slots, values, f.stamps)):
                current = stamps[s]
                if current < t:
                    if first[s] is None:
                        first[s] = seq + i
                    acc[s] = v
                    stamps[s] = t
        elif op == LAST:
            for s, v in zip(slots, values):
                acc[s] = v
        else:
            for i, (s, v) in enumerate(zip(slots, values)):
                o = op if ops is None else ops[i]
                if o == SUM:
                    acc[s] += v
                elif o == LAST:
                    acc[s] = v
                elif o == MOSTRECENT:
                    t = f.stamps[i]
                    if stamps[s] < t:
                        if first[s] is None:
                            first[s] = seq + i
                        acc[s] = v
                        stamps[s] = t
                elif not seen[s]:
                    seen[s] = True
                    acc[s] = v
                elif (v < acc[s]) if o == MIN else (v > acc[s]):
                    acc[s] = v
        seq += len(slots)
    return acc, first


class MergedFamily(Metric):
    """A merged family whose values live in slots; ``samples`` is built on demand."""

    def __init__(self, fam: _FamilyPlan, acc: list, first: list | None):
        # Metric.__init__ would validate the name again and set samples = [].
        self.name, self.documentation, self.unit = fam.name, fam.documentation, ""
        self.type = fam.typ
        self._multiprocess_mode = fam.mode
        self._fam = fam
        self._explicit: list | None = None
        self._keep: list[bool] | None = None
        self.order, self.values = _values(fam, acc, first)

    # -- the Metric interface -------------------------------------------------------------
    @property
    def samples(self) -> list[Sample]:
        if self._explicit is not None:
            return self._explicit
        return [Sample(name, dict(labels), v) for name, labels, v in self.items()]

    @samples.setter
    def samples(self, samples: list[Sample]) -> None:
        self._explicit = list(samples)

    def add_sample(self, *args, **kwargs) -> None:   # pragma: no cover - not used on merged families
        raise TypeError("a merged family is read-only")

    # -- rankscope's needs ----------------------------------------------------------------
    def keep_only(self, label: str, allowed: set[str]) -> None:
        """Serve only the series whose ``label`` is one of ``allowed`` (series without it are dropped)."""
        self._keep = [dict(s.labels).get(label) in allowed for s in self._fam.series]

    def items(self) -> Iterable[tuple[str, tuple, float]]:
        """(sample name, labels as sorted pairs, value) of every series served."""
        series, keep = self._fam.series, self._keep
        order = range(len(series)) if self.order is None else self.order
        return ((series[i].name, series[i].labels, v) for i, v in zip(order, self.values) if keep is None or keep[i])

    @property
    def plan(self) -> _FamilyPlan:
        return self._fam

    def render(self, fmt, out: list[str]) -> bool:
        """Append this family's exposition text; False if it must go through the library."""
        if self._explicit is not None:
            return False
        prefixes = fmt.prefixes(self._fam)
        if prefixes is None:
            return False
        out.append(fmt.header(self))
        keep = self._keep
        fmt_value = value_text if self.type != "gauge" else floatToGoString
        if keep is None:
            if self.order is None:
                out.extend([f"{p}{fmt_value(v)}\n" for p, v in zip(prefixes, self.values)])
            else:
                out.extend([f"{prefixes[i]}{fmt_value(v)}\n" for i, v in zip(self.order, self.values)])
        else:
            order = range(len(prefixes)) if self.order is None else self.order
            out.extend([f"{prefixes[i]}{fmt_value(v)}\n" for i, v in zip(order, self.values) if keep[i]])
        return True


def _values(fam: _FamilyPlan, acc: list, first: list | None) -> tuple[list | None, list]:
    """The family's output values (and their series, when not all of them in plan order)."""
    if fam.histogram:
        out = []
        a = 0.0
        for kind, s in fam.program:
            if kind == 0:
                out.append(acc[s])
            elif kind == 1:
                a = 0.0
                a += acc[s]
                out.append(a)
            elif kind == 2:
                a += acc[s]
                out.append(a)
            else:
                out.append(a)
        return None, out
    if not fam.dynamic:
        return None, [acc[s] for s in fam.program]
    # mostrecent: a series exists once a file set it (timestamp > 0), in the order it was first set.
    present = [(first[s], i, s) for i, s in enumerate(fam.program) if first[s] is not None]
    if any(present[k][0] > present[k + 1][0] for k in range(len(present) - 1)):
        present.sort()
    return [i for _, i, _ in present], [acc[s] for _, _, s in present]


_VALUE_CACHE_MAX = 1 << 17
_value_text: dict[float, str] = {}


def value_text(v: float) -> str:
    """floatToGoString, remembered. Only for sums (counters, histograms): a sum that
    started at 0.0 is never -0.0, which would share 0.0's entry."""
    s = _value_text.get(v)
    if s is None:
        s = floatToGoString(v)
        if len(_value_text) >= _VALUE_CACHE_MAX:
            _value_text.clear()
        _value_text[v] = s
    return s


class RunReader:
    """The files of one run directory, kept between scrapes."""

    def __init__(self):
        self.files: dict[str, DbFile] = {}
        self._intern: dict = {}
        self._plan_key: tuple | None = None
        self._plan: _Plan | None = None

    def merge(self, paths: list[str]) -> list[Metric]:
        files = []
        for path in paths:
            f = self.files.get(path)
            if f is None:
                f = self.files[path] = DbFile(path, self._intern)
            if f.refresh():
                files.append(f)
        if len(self.files) > len(files):
            live = {f.path for f in files}
            for path in [p for p in self.files if p not in live]:
                del self.files[path]
        if not files:
            return []
        key = tuple((f.path, f.version) for f in files)
        if key != self._plan_key:
            try:
                self._plan = _build_plan(files)
            except _Unsupported:
                self._plan = None
            self._plan_key = key
        if self._plan is None:
            return [m for m in MultiProcessCollector.merge([f.path for f in files], accumulate=True)
                    if m.name not in FENCE_NAMES]
        acc, first = _accumulate(self._plan)
        return [MergedFamily(fam, acc, first) for fam in self._plan.families if fam.name not in FENCE_NAMES]


class Reader:
    """Run readers by directory; drops those of runs no longer read."""

    def __init__(self):
        self.runs: dict[Path, RunReader] = {}

    def merge(self, run_dir: Path, paths: list[str]) -> list[Metric]:
        run = self.runs.get(run_dir)
        if run is None:
            run = self.runs[run_dir] = RunReader()
        return run.merge(paths)

    def forget_except(self, run_dirs: Iterable[Path]) -> None:
        keep = set(run_dirs)
        for run_dir in [d for d in self.runs if d not in keep]:
            del self.runs[run_dir]
