"""NIC-only mode with MIG (issue 30): NVIDIA's plugin (a stand-in, mig-strategy mixed) serves
`nvidia.com/mig-1g.10gb` by MIG UUID and picks the slices itself; the agent serves the VFs. A container whose MIG
device came first gets a VF under its parent GPU's switch whenever one is free there: the ownership lookup reads
the MIG UUID from PodResources, and placement puts a MIG device where its parent GPU sits. Over unix sockets, on
the simulated dgx-h100-mig (GPUs 0-3: seven 1g.10gb slices each, one RDMA PF under each GPU's switch)."""

from __future__ import annotations

import random

from agent.simulate.kubelet import AdmissionError
from tests.fakes.standin_plugin import StandInPlugin
from tests.ownership.rig import NIC, node_factory, offered_only, pix

__all__ = ["node_factory"]  # the fixture

MIG = "nvidia.com/mig-1g.10gb"


async def test_nic_only_mig_first_containers_get_a_pix_vf(node_factory) -> None:
    node = await node_factory(serve_gpus=False, profile="dgx-h100-mig")
    migs = sorted(m.uuid for g in node.topology.gpus for m in g.mig_devices)
    assert len(migs) == 28
    nvidia = StandInPlugin(node.directory / "dp", MIG, migs, rng=random.Random(9))  # noqa: S311
    await nvidia.start()
    try:
        await node.kubelet.wait_for(lambda: MIG in node.kubelet.plugins and node.kubelet.plugins[MIG].lists > 0)
        rng = random.Random(13)  # noqa: S311
        live: list[tuple[str, str]] = []
        held: list[bool] = []
        for step in range(40):
            node.now += 0.1
            if live and (len(live) >= 10 or rng.random() < 0.3):
                node.kubelet.end_pod(*live.pop(rng.randrange(len(live))))
                continue
            requests = {MIG: 1, NIC: 1}
            free_vfs = node.free(NIC)
            key = node.pod(f"m{step}", requests)
            try:
                got = await node.kubelet.admit(requests, order=[MIG, NIC], pod=key)
            except AdmissionError:
                continue
            live.append(key)
            mig, vf = got[MIG][0], got[NIC][0]
            held.append(pix(node.topology, mig, vf) or not any(pix(node.topology, mig, v) for v in free_vfs))
        assert len(held) >= 20 and all(held), held
        assert node.sample("gpu_node_agent_pod_resources_lookups_total", result="exact") >= len(held)
        offered_only(node)
    finally:
        await nvidia.stop()
