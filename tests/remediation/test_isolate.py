"""Isolating one device: the health assessor's verdict for a real Xid, the stand-in kubelet serving PodResources
over its unix socket (which pod holds which GPU, read by the real gRPC client), the HTTP API double for the
node, pods and evictions, and the fake clock for drain-mode times.

Done when (issue "remediation that fits training jobs"): Xid 48 on GPU 3 evicts only the pod holding GPU 3 and
leaves the node schedulable; a second GPU fault escalates to cordon + drain; drain modes hold for the isolated
device's pods; a reset ends the isolation; a restarted agent neither re-counts nor re-announces it.
"""

from __future__ import annotations

from agent.config.remediation import DrainRule
from agent.signals import Severity
from tests.remediation.conftest import Harness, make_config
from tests.remediation.rig import GPU, Rig
from tests.remediation.test_drain import P, evictions


async def start(harness: Harness, rig: Rig, **config: object) -> None:
    await harness.start(make_config(**config), pods_of=rig.ownership.pods_holding_now)
    harness.activity.append(rig.kubelet_calls)


async def test_xid48_on_gpu3_evicts_only_the_pod_holding_it_and_the_node_stays_schedulable(harness: Harness,
                                                                                        rig: Rig) -> None:
    held = await rig.run_pods(harness, [f"trainer-{i}" for i in range(5)])
    gpu3 = held["trainer-3"]
    await start(harness, rig)
    verdict = rig.xid(gpu3, 48)
    assert verdict.severity is Severity.ISOLATE and verdict.devices == (rig.gpus[gpu3],)
    assert rig.assessor.book.unhealthy_devices().keys() == {rig.gpus[gpu3]}  # out of ListAndWatch
    await harness.verdict(verdict)

    assert evictions(harness) == ["trainer-3"]
    node = harness.api.node
    assert not node["spec"].get("unschedulable") and not node["spec"].get("taints")
    assert harness.actions("isolate", "ok") == 1 and harness.actions("cordon", "ok") == 0
    assert harness.api.annotations[f"{P}/isolated-devices"] == rig.gpus[gpu3]
    condition = harness.api.condition("GpuUnhealthy")
    assert condition["status"] == "False" and condition["reason"] == "GpuXid48"
    assert rig.gpus[gpu3] in condition["message"] and "ml/trainer-3" in condition["message"]
    assert "DeviceIsolated" in harness.event_reasons()

    rig.kubelet.end_pod("ml", "trainer-3")  # the evicted pod (gone from the API double) ends on the kubelet too
    await rig.ownership.refresh()
    await harness.advance(11)
    assert harness.api.annotations[f"{P}/isolate-drain"] == "complete"
    assert evictions(harness) == ["trainer-3"]


async def test_a_pod_admitted_after_the_last_poll_is_drained_and_the_drain_waits_for_the_kubelet(
        harness: Harness, rig: Rig) -> None:
    """Issue 26: the poll's reading predates the pod; the decision asks the kubelet then, so the pod admitted a
    moment before the Xid is the one evicted, and the drain is complete only once the kubelet lists no holder."""
    await rig.run_pods(harness, ["early"])  # the last periodic reading is taken here
    await start(harness, rig)
    harness.api.add_pod("train", "a")
    got = await rig.kubelet.admit({GPU: 1}, pod=("train", "a"))  # admitted after the reading
    index = rig.gpus.index(got[GPU][0])
    assert not rig.ownership.latest or not rig.ownership.latest.holders(rig.gpus[index])  # the stale poll
    await harness.verdict(rig.xid(index, 48))
    assert evictions(harness) == ["a"]
    assert "train/a" in harness.api.condition("GpuUnhealthy")["message"]

    await harness.advance(11)  # evicted, but the kubelet still lists the pod's devices: not over yet
    assert harness.api.annotations[f"{P}/isolate-drain"] == "running"
    rig.kubelet.end_pod("train", "a")
    await harness.advance(11)
    assert harness.api.annotations[f"{P}/isolate-drain"] == "complete"
    assert evictions(harness) == ["a"]


async def test_a_kubelet_that_does_not_answer_never_completes_the_drain(harness: Harness, rig: Rig) -> None:
    held = await rig.run_pods(harness, ["t0", "t1"])
    await start(harness, rig)
    await rig.kubelet.stop()  # PodResources goes away before the fault
    await harness.verdict(rig.xid(held["t1"], 48))
    assert evictions(harness) == []  # nobody can be named, nobody is evicted ...
    await harness.advance(60)
    assert harness.api.annotations[f"{P}/isolate-drain"] == "running"  # ... and the drain is not called complete
    assert any("unknown" in e["message"] for e in harness.api.events.values() if e["reason"] == "DeviceIsolated")


