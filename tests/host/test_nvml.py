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


def test_real_nvml_reads_mig_devices_and_names_their_profiles():
    """nvmlDeviceGetMaxMigDeviceCount slots (NOT_FOUND: empty), GI/CI ids, and the profile from the slice counts
    and memory as go-nvlib names it: an H100 80GB's 1-slice device is 1g.10gb, a 1-of-2-slice CI 1c.2g.20gb."""
    import types as _types

    class _NotFound(_NvmlError):
        value = 6

    lib = _library(["00000000:3B:00.0", "00000000:86:00.0"])
    lib.nvmlDeviceGetMigMode = lambda h: (1, 1) if h == 0 else (0, 0)
    lib.nvmlDeviceGetMemoryInfo = lambda h: _types.SimpleNamespace(total=81559 << 20)
    lib.nvmlDeviceGetMaxMigDeviceCount = lambda h: 3
    migs = {0: ("MIG-a", 3, 0, 1, 1, 9984), 2: ("MIG-b", 1, 1, 2, 1, 19968)}

    def handle(parent, slot):
        if slot not in migs:
            raise _NotFound("not found")
        return ("mig", slot)

    lib.nvmlDeviceGetMigDeviceHandleByIndex = handle
    real_uuid = lib.nvmlDeviceGetUUID
    lib.nvmlDeviceGetUUID = lambda h: migs[h[1]][0] if isinstance(h, tuple) else real_uuid(h)
    lib.nvmlDeviceGetGpuInstanceId = lambda h: migs[h[1]][1]
    lib.nvmlDeviceGetComputeInstanceId = lambda h: migs[h[1]][2]
    lib.nvmlDeviceGetAttributes = lambda h: _types.SimpleNamespace(
        gpuInstanceSliceCount=migs[h[1]][3], computeInstanceSliceCount=migs[h[1]][4], memorySizeMB=migs[h[1]][5])
    found = RealNvml(lib).mig_devices()
    assert list(found) == ["0000:3b:00.0"]
    assert [(m.uuid, m.gpu_instance, m.compute_instance, m.profile) for m in found["0000:3b:00.0"]] == [
        ("MIG-a", 3, 0, "1g.10gb"), ("MIG-b", 1, 1, "1c.2g.20gb")]
