import os

import pytest


@pytest.fixture(autouse=True)
def _no_leaked_multiproc_dir():
    """An in-process Monitor sets PROMETHEUS_MULTIPROC_DIR (it must stay set for
    prometheus_client); jobs started by later tests would inherit it and refuse
    to start, so each test gets the variable back as it found it."""
    before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    yield
    if before is None:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = before
