"""The TensorBoard backend: one event-file directory per run, ``<tensorboard_dir>/<run slug>``.

TensorBoard (through ``torch.utils.tensorboard``) is imported only when the writer thread
opens the backend; ``check_directory`` says at start-up whether it can work.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from rankscope.contract.environment import ConfigError
from rankscope.contract.rundir import run_slug
from rankscope.sinks import backend
from rankscope.sinks.summary import Record

EVENTS_TEXT_TAG = "rankscope/events"


def check_directory(directory: Path) -> Path:
    """``directory``, made; ConfigError without the tensorboard package or where it cannot be written."""
    if backend.missing("tensorboard"):
        raise ConfigError("tensorboard_dir is set but the tensorboard package is not installed: "
                          "pip install 'rankscope[tensorboard]'")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".rankscope-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{directory} cannot be written: {e.strerror or e}", field="tensorboard_dir") from None
    return directory


class TensorBoardBackend(backend.Backend):
    """One event-file directory, ``<tensorboard_dir>/<run slug>``; ``add_scalar`` per tag."""

    name = "tensorboard"
    reopen_after_error = True

    def __init__(self, directory: Path, run: str):
        self.log_dir = directory / run_slug(run)
        self.writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # flush_secs: the interval's flush() below writes each record; max_queue bounds the writer's own queue.
        self.writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=64, flush_secs=30)

    def write(self, record: Record) -> None:
        for tag, v in record.scalars.items():
            self.writer.add_scalar(tag, v, global_step=record.step, walltime=record.wall_time)
        if record.events:
            self.writer.add_text(EVENTS_TEXT_TAG, "  \n".join(record.events), global_step=record.step,
                                 walltime=record.wall_time)
        self.writer.flush()

    def close(self) -> int:
        if self.writer is not None:
            self.writer.close()
        return 0

    def reset(self) -> None:
        # TensorBoard's own writer thread dies on a write error (a full disk) and refuses every
        # later event: drop it, and let the next record start a new event file in the same run.
        writer, self.writer = self.writer, None
        try:
            if writer is not None:
                writer.close()
        except Exception:   # noqa: BLE001 - the same full disk
            pass
