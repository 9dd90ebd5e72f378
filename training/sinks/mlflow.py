"""The MLflow backend: one MLflow run per job, through an ``MlflowClient``.

MLflow is imported only when the writer thread opens the backend; ``check_uri`` (at
configuration) and ``check_store`` (at start-up) say whether what is configured can work.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any

from rankscope.contract.environment import ConfigError
from rankscope.sinks import backend
from rankscope.sinks.summary import Record

MLFLOW_EVENT_TAG = "rankscope.last_event"
MLFLOW_RUN_TAG = "rankscope.run"
# Schemes MLflow's tracking client accepts for a tracking store.
MLFLOW_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql", "databricks", "file")
SQL_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# The sink's own HTTP settings for MLflow (rank 0 only; a value the user set wins): fail within seconds,
# not after MLflow's default 7 retries with exponential back-off over minutes.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "5", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1"}
MLFLOW_PENDING = 4         # asynchronous MLflow batches in flight; the writer waits for the oldest beyond
_ASYNC_LOG = "mlflow.utils.async_logging.async_logging_queue"


def check_uri(uri: str) -> str:
    """The URI's scheme; ConfigError unless MLflow's tracking client takes it."""
    scheme = urllib.parse.urlsplit(uri).scheme.split("+")[0].lower()
    if scheme not in MLFLOW_SCHEMES:
        raise ConfigError(f"{uri!r}: the scheme must be one of {', '.join(s + ':' for s in MLFLOW_SCHEMES)} "
                          "(e.g. http://mlflow:5000 or sqlite:////path/mlflow.db)", field="mlflow_tracking_uri")
    if scheme in ("http", "https") and not urllib.parse.urlsplit(uri).hostname:
        raise ConfigError(f"{uri!r}: no host", field="mlflow_tracking_uri")
    return scheme


def check_store(uri: str) -> None:
    """ConfigError where MLflow or the store's own needs are missing (at start-up, not at the first record)."""
    scheme = check_uri(uri)
    if backend.missing("mlflow"):
        raise ConfigError("mlflow_tracking_uri is set but MLflow is not installed: pip install 'rankscope[mlflow]'")
    if scheme in SQL_SCHEMES and backend.missing("sqlalchemy"):
        raise ConfigError(f"{uri!r}: a {scheme} store needs the full MLflow package (SQLAlchemy), not "
                          "mlflow-skinny: pip install mlflow, or use the tracking server's http(s):// URI",
                          field="mlflow_tracking_uri")
    if scheme == "sqlite":
        path = uri.split(":///", 1)[1] if ":///" in uri else ""
        parent = Path(path).parent if path and path != ":memory:" else None
        if parent is not None and not (parent.is_dir() and os.access(parent, os.W_OK)):
            raise ConfigError(f"{uri!r}: the directory {parent} does not exist or cannot be written",
                              field="mlflow_tracking_uri")
    if scheme == "file" and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
        raise ConfigError(f"{uri!r}: MLflow 3 refuses its file store unless MLFLOW_ALLOW_FILE_STORE=true; "
                          "use sqlite:////path/mlflow.db or a tracking server", field="mlflow_tracking_uri")


def _done(ops: Any) -> bool:
    """Whether MLflow's RunOperations has finished (False where its futures cannot be seen)."""
    futures = getattr(ops, "_operation_futures", None)
    return futures is not None and all(f.done() for f in futures)


class _OwnRunFilter(logging.Filter):
    """Keeps MLflow's async-logging error for each failed batch of the sink's run out of the log
    (each is counted as a drop, whose first reason is logged once); other runs' errors pass."""

    def __init__(self, run_id: str):
        super().__init__()
        self.run_id = run_id

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            return self.run_id not in record.getMessage()
        except Exception:   # noqa: BLE001
            return True


class MlflowBackend(backend.Backend):
    """One MLflow run per job (found again by its ``rankscope.run`` tag after a restart), through
    an ``MlflowClient`` with an explicit run id: a run the user has active in this process is untouched."""

    name = "mlflow"

    def __init__(self, uri: str, experiment: str, run: str):
        self.uri, self.experiment, self.run = uri, experiment, run
        self.client: Any = None
        self.run_id: str | None = None
        self.pending: deque[Any] = deque()
        self.failed = 0
        self._filter: _OwnRunFilter | None = None

    def open(self) -> None:
        if urllib.parse.urlsplit(self.uri).scheme.lower() in ("http", "https"):
            for k, v in MLFLOW_HTTP_DEFAULTS.items():
                os.environ.setdefault(k, v)
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(self.experiment)
        quoted = self.run.replace("\\", "\\\\").replace('"', '\\"')
        # A relaunch of rank 0 (torchelastic restart, the job resubmitted after a crash) continues the
        # run its earlier launch left RUNNING; a run that ended (FINISHED) is never reopened.
        found = client.search_runs([exp_id], f'tags.`{MLFLOW_RUN_TAG}` = "{quoted}" and attributes.status = "RUNNING"',
                                   max_results=1)
        if found:
            run_id = found[0].info.run_id
        else:
            run_id = client.create_run(exp_id, run_name=self.run, tags={MLFLOW_RUN_TAG: self.run}).info.run_id
        self.client, self.run_id = client, run_id
        self._filter = _OwnRunFilter(run_id)
        logging.getLogger(_ASYNC_LOG).addFilter(self._filter)

    def write(self, record: Record) -> None:
        from mlflow.entities import Metric, RunTag

        ts = int(record.wall_time * 1000)
        metrics = [Metric(k, float(v), ts, record.step) for k, v in record.scalars.items()]
        tags = [RunTag(MLFLOW_EVENT_TAG, "\n".join(record.events)[-5000:])] if record.events else []
        self.pending.append(self.client.log_batch(self.run_id, metrics, tags=tags, synchronous=False))
        while self.pending and (len(self.pending) > MLFLOW_PENDING or _done(self.pending[0])):
            self._settle(self.pending.popleft())   # bounded: MLflow's own queue has no limit

    def _settle(self, ops: Any) -> None:
        try:
            ops.wait()
        except Exception:   # noqa: BLE001 - MLflow raises its own and requests' exceptions
            self.failed += 1

    def take_failed(self) -> int:
        n, self.failed = self.failed, 0
        return n

    def close(self) -> int:
        while self.pending:
            self._settle(self.pending.popleft())
        if self.client is not None and self.run_id is not None:
            try:
                self.client.set_terminated(self.run_id, "FINISHED")
            except Exception:   # noqa: BLE001 - the server is gone: the run stays RUNNING there
                pass
        if self._filter is not None:
            logging.getLogger(_ASYNC_LOG).removeFilter(self._filter)
        return self.take_failed()