async def test_a_second_gpu_fault_escalates_to_cordon_and_drain(harness: Harness, rig: Rig) -> None:
    held = await rig.run_pods(harness, [f"trainer-{i}" for i in range(5)])
    await start(harness, rig)
    await harness.verdict(rig.xid(held["trainer-3"], 48))
    assert evictions(harness) == ["trainer-3"]

    verdict = rig.xid(held["trainer-1"], 95)  # another GPU: the node is no longer whole
    assert verdict.severity is Severity.DRAIN and verdict.reason == "MultipleDevicesIsolated"
    await harness.verdict(verdict)
    assert harness.api.node["spec"]["unschedulable"] is True
    assert harness.actions("cordon", "ok") == 1
    assert sorted(evictions(harness)) == [f"trainer-{i}" for i in range(5)]  # trainer-3 was already gone
    assert f"{P}/isolated-devices" not in harness.api.annotations  # the node path took over
    assert "DeviceIsolationEnded" in harness.event_reasons()
    assert harness.api.condition("GpuUnhealthy")["status"] == "True"


async def test_drain_modes_hold_for_the_isolated_devices_pods(harness: Harness, rig: Rig) -> None:
    rules = [DrainRule(namespaces=["ckpt"], mode="DeleteAfterTimeout", timeout_seconds=600),
             DrainRule(namespaces=["long"], mode="AllowCompletion")]
    held = await rig.run_pods(harness, ["a0", "a1"], namespace="ckpt")
    held |= await rig.run_pods(harness, ["b2", "b3"], namespace="long")
    await start(harness, rig, drain_modes=rules, drain_deadline_seconds=1800)

    await harness.verdict(rig.xid(held["a1"], 64))
    assert evictions(harness) == []
    await harness.advance(590)
    assert evictions(harness) == []
    await harness.advance(11)  # 600 s after the fault
    assert evictions(harness) == ["a1"]

    await harness.verdict(rig.reset(held["a1"]))  # the reset cleared a1's GPU; then b3's (AllowCompletion)
    await harness.verdict(rig.xid(held["b3"], 95))
    await harness.advance(1900)
    assert evictions(harness) == ["a1"]  # never evicted: the drain waits for it
    assert harness.api.annotations[f"{P}/isolate-drain"] == "deadline"
    assert harness.api.annotations[f"{P}/isolated-devices"] == rig.gpus[held["b3"]]


async def test_a_reset_ends_the_isolation_and_a_restart_repeats_nothing(harness: Harness, rig: Rig) -> None:
    held = await rig.run_pods(harness, [f"trainer-{i}" for i in range(4)])
    await start(harness, rig)
    verdict = rig.xid(held["trainer-2"], 48)
    await harness.verdict(verdict)
    assert evictions(harness) == ["trainer-2"] and harness.actions("isolate", "ok") == 1

    # a new agent process on the same node: same isolation, nothing counted again
    await harness.restart(pods_of=rig.ownership.pods_holding_now)
    await harness.verdict(verdict)
    assert harness.actions("isolate", "ok") == 0
    assert [r for r in harness.event_reasons() if r == "DeviceIsolated"] == ["DeviceIsolated"]

    await harness.verdict(rig.reset(held["trainer-2"]))
    assert f"{P}/isolated-devices" not in harness.api.annotations
    assert "DeviceIsolationEnded" in harness.event_reasons()
    assert harness.api.condition("GpuUnhealthy")["status"] == "False"
    assert not harness.api.node["spec"].get("unschedulable")


async def test_without_podresources_no_pod_is_evicted(harness: Harness, rig: Rig) -> None:
    held = await rig.run_pods(harness, ["trainer-0", "trainer-1"])
    await harness.start(make_config())  # ownership not wired: which pod holds the GPU is unknown
    await harness.verdict(rig.xid(held["trainer-1"], 48))
    assert evictions(harness) == []
    assert harness.api.annotations[f"{P}/isolated-devices"] == rig.gpus[held["trainer-1"]]
    event = next(e for e in harness.api.events.values() if e["reason"] == "DeviceIsolated")
    assert "unknown" in event["message"]
