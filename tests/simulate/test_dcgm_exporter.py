"""The simulated dcgm-exporter writes dcgm-exporter's exact text, and the Prometheus parser reads it.

Raw lines are checked where byte layout matters (label order, NVML bus ids, value formatting); everything else
goes through `prometheus_client`'s parser, which is what a scraper would use. HTTP and the command line are in
test_dcgm_exporter_http.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from agent.host.busid import BusIdError
from agent.simulate.dcgm_exporter import ExporterGpu, SimulatedDcgmExporter, nvml_bus_id
from agent.simulate.dcgm_fields import FIELDS, OPTIONAL_FIELDS
from agent.simulate.node import simulated_topology

UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-11111111-1111-2222-3333-444444444444"
UUID2 = "GPU-22222222-1111-2222-3333-444444444444"
GPUS = [ExporterGpu(index=0, uuid=UUID0, bus_id="0000:1b:00.0"),
        ExporterGpu(index=1, uuid=UUID1, bus_id="0000:43:00.0")]
MIG_GPU = ExporterGpu(index=2, uuid=UUID2, bus_id="0000:52:00.0", mig=(("1g.10gb", 3), ("3g.40gb", 1)))
DEFAULT_FAMILIES = {name for name, f in FIELDS.items() if f.default} | {"DCGM_FI_DEV_XID_ERRORS"}
PREFIX0 = (f'gpu="0",UUID="{UUID0}",pci_bus_id="00000000:1B:00.0",device="nvidia0",'
           f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-1",DCGM_FI_DRIVER_VERSION="550.54.15"')


class FakeTime:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, family: str) -> list[tuple[dict[str, str], float]]:
    found = families(text).get(family)
    return [(s.labels, s.value) for s in found.samples] if found else []


def line(text: str, name: str, gpu: str = "0", extra: str = "") -> str:
    """The one raw sample line of `name` for GPU `gpu` whose text contains `extra`."""
    found = [ln for ln in text.splitlines() if ln.startswith(name + '{gpu="' + gpu + '"') and extra in ln]
    assert len(found) == 1, found
    return found[0]


@pytest.fixture
def clock() -> FakeTime:
    return FakeTime()


@pytest.fixture
def exporter(clock: FakeTime) -> SimulatedDcgmExporter:
    return SimulatedDcgmExporter(GPUS, xid_metrics=("gauge", "count", "total"), clock=clock)


# --- the text -------------------------------------------------------------------------------------------------


def test_a_rendered_line_has_dcgm_exporters_labels_in_its_order() -> None:
    text = SimulatedDcgmExporter(GPUS).render()
    assert line(text, "DCGM_FI_DEV_GPU_TEMP") == f"DCGM_FI_DEV_GPU_TEMP{{{PREFIX0}}} 27"
    assert line(text, "DCGM_FI_DEV_POWER_USAGE") == f"DCGM_FI_DEV_POWER_USAGE{{{PREFIX0}}} 69.250000"
    assert text.startswith("# HELP DCGM_FI_DEV_SM_CLOCK SM clock frequency (in MHz).\n"
                           "# TYPE DCGM_FI_DEV_SM_CLOCK gauge\nDCGM_FI_DEV_SM_CLOCK{gpu=\"0\",")
    assert text.endswith("\n")
    assert "\n\n" not in text


@pytest.mark.parametrize(("bus_id", "nvml"), [("0000:1b:00.0", "00000000:1B:00.0"),
                                              ("0001:c3:1f.7", "00000001:C3:1F.7"),
                                              ("00000000:3B:00.0", "00000000:3B:00.0")])
def test_bus_ids_render_in_nvml_form(bus_id: str, nvml: str) -> None:
    assert nvml_bus_id(bus_id) == nvml


def test_a_bad_bus_id_is_refused() -> None:
    with pytest.raises(BusIdError):
        nvml_bus_id("1b:00.0")


def test_stock_families_parse_with_help_type_and_one_sample_per_gpu() -> None:
    parsed = families(SimulatedDcgmExporter(GPUS).render())
    assert set(parsed) == DEFAULT_FAMILIES
    for name, family in parsed.items():
        assert family.type == FIELDS[name].prom_type
        assert family.documentation == FIELDS[name].help
        assert [s.labels["gpu"] for s in family.samples] == ["0", "1"]
    xid = parsed["DCGM_FI_DEV_XID_ERRORS"].samples[0]
    assert xid.labels == {"gpu": "0", "UUID": UUID0, "pci_bus_id": "00000000:1B:00.0", "device": "nvidia0",
                          "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "node-1",
                          "DCGM_FI_DRIVER_VERSION": "550.54.15"}


def test_optional_fields_render_only_once_set_then_for_every_gpu(exporter: SimulatedDcgmExporter) -> None:
    assert not set(OPTIONAL_FIELDS) & set(families(exporter.render()))
    exporter.set_field(UUID1, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", 2)
    text = exporter.render()
    assert samples(text, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL") == [
        ({**samples(text, "DCGM_FI_DEV_GPU_TEMP")[0][0]}, 0), ({**samples(text, "DCGM_FI_DEV_GPU_TEMP")[1][0]}, 2)]
    assert "# TYPE DCGM_FI_DEV_ECC_DBE_VOL_TOTAL counter\n" in text
    assert "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" not in text


def test_extra_fields_render_every_optional_field_with_zero() -> None:
    parsed = families(SimulatedDcgmExporter(GPUS, extra_fields=True).render())
    assert set(parsed) == DEFAULT_FAMILIES | set(OPTIONAL_FIELDS)
    assert "DCGM_FI_DEV_ROW_REMAP_PENDING" in parsed
    for name in OPTIONAL_FIELDS:
        assert [s.value for s in parsed[name].samples] == [0, 0]


def test_set_and_add_field(exporter: SimulatedDcgmExporter) -> None:
    exporter.add_to_field(UUID0, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 1)
    exporter.add_to_field(UUID0, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", 2)
    exporter.set_field(UUID1, "DCGM_FI_DEV_ROW_REMAP_FAILURE", 1)
    exporter.set_field(UUID0, "DCGM_FI_DEV_POWER_USAGE", 345.123)
    exporter.add_to_field(UUID1, "DCGM_FI_DEV_GPU_TEMP", 60)
    text = exporter.render()
    assert line(text, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS").endswith("} 3")
    assert line(text, "DCGM_FI_DEV_ROW_REMAP_FAILURE", "1").endswith("} 1")
    assert line(text, "DCGM_FI_DEV_POWER_USAGE").endswith("} 345.123000")  # Go's %f for DCGM doubles
    assert line(text, "DCGM_FI_DEV_GPU_TEMP", "1").endswith("} 88")


def test_per_lane_and_unknown_fields_can_be_set_by_name(exporter: SimulatedDcgmExporter) -> None:
    exporter.add_to_field(UUID1, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L17", 5)
    exporter.set_field(UUID0, "DCGM_FI_DEV_SOMETHING_NEW", 7)
    parsed = families(exporter.render())
    lane = parsed["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L17"]
    assert lane.type == "counter"
    sample_name = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L17_total"  # the parser's name for counter samples
    assert [(s.name, s.value) for s in lane.samples] == [(sample_name, 0), (sample_name, 5)]
    assert [s.value for s in parsed["DCGM_FI_DEV_SOMETHING_NEW"].samples] == [7, 0]


@pytest.mark.parametrize(("field", "value", "message"), [
    ("NOT_DCGM", 1, "not a DCGM field"),
    ("DCGM_FI_DEV_XID_ERRORS", 79, "inject_xid"),
    ("DCGM_FI_DEV_GPU_TEMP", 1.5, "integer field"),
])
def test_bad_field_settings_are_refused(exporter: SimulatedDcgmExporter, field: str, value: float,
                                        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        exporter.set_field(UUID0, field, value)


def test_unknown_gpus_and_bad_options_are_refused(exporter: SimulatedDcgmExporter) -> None:
    with pytest.raises(ValueError, match="no GPU"):
        exporter.inject_xid("GPU-nope", 79)
    with pytest.raises(ValueError, match="positive"):
        exporter.inject_xid(UUID0, 0)
    with pytest.raises(ValueError, match="no MIG GPU instance"):
        exporter.inject_xid(UUID0, 79, gpu_instance=1)
    with pytest.raises(ValueError, match="unknown xid metrics"):
        SimulatedDcgmExporter(GPUS, xid_metrics=("gauge", "histogram"))
    with pytest.raises(ValueError, match="uuid_label"):
        SimulatedDcgmExporter(GPUS, uuid_label="gpu_uuid")
    with pytest.raises(ValueError, match="unique"):
        SimulatedDcgmExporter([*GPUS, GPUS[0]])
    with pytest.raises(ValueError, match="label value"):
        exporter.assign_pod(UUID0, "default", 'bad"pod', "main")


# --- Xids -----------------------------------------------------------------------------------------------------


def test_xid_gauge_shows_the_last_code_and_zero_before_any(exporter: SimulatedDcgmExporter) -> None:
    assert [v for _, v in samples(exporter.render(), "DCGM_FI_DEV_XID_ERRORS")] == [0, 0]
    exporter.inject_xid(UUID1, 79)
    exporter.inject_xid(UUID1, 48, count=3)
    assert [v for _, v in samples(exporter.render(), "DCGM_FI_DEV_XID_ERRORS")] == [0, 48]


def test_xid_count_is_per_code_within_the_window_and_ages_out(exporter: SimulatedDcgmExporter,
                                                                clock: FakeTime) -> None:
    text = exporter.render()
    # Like the real collector: a GPU without Xids in the window has one 0 series without an `xid` label.
    assert line(text, "DCGM_EXP_XID_ERRORS_COUNT") == (
        f'DCGM_EXP_XID_ERRORS_COUNT{{{PREFIX0},window_size_in_ms="300000"}} 0')
    exporter.inject_xid(UUID0, 79)
    clock.now += 200
    exporter.inject_xid(UUID0, 79, count=2)
    exporter.inject_xid(UUID0, 13)
    text = exporter.render()
    assert line(text, "DCGM_EXP_XID_ERRORS_COUNT", extra='xid="79"') == (
        f'DCGM_EXP_XID_ERRORS_COUNT{{{PREFIX0},window_size_in_ms="300000",xid="79"}} 3')
    counts = {(labels["gpu"], labels.get("xid")): v for labels, v in samples(text, "DCGM_EXP_XID_ERRORS_COUNT")}
    assert counts == {("0", "13"): 1, ("0", "79"): 3, ("1", None): 0}
    clock.now += 101  # the first 79 is now 301 s old
    counts = {(labels["gpu"], labels.get("xid")): v
              for labels, v in samples(exporter.render(), "DCGM_EXP_XID_ERRORS_COUNT")}
    assert counts == {("0", "13"): 1, ("0", "79"): 2, ("1", None): 0}
    clock.now += 300
    counts = {(labels["gpu"], labels.get("xid")): v
              for labels, v in samples(exporter.render(), "DCGM_EXP_XID_ERRORS_COUNT")}
    assert counts == {("0", None): 0, ("1", None): 0}


def test_xid_window_length_is_an_option(clock: FakeTime) -> None:
    exporter = SimulatedDcgmExporter(GPUS, xid_metrics=("count",), xid_window_seconds=60, clock=clock)
    exporter.inject_xid(UUID0, 94)
    assert 'window_size_in_ms="60000",xid="94"} 1' in exporter.render()
    clock.now += 61
    assert 'xid="94"' not in exporter.render()
    assert "DCGM_FI_DEV_XID_ERRORS" not in exporter.render()


def test_xid_total_counts_since_start_and_exists_only_once_seen(exporter: SimulatedDcgmExporter,
                                                                 clock: FakeTime) -> None:
    assert "DCGM_EXP_XID_ERRORS_TOTAL" not in exporter.render()
    exporter.inject_xid(UUID1, 79, count=2)
    clock.now += 10_000
    exporter.inject_xid(UUID1, 79)
    exporter.inject_xid(UUID1, 31)
    text = exporter.render()
    assert "# TYPE DCGM_EXP_XID_ERRORS_TOTAL counter\n" in text
    assert line(text, "DCGM_EXP_XID_ERRORS_TOTAL", "1", 'xid="79"').endswith(',xid="79"} 3')
    total = families(text)["DCGM_EXP_XID_ERRORS_TOTAL"]
    assert [(s.name, s.labels["xid"], s.value) for s in total.samples] == [
        ("DCGM_EXP_XID_ERRORS_TOTAL_total", "31", 1), ("DCGM_EXP_XID_ERRORS_TOTAL_total", "79", 3)]


def test_a_stock_exporter_has_only_the_xid_gauge(clock: FakeTime) -> None:
    exporter = SimulatedDcgmExporter(GPUS, clock=clock)
    exporter.inject_xid(UUID0, 79)
    names = set(families(exporter.render()))
    assert "DCGM_FI_DEV_XID_ERRORS" in names
    assert not {"DCGM_EXP_XID_ERRORS_COUNT", "DCGM_EXP_XID_ERRORS_TOTAL"} & names


def test_the_xid_gauge_can_be_disabled() -> None:
    exporter = SimulatedDcgmExporter(GPUS, xid_metrics=("total",))
    exporter.inject_xid(UUID0, 79)
    assert set(families(exporter.render())) == DEFAULT_FAMILIES - {"DCGM_FI_DEV_XID_ERRORS"} | {
        "DCGM_EXP_XID_ERRORS_TOTAL"}


def test_inject_and_render_from_many_threads(exporter: SimulatedDcgmExporter) -> None:
    def inject() -> None:
        for _ in range(200):
            exporter.inject_xid(UUID0, 79)
            exporter.add_to_field(UUID0, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", 1)

    threads = [threading.Thread(target=inject) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in range(20):
        families(exporter.render())
    for thread in threads:
        thread.join()
    text = exporter.render()
    assert line(text, "DCGM_EXP_XID_ERRORS_TOTAL").endswith("} 800")
    assert line(text, "DCGM_FI_DEV_PCIE_REPLAY_COUNTER").endswith("} 800")


# --- MIG, pods, old namespace, profiles -----------------------------------------------------------------------


def test_mig_instances_render_with_instance_labels(clock: FakeTime) -> None:
    exporter = SimulatedDcgmExporter([*GPUS, MIG_GPU], xid_metrics=("gauge", "count", "total"), clock=clock)
    exporter.inject_xid(UUID2, 79, gpu_instance=3)
    exporter.inject_xid(UUID2, 48)  # the whole GPU: every instance sees it
    exporter.set_field(UUID2, "DCGM_FI_DEV_FB_USED", 4096, gpu_instance=1)
    text = exporter.render()
    assert line(text, "DCGM_FI_DEV_GPU_TEMP", "2", 'GPU_I_ID="3"') == (
        f'DCGM_FI_DEV_GPU_TEMP{{gpu="2",UUID="{UUID2}",pci_bus_id="00000000:52:00.0",device="nvidia2",'
        'modelName="NVIDIA H100 80GB HBM3",GPU_I_PROFILE="1g.10gb",GPU_I_ID="3",Hostname="node-1",'
        'DCGM_FI_DRIVER_VERSION="550.54.15"} 29')
    assert [(labels["gpu"], labels.get("GPU_I_ID"), v) for labels, v in samples(text, "DCGM_FI_DEV_FB_USED")] == [
        ("0", None, 1), ("1", None, 1), ("2", "3", 1), ("2", "1", 4096)]
    totals = {(labels["gpu"], labels.get("GPU_I_PROFILE"), labels["xid"]): v
              for labels, v in samples(text, "DCGM_EXP_XID_ERRORS_TOTAL")}
    assert totals == {("2", "1g.10gb", "79"): 1, ("2", "1g.10gb", "48"): 1, ("2", "3g.40gb", "48"): 1}
    assert line(text, "DCGM_EXP_XID_ERRORS_COUNT", "2", 'GPU_I_ID="3",Hostname="node-1",'
                                                        'DCGM_FI_DRIVER_VERSION="550.54.15",'
                                                        'window_size_in_ms="300000",xid="79"').endswith("} 1")


def test_pod_attributes_follow_the_labels_sorted(exporter: SimulatedDcgmExporter) -> None:
    exporter.assign_pod(UUID1, namespace="team-a", pod="train-0", container="main")
    exporter.inject_xid(UUID1, 79)
    text = exporter.render()
    assert line(text, "DCGM_EXP_XID_ERRORS_TOTAL", "1").endswith(
        ',DCGM_FI_DRIVER_VERSION="550.54.15",xid="79",container="main",namespace="team-a",pod="train-0"} 1')
    assert line(text, "DCGM_FI_DEV_SM_CLOCK", "1").endswith(
        'Hostname="node-1",DCGM_FI_DRIVER_VERSION="550.54.15",container="main",namespace="team-a",pod="train-0"} 345')
    assert "pod=" not in line(text, "DCGM_FI_DEV_SM_CLOCK", "0")
    exporter.release_pod(UUID1)
    assert "pod=" not in exporter.render()


def test_the_old_namespace_labels_uuid_lower_case_and_empty_labels_are_left_out() -> None:
    exporter = SimulatedDcgmExporter(GPUS, uuid_label="uuid", hostname="", driver_version="")
    assert line(exporter.render(), "DCGM_FI_DEV_FB_FREE") == (
        f'DCGM_FI_DEV_FB_FREE{{gpu="0",uuid="{UUID0}",pci_bus_id="00000000:1B:00.0",device="nvidia0",'
        'modelName="NVIDIA H100 80GB HBM3"} 81004')


@pytest.mark.parametrize("profile", ["dgx-h100", "pcie-pairs", "vm-flat"])
def test_profile_gpus_are_numbered_like_the_agents_topology(profile: str, tmp_path: Path) -> None:
    exporter = SimulatedDcgmExporter.for_profile(profile, hostname="sim")
    topology = simulated_topology(profile, tmp_path)
    assert [(g.index, g.uuid, g.bus_id) for g in exporter.gpus] == [
        (g.index, g.uuid, g.bus_id) for g in topology.gpus]
    assert exporter.hostname == "sim"
    gpu2 = [labels for labels, _ in samples(exporter.render(), "DCGM_FI_DEV_XID_ERRORS") if labels["gpu"] == "2"]
    assert gpu2[0]["UUID"] == topology.gpus[2].uuid
    assert gpu2[0]["pci_bus_id"] == nvml_bus_id(topology.gpus[2].bus_id)


def test_profiles_name_their_gpu_model() -> None:
    assert {g.model for g in SimulatedDcgmExporter.for_profile("dgx-h100").gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.model for g in SimulatedDcgmExporter.for_profile("pcie-pairs").gpus} == {"Tesla V100-SXM2-16GB"}
