"""Issue 39, end to end: `run --simulate` against the HTTP API double publishes the node labels GFD would (plus the
agent's own) on an NFD NodeFeature, or on the Node without NFD; restarts and failing sources never blink them."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from agent.simulate.profiles import load_profile
from tests.fakes.polling import until
from tests.labels.rig import (
    DAEMONSET,
    H100_GFD,
    H100_OWN,
    MIG_1G_10GB,
    NAMESPACE,
    NODE,
    POD,
    feature,
    feature_labels,
    nvml_overrides,
    published,
    start,
    xid_line,
)


def _scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="gnal"))


def _writes(api: object) -> int:
    return len(api.feature_requests(writes=True))  # type: ignore[attr-defined]


async def test_nodefeature_carries_gfds_keys_and_the_agents_owned_by_pod_and_daemonset_then_xid_79_lowers_healthy():
    agent, api, kmsg = await start(_scratch())
    try:
        await published(api, agent, feature_labels)
        assert feature_labels(api) == {**H100_GFD, **H100_OWN}
        meta = feature(api)["metadata"]  # type: ignore[index]
        assert meta["labels"] == {"nfd.node.kubernetes.io/node-name": NODE}
        owners = meta["ownerReferences"]
        assert owners[0] == {k: v for k, v in DAEMONSET.items() if k != "blockOwnerDeletion"}
        assert owners[1] == {"apiVersion": "v1", "kind": "Pod", "name": POD, "uid": f"uid-{NAMESPACE}-{POD}"}
        assert _writes(api) == 1  # created once, complete
        await asyncio.sleep(5)  # five full passes (interval 1 s) at steady state
        assert _writes(api) == 1
        bus_id = sorted(load_profile("dgx-h100").gpu_uuids)[0]
        writes = _writes(api)
        with kmsg.open("a") as handle:
            handle.write(xid_line(bus_id))
        started = time.monotonic()
        await until(lambda: feature_labels(api).get("gpunodeagent.io/gpu.healthy") == "7", "gpu.healthy 7", 30)
        took = time.monotonic() - started
        await asyncio.sleep(2)
        assert _writes(api) == writes + 1, "one write for the change"
        assert feature_labels(api) == {**H100_GFD, **H100_OWN, "gpunodeagent.io/gpu.healthy": "7"}
        assert took < 5, took
        text = await asyncio.to_thread(agent.metrics)
        assert 'gpu_node_agent_node_label_writes_total{outcome="ok"} 2.0' in text
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()
    assert api.node_features.get((NAMESPACE, f"gpu-node-agent-{NODE}")), "never deleted on exit"


async def test_without_nfd_the_labels_land_on_the_node_and_foreign_labels_are_untouched():
    directory = _scratch()
    agent, api, _ = await start(directory, nfd=False)
    # a foreign nvidia.com/ key, and an annotation edited to claim labels the agent never wrote
    api.admin_patch({"metadata": {"labels": {"team.example.com/rack": "r12", "nvidia.com/gpu.product": "theirs"},
                                  "annotations": {"gpunodeagent.io/labels": "kubernetes.io/hostname,"
                                                                            "team.example.com/rack"}}})
    try:
        await published(api, agent, lambda a: a.labels.get("gpunodeagent.io/gpu.healthy"))
        labels = api.labels
        wanted = {k: v for k, v in {**H100_GFD, **H100_OWN}.items() if k != "nvidia.com/gpu.product"}
        assert {k: labels.get(k) for k in wanted} == wanted
        assert labels["team.example.com/rack"] == "r12" and labels["nvidia.com/gpu.product"] == "theirs"
        assert labels["kubernetes.io/hostname"] == NODE
        assert set(api.annotations["gpunodeagent.io/labels"].split(",")) == set(wanted)
        assert not api.feature_requests(writes=True)
        patches = [r for r in api.node_requests() if r.method == "PATCH" and "labels" in (r.body or {}).get(
            "metadata", {})]
        await asyncio.sleep(3)
        assert len([r for r in api.node_requests() if r.method == "PATCH" and "labels" in (r.body or {}).get(
            "metadata", {})]) == len(patches) == 1
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()


async def test_mig_mixed_carries_the_profile_resource_and_gfds_nodefeature_turns_the_nvidia_keys_off():
    agent, api, _ = await start(_scratch(), "--mig-strategy", "mixed", profile="dgx-h100-mig")
    try:
        await published(api, agent, feature_labels)
        assert feature_labels(api) == {**H100_GFD, **MIG_1G_10GB, **H100_OWN}
    finally:
        agent.stop()
    # GFD publishes for this node (in gpu-operator): a new agent leaves every nvidia.com/ key to it
    api.put_node_feature("gpu-operator", {"metadata": {"name": f"nvidia-features-for-{NODE}"},
                                          "spec": {"labels": {"nvidia.com/gpu.count": "8"}}})
    agent, api, _ = await start(_scratch(), "--mig-strategy", "mixed", profile="dgx-h100-mig", api=api)
    try:
        await until(lambda: not any(k.startswith("nvidia.com/") for k in feature_labels(api))
                    or agent.process.poll() is not None, "no nvidia.com/ key", timeout=60)
        assert feature_labels(api) == H100_OWN
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()


async def test_a_restart_never_blanks_a_key_and_a_failing_nvml_keeps_every_value():
    agent, api, _ = await start(_scratch())
    try:
        await published(api, agent, feature_labels)
    finally:
        assert agent.stop() == 0
    before, writes = feature_labels(api), _writes(api)
    assert before == {**H100_GFD, **H100_OWN}
    agent, api, _ = await start(_scratch(), api=api)
    try:
        await until(lambda: any("node labels: publishing on" in m for m in agent.messages())
                    or agent.process.poll() is not None, "the restarted agent publishing", timeout=60)
        overrides = nvml_overrides(agent)
        await asyncio.sleep(4)  # its first complete reading is the same: no request at all
        assert _writes(api) == writes and feature_labels(api) == before
        (overrides / "driver.json").write_text(json.dumps({"unavailable": "NVMLError_DriverNotLoaded: test"}))
        await until(lambda: 'gpu_node_agent_health_check_up{check="nvml"} 0.0' in agent.metrics(),
                    "NVML seen failing", timeout=30)
        await asyncio.sleep(4)
        assert _writes(api) == writes and feature_labels(api) == before  # kept: no 0, no dropped key
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()


async def test_a_time_sliced_config_gets_gfds_shared_product_and_replicas():
    directory = _scratch()
    config = directory / "nvidia-dp.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
                      "      replicas: 10\n")
    agent, api, _ = await start(directory, "--nvidia-dp-config", str(config))
    try:
        await published(api, agent, feature_labels)
        assert feature_labels(api) == {**H100_GFD, **H100_OWN,
                                       "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-SHARED",
                                       "nvidia.com/gpu.replicas": "10",
                                       "nvidia.com/gpu.sharing-strategy": "time-slicing"}
    finally:
        code = agent.stop()
        await api.stop()
    assert code == 0, agent.log_tail()
