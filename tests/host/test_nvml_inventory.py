"""`RealNvml.inventory` over the real `pynvml` wrappers and a stand-in libnvidia-ml (tests/fakes/libnvml.py): the
driver version, each GPU, and which calls this driver answers, as `gpu-node-agent doctor` shows them."""

from __future__ import annotations

import pynvml

from agent.host.nvml import RealNvml, SimulatedNvml
from tests.fakes.libnvml import StandInGpu, StandInLibNvml


def test_a_current_driver_answers_every_call_the_health_checks_make():
    library = StandInLibNvml([StandInGpu("GPU-a"), StandInGpu("GPU-b")])
    with library.install():
        inventory = RealNvml(pynvml).inventory()
    assert inventory.driver_version == "570.124.06"
    assert [(g.index, g.uuid, g.name) for g in inventory.gpus] == [(0, "GPU-a", "NVIDIA H100 80GB HBM3"),
                                                                   (1, "GPU-b", "NVIDIA H100 80GB HBM3")]
    support = inventory.support
    assert support["nvlink_state_field"] == "yes" and support["recovery_action_field"] == "yes"
    assert support["fabric_info"] == "v3" and support["process_list"] == "v3" and support["event_set"] == "yes"
    assert support["remapped_rows"] == "no"  # the stand-in has no nvmlDeviceGetRemappedRows: FUNCTION_NOT_FOUND
    assert library.holders() == ["1 NVML session(s)"]  # the probe's event set is freed; the port's session stays


def test_an_older_driver_is_named_by_what_it_lacks():
    library = StandInLibNvml([StandInGpu("GPU-a", link_state_field=False,
                                         recovery_return=pynvml.NVML_ERROR_NOT_SUPPORTED)], old_driver=True)
    with library.install():
        support = RealNvml(pynvml).inventory().support
    assert support["nvlink_state_field"] == "no" and support["recovery_action_field"] == "no"
    assert support["process_list"] == "v2"


def test_the_simulated_port_reports_its_unsupported_groups():
    nvml = SimulatedNvml({"0000:1b:00.0": "GPU-a"}, nvlinks=18, fabric=True)
    nvml.set_unsupported("GPU-a", "recovery_action", "events")
    inventory = nvml.inventory()
    assert inventory.gpus[0].bus_id == "0000:1b:00.0"
    assert inventory.support["recovery_action_field"] == "no" and inventory.support["event_set"] == "no"
    assert inventory.support["nvlink_state_field"] == "yes"
