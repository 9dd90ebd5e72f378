"""Step-indexed run summaries for TensorBoard and MLflow: one run, written by rank 0 only.

Prometheus keeps series by time; a person comparing two training runs wants
them by step, and one run per job, not one per GPU (one MLflow run per rank,
every node logging to the tracking server, TensorBoard with hundreds of runs
and ``add_scalars``' writer per tag are the known ways to hurt these tools).
So the sink runs on the global rank 0 only, reads every rank's values from the
node exporters' ``/metrics`` (no collective on the training path, no socket on
the hot path), and writes one record of job-wide figures per interval, at the
highest training step any rank has reached (docs/sinks.md). The figures are the
alert rules' (``rankscope.pages.figures``):

    rankscope/step_time/{min,median,max}   mean step seconds of each rank over the interval, across ranks
    rankscope/slowest_rank                 the rank whose compute per step (forward+backward+optimizer) is
                                           furthest over its stage's peers' median (without peers: the most)
    rankscope/straggler_ratio              its compute per step over the median of its peers' (the stage's
                                           ranks without the slowest): the Straggler rule's ratio
    rankscope/comm_wait_fraction[/max]     comm_wait phase seconds / step (phase) seconds (all ranks pooled; worst rank)
    rankscope/loss/{mean,spread,std}       across the ranks' last finite loss
    rankscope/throughput/steps_per_s       steps per second, mean over ranks
    rankscope/mfu, rankscope/goodput       only when the ranks publish the series they come from
    rankscope/ranks/{reporting,stalled,dead}
    rankscope/events/{nonfinite,oom,restarts,hang_suspects}
    text (TensorBoard add_text / MLflow tag rankscope.last_event): one line per event

Its parts: ``summary`` (the common summary, pure), ``collector`` (the ``Sink``: reads the
pages, summarises), ``backend`` (a backend's writer thread and bounded queue),
``tensorboard`` and ``mlflow`` (the two backends and their start-up checks), ``process``
(the child process the ``Sink`` runs in, and rank 0's handle on it).

The sink runs in a child process of rank 0 (``rankscope.sinks.process``), so that none of
its work takes the training thread's interpreter. Its threads there:
``rankscope-sink`` scrapes and summarises every ``interval_s``; each backend has
its writer thread (``rankscope-sink-tensorboard``, ``rankscope-sink-mlflow``)
behind a bounded queue. A record that does not fit, or that its backend fails
to write (a dead MLflow server, a full disk), is dropped and counted in
``rankscope_telemetry_dropped_total{what="sink"}`` (on rank 0: the child reports each drop).

This package imports neither tensorboard nor mlflow until a writer thread opens
its backend (in the child); ``build`` checks at start-up that what is configured can work.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rankscope.contract.environment import ConfigError, metrics_url
from rankscope.sinks.backend import QUEUE_MIN_RECORDS, QUEUE_SECONDS, Backend, Writer
from rankscope.sinks.collector import SCRAPE_TIMEOUT_S, Sink, exporter_urls, log
from rankscope.sinks.mlflow import (MLFLOW_EVENT_TAG, MLFLOW_HTTP_DEFAULTS, MLFLOW_PENDING, MLFLOW_RUN_TAG,
                                    MLFLOW_SCHEMES, SQL_SCHEMES, MlflowBackend)
from rankscope.sinks.mlflow import check_store
from rankscope.sinks.mlflow import check_uri as check_mlflow_uri
from rankscope.sinks.process import SinkProcess
from rankscope.sinks.summary import TAG, WANTED, RankValues, Record, Summarizer, parse_page
from rankscope.sinks.tensorboard import EVENTS_TEXT_TAG, TensorBoardBackend, check_directory

__all__ = ["EVENTS_TEXT_TAG", "MLFLOW_EVENT_TAG", "MLFLOW_HTTP_DEFAULTS", "MLFLOW_PENDING", "MLFLOW_RUN_TAG",
           "MLFLOW_SCHEMES", "QUEUE_MIN_RECORDS", "QUEUE_SECONDS", "SCRAPE_TIMEOUT_S", "SQL_SCHEMES", "TAG", "WANTED",
           "Backend", "MlflowBackend", "RankValues", "Record", "Sink", "SinkProcess", "Summarizer",
           "TensorBoardBackend", "Writer", "build", "check_mlflow_uri", "exporter_urls", "log", "parse_page"]


def build(config: Any, identity: Any, errors: Any) -> SinkProcess | None:
    """The sink this rank runs, or None (not rank 0, or nothing configured). Checks now, at
    start-up, everything that would otherwise fail later: the optional packages, a directory
    that cannot be written, a database whose directory does not exist. Starts nothing."""
    if config.tensorboard_dir is None and config.mlflow_tracking_uri is None:
        return None
    if identity.rank != 0:
        return None
    urls = []
    if config.exporter != "off":
        urls.append(metrics_url(config.metrics_addr, config.metrics_port))   # the node's own: first
    urls += [u for u in exporter_urls(config.sink_exporters) if u not in urls]
    if not urls:
        raise ConfigError("the TensorBoard / MLflow sink reads the node exporters' /metrics, and exporter=off "
                          "starts none: set RANKSCOPE_SINK_EXPORTERS=host:port[,host:port...]")
    writers: list[Backend] = []
    if config.tensorboard_dir is not None:
        writers.append(TensorBoardBackend(check_directory(Path(config.tensorboard_dir)), identity.run))
    if config.mlflow_tracking_uri is not None:
        check_store(config.mlflow_tracking_uri)
        writers.append(MlflowBackend(config.mlflow_tracking_uri, config.mlflow_experiment, identity.run))
    return SinkProcess(urls, identity.run, config.sink_interval_s, writers, errors.drop)
