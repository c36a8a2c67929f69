"""The NVML port: the real one without a driver, with a stand-in library, and the simulated one."""

from __future__ import annotations

import logging
import types

from agent.host.nvml import RealNvml, SimulatedNvml


def test_real_nvml_without_a_driver_is_unavailable_not_fatal(caplog):
    # This machine has nvidia-ml-py but no libnvidia-ml.so: the real import path and real failure.
    nvml = RealNvml()
    with caplog.at_level(logging.WARNING):
        assert nvml.gpu_uuids() == {}
        assert nvml.available is False
    assert "NVML unavailable" in caplog.text
    assert caplog.text.count("NVML unavailable") == 1  # said once, not on every call


class _NvmlError(Exception):
    pass


class _GpuIsLost(_NvmlError):
    pass


def _library(bus_ids: list[str | None]) -> types.ModuleType:
    """A stand-in for pynvml with the same call shapes: GPU i is lost when its bus id is None."""
    lib = types.ModuleType("pynvml")
    lib.NVMLError = _NvmlError
    lib.nvmlInit = lambda: None
    lib.nvmlDeviceGetCount = lambda: len(bus_ids)
    lib.nvmlDeviceGetHandleByIndex = lambda i: i

    def pci_info(handle: int) -> types.SimpleNamespace:
        if bus_ids[handle] is None:
            raise _GpuIsLost("GPU is lost")
        return types.SimpleNamespace(busId=bus_ids[handle].encode())

    lib.nvmlDeviceGetPciInfo = pci_info
    lib.nvmlDeviceGetUUID = lambda h: f"GPU-{h}"
    return lib


def test_real_nvml_normalises_bus_ids_and_skips_lost_gpus(caplog):
    nvml = RealNvml(_library(["00000000:3B:00.0", None, "00000000:86:00.0", "garbage"]))
    with caplog.at_level(logging.WARNING):
        assert nvml.gpu_uuids() == {"0000:3b:00.0": "GPU-0", "0000:86:00.0": "GPU-2"}
    assert "GPU 1 skipped" in caplog.text and "GPU 3 skipped" in caplog.text
    assert nvml.available


def test_simulated_nvml_answers_with_the_profile_uuids():
    assert SimulatedNvml({"0000:1B:00.0": "GPU-x"}).gpu_uuids() == {"0000:1b:00.0": "GPU-x"}


def test_real_nvml_reads_minors_and_mig_mode():
    lib = _library(["00000000:3B:00.0", None, "00000000:86:00.0"])
    lib.nvmlDeviceGetMinorNumber = lambda h: {0: 2, 2: 0}[h]
    lib.nvmlDeviceGetMigMode = lambda h: (1, 1) if h == 2 else (0, 1)  # (current, pending) as pynvml returns
    nvml = RealNvml(lib)
    assert nvml.gpu_minors() == {"0000:3b:00.0": 2, "0000:86:00.0": 0}
    assert nvml.mig_gpus() == {"0000:86:00.0"}


def test_simulated_nvml_minors_follow_bus_order_and_mig_is_configurable():
    nvml = SimulatedNvml({"0000:86:00.0": "GPU-b", "0000:1b:00.0": "GPU-a"}, mig=["0000:86:00.0"])
    assert nvml.gpu_minors() == {"0000:1b:00.0": 0, "0000:86:00.0": 1}
    assert nvml.mig_gpus() == {"0000:86:00.0"}
