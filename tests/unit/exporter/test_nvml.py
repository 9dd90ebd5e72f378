"""The exporter's NVML collector. No GPU here, so these run it against a
stand-in pynvml module (the only fake in the suite: NVML cannot run without a
driver); tests/gpu/test_gpu.py checks the same collector on a real GPU."""

from __future__ import annotations

import types

import pynvml

from rankscope.exporter.nvml import NvmlCollector


def fake_nvml(devices: int = 2, fail: set[str] = frozenset()):
    calls: dict[str, int] = {}

    def fn(name, result):
        def call(*args):
            calls[name] = calls.get(name, 0) + 1
            if name in fail:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return result(*args) if callable(result) else result
        return call

    m = types.SimpleNamespace(**{k: getattr(pynvml, k) for k in dir(pynvml) if k.isupper() or k.startswith("nvmlEventType")})
    m.nvmlInit = fn("init", None)
    m.nvmlDeviceGetCount = fn("count", devices)
    m.nvmlDeviceGetHandleByIndex = fn("handle", lambda i: f"h{i}")
    m.nvmlSystemGetDriverVersion = fn("driver", b"550.54")
    m.nvmlDeviceGetUUID = fn("uuid", lambda h: f"GPU-{h}")
    m.nvmlDeviceGetName = fn("name", "NVIDIA H200")
    m.nvmlDeviceGetUtilizationRates = fn("util", types.SimpleNamespace(gpu=87, memory=40))
    m.nvmlDeviceGetMemoryInfo = fn("mem", types.SimpleNamespace(used=2 << 30, total=141 << 30))
    m.nvmlDeviceGetPowerUsage = fn("power", 350_000)                 # milliwatts
    m.nvmlDeviceGetEnforcedPowerLimit = fn("limit", 700_000)
    m.nvmlDeviceGetTotalEnergyConsumption = fn("energy", 5_000_000)  # millijoules
    m.nvmlDeviceGetTemperature = fn("temp", 61)
    m.nvmlDeviceGetClockInfo = fn("clock", 1980)                     # MHz
    m.nvmlDeviceGetCurrentClocksEventReasons = fn("reasons", 0x4 | 0x40)
    m.nvmlDeviceGetTotalEccErrors = fn("ecc", lambda h, kind, counter: 3 if kind == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0)
    m.nvmlEventSetCreate = fn("eventset", "set")
    m.nvmlDeviceRegisterEvents = fn("register", None)
    m.nvmlEventSetWait_v2 = fn("wait", lambda s, t: (_ for _ in ()).throw(pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)))
    return m, calls


def samples(collector):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in collector.collect() for s in f.samples}


def test_readings_are_converted_to_base_units_and_labelled():
    nvml, _ = fake_nvml()
    got = samples(NvmlCollector("n1", nvml=nvml))
    labels = (("gpu", "1"), ("node", "n1"), ("uuid", "GPU-h1"))
    assert got[("rankscope_gpu_utilization_ratio", labels)] == 0.87
    assert got[("rankscope_gpu_memory_total_bytes", labels)] == float(141 << 30)
    assert got[("rankscope_gpu_power_watts", labels)] == 350.0
    assert got[("rankscope_gpu_energy_joules_total", labels)] == 5000.0
    assert got[("rankscope_gpu_sm_clock_hertz", labels)] == 1.98e9
    assert got[("rankscope_gpu_temperature_celsius", labels)] == 61
    assert got[("rankscope_gpu_throttled", labels[:2] + (("reason", "sw_power_cap"),) + labels[2:])] == 1
    assert got[("rankscope_gpu_throttled", labels[:2] + (("reason", "gpu_idle"),) + labels[2:])] == 0
    assert got[("rankscope_gpu_ecc_errors_total", labels[:2] + (("type", "corrected"),) + labels[2:])] == 3
    info = [k for k in got if k[0] == "rankscope_gpu_info"]
    assert len(info) == 2 and dict(info[0][1])["driver_version"] == "550.54"


def test_unsupported_readings_are_left_out_not_fatal():
    nvml, _ = fake_nvml(devices=1, fail={"power", "ecc"})
    got = samples(NvmlCollector("n1", nvml=nvml))
    names = {k[0] for k in got}
    assert "rankscope_gpu_power_watts" not in names and "rankscope_gpu_ecc_errors_total" not in names
    assert "rankscope_gpu_utilization_ratio" in names


def test_no_driver_means_no_gpu_series_and_init_is_tried_once():
    collector = NvmlCollector("n1")        # the real pynvml: no driver on this machine
    assert not collector.available and collector.no_driver
    assert list(collector.collect()) == []
