"""The DCGM interpreter on dcgm-exporter's own text: what a change between two scrapes means, and what it does not.

The text is written out line by line in the exporter's format (render_metrics.go: HELP/TYPE per field, labels
gpu, UUID, pci_bus_id in NVML form, device, modelName, MIG's GPU_I_PROFILE/GPU_I_ID, Hostname, then the
field's own labels and pod attributes), so these tests do not lean on the agent's own simulated exporter.
"""

from __future__ import annotations

import pytest

from agent.health.dcgm import (
    MAX_LABEL_TEXTS,
    XID_COUNT,
    XID_LAST,
    XID_TOTAL,
    DcgmInterpreter,
    MalformedScrapeError,
    NodeLines,
    Reading,
    parse_scrape,
)
from agent.simulate.node import SimulatedNode
from agent.topology.model import Topology

TYPES = {XID_LAST: "gauge", XID_COUNT: "gauge", "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
         "DCGM_FI_DEV_ROW_REMAP_PENDING": "gauge", "DCGM_FI_DEV_GPU_TEMP": "gauge"}


def _nvml_bus(bus_id: str) -> str:
    domain, rest = bus_id.split(":", 1)
    return f"0000{domain}:{rest}".upper()


def _series(topology: Topology, index: int, *, uuid: str | None = None, mig: tuple[str, int] | None = None,
            extra: dict[str, str] | None = None) -> str:
    gpu = topology.gpus[index]
    labels = [f'gpu="{index}"', f'UUID="{uuid if uuid is not None else gpu.uuid}"',
              f'pci_bus_id="{_nvml_bus(gpu.bus_id)}"', f'device="nvidia{index}"', 'modelName="NVIDIA H100 80GB HBM3"']
    if mig:
        labels += [f'GPU_I_PROFILE="{mig[0]}"', f'GPU_I_ID="{mig[1]}"']
    labels += ['Hostname="node-1"', 'DCGM_FI_DRIVER_VERSION="550.54.15"']
    labels += [f'{k}="{v}"' for k, v in sorted((extra or {}).items())]
    return "{" + ",".join(labels) + "}"


def exposition(topology: Topology, rows: list[tuple[str, int, float, dict[str, object]]]) -> str:
    """rows of (metric, gpu index, value, options) -> the exporter's text, one HELP/TYPE block per metric."""
    blocks: dict[str, list[str]] = {}
    for metric, index, value, options in rows:
        extra = {k: str(v) for k, v in options.items() if k not in ("uuid", "mig")}
        labels = _series(topology, index, uuid=options.get("uuid"), mig=options.get("mig"),  # type: ignore[arg-type]
                         extra=extra)
        blocks.setdefault(metric, []).append(f"{metric}{labels} {value:g}")
    text = []
    for metric, lines in blocks.items():
        text += [f"# HELP {metric} {metric} help.", f"# TYPE {metric} {TYPES.get(metric, 'counter')}", *lines]
    return "\n".join(text) + "\n"


@pytest.fixture
def topology(node: SimulatedNode) -> Topology:
    return node.topology()


def read(interp: DcgmInterpreter, topology: Topology, rows: list, now: float) -> Reading:
    return interp.read(parse_scrape(exposition(topology, rows)), now)


def test_parse_reads_gpu_identity_mig_and_series_labels(topology: Topology) -> None:
    text = exposition(topology, [(XID_TOTAL, 2, 3, {"xid": 79, "mig": ("1g.10gb", 5)}),
                                 ("DCGM_FI_DEV_GPU_TEMP", 0, 41, {"pod": "train-0", "namespace": "ml"})])
    text += '# TYPE DCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT gauge\nDCGM_FI_DEV_NVSWITCH_TEMPERATURE_CURRENT' \
            '{nvswitch="0",Hostname="node-1"} 40\n'
    text += '# TYPE DCGM_FI_DEV_ROW_REMAP_FAILURE gauge\nDCGM_FI_DEV_ROW_REMAP_FAILURE' \
            '{gpu="9",pci_bus_id="00000000:F1:00.0"} 0\n'
    scrape = parse_scrape(text)
    # Metrics the agent does not read (temperatures) are cut before parsing.
    assert scrape.metrics == {XID_TOTAL, "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
    by_metric = {s.metric: s for s in scrape.samples}
    assert set(by_metric) == {XID_TOTAL, "DCGM_FI_DEV_ROW_REMAP_FAILURE"}
    assert by_metric["DCGM_FI_DEV_ROW_REMAP_FAILURE"].bus_id == "0000:f1:00.0"  # no UUID label: bus id only
    xid = by_metric[XID_TOTAL]
    assert (xid.uuid, xid.bus_id, xid.instance, xid.series, xid.value) == (
        topology.gpus[2].uuid, topology.gpus[2].bus_id, "5", (("xid", "79"),), 3.0)


@pytest.mark.parametrize("text", [
    'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-',  # cut short: whatever the metric
    "DCGM_FI_DEV_XID_ERRORS{gpu=\"0\"} forty-one\n",
    "# TYPE DCGM_EXP_XID_ERRORS_TOTAL counter\nDCGM_EXP_XID_ERRORS_TOTAL{gpu=0} 1\n",
    "<html><body>404 page not found</body></html>\n",  # the wrong URL on a web server
])
def test_malformed_text_is_one_clear_error(text: str) -> None:
    with pytest.raises(MalformedScrapeError, match="not Prometheus text"):
        parse_scrape(text)


def test_a_broken_line_of_a_metric_the_agent_does_not_read_does_not_blind_it(topology: Topology) -> None:
    text = exposition(topology, [(XID_LAST, 0, 0, {})]) + 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} hot\n'
    assert [s.metric for s in parse_scrape(text).samples] == [XID_LAST]


