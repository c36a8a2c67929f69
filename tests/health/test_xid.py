"""The Xid catalog's default actions, operator overrides, and counting floods without acting on each one."""

from __future__ import annotations

import logging

import pytest

from agent.config.health import HealthConfig, parse_xid_override
from agent.health.findings import GpuRef
from agent.health.xid import BUCKET_ACTIONS, CATALOG, XidCounter, XidPolicy
from agent.signals import Severity

GPU = GpuRef("0", "GPU-a", "0000:1b:00.0")


@pytest.mark.parametrize(("code", "action"), [
    *[(code, Severity.DRAIN) for code in (79, 74, 119, 120, 46, 62, 109, 140, 144, 150, 151, 160)],
    # counted only, as NVIDIA's catalog says: 63 (row-remap event, IGNORE) and 94 (contained ECC error, RESTART_APP)
    *[(code, Severity.HEALTHY) for code in (13, 31, 43, 45, 8, 32, 68, 92, 154, 63, 94)],
    *[(code, Severity.ISOLATE) for code in (48, 64, 95)],  # one GPU's memory needing its reset: that GPU only
    (54, Severity.CORDON),
    (999, Severity.DEGRADED),  # not in the catalog: visible, never disruptive
])
def test_default_actions_follow_nvidia_buckets(code: int, action: Severity) -> None:
    assert XidPolicy().action(code) == action


def test_every_catalog_bucket_has_an_action() -> None:
    assert {info.bucket for info in CATALOG.values()} <= set(BUCKET_ACTIONS)
    assert CATALOG[79].mnemonic == "GPU_HAS_FALLEN_OFF_THE_BUS"


def test_overrides_win() -> None:
    policy = XidPolicy(HealthConfig(xid_actions=["109=none", "63=cordon", "999=drain"]).xid_action_overrides())
    assert (policy.action(109), policy.action(63), policy.action(999)) == (
        Severity.HEALTHY, Severity.CORDON, Severity.DRAIN)
    assert policy.action(79) == Severity.DRAIN


@pytest.mark.parametrize("bad", ["109", "x=drain", "109=reboot", "=drain"])
def test_bad_overrides_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError, match=r"CODE=ACTION|one of"):
        parse_xid_override(bad)


def test_a_flood_is_counted_but_starts_one_burst() -> None:
    counter = XidCounter(burst_window=180)
    records = [counter.record(GPU, 45, "kmsg", now=i * 0.01) for i in range(10_000)]
    assert counter.totals[(GPU, 45)] == 10_000
    assert sum(r.first_of_burst for r in records) == 1


def test_burst_ends_after_silence_and_is_summarised(caplog: pytest.LogCaptureFixture) -> None:
    counter = XidCounter(burst_window=10)
    counter.record(GPU, 13, "kmsg", now=0)
    counter.record(GPU, 13, "kmsg", now=5)
    with caplog.at_level(logging.INFO):
        counter.sweep(now=16)
    assert "2 occurrences" in caplog.text
    assert counter.record(GPU, 13, "kmsg", now=17).first_of_burst


def test_nvml_event_and_kernel_line_of_one_xid_count_once() -> None:
    counter = XidCounter(burst_window=180, pair_window=5)
    assert counter.record(GPU, 79, "nvml", now=0).counted
    assert not counter.record(GPU, 79, "kmsg", now=0.1).counted
    assert counter.totals[(GPU, 79)] == 1
    # two real Xids seen by both sources: two
    assert counter.record(GPU, 79, "kmsg", now=30).counted
    assert not counter.record(GPU, 79, "nvml", now=30.2).counted
    assert counter.totals[(GPU, 79)] == 2
    # a source alone is never deduplicated against itself
    assert counter.record(GPU, 79, "kmsg", now=30.3).counted
    assert counter.totals[(GPU, 79)] == 3


def test_dcgm_reports_many_at_once_and_late_and_only_the_excess_is_new() -> None:
    counter = XidCounter(burst_window=180, pair_window=90)
    for t in (0.0, 1.0, 2.0):  # three Xid 79s in the kernel log
        counter.record(GPU, 79, "kmsg", now=t)
    # DCGM's total rises by 4 one scrape (40 s) later: three of them are the kernel log's, one is new
    assert counter.record(GPU, 79, "dcgm", now=40.0, count=4).counted
    assert counter.totals[(GPU, 79)] == 4
    assert not counter.record(GPU, 79, "kmsg", now=41.0).counted  # the kernel log catching up on the fourth
    assert counter.totals[(GPU, 79)] == 4


def test_other_gpus_and_codes_are_separate() -> None:
    counter = XidCounter(burst_window=180)
    other = GpuRef("1", "GPU-b", "0000:43:00.0")
    assert counter.record(GPU, 79, "kmsg", 0).first_of_burst
    assert counter.record(other, 79, "kmsg", 0).first_of_burst
    assert counter.record(GPU, 48, "kmsg", 0).first_of_burst
