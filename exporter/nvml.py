"""Per-GPU readings through NVML (nvidia-ml-py's ``pynvml``).

NVML is initialised once. On a machine without the NVIDIA driver
``nvmlInit`` raises ``NVMLError_LibraryNotFound``; that is remembered (a
retry costs ~30 us and never succeeds) and the collector yields nothing. A
reading a device does not support (power on some boards, ECC on consumer
cards) is left out rather than failing the whole GPU.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from rankscope.exporter.catalog import BY_NAME, THROTTLE_REASONS

log = logging.getLogger("rankscope.exporter")

# NVML's clocks-event (throttle) reason bits, by our label value.
_THROTTLE_BITS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
assert set(_THROTTLE_BITS) == set(THROTTLE_REASONS)


class NvmlCollector:
    def __init__(self, node: str, nvml: Any = None):
        self.node = node
        self.available = False
        self.error: str | None = None
        self._xid_counts: dict[int, int] = {}
        self._last_xid: dict[int, int] = {}
        self._event_set = None
        try:
            if nvml is None:
                import pynvml as nvml
            self.nvml = nvml
            nvml.nvmlInit()
            self.available = True
            self.count = nvml.nvmlDeviceGetCount()
            self._handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self.count)]
            self.driver = _str(nvml.nvmlSystemGetDriverVersion())
            self._watch_xids()
        except Exception as e:  # no driver (the common CPU case) or a broken one
            self.available = False
            self.error = f"{type(e).__name__}: {e}"
            self.no_driver = type(e).__name__ in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded",
                                                  "ModuleNotFoundError")
            log.info("NVML unavailable (%s): no GPU series", self.error)

    @property
    def healthy(self) -> bool:
        """False where NVML is there but failed (a broken driver); no driver at all is a CPU node, not a failure."""
        return not (self.error and not getattr(self, "no_driver", False))

    def _watch_xids(self) -> None:
        nvml = self.nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
            for h in self._handles:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._event_set)
        except Exception as e:  # not supported on every board / in every container
            log.info("XID events unavailable: %s", e)
            self._event_set = None

    def _drain_xids(self) -> None:
        if self._event_set is None:
            return
        nvml = self.nvml
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, 0)
            except Exception:  # NVML_ERROR_TIMEOUT: no pending event
                return
            index = next((i for i, h in enumerate(self._handles) if _same(h, data.device)), 0)
            self._xid_counts[index] = self._xid_counts.get(index, 0) + 1
            self._last_xid[index] = int(data.eventData)

    def snapshot(self, uuid: str) -> dict:
        """The GPU ``uuid`` now: utilisation, clocks, power, temperature, throttle reasons, ECC, Xid, memory."""
        nvml = self.nvml
        self._drain_xids()
        for i, h in enumerate(self._handles):
            if _str(_try(lambda: nvml.nvmlDeviceGetUUID(h)) or "") == uuid:
                return {"uuid": uuid, "gpu": i, **_snapshot(nvml, h), "xid_errors": self._xid_counts.get(i, 0),
                        "last_xid": self._last_xid.get(i, 0)}
        return {"uuid": uuid, "error": "no GPU of this node has this UUID"}

    def collect(self) -> Iterator[Metric]:
        if not self.available:
            return
        nvml = self.nvml
        self._drain_xids()
        fam = {name: (CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily)(
            name, spec.help, labels=spec.label_names) for name, spec in BY_NAME.items() if name.startswith("rankscope_gpu_")}
        for i, h in enumerate(self._handles):
            uuid = _str(_try(lambda: nvml.nvmlDeviceGetUUID(h)) or "")
            labels = [self.node, str(i), uuid]
            fam["rankscope_gpu_info"].add_metric(labels + [_str(_try(lambda: nvml.nvmlDeviceGetName(h)) or ""),
                                                           self.driver], 1.0)
            util = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
            if util is not None:
                fam["rankscope_gpu_utilization_ratio"].add_metric(labels, util.gpu / 100.0)
                fam["rankscope_gpu_memory_utilization_ratio"].add_metric(labels, util.memory / 100.0)
            mem = _try(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
            if mem is not None:
                fam["rankscope_gpu_memory_used_bytes"].add_metric(labels, float(mem.used))
                fam["rankscope_gpu_memory_total_bytes"].add_metric(labels, float(mem.total))
            _put(fam, "rankscope_gpu_power_watts", labels, _try(lambda: nvml.nvmlDeviceGetPowerUsage(h)), 1e-3)
            _put(fam, "rankscope_gpu_power_limit_watts", labels,
                 _try(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(h)), 1e-3)
            _put(fam, "rankscope_gpu_energy_joules_total", labels,
                 _try(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)), 1e-3)
            _put(fam, "rankscope_gpu_temperature_celsius", labels,
                 _try(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)), 1.0)
            _put(fam, "rankscope_gpu_sm_clock_hertz", labels,
                 _try(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)), 1e6)
            reasons = _try(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
            if reasons is None:
                reasons = _try(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
            if reasons is not None:
                for reason, bit in _THROTTLE_BITS.items():
                    fam["rankscope_gpu_throttled"].add_metric(labels + [reason], 1.0 if reasons & bit else 0.0)
            for kind, err_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                                   ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
                count = _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(h, err_type, nvml.NVML_VOLATILE_ECC))
                if count is not None:
                    fam["rankscope_gpu_ecc_errors_total"].add_metric(labels + [kind], float(count))
            fam["rankscope_gpu_xid_errors_total"].add_metric(labels, float(self._xid_counts.get(i, 0)))
            fam["rankscope_gpu_last_xid"].add_metric(labels, float(self._last_xid.get(i, 0)))
        yield from fam.values()


def _snapshot(nvml: Any, h: Any) -> dict:
    """One GPU's state now, for an evidence capture (rankscope.exporter.evidence)."""
    out: dict[str, Any] = {}
    util = _try(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
    if util is not None:
        out["utilization_ratio"], out["memory_utilization_ratio"] = util.gpu / 100.0, util.memory / 100.0
    mem = _try(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
    if mem is not None:
        out["memory_used_bytes"], out["memory_total_bytes"] = float(mem.used), float(mem.total)
    for key, fn, scale in (("sm_clock_hertz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), 1e6),
                           ("memory_clock_hertz", lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM), 1e6),
                           ("power_watts", lambda: nvml.nvmlDeviceGetPowerUsage(h), 1e-3),
                           ("temperature_celsius",
                            lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU), 1.0)):
        value = _try(fn)
        if value is not None:
            out[key] = float(value) * scale
    reasons = _try(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
    if reasons is None:
        reasons = _try(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
    if reasons is not None:
        out["throttle_reasons"] = [reason for reason, bit in _THROTTLE_BITS.items() if reasons & bit]
    for kind, err_type in (("corrected", nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED),
                           ("uncorrected", nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED)):
        count = _try(lambda: nvml.nvmlDeviceGetTotalEccErrors(h, err_type, nvml.NVML_VOLATILE_ECC))
        if count is not None:
            out[f"ecc_{kind}"] = float(count)
    return out


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _put(fam: dict, name: str, labels: list[str], value: Any, scale: float) -> None:
    if value is not None:
        fam[name].add_metric(labels, float(value) * scale)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _same(a: Any, b: Any) -> bool:
    try:
        import ctypes

        return ctypes.addressof(a.contents) == ctypes.addressof(b.contents)
    except Exception:
        return a == b
