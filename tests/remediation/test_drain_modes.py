"""Drain modes per workload against the HTTP API double and the fake clock: Immediate, AllowCompletion,
DeleteAfterTimeout (rule timeout, shorter pod annotation, longer one refused), first match wins, pod Events."""

from __future__ import annotations

import pytest

from agent.config.load import ConfigError, from_mapping
from agent.config.remediation import DrainRule, RemediationConfig, parse_selector
from tests.remediation.conftest import Harness, make_config
from tests.remediation.test_drain import DRAIN, P, evictions

RULES = [DrainRule(namespaces=["train"], pod_selector="checkpoint=yes", mode="DeleteAfterTimeout",
                   timeout_seconds=600),
         DrainRule(namespaces=["train"], mode="AllowCompletion"),
         DrainRule(pod_selector="tier=batch", mode="DeleteAfterTimeout", timeout_seconds=1200)]


def pod_events(harness: Harness, name: str) -> list[dict]:
    return [e for e in harness.api.events.values()
            if e.get("involvedObject", {}).get("kind") == "Pod" and e["involvedObject"]["name"] == name]


async def test_each_mode_is_applied_by_first_matching_rule(harness: Harness):
    api = harness.api
    api.add_pod("train", "ckpt-job", labels={"checkpoint": "yes"})
    api.add_pod("train", "long-job")
    api.add_pod("web", "batch-1", labels={"tier": "batch"})
    api.add_pod("web", "frontend")
    api.add_pod("kube-system", "dp", owner="DaemonSet", labels={"tier": "batch"})
    api.add_pod("kube-system", "static", mirror=True, owner="Node")
    await harness.start(make_config(drain_modes=RULES))
    await harness.verdict(DRAIN)
    assert evictions(harness) == ["frontend"]  # no rule: defaultDrainMode Immediate
    for name, mode in (("ckpt-job", "DeleteAfterTimeout"), ("long-job", "AllowCompletion"),
                       ("batch-1", "DeleteAfterTimeout"), ("frontend", "Immediate")):
        (event,) = pod_events(harness, name)
        assert event["reason"] == "DrainScheduled" and f"drain mode {mode}" in event["message"]
        assert event["metadata"]["namespace"] == event["involvedObject"]["namespace"]
    assert "eviction at" in pod_events(harness, "ckpt-job")[0]["message"]
    assert "not evicted" in pod_events(harness, "long-job")[0]["message"]
    assert not pod_events(harness, "dp") and not pod_events(harness, "static")

    await harness.advance(590)
    assert "ckpt-job" not in evictions(harness)  # its time is 600 s after the fault
    await harness.advance(11)
    assert evictions(harness).count("ckpt-job") == 1 and "batch-1" not in evictions(harness)
    await harness.advance(600)
    assert "batch-1" in evictions(harness)
    await harness.advance(1500)  # AllowCompletion: never evicted, the drain waits
    assert "long-job" not in evictions(harness) and ("train", "long-job") in api.pods
    assert api.annotations[f"{P}/drain"] == "running"
    assert harness.actions("drain_mode", "AllowCompletion") == 1
    api.delete_pod("train", "long-job")  # the job finished by itself
    await harness.advance(11)
    assert api.annotations[f"{P}/drain"] == "complete"
    assert "dp" not in evictions(harness) and "static" not in evictions(harness)


async def test_allow_completion_pod_still_running_at_the_deadline_is_reported_not_evicted(harness: Harness):
    harness.api.add_pod("train", "long-job")
    await harness.start(make_config(drain_modes=RULES, drain_deadline_seconds=1800))
    await harness.verdict(DRAIN)
    await harness.advance(2000)
    assert evictions(harness) == []
    assert harness.api.annotations[f"{P}/drain"] == "deadline"
    event = next(e for e in harness.api.events.values() if e["reason"] == "DrainDeadlineExceeded")
    assert "train/long-job" in event["message"]


async def test_the_annotation_may_shorten_the_timeout_never_lengthen_it(harness: Harness):
    api = harness.api
    api.add_pod("web", "hurry", labels={"tier": "batch"}, annotations={f"{P}/drain-timeout-seconds": "60"})
    api.add_pod("web", "greedy", labels={"tier": "batch"}, annotations={f"{P}/drain-timeout-seconds": "99999"})
    api.add_pod("web", "garbled", labels={"tier": "batch"}, annotations={f"{P}/drain-timeout-seconds": "soon"})
    await harness.start(make_config(drain_modes=RULES))
    await harness.verdict(DRAIN)
    assert "asked for 99999s, more than the configured 1200s" in pod_events(harness, "greedy")[0]["message"]
    assert "ignored" in pod_events(harness, "garbled")[0]["message"]
    await harness.advance(50)
    assert evictions(harness) == []
    await harness.advance(15)
    assert evictions(harness) == ["hurry"]
    await harness.advance(1100)
    assert evictions(harness) == ["hurry"]
    await harness.advance(40)
    assert sorted(evictions(harness)) == ["garbled", "greedy", "hurry"]


async def test_delete_after_timeout_counts_from_the_fault_across_an_agent_restart(harness: Harness):
    harness.api.add_pod("train", "ckpt-job", labels={"checkpoint": "yes"})
    config = make_config(drain_modes=RULES)
    await harness.start(config)
    await harness.verdict(DRAIN)
    await harness.advance(400)
    await harness.restart(config)
    await harness.verdict(DRAIN)
    await harness.advance(150)
    assert evictions(harness) == []
    await harness.advance(60)  # 610 s after the fault, not 600 s after the restart
    assert evictions(harness) == ["ckpt-job"]


async def test_default_mode_from_config(harness: Harness):
    harness.api.add_pod("web", "frontend")
    await harness.start(make_config(default_drain_mode="DeleteAfterTimeout", default_drain_timeout_seconds=300))
    await harness.verdict(DRAIN)
    await harness.advance(290)
    assert evictions(harness) == []
    await harness.advance(20)
    assert evictions(harness) == ["frontend"]


def test_config_file_spelling_and_validation():
    config = from_mapping(RemediationConfig, {
        "drainModes": [{"namespaces": ["train"], "podSelector": "app=trainer,team==ml", "mode": "DeleteAfterTimeout",
                        "timeoutSeconds": 900}],
        "defaultDrainMode": "AllowCompletion"})
    assert config.drain_modes[0].timeout_seconds == 900 and config.default_drain_mode == "AllowCompletion"
    assert parse_selector(config.drain_modes[0].pod_selector) == (("app", "trainer"), ("team", "ml"))
    for bad, words in (({"drainModes": [{"mode": "Later"}]}, "not one of"),
                       ({"drainModes": [{"podSelector": "app!=x"}]}, "podSelector"),
                       ({"drainModes": [{"podSelector": "app in (a,b)"}]}, "podSelector"),
                       ({"drainModes": [{"mode": "DeleteAfterTimeout", "timeoutSeconds": 7200}]},
                        "drainDeadlineSeconds"),
                       ({"drainModes": [{"timeoutSeconds": -1}]}, "positive"),
                       ({"defaultDrainMode": "Soon"}, "not one of")):
        with pytest.raises(ConfigError, match=words):
            from_mapping(RemediationConfig, bad)
