"""Every metric a rank writes: name, type, help, labels.

This module is the rank side of the metric-name contract (docs/design.md,
"The contract"). Rules, dashboards and tests refer only to names defined here
or in ``rankscope.exporter.catalog``; ``tests/unit/contract/test_catalog.py`` enforces it.

It imports nothing heavy (no torch, no prometheus_client) so that the exporter,
the docs generator and the tests can read it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rankscope.contract.thresholds import STRAGGLER_PHASES

PREFIX = "rankscope_"

# Identity labels carried by every per-rank series. `job` and `instance` are
# Prometheus's target labels and must never be exported by us.
IDENTITY_LABELS: tuple[str, ...] = ("run", "rank", "local_rank", "node")

# Bounded label values. Anything not listed here is rejected at start-up.
PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "comm_wait", "other")
# Where a rank is between its process start and its first step (rankscope.publishing.startup.StartupPhases):
# launch       its own work before init_process_group (imports, data, model building)
# rendezvous   inside init_process_group: waiting for every rank of the world to arrive
# first_step   its process group made, no step completed yet (a first compile, a checkpoint load)
# training     a step completed
STARTUP_PHASES: tuple[str, ...] = ("launch", "rendezvous", "first_step", "training")
# The rank's own declared work between steps (``with monitor.checkpoint()`` / ``monitor.evaluation()``),
# known while it runs: a rank in one is busy, not hung, and its peers waiting for it are not stuck.
BLOCKS: tuple[str, ...] = ("checkpoint_save", "checkpoint_restore", "evaluation")
COLLECTIVE_OPS: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "send",
    "recv",
)
# Every collective of every process group, as torch's flight recorder names it
# (rankscope.collectives.ring_entries.op_of): the ops above plus those without an explicit API
# here; anything else is "other".
PROCESS_GROUP_OPS: tuple[str, ...] = COLLECTIVE_OPS + ("reduce", "gather", "scatter", "other")
# Labels of the per-process-group series: ``group`` is the group's role
# (``default``, a device-mesh dimension name such as ``dp_shard`` or ``tp``, the
# group's own description, else ``pg<name>``), ``group_id`` its name, the same
# on every member rank and different for two groups of one role (the two ``tp``
# groups of a 2x2 mesh): rules compare sequence numbers within one group_id.
PROCESS_GROUP_LABELS: tuple[str, ...] = ("group", "group_id")
# Process groups a rank publishes at most (RANKSCOPE_MAX_PROCESS_GROUPS); the
# collectives of any further group are dropped and counted.
MAX_PROCESS_GROUPS_DEFAULT = 16
# A rank's series for an op exist from its first use of the op, except these,
# which every data-parallel job uses and which read 0 from start-up.
EAGER_COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce",)
NONFINITE_WHAT: tuple[str, ...] = ("loss", "grad")
# Where rankscope's own code failed (rankscope_telemetry_errors_total{component}).
ERROR_COMPONENTS: tuple[str, ...] = ("step", "publisher", "memory", "collectives", "loss", "tracing", "user",
                                     "replicas")
# What rankscope had to throw away (rankscope_telemetry_dropped_total{what}).
DROP_REASONS: dict[str, str] = {
    "step_duration": "a step's duration and values (the step is still counted): more steps between two publishes "
                     "than buffered",
    "device_value": "a CUDA loss, grad-norm, lr or user-metric value evicted before the device finished it",
    "device_step": "a CUDA step's phase timings evicted before the device finished them",
    "collective": "a completed collective's timing evicted before it was published",
    "value": "an observed loss, grad_norm or lr that is not a number",
    "late_value": "a value observed after its step had ended",
    "value_modified": "an observed CPU tensor modified in place after its step, before it was read",
    "data_wait": "a batch's wait in the data-wait histogram (still in the data phase): more batches fetched "
                 "between two steps than logged",
    "process_group": "a collective of a process group beyond the rank's budget (RANKSCOPE_MAX_PROCESS_GROUPS)",
    "flight_recorder": "a collective overwritten in torch's flight recorder ring before it was read",
    "replica_check": "a replica fingerprint not taken or not published: the model's parameters changed after "
                     "watch(), its tensors are on a device the monitor cannot time, or the publisher was far behind",
    "sink": "a record of rank 0's TensorBoard / MLflow sink not written: its queue was full, the backend failed "
            "(a dead tracking server, a full disk), or no exporter answered (docs/sinks.md)",
}

# Where a rank process's wall time goes (rankscope_wall_seconds_total{category}),
# after Google's ml-goodput-measurement; the categories add up to the process's
# wall time (docs/goodput.md). "productive" is goodput, the others badput:
# productive       step time that trained (step duration minus its data wait);
#                  steps repeated after a relaunch are lost_progress instead
# startup          process start to the first step
# data_wait        waiting for batches
# checkpoint_save, checkpoint_restore  inside monitor.checkpoint("save" | "restore")
# evaluation       inside monitor.evaluation()
# lost_progress    re-doing steps an earlier launch of the run had completed
# idle             everything else: gaps between steps, steps cut short by an
#                  exception, hung time
GOODPUT_CATEGORIES: tuple[str, ...] = (
    "productive", "startup", "data_wait", "checkpoint_save", "checkpoint_restore", "evaluation",
    "lost_progress", "idle",
)
# The wait for one batch: ~1 ms (a prefetched batch) to a 30 s loader stall.
DATA_WAIT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

# Step times range from ~1 ms (tiny CPU models) to minutes (huge GPU steps).
STEP_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 1.5, 2.5, 5.0, 10.0, 30.0, 60.0,
)
# Collectives range from tens of microseconds (small NCCL all-reduce) to
# seconds (large gloo transfers, or waiting for a straggler).
COLLECTIVE_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    """One metric of the contract.

    ``labels`` are the labels beyond the identity labels (which every rank
    series carries; exporter-side specs say whether they do with
    ``identity``). ``gauge_mode`` is prometheus_client's multiprocess mode:
    ``mostrecent`` keeps the last value after the process dies (post-mortem
    value of memory, step, loss), ``livemostrecent`` drops it when the
    exporter marks the process dead (heartbeat, in-flight collectives: a dead
    rank is in no collective).
    """

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    identity: bool = True
    gauge_mode: str = "mostrecent"
    buckets: tuple[float, ...] | None = None

    @property
    def label_names(self) -> tuple[str, ...]:
        return (IDENTITY_LABELS if self.identity else ()) + self.labels


def _c(name: str, help: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, "counter", help, labels)


def _g(name: str, help: str, labels: tuple[str, ...] = (), mode: str = "mostrecent") -> MetricSpec:
    return MetricSpec(name, "gauge", help, labels, gauge_mode=mode)


def _h(name: str, help: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, "histogram", help, labels, buckets=buckets)


# Labels of rankscope_replica_fingerprint (rankscope.replicas.check).
REPLICA_LABELS: tuple[str, ...] = ("replicas", "group", "shard", "of", "part", "param", "slot")

# Labels of rankscope_rank_info beyond identity. Empty string where unknown.
RANK_INFO_LABELS: tuple[str, ...] = (
    "world_size",
    "local_world_size",
    "process_id",  # not "pid": prometheus_client multiprocess mode strips a gauge label of that name
    "hostname",
    "device",
    "gpu_uuid",
    "backend",
    "torch_version",
    "nccl_version",
    "rankscope_version",
    "slurm_job_id",
    "k8s_pod",
)

RANK_METRICS: tuple[MetricSpec, ...] = (
    # identity and liveness
    _g("rankscope_rank_info", "Identity of a rank (value 1): world size, pid, device, GPU UUID, backend, versions.",
       RANK_INFO_LABELS),
    _g("rankscope_rank_layout_info",
       "Where the rank sits in the job's parallel layout (value 1; 0 for a layout it no longer has): its pipeline "
       "stage, its tensor-parallel group (its coordinates on the other mesh dimensions) and every mesh coordinate; "
       "empty where the job has none.", ("stage", "tp_group", "mesh")),
    _g("rankscope_rank_start_timestamp_seconds", "Unix time at which the rank's monitor started."),
    _g("rankscope_launch_world_size",
       "Ranks of the job as its launcher's environment says (WORLD_SIZE, SLURM_NTASKS): known before any process "
       "group exists, so that ranks that never started are counted."),
    _g("rankscope_startup_phase",
       "1 for the start-up phase the rank is in, 0 for the others: launch (before init_process_group), "
       "rendezvous (inside it, waiting for the other ranks), first_step (no step completed yet), training.",
       ("phase",)),
    _g("rankscope_startup_phase_since_timestamp_seconds",
       "Unix time at which the rank entered its start-up phase (launch: the process's start)."),
    _g("rankscope_block_started_timestamp_seconds",
       "Unix time at which the rank entered the checkpoint or evaluation block it is in (monitor.checkpoint(), "
       "monitor.evaluation()), 0 for the others: a rank busy with its own declared work, whose peers may wait "
       "for it in a collective meanwhile.", ("block",), mode="livemostrecent"),
    _g("rankscope_block_ended_timestamp_seconds",
       "Unix time at which the rank's last checkpoint or evaluation block ended: progress, as a step is (the "
       "exporter's stall clock starts from the later of the two)."),
    _g("rankscope_heartbeat_timestamp_seconds",
       "Unix time of the rank's last heartbeat (a background thread beats while the interpreter runs).",
       mode="livemostrecent"),
    # steps
    _g("rankscope_step", "Global training step of the last completed step."),
    _c("rankscope_steps_total", "Training steps completed by this rank process."),
    _h("rankscope_step_duration_seconds", "Wall-clock duration of training steps.", STEP_BUCKETS),
    _g("rankscope_step_last_duration_seconds", "Wall-clock duration of the last completed step."),
    _g("rankscope_step_last_compute_seconds",
       f"Compute seconds of the last completed step: {', '.join(STRAGGLER_PHASES[:-1])} and {STRAGGLER_PHASES[-1]}, "
       "its measured communication "
       "wait excluded (backward left out where DDP's wait is only sampled, the CPU default); its spread across "
       "the ranks of a stage, scrape by scrape, is the load imbalance."),
    _g("rankscope_last_step_timestamp_seconds", "Unix time at which the last step completed."),
    _c("rankscope_phase_seconds_total",
       "Seconds spent per step phase; exposed communication wait is 'comm_wait', untracked time 'other'.",
       ("phase",)),
    _c("rankscope_samples_total", "Training samples processed."),
    _c("rankscope_tokens_total", "Training tokens processed."),
    # goodput and model FLOPs utilisation (docs/goodput.md)
    _c("rankscope_wall_seconds_total",
       "Seconds of the rank process's wall time by what they went to: productive (goodput), startup, data_wait, "
       "checkpoint_save, checkpoint_restore, evaluation, lost_progress, idle.", ("category",)),
    _h("rankscope_data_wait_seconds", "Wait for each batch from the data loader.", DATA_WAIT_BUCKETS),
    _c("rankscope_model_flops_total",
       "Model FLOPs of the completed steps (tokens x FLOPs per token, or samples x FLOPs per sample); "
       "only when a FLOPs figure is configured."),
    _g("rankscope_device_peak_flops",
       "Peak dense FLOP/s of the rank's device for the configured dtype (the MFU denominator); "
       "only on a GPU whose peak is known or given (RANKSCOPE_PEAK_FLOPS), never on a CPU."),
    # loss and training health
    _g("rankscope_loss", "Loss of the last step whose value is known."),
    _g("rankscope_loss_ema", "Exponential moving average of the loss."),
    _g("rankscope_loss_zscore", "Last loss in standard deviations above its rolling mean."),
    _g("rankscope_grad_norm", "Gradient norm of the last step that reported one."),
    _g("rankscope_learning_rate", "Learning rate of the last step."),
    _c("rankscope_nonfinite_total", "Steps whose loss or gradient norm was NaN or infinite.", ("what",)),
    _c("rankscope_loss_spikes_total", "Steps whose loss z-score exceeded the spike threshold."),
    _c("rankscope_grad_norm_spikes_total", "Steps whose gradient norm exceeded the explosion factor times its average."),
    # collectives
    _h("rankscope_collective_duration_seconds",
       "Collective duration from launch to completion (DDP buckets: completion under overlap with backward).",
       COLLECTIVE_BUCKETS, ("op",)),
    _g("rankscope_collective_last_duration_seconds", "Duration of the last completed collective.", ("op",)),
    _c("rankscope_collective_bytes_total", "Bytes of input handed to collectives.", ("op",)),
    _c("rankscope_collective_bus_bytes_total",
       "Bytes of collectives times nccl-tests' bus factor of the op and group size (all_reduce 2(n-1)/n; "
       "all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast 1): over the duration, the bus bandwidth.",
       ("op",)),
    _g("rankscope_collective_in_flight", "1 while the rank is inside a collective of this op, else 0.", ("op",),
       mode="livemostrecent"),
    _g("rankscope_collective_started_timestamp_seconds",
       "Unix time at which the collective now in flight started; 0 when none is.", ("op",), mode="livemostrecent"),
    # every collective of every process group, from torch's flight recorder
    _c("rankscope_process_group_collectives_total",
       "Collectives issued on a process group, by op (every collective the backend ran, DDP's, FSDP's, "
       "tensor parallel's and the user's alike).", PROCESS_GROUP_LABELS + ("op",)),
    _c("rankscope_process_group_collective_bytes_total",
       "Bytes of the collectives issued on a process group, by op (all_gather: the gathered output; "
       "everything else: the input).", PROCESS_GROUP_LABELS + ("op",)),
    _c("rankscope_process_group_collective_bus_bytes_total",
       "Bytes of the collectives issued on a process group times nccl-tests' bus factor of the op and the "
       "group's size: over the duration (NCCL with collective timing on), the bus bandwidth.",
       PROCESS_GROUP_LABELS + ("op",)),
    _h("rankscope_process_group_collective_duration_seconds",
       "Device duration of a process group's collectives, where the backend measures it (NCCL with "
       "collective timing on); gloo gives none.", COLLECTIVE_BUCKETS, ("group", "op")),
    _g("rankscope_process_group_last_enqueued_seq",
       "Sequence number of the last collective this rank enqueued on the process group.",
       PROCESS_GROUP_LABELS, mode="livemostrecent"),
    _g("rankscope_process_group_last_completed_seq",
       "Sequence number of the last collective of the process group that completed on this rank.",
       PROCESS_GROUP_LABELS, mode="livemostrecent"),
    _g("rankscope_process_group_in_flight_started_timestamp_seconds",
       "Unix time at which the oldest collective of this op still in flight on the process group was "
       "enqueued; 0 when none is.", PROCESS_GROUP_LABELS + ("op",), mode="livemostrecent"),
    # replicas (rankscope.replicas): the fingerprint of what must be bit-identical on other ranks
    _g("rankscope_replica_fingerprint",
       "A check of the tensors this rank holds a replica of, every K steps: (step mod 2^27) x 2^26 + the sum of "
       "their bits as integers folded to 26 bits; equal on two ranks exactly when they checked the same step and "
       "hold the same bits. replicas: ddp or the mesh dimension they are replicated on; group: the process group "
       "(its name); shard: which part of the model; of: weights (after the optimizer step) or grads (reduced, "
       "before it); part: all, or the index of a run of consecutive parameters whose first is param; slot: the "
       "check number mod 2 (the last two checks).", REPLICA_LABELS, mode="livemostrecent"),
    _g("rankscope_replica_group_size",
       "Ranks of the process group that hold a replica of the same tensors as this rank (its replica set's "
       "group): a check is judged once a majority of them, or all, have made it.", REPLICA_LABELS[:3],
       mode="livemostrecent"),
    # memory
    _g("rankscope_device_memory_allocated_bytes", "Bytes currently allocated by the CUDA caching allocator."),
    _g("rankscope_device_memory_reserved_bytes", "Bytes currently reserved by the CUDA caching allocator."),
    _g("rankscope_device_memory_peak_allocated_bytes", "Peak bytes allocated by the CUDA caching allocator."),
    _g("rankscope_device_memory_total_bytes", "Total memory of the rank's device."),
    _c("rankscope_alloc_retries_total", "Allocator retries after a failed cudaMalloc (cache flush and retry)."),
    _c("rankscope_oom_total", "Out-of-memory errors raised inside a monitored step."),
    _g("rankscope_host_memory_rss_bytes", "Resident set size of the rank process."),
    _g("rankscope_host_memory_limit_bytes", "Memory limit of the rank's cgroup, or the host's total memory."),
    # self-telemetry
    _c("rankscope_spans_dropped_total", "Spans dropped or failed to export (queue full, collector down)."),
    _c("rankscope_telemetry_errors_total",
       "Errors inside rankscope's own telemetry, by component; training continued.", ("component",)),
    _c("rankscope_telemetry_dropped_total",
       "Values rankscope threw away, by kind (a full buffer, an unreadable or late value); training continued.",
       ("what",)),
)

# A step's values together (the step, its time, loss, gradient norm, learning rate): the publisher
# writes them in one stretch between two fences, and the exporter reads the file again while the
# fences differ (a seqlock across processes; rankscope.exporter.reader). Written, never exported.
VALUES_FENCE_BEGIN = PREFIX + "values_fence_begin"   # written first
VALUES_FENCE_END = PREFIX + "values_fence_end"       # written last
FENCE_METRICS: tuple[MetricSpec, ...] = (
    _g(VALUES_FENCE_END, "How many times the publisher finished writing a step's values (internal)."),
    _g(VALUES_FENCE_BEGIN, "How many times the publisher began writing a step's values (internal)."),
)

# Names a user-declared metric may not take (see Monitor.custom).
USER_PREFIX = PREFIX + "user_"

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in RANK_METRICS}