def test_first_scrape_is_a_baseline_and_totals_count_what_is_new(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    first = read(interp, topology, [(XID_TOTAL, 1, 4, {"xid": 79}), (XID_LAST, 1, 79, {})], 0.0)
    assert first.baseline and first.xids == []  # four old Xid 79s are history, not news
    again = read(interp, topology, [(XID_TOTAL, 1, 4, {"xid": 79}), (XID_LAST, 1, 79, {})], 15.0)
    assert again.xids == []
    more = read(interp, topology, [(XID_TOTAL, 1, 6, {"xid": 79}), (XID_TOTAL, 3, 1, {"xid": 48}),
                                   (XID_LAST, 1, 79, {}), (XID_LAST, 3, 48, {})], 30.0)
    assert more.xid_metric == XID_TOTAL
    assert [(x.gpu.index, x.code, x.count) for x in more.xids] == [(1, 79, 2), (3, 48, 1)]
    # The exporter restarted: its totals start again from zero, so what it shows now is all new.
    restarted = read(interp, topology, [(XID_TOTAL, 1, 1, {"xid": 79}), (XID_LAST, 1, 79, {})], 45.0)
    assert [(x.gpu.index, x.code, x.count) for x in restarted.xids] == [(1, 79, 1)]


def test_window_counts_rise_with_new_xids_and_fall_silently(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    window = {"window_size_in_ms": 300000}
    read(interp, topology, [(XID_COUNT, 0, 1, {"xid": 13, **window})], 0.0)
    rose = read(interp, topology, [(XID_COUNT, 0, 3, {"xid": 13, **window}),
                                   (XID_COUNT, 4, 1, {"xid": 94, **window})], 15.0)
    assert rose.xid_metric == XID_COUNT
    assert [(x.gpu.index, x.code, x.count) for x in rose.xids] == [(0, 13, 2), (4, 94, 1)]
    aged = read(interp, topology, [(XID_COUNT, 0, 1, {"xid": 13, **window})], 30.0)
    assert aged.xids == []  # Xids leaving the window are not new ones


def test_last_xid_gauge_sees_a_change_not_a_count(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    read(interp, topology, [(XID_LAST, 0, 0, {}), (XID_LAST, 5, 31, {})], 0.0)
    changed = read(interp, topology, [(XID_LAST, 0, 79, {}), (XID_LAST, 5, 31, {})], 15.0)
    assert changed.xid_metric == XID_LAST
    assert [(x.gpu.index, x.code, x.count) for x in changed.xids] == [(0, 79, 1)]
    # Two more Xid 79s between scrapes leave the gauge where it was: the documented blind spot of this metric.
    same = read(interp, topology, [(XID_LAST, 0, 79, {}), (XID_LAST, 5, 31, {})], 30.0)
    assert same.xids == []


def test_gauge_then_counted_metric_reports_one_xid_once(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    read(interp, topology, [(XID_LAST, 2, 0, {})], 0.0)
    # The gauge moves before the exporter's total has its first series for this GPU ...
    gauge = read(interp, topology, [(XID_LAST, 2, 79, {})], 15.0)
    assert [(x.code, x.count, x.metric) for x in gauge.xids] == [(79, 1, XID_LAST)]
    # ... and the total's new series a scrape later is the same Xid, not a second one.
    total = read(interp, topology, [(XID_LAST, 2, 79, {}), (XID_TOTAL, 2, 1, {"xid": 79})], 30.0)
    assert total.xids == []
    later = read(interp, topology, [(XID_LAST, 2, 79, {}), (XID_TOTAL, 2, 2, {"xid": 79})], 45.0)
    assert [(x.code, x.count) for x in later.xids] == [(79, 1)]


def test_nvlink_lifetime_totals_are_never_judged_only_their_increase(topology: Topology) -> None:
    interp = DcgmInterpreter(topology, nvlink_errors_per_minute=0.0)
    flit = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
    replay = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"
    lane = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_L3"
    assert read(interp, topology, [(flit, 0, 912345, {}), (replay, 0, 5000, {}), (lane, 0, 5000, {})],
                0.0).growth == []
    quiet = read(interp, topology, [(flit, 0, 912345, {}), (replay, 0, 5000, {}), (lane, 0, 5000, {})], 60.0)
    assert quiet.growth == []  # a huge lifetime count that does not move is a healthy link
    grew = read(interp, topology, [(flit, 0, 912345, {}), (replay, 0, 5003, {}), (lane, 0, 5003, {})], 120.0)
    assert [(g.gpu.index, g.kind, g.increase) for g in grew.growth] == [(0, "nvlink", 3.0)]  # lane not added again
    assert "+3 replay" in grew.growth[0].detail


def test_rates_below_their_threshold_are_not_findings(topology: Topology) -> None:
    interp = DcgmInterpreter(topology, nvlink_errors_per_minute=10.0, pcie_replays_per_minute=8.0)
    pcie, crc = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"
    read(interp, topology, [(pcie, 6, 100, {}), (crc, 6, 0, {})], 0.0)
    slow = read(interp, topology, [(pcie, 6, 107, {}), (crc, 6, 9, {})], 60.0)  # 7/min and 9/min
    assert slow.growth == []
    fast = read(interp, topology, [(pcie, 6, 127, {}), (crc, 6, 30, {})], 120.0)  # 20/min and 21/min
    assert sorted((g.gpu.index, g.kind, g.increase) for g in fast.growth) == [(6, "nvlink", 21.0),
                                                                             (6, "pcie_replay", 20.0)]
    reset = read(interp, topology, [(pcie, 6, 0, {}), (crc, 6, 0, {})], 180.0)
    assert reset.growth == []  # a GPU reset zeroes the counters: a new baseline, not a negative rate


def test_ecc_growth_and_memory_flags(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    dbe, remapped = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
    first = read(interp, topology, [(dbe, 3, 2, {}), (remapped, 3, 1, {}),
                                    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", 3, 1, {})], 0.0)
    assert first.growth == []  # old errors are history
    assert [(f.gpu.index, f.name, f.active) for f in first.flags] == [(3, "remap_failure", True)]  # state is now
    grew = read(interp, topology, [(dbe, 3, 2, {}), (remapped, 3, 2, {}),
                                   ("DCGM_FI_DEV_ROW_REMAP_FAILURE", 3, 0, {})], 15.0)
    assert [(g.gpu.index, g.kind) for g in grew.growth] == [(3, "dbe")]
    assert [(f.name, f.active) for f in grew.flags] == [("remap_failure", False)]


def test_gpus_of_another_node_are_unknown_never_matched_by_bus_id(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    stranger = "GPU-00000000-1111-2222-3333-444444444444"
    reading = read(interp, topology, [(XID_LAST, 0, 0, {}), (XID_LAST, 1, 0, {"uuid": stranger})], 0.0)
    # GPU 1's bus id is ours, but the exporter names another GPU there: a different node's exporter.
    assert reading.matched == {0}
    assert reading.unknown == {f"{stranger} ({topology.gpus[1].bus_id})"}
    later = read(interp, topology, [(XID_LAST, 0, 0, {}), (XID_LAST, 1, 79, {"uuid": stranger})], 15.0)
    assert later.xids == []


def test_mig_instances_carry_their_xids_and_device_fields_count_once(topology: Topology) -> None:
    interp = DcgmInterpreter(topology)
    sbe = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
    a, b = ("1g.10gb", 1), ("1g.10gb", 2)
    read(interp, topology, [(sbe, 7, 5, {"mig": a}), (sbe, 7, 5, {"mig": b})], 0.0)
    reading = read(interp, topology, [(sbe, 7, 6, {"mig": a}), (sbe, 7, 6, {"mig": b}),
                                      (XID_TOTAL, 7, 1, {"mig": b, "xid": 94})], 15.0)
    assert [(x.gpu.index, x.code, x.count, x.gpu_instance) for x in reading.xids] == [(7, 94, 1, 2)]
    assert [(g.kind, g.increase) for g in reading.growth] == [("sbe", 1.0)]


def test_node_lines_remember_label_texts_within_a_bound_and_still_count_foreign_gpus(topology: Topology) -> None:
    lines = NodeLines(topology)
    mine = f'{XID_LAST}{{gpu="0",UUID="{topology.gpus[0].uuid}",pci_bus_id="00000000:1B:00.0"}} 0'
    assert lines.keep(mine) and lines.keep(mine)  # the second sight of the label text is remembered, same answer
    foreign = [f'{XID_LAST}{{gpu="{i}",UUID="GPU-foreign-{i}",pci_bus_id="00000000:F1:00.0"}} 0'
               for i in range(MAX_LABEL_TEXTS + 10)]
    assert not any(lines.keep(line) for line in foreign)
    assert not lines.keep(foreign[0])  # forgotten by the bound, read again: still foreign, counted again
    assert lines.foreign_samples == MAX_LABEL_TEXTS + 11
    assert len(lines._identities) <= MAX_LABEL_TEXTS
    assert lines.keep(mine)
    hidden = f'{XID_LAST}{{gpu="0",note="a,UUID=",UUID="GPU-foreign-x"}} 0'  # a UUID-like text inside a value
    assert not lines.keep(hidden)
