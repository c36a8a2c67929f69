"""Joint mode with time-sliced GPUs and the kubelet's facts, end to end over unix sockets.

The GPUs are served as replicas (`<uuid>::<n>`), so the kubelet's free and held GPU devices are replica IDs, as
are the servers' own. A NIC-first container must get a VF under the switch of a GPU that still has a free
replica: the free GPUs the policy aligns with are the servers' replicas the kubelet does not hold (a GPU with one
free replica is free), not an empty set. Also on churn, whichever resource comes first.
"""

from __future__ import annotations

from agent.config.sharing import ReplicatedResourceConfig, TimeSlicingConfig
from tests.ownership.rig import GPU, NIC, node_factory, offered_only, pix
from tests.ownership.test_pairing import churn

__all__ = ["node_factory"]  # the fixture

REPLICAS = 2


async def test_nic_first_container_goes_under_the_last_gpu_with_a_free_replica(node_factory) -> None:
    sliced = TimeSlicingConfig(resources=[ReplicatedResourceConfig(name=GPU, replicas=REPLICAS)])
    node = await node_factory(serve_gpus=True, profile="dgx-h100", config_changes={"time_slicing": sliced})
    gpus = node.gpu_ids()
    for step in range(len(gpus) * REPLICAS - 1):  # every replica held but one
        node.now += 0.1
        await node.kubelet.admit({GPU: 1}, order=[GPU], pod=node.pod(f"g{step}", {GPU: 1}))
    free = {replica.partition("::")[0] for replica in node.free(GPU)}
    assert len(free) == 1 and free != {gpus[0]}, free  # the last free GPU is not the one the lowest VF sits at
    assert node.service is not None
    await node.service.refresh()  # a fresh reading: the facts' free GPUs are used, not only the estimate
    for step in range(3):  # each ends before the next: the same GPU is the only one with a free replica
        node.now += 0.1
        key = node.pod(f"p{step}", {GPU: 1, NIC: 1})
        got = await node.kubelet.admit({GPU: 1, NIC: 1}, order=[NIC, GPU], pod=key)
        assert got[GPU][0].partition("::")[0] in free
        assert pix(node.topology, got[GPU][0].partition("::")[0], got[NIC][0]), got
        node.kubelet.end_pod(*key)
        await node.service.refresh()
    offered_only(node)


async def test_joint_mode_with_time_sliced_gpus_every_pair_is_pix_when_one_was_free(node_factory) -> None:
    """Churn with 20 % single-resource pods: every GPU+NIC container is PIX whenever a free replica and a free VF
    shared a switch, whichever resource came first (NIC-first: 46 of 65 on the old code, seed 1, 300 steps)."""
    sliced = TimeSlicingConfig(resources=[ReplicatedResourceConfig(name=GPU, replicas=REPLICAS)])
    node = await node_factory(serve_gpus=True, profile="dgx-h100", config_changes={"time_slicing": sliced})
    held = await churn(node, steps=120, seed=1, restarts=())
    assert held["gpu-first"] and held["nic-first"]
    assert all(held["gpu-first"]), held
    assert all(held["nic-first"]), held
    offered_only(node)
