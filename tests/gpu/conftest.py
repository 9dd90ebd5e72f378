"""The GPU check's session: its figures file is written once, after every module's checks."""

from __future__ import annotations

import json
import os

import pytest

from tests.gpu.figures import FIGURES


@pytest.fixture(scope="session", autouse=True)
def figures_file():
    import torch

    if torch.cuda.is_available():
        FIGURES["device"] = torch.cuda.get_device_name(0)
        FIGURES["torch"] = torch.__version__
    yield
    out = os.environ.get("GPU_CHECK_OUT")
    if out and torch.cuda.is_available():
        with open(out, "w") as f:
            json.dump(FIGURES, f, indent=1, default=str)
