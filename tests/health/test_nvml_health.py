"""NVML for health: error translation in the real port (stand-in library), the simulated port's faults, and the
service's behaviour without NVML, with lost GPUs and with calls a GPU does not support."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import pynvml
import pytest

from agent.health.service import NvmlRequiredError
from agent.host.nvml import (
    GpuLostError,
    MemoryHealth,
    NvmlError,
    NvmlEvent,
    NvmlUnavailableError,
    RealNvml,
    SimulatedNvml,
)
from agent.simulate.node import SimulatedNode
from tests.fakes.kmsg import xid_record
from tests.fakes.polling import until
from tests.health.conftest import fast_config

LOST, NOT_SUPPORTED, TIMEOUT_CODE, UNKNOWN = (pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_NOT_SUPPORTED,
                                              pynvml.NVML_ERROR_TIMEOUT, pynvml.NVML_ERROR_UNKNOWN)


def _raise(code: int) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        raise pynvml.NVMLError(code)  # pynvml maps the code to NVMLError_GpuIsLost etc.
    return call


def _library(**overrides: Any) -> types.ModuleType:
    """A stand-in for pynvml: real exception classes and call shapes, values from the test."""
    lib = types.ModuleType("pynvml")
    lib.NVMLError = pynvml.NVMLError
    lib.nvmlInit = lambda: None
    lib.nvmlDeviceGetHandleByUUID = lambda uuid: f"h-{uuid}"
    lib.nvmlDeviceGetTotalEccErrors = lambda h, error, counter: 10 * error + counter + 1
    lib.nvmlDeviceGetRetiredPages = lambda h, cause: [0x1000] * (cause + 1)
    lib.nvmlDeviceGetRetiredPagesPendingStatus = lambda h: 0
    lib.nvmlDeviceGetRemappedRows = lambda h: (2, 1, 1, 0)
    lib.nvmlEventSetCreate = lambda: "set"
    lib.nvmlDeviceGetSupportedEventTypes = lambda h: 0x1 | 0x2 | 0x8 | 0x4
    lib.registered = {}
    lib.nvmlDeviceRegisterEvents = lambda h, mask, s: lib.registered.__setitem__(h, mask)
    lib.nvmlEventSetFree = lambda s: None
    lib.nvmlDeviceGetUUID = lambda h: h.removeprefix("h-")
    lib.nvmlDeviceGetTemperature = lambda h, sensor: 40
    for name, value in overrides.items():
        setattr(lib, name, value)
    return lib


def test_real_port_without_a_driver_reports_unavailable() -> None:
    nvml = RealNvml()  # nvidia-ml-py is installed, libnvidia-ml.so.1 is not
    with pytest.raises(NvmlUnavailableError):
        nvml.memory_health("GPU-x")
    with pytest.raises(NvmlUnavailableError):
        nvml.open_events(["GPU-x"])
    assert nvml.unavailable_reason


def test_real_port_reads_memory_health() -> None:
    health = RealNvml(_library()).memory_health("GPU-a")
    assert health == MemoryHealth("GPU-a", ecc_corrected_volatile=1, ecc_uncorrected_volatile=11,
                                  ecc_corrected_aggregate=2, ecc_uncorrected_aggregate=12, retired_pages_sbe=1,
                                  retired_pages_dbe=2, retired_pages_pending=False, remapped_rows_corrected=2,
                                  remapped_rows_uncorrected=1, remap_pending=True, remap_failure=False)


def test_real_port_not_supported_per_call(caplog: pytest.LogCaptureFixture) -> None:
    nvml = RealNvml(_library(nvmlDeviceGetRemappedRows=_raise(NOT_SUPPORTED),
                             nvmlDeviceGetRetiredPages=_raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)))
    with caplog.at_level(logging.INFO):
        first = nvml.memory_health("GPU-a")
        nvml.memory_health("GPU-a")
    assert first.remap_pending is None and first.remapped_rows_corrected is None
    assert first.retired_pages_sbe is None and first.retired_pages_dbe is None
    assert first.ecc_corrected_volatile == 1 and first.retired_pages_pending is False
    assert caplog.text.count("remapped rows not supported") == 1  # said once per GPU and call


@pytest.mark.parametrize("where", ["nvmlDeviceGetHandleByUUID", "nvmlDeviceGetTotalEccErrors"])
@pytest.mark.parametrize("code", [LOST, pynvml.NVML_ERROR_RESET_REQUIRED])
def test_real_port_lost_gpu(where: str, code: int) -> None:
    with pytest.raises(GpuLostError) as info:
        RealNvml(_library(**{where: _raise(code)})).memory_health("GPU-a")
    assert info.value.uuid == "GPU-a"


def test_real_port_other_errors_are_nvml_errors() -> None:
    with pytest.raises(NvmlError) as info:
        RealNvml(_library(nvmlDeviceGetRemappedRows=_raise(UNKNOWN))).memory_health("GPU-a")
    assert not isinstance(info.value, GpuLostError)


def _event(uuid: str, kind: int, data: int = 0, instance: int = 0xFFFFFFFF) -> types.SimpleNamespace:
    return types.SimpleNamespace(device=f"h-{uuid}", eventType=kind, eventData=data, gpuInstanceId=instance)


def test_real_event_set_masks_registration_and_translates_events() -> None:
    waits: list[Any] = [pynvml.NVMLError(TIMEOUT_CODE), _event("GPU-a", 0x8, 79), _event("GPU-b", 0x8, 94, 5),
                        _event("GPU-a", 0x2), _event("GPU-a", 0x4)]

    def wait(event_set: Any, timeout_ms: int) -> Any:
        item = waits.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    def supported(handle: str) -> int:
        if handle == "h-GPU-c":
            raise pynvml.NVMLError(NOT_SUPPORTED)
        return 0x8 | 0x4 if handle == "h-GPU-b" else 0xF

    lib = _library(nvmlEventSetWait_v2=wait, nvmlDeviceGetSupportedEventTypes=supported)
    events = RealNvml(lib).open_events(["GPU-a", "GPU-b", "GPU-c"])
    assert lib.registered == {"h-GPU-a": 0xB, "h-GPU-b": 0x8}  # only Xid/SBE/DBE, only what is supported
    assert [events.wait(0.01) for _ in range(5)] == [
        [], [NvmlEvent("xid", "GPU-a", 79)], [NvmlEvent("xid", "GPU-b", 94, 5)], [NvmlEvent("dbe", "GPU-a")], []]
    events.close()


def test_real_event_set_finds_which_gpu_is_lost() -> None:
    def temperature(handle: str, sensor: int) -> int:
        if handle == "h-GPU-b":
            raise pynvml.NVMLError(LOST)
        return 40

    lib = _library(nvmlEventSetWait_v2=_raise(LOST), nvmlDeviceGetTemperature=temperature)
    events = RealNvml(lib).open_events(["GPU-a", "GPU-b"])
    assert events.wait(0.01) == [NvmlEvent("lost", "GPU-b")]
    with pytest.raises(NvmlError):  # still lost, nothing new: the watcher backs off
        events.wait(0.01)
    lost_at_open = RealNvml(_library(nvmlDeviceGetHandleByUUID=_raise(LOST))).open_events(["GPU-a"])
    assert lost_at_open.wait(0.01) == [NvmlEvent("lost", "GPU-a")]


def test_simulated_port_faults() -> None:
    nvml = SimulatedNvml({"0000:1b:00.0": "GPU-a", "0000:43:00.0": "GPU-b"})
    events = nvml.open_events(["GPU-a"])
    nvml.inject_xid("GPU-a", 48)
    nvml.inject_xid("GPU-b", 48)  # not watched by this set
    nvml.inject_ecc("GPU-a", corrected=3, uncorrected=1)
    assert events.wait(1) == [NvmlEvent("xid", "GPU-a", 48), NvmlEvent("sbe", "GPU-a"), NvmlEvent("dbe", "GPU-a")]
    assert events.wait(0.01) == []
    assert nvml.memory_health("GPU-a").ecc_corrected_aggregate == 3
    nvml.set_unsupported("GPU-a", "remapped_rows")
    assert nvml.memory_health("GPU-a").remap_pending is None
    nvml.lose_gpu("GPU-a")
    assert events.wait(1) == [NvmlEvent("lost", "GPU-a")]
    with pytest.raises(GpuLostError):
        nvml.memory_health("GPU-a")
    nvml.reset_gpu("GPU-a")
    after = nvml.memory_health("GPU-a")
    assert (after.ecc_corrected_volatile, after.ecc_corrected_aggregate) == (0, 3)
    events.close()
    absent = SimulatedNvml({"0000:1b:00.0": "GPU-a"}, available=False)
    assert absent.gpu_uuids() == {} and not absent.available
    with pytest.raises(NvmlUnavailableError):
        absent.open_events(["GPU-a"])


async def test_without_nvml_the_nvml_checks_are_unavailable_and_the_rest_runs(node: SimulatedNode, kmsg_file,
                                                                              start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file), nvml=RealNvml())
    checks = running.service.checks
    assert checks["nvml_events"].startswith("unavailable") and checks["nvml_poll"].startswith("unavailable")
    assert checks["kmsg"] == "ok" and checks["links"] == "ok"
    assert running.registry.get_sample_value("gpu_node_agent_health_check_up", {"check": "nvml_poll"}) == 0
    assert running.registry.get_sample_value("gpu_node_agent_health_check_up", {"check": "kmsg"}) == 1
    gpu = node.topology().gpus[2]
    with kmsg_file.open("a") as log:
        log.write(xid_record(1, "0000:52:00", 95))
    await until(lambda: running.service.verdict.verdict == "isolate")
    assert running.health().get(gpu.uuid) is False  # (unknownHealthAction marks every GPU Unhealthy already)


async def test_require_nvml_fails_loudly(node: SimulatedNode, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file, require_nvml=True), wait_first_pass=False,
                                  nvml=SimulatedNvml(node.profile.gpu_uuids, available=False))
    with pytest.raises(NvmlRequiredError, match="require-nvml"):
        await running.task


async def test_lost_gpu_is_unhealthy_until_nvml_answers_again(node: SimulatedNode, kmsg_file,
                                                              start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file))
    uuid = node.topology().gpus[1].uuid
    node.nvml.lose_gpu(uuid)
    await until(lambda: running.health().get(uuid) is False)
    assert running.service.verdict.verdict == "drain"
    node.nvml.reset_gpu(uuid)
    await until(lambda: running.health().get(uuid) is True)
    assert running.service.verdict.verdict == "healthy"


async def test_unsupported_calls_skip_their_checks_only(node: SimulatedNode, kmsg_file, start_service) -> None:
    gpus = node.topology().gpus
    node.nvml.set_unsupported(gpus[0].uuid, "ecc", "remapped_rows", "events")
    running = await start_service(node, fast_config(kmsg_file))
    await until(lambda: running.service.nvml_poll.polls >= 2)
    labels = {"gpu": "0", "uuid": gpus[0].uuid, "pci_bus_id": "0000:1b:00.0"}
    get = running.registry.get_sample_value
    assert get("gpu_node_agent_row_remap_pending", labels) is None
    assert get("gpu_node_agent_retired_pages_pending", labels) == 0
    assert get("gpu_node_agent_row_remap_pending", {**labels, "gpu": "1", "uuid": gpus[1].uuid,
                                                    "pci_bus_id": "0000:43:00.0"}) == 0
    assert running.service.checks["nvml_poll"] == "ok" and running.service.verdict.verdict == "healthy"
    node.nvml.inject_xid(gpus[1].uuid, 48)  # the other GPUs' events still flow
    await until(lambda: running.health().get(gpus[1].uuid) is False)


async def test_memory_findings(node: SimulatedNode, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file))
    gpus = node.topology().gpus
    a, b = gpus[3].uuid, gpus[4].uuid
    labels = {"gpu": "3", "uuid": a, "pci_bus_id": "0000:61:00.0"}
    node.nvml.set_memory(a, remap_pending=True)
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_gpu_reset_pending", labels) == 1,
                "the pending remap advises a reset")
    # an advisory: the GPU stays in service and the node healthy (NVIDIA: new work can still be launched)
    assert running.registry.get_sample_value("gpu_node_agent_row_remap_pending", labels) == 1
    assert running.health().get(a) is not False and running.service.verdict.verdict == "healthy"
    assert running.service.verdict.reset_advised == (a,)
    node.nvml.reset_gpu(a)  # applies the remap
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_gpu_reset_pending", labels) == 0,
                "the reset ends the advisory")
    node.nvml.inject_ecc(b, corrected=5)
    await until(lambda: running.service.verdict.verdict == "degraded")
    assert b not in running.health()  # degraded is a node verdict, not device health
    ecc = {"gpu": "4", "uuid": b, "pci_bus_id": "0000:9d:00.0", "error_type": "corrected",
           "counter_type": "aggregate"}
    await until(lambda: running.registry.get_sample_value("gpu_node_agent_ecc_errors_total", ecc) == 5)


async def test_volatile_ecc_zeroed_is_a_reset(node: SimulatedNode, kmsg_file, start_service) -> None:
    running = await start_service(node, fast_config(kmsg_file))
    uuid = node.topology().gpus[5].uuid
    node.nvml.inject_ecc(uuid, uncorrected=2)
    await until(lambda: running.service.nvml_poll.polls >= 2)
    node.nvml.inject_xid(uuid, 48)
    await until(lambda: running.health().get(uuid) is False)
    polls = running.service.nvml_poll.polls
    await until(lambda: running.service.nvml_poll.polls >= polls + 2)
    assert running.health()[uuid] is False  # a reset-class Xid stays until a reset is seen
    node.nvml.reset_gpu(uuid)
    await until(lambda: running.health().get(uuid) is True)


async def test_the_poll_resumes_when_nvml_comes_back(node: SimulatedNode, kmsg_file, start_service) -> None:
    """NVML can go away while the agent runs (a driver reload; a re-initialisation that fails right after a GPU
    reset closed the session): the poll check says so, keeps looking, and polls again once NVML answers."""
    running = await start_service(node, fast_config(kmsg_file))
    checks, poller = running.service.checks, running.service.nvml_poll
    node.nvml.set_available(False)
    await until(lambda: checks["nvml_poll"].startswith("unavailable"), "the poll says NVML is gone")
    node.nvml.set_available(True)
    polls = poller.polls
    await until(lambda: checks["nvml_poll"] == "ok" and poller.polls > polls, "the poll running again")
    assert running.registry.get_sample_value("gpu_node_agent_health_check_up", {"check": "nvml_poll"}) == 1
